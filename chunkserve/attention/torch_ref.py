"""Reference attention over the paged cache in plain PyTorch (any device; the CPU path and
the oracle GPU kernels are tested against).

Per layer: one scatter of the step's new K/V by ``slot_mapping``; attention per prefill
chunk (few per step: PyTorch's fused SDPA in fp32, query blocks by hand in bf16); and the
decodes of the step batched into a few padded gathers plus one attention each, a key-length
mask hiding the padding. Decodes are sorted by length and
cut into a few groups (``decode_groups``) when that saves more padded keys than the extra
calls cost. Masks and gather indices are built once per step in ``prepare``.

Decode attention is two batched matmuls over the gathered keys as they lie in the pool,
``[D, S, Hkv * hd]``, with queries spread block-diagonally over the KV heads (zeros for the
other heads' columns). That reads K and V in place, no transposed copy: 3x the FLOPs of
grouped-query attention but on a CPU this step is bound by memory, and it is 4x faster than
an einsum over ``[D, Hkv, G, hd]``.

A layer's ``AttentionSpec`` (scale, sliding window, soft-cap) reaches every path as ``_Opts``.
Without a window or a cap the paths above run as they are (only the scale changes). With
them: prefill chunks go through ``_prefill_spec`` (query blocks, each against the keys its
rows' windows hold, gathered from the first block a window reaches); decodes gather only the
blocks their windows reach (a gather and mask per window, built once per step), and so do
short chunks (from the block holding their first row's first key); the cap applies to every
path's scores. Attention sinks (``AttentionSpec.sinks``: a learned logit per head
in each row's softmax denominator) take the by-hand softmax on every path (``_softmax``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from chunkserve.attention.base import AttentionBackend, AttentionSpec, BatchLayout
from chunkserve.scheduling.decode_groups import split_decode_groups

PREFILL_BLOCK_ROWS = 128
# Chunks of at most this many rows that continue a cached sequence (a decode with draft
# tokens being verified, or the short tail of a prompt) are batched like decodes: one padded
# gather and two matmuls per group instead of a gather and a loop per chunk.
SHORT_CHUNK_ROWS = 17
# Query rows per SDPA call of a windowed fp32 chunk (each call reads its rows' keys only).
SDPA_WINDOW_ROWS = 512


@dataclass(frozen=True)
class _Opts:
    """A layer's ``AttentionSpec`` resolved for this backend's head size."""

    scale: float
    window: int | None = None  # W: position p sees keys max(0, p - W + 1) .. p
    softcap: float | None = None

    @property
    def plain(self) -> bool:
        """No window and no cap: the paths of ``spec=None`` (at this scale)."""
        return self.window is None and self.softcap is None


@dataclass
class _PrefillChunk:
    row_start: int
    row_end: int
    ctx_len: int
    # None when the chunk starts at position 0: it attends causally to its own fresh K/V.
    block_ids: torch.Tensor | None  # [num_blocks] int64


@dataclass
class _DecodeGroup:
    rows: torch.Tensor  # [n] int64, rows of the batch (absolute)
    block_ids: torch.Tensor  # [n * max_blocks] int64
    pad_mask: torch.Tensor  # [n, 1, S] bool, True = padding
    num_blocks: int  # max_blocks; S = max_blocks * block_size
    contiguous_start: int | None  # rows are start..start+n-1 (no scatter needed)
    seq_lens: torch.Tensor  # [n, 1, 1] keys each row sees (its position + 1)
    # The group under each window W: only the blocks its windows reach (first use in a step)
    windowed: dict[int, _WindowedDecodes] = field(default_factory=dict)


@dataclass
class _WindowedDecodes:
    """A decode group's gather under a window W: row i reads its blocks from the one holding
    key ``len_i - W`` on, ``num_blocks`` of them (padded with the null block)."""

    block_ids: torch.Tensor  # [n * num_blocks] int64
    mask: torch.Tensor  # [n, 1, num_blocks * block_size] bool, True = outside the window
    num_blocks: int


@dataclass
class _ShortGroup:
    """Short chunks batched: ``m`` sequences, each padded to ``r`` query rows."""

    m: int
    r: int
    q_index: torch.Tensor  # [m * r] rows of the batch to gather (padding repeats a real row)
    valid: torch.Tensor  # [m * r] bool, real rows
    out_rows: torch.Tensor  # [number of real rows] rows of the batch they fill, in order
    block_ids: torch.Tensor  # [m * num_blocks] int64
    mask: torch.Tensor  # [m, r, 1, S] bool, True = a key the row must not see
    num_blocks: int
    limits: torch.Tensor  # [m, r, 1, 1] keys each row sees (its position + 1)
    # The group under each window W: only the blocks its windows reach (first use in a step)
    windowed: dict[int, _WindowedDecodes] = field(default_factory=dict)


@dataclass
class _TorchMetadata:
    prefills: list[_PrefillChunk] = field(default_factory=list)
    decode_groups: list[_DecodeGroup] = field(default_factory=list)
    short_groups: list[_ShortGroup] = field(default_factory=list)


class TorchAttentionBackend(AttentionBackend):
    name = "torch"
    # Chunks continuing a cached sequence up to this many rows are attended like decodes
    # (None: any); the CPU backend sets its kernel's limit for its dtype.
    kernel_max_rows: int | None = SHORT_CHUNK_ROWS

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        super().__init__(num_heads, num_kv_heads, head_dim)
        g = num_heads // num_kv_heads
        self._head_idx = torch.arange(num_heads)
        self._kv_head_idx = self._head_idx // g  # query head h reads KV head h // G
        # Reused gather buffers: fresh multi-MB allocations page-fault on every layer.
        self._buffers: dict[tuple, torch.Tensor] = {}
        self._masks: dict[tuple, torch.Tensor] = {}
        self._plain = _Opts(self.scale)
        self._specs: dict[AttentionSpec, _Opts] = {}

    def supports(self, spec: AttentionSpec | None) -> str | None:
        """Every scale, window, soft-cap and attention sinks."""
        return None

    def _opts(self, spec: AttentionSpec | None) -> _Opts:
        """``spec`` resolved (checked once per distinct spec, then looked up)."""
        if spec is None:
            return self._plain
        opts = self._specs.get(spec)
        if opts is None:
            self.check_spec(spec)
            opts = _Opts(spec.resolve_scale(self.head_dim), spec.sliding_window, spec.logit_softcap)
            self._specs[spec] = opts
        return opts

    def _buffer(self, slot: int, like: torch.Tensor, num_blocks: int) -> torch.Tensor:
        key = (slot, like.dtype, like.device)
        per_block = like[0].numel()
        buf = self._buffers.get(key)
        if buf is None or buf.numel() < num_blocks * per_block:
            buf = torch.empty(num_blocks * per_block * 5 // 4, dtype=like.dtype, device=like.device)
            self._buffers[key] = buf
        return buf[: num_blocks * per_block].view(num_blocks, *like.shape[1:])

    def prepare(self, layout: BatchLayout) -> _TorchMetadata:
        meta = self._new_metadata()
        if self._head_idx.device != layout.input_ids.device:
            self._head_idx = self._head_idx.to(layout.input_ids.device)
            self._kv_head_idx = self._kv_head_idx.to(layout.input_ids.device)
        short = self._prepare_prefills(layout, meta)
        self._prepare_runs(layout, short, meta)
        return meta

    def _new_metadata(self) -> _TorchMetadata:
        return _TorchMetadata()

    def _prepare_prefills(self, layout: BatchLayout, meta: _TorchMetadata) -> list[int]:
        """Prefill chunks attended one by one go to ``meta.prefills``; returns the others:
        chunks of at most ``kernel_max_rows`` rows (None: any) that continue a cached
        sequence (attended like decodes, by ``_prepare_runs``)."""
        most = self.kernel_max_rows
        short: list[int] = []
        for i in range(layout.num_prefill_seqs):
            rows = layout.query_start_host[i + 1] - layout.query_start_host[i]
            if layout.context_start_host[i] > 0 and (most is None or rows <= most):
                short.append(i)
            else:
                meta.prefills.append(self._prefill_chunk(layout, i))
        return short

    @staticmethod
    def _prefill_chunk(layout: BatchLayout, i: int) -> _PrefillChunk:
        """Prefill sequence ``i`` of the layout, attended on its own."""
        start_row, end_row = layout.query_start_host[i], layout.query_start_host[i + 1]
        ctx_len = layout.seq_lens_k_host[i]
        if layout.context_start_host[i] == 0:
            return _PrefillChunk(start_row, end_row, ctx_len, None)
        num_blocks = -(-ctx_len // layout.block_size)
        block_ids = torch.tensor(
            layout.block_tables_host[i][:num_blocks],
            device=layout.input_ids.device,
            dtype=torch.int64,
        )
        return _PrefillChunk(start_row, end_row, ctx_len, block_ids)

    def _prepare_runs(self, layout: BatchLayout, short: list[int], meta: _TorchMetadata) -> None:
        """The short chunks ``short`` and the decodes: padded gathers, grouped by length."""
        self._prepare_short(layout, short, meta)
        self._prepare_decodes(layout, meta)

    def _prepare_short(self, layout: BatchLayout, short: list[int], meta: _TorchMetadata) -> None:
        device = layout.input_ids.device
        if short:
            lengths = [layout.seq_lens_k_host[i] for i in short]
            for group in split_decode_groups(lengths, layout.block_size):
                seqs = [short[g] for g in group]
                meta.short_groups.append(self._short_group(layout, seqs, device))

    def _prepare_decodes(self, layout: BatchLayout, meta: _TorchMetadata) -> None:
        device = layout.input_ids.device
        bs = layout.block_size
        p = layout.num_prefill_seqs
        if layout.num_decode_tokens:
            lengths = layout.seq_lens_k_host[p:]
            row0 = layout.num_prefill_tokens
            for group in split_decode_groups(lengths, bs):
                meta.decode_groups.append(self._decode_group(layout, group, row0, device))

    def _short_group(
        self, layout: BatchLayout, seqs: list[int], device: torch.device
    ) -> _ShortGroup:
        bs = layout.block_size
        qs = layout.query_start_host
        rows = [qs[i + 1] - qs[i] for i in seqs]
        r = max(rows)
        lengths = [layout.seq_lens_k_host[i] for i in seqs]
        max_blocks = -(-max(lengths) // bs)
        q_index, valid, out_rows, limits = [], [], [], []
        for i, n, length in zip(seqs, rows, lengths):
            start = length - n  # position of the chunk's first row
            for j in range(r):
                q_index.append(qs[i] + min(j, n - 1))
                valid.append(j < n)
                limits.append(start + min(j, n - 1) + 1)  # row j sees keys [0, start + j]
            out_rows.extend(range(qs[i], qs[i] + n))
        idx = torch.tensor(seqs, dtype=torch.int64, device=device)
        block_ids = layout.block_tables[idx, :max_blocks].reshape(-1).long()
        key_pos = torch.arange(max_blocks * bs, device=device)
        limit = torch.tensor(limits, device=device).view(len(seqs), r, 1, 1)
        return _ShortGroup(
            m=len(seqs),
            r=r,
            q_index=torch.tensor(q_index, dtype=torch.int64, device=device),
            valid=torch.tensor(valid, dtype=torch.bool, device=device),
            out_rows=torch.tensor(out_rows, dtype=torch.int64, device=device),
            block_ids=block_ids,
            mask=key_pos.view(1, 1, 1, -1) >= limit,
            num_blocks=max_blocks,
            limits=limit,
        )

    def _decode_group(
        self, layout: BatchLayout, group: list[int], row0: int, device: torch.device
    ) -> _DecodeGroup:
        bs = layout.block_size
        p = layout.num_prefill_seqs
        lengths = [layout.seq_lens_k_host[p + i] for i in group]
        max_blocks = -(-max(lengths) // bs)
        idx = torch.tensor(group, dtype=torch.int64, device=device)
        block_ids = layout.block_tables[p + idx, :max_blocks].reshape(-1).long()
        key_pos = torch.arange(max_blocks * bs, device=device)
        seq = torch.tensor(lengths, device=device)
        pad = (key_pos[None, :] >= seq[:, None])[:, None, :]
        contiguous = group == list(range(group[0], group[0] + len(group)))
        return _DecodeGroup(
            rows=idx + row0,
            block_ids=block_ids,
            pad_mask=pad,
            num_blocks=max_blocks,
            contiguous_start=row0 + group[0] if contiguous else None,
            seq_lens=seq.view(-1, 1, 1),
        )

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        layout: BatchLayout,
        metadata: _TorchMetadata,
        spec: AttentionSpec | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        opts = self._opts(spec)
        if (sinks is not None) != (spec is not None and spec.sinks):
            raise ValueError("sinks: passed exactly when the layer's spec has sinks")
        self.write_kv(k, v, k_cache, v_cache, layout)

        out = torch.empty_like(q, memory_format=torch.contiguous_format)  # [T_padded, H, hd]
        if out.shape[0] > layout.num_tokens:
            out[layout.num_tokens :] = 0  # padding rows (see ModelRunner.build_layout)
        sink = None if sinks is None else sinks.float()  # [H]
        self._forward_prefills(q, k, v, k_cache, v_cache, out, metadata, opts, sink)
        self._forward_runs(q, k_cache, v_cache, out, metadata, opts, sink)
        return out

    def _forward_prefills(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        out: torch.Tensor,
        metadata: _TorchMetadata,
        opts: _Opts,
        sinks: torch.Tensor | None = None,
    ) -> None:
        num_kv_heads, head_dim = self.num_kv_heads, self.head_dim
        bs = k_cache.shape[1]
        for chunk in metadata.prefills:
            rows = slice(chunk.row_start, chunk.row_end)
            start = chunk.ctx_len - (chunk.row_end - chunk.row_start)
            key0 = 0  # position of kc's first key
            if chunk.block_ids is None:  # starts at position 0: its own fresh K/V
                kc, vc = k[rows], v[rows]
            else:
                block_ids = chunk.block_ids
                if opts.window is not None:  # from the block holding the first row's window
                    first_block = max(0, start - opts.window + 1) // bs
                    block_ids, key0 = block_ids[first_block:], first_block * bs
                kc = k_cache.index_select(0, block_ids).view(-1, num_kv_heads, head_dim)
                vc = v_cache.index_select(0, block_ids).view(-1, num_kv_heads, head_dim)
                kc, vc = kc[: chunk.ctx_len - key0], vc[: chunk.ctx_len - key0]
            if opts.plain and sinks is None:
                out[rows] = self._prefill(q[rows], kc, vc, start, opts.scale)
            else:
                out[rows] = self._prefill_spec(q[rows], kc, vc, start, key0, opts, sinks)

    def _forward_runs(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        out: torch.Tensor,
        metadata: _TorchMetadata,
        opts: _Opts,
        sinks: torch.Tensor | None = None,
    ) -> None:
        """Short chunks and decodes (``_prepare_runs``), into their rows of ``out``."""
        for short in metadata.short_groups:
            qs = q.index_select(0, short.q_index)
            o = self._short(qs, k_cache, v_cache, short, opts, sinks)
            out.index_copy_(0, short.out_rows, o[short.valid])

        for group in metadata.decode_groups:
            if group.contiguous_start is not None:
                r0 = group.contiguous_start
                qg = q[r0 : r0 + group.rows.numel()]
                o = self._decode(qg, k_cache, v_cache, group, opts, sinks)
                out[r0 : r0 + group.rows.numel()] = o
            else:
                qg = q.index_select(0, group.rows)
                o = self._decode(qg, k_cache, v_cache, group, opts, sinks)
                out.index_copy_(0, group.rows, o)

    def _prefill(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        start: int,
        scale: float | None = None,
    ) -> torch.Tensor:
        """One chunk: ``q`` [L, H, hd] at positions start..start+L-1; ``k``/``v``
        [start+L, Hkv, hd] from position 0.

        fp32: PyTorch's fused SDPA (its CPU kernel works in key blocks with an online
        softmax, no score matrix), measured at 2 threads on the 2-core EPYC per layer of the
        embedded model's shapes: a 2,048-token prompt 74 -> 43 ms, 512 rows after 1,536
        cached 50 -> 25 ms. In bf16 the same kernel is 1.2x slower than ``_prefill_blocked``
        (39 vs 48 ms, 20 vs 23 ms), so bf16 and fp16 stay blocked.
        ``scale``: None is ``head_dim ** -0.5``."""
        if q.dtype != torch.float32:
            return self._prefill_blocked(q, k, v, start, scale)
        num_rows = q.shape[0]
        qt, kt, vt = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))  # [1, heads, n, hd]
        if start == 0:
            o = F.scaled_dot_product_attention(
                qt, kt, vt, is_causal=True, scale=scale, enable_gqa=True
            )
        else:
            mask = self._chunk_mask(num_rows, start, q.device)
            o = F.scaled_dot_product_attention(
                qt, kt, vt, attn_mask=mask, scale=scale, enable_gqa=True
            )
        return o[0].transpose(0, 1)

    def _prefill_spec(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        start: int,
        key0: int,
        opts: _Opts,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One chunk under a window and/or a soft-cap: ``q`` [L, H, hd] at positions
        start..start+L-1; ``k``/``v`` [start+L-key0, Hkv, hd] the keys from position
        ``key0`` (at most the first row's window start). In blocks of query rows, each block
        against the keys from its first row's window start to its last row: fp32 without a
        cap through SDPA with the block's mask, else scores in fp32 (capped, masked) and a
        softmax by hand."""
        num_rows = q.shape[0]
        h, hkv, hd = self.num_heads, self.num_kv_heads, self.head_dim
        g, w, cap = h // hkv, opts.window, opts.softcap
        sdpa = q.dtype == torch.float32 and cap is None and sinks is None
        sink = None if sinks is None else sinks.view(hkv, g, 1, 1)
        block = SDPA_WINDOW_ROWS if sdpa else PREFILL_BLOCK_ROWS
        kh, vh = k.transpose(0, 1), v.transpose(0, 1)  # [Hkv, keys, hd]
        out = torch.empty(num_rows, h, hd, dtype=q.dtype, device=q.device)
        for r0 in range(0, num_rows, block):
            r1 = min(num_rows, r0 + block)
            n, p0 = r1 - r0, start + r0  # rows at positions p0 .. p0 + n - 1
            lo = max(key0, 0 if w is None else p0 - w + 1)  # the block's first key
            a, b = lo - key0, start + r1 - key0  # its keys in k, v
            visible = self._band_mask(n, p0, lo, w, q.device)  # [n, b - a]
            if sdpa:
                o = F.scaled_dot_product_attention(
                    q[r0:r1].transpose(0, 1).unsqueeze(0),
                    kh[:, a:b].unsqueeze(0),
                    vh[:, a:b].unsqueeze(0),
                    attn_mask=visible,
                    scale=opts.scale,
                    enable_gqa=True,
                )
                out[r0:r1] = o[0].transpose(0, 1)
                continue
            qb = q[r0:r1].view(n, hkv, g, hd).permute(1, 2, 0, 3).reshape(hkv, g * n, hd)
            scores = torch.bmm(qb, kh[:, a:b].transpose(1, 2)).float().mul_(opts.scale)
            if cap is not None:
                scores.div_(cap).tanh_().mul_(cap)
            scores = scores.view(hkv, g, n, b - a).masked_fill_(~visible, float("-inf"))
            probs = _softmax(scores, sink).to(v.dtype).view(hkv, g * n, b - a)
            o = torch.bmm(probs, vh[:, a:b]).view(hkv, g, n, hd)
            out[r0:r1] = o.permute(2, 0, 1, 3).reshape(n, h, hd)
        return out

    def _band_mask(
        self, n: int, p0: int, lo: int, window: int | None, device: torch.device
    ) -> torch.Tensor:
        """[n, p0 + n - lo] bool, True where row i (position p0 + i) sees key lo + j:
        lo + j <= p0 + i, and lo + j > p0 + i - window. Kept for the step's other layers."""
        key = ("band", n, p0, lo, window, device)
        mask = self._masks.get(key)
        if mask is None:
            self._evict_masks()
            qpos = torch.arange(p0, p0 + n, device=device).view(-1, 1)
            kpos = torch.arange(lo, p0 + n, device=device).view(1, -1)
            mask = kpos <= qpos
            if window is not None:
                mask &= kpos > qpos - window
            self._masks[key] = mask
        return mask

    def _evict_masks(self) -> None:
        """One step's chunk masks are kept; past 64 the older steps' go."""
        if len(self._masks) > 64:
            self._masks = {k: m for k, m in self._masks.items() if k[0] not in ("chunk", "band")}

    def _chunk_mask(self, n: int, start: int, device: torch.device) -> torch.Tensor:
        """[n, start + n] bool, True where row i (position start + i) may look: keys
        0..start+i. Kept for the step's other layers (the same chunks come 30 times)."""
        key = ("chunk", n, start, device)
        mask = self._masks.get(key)
        if mask is None:
            self._evict_masks()
            mask = torch.ones(n, start + n, dtype=torch.bool, device=device).tril_(start)
            self._masks[key] = mask
        return mask

    def _prefill_blocked(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        start: int,
        scale: float | None = None,
    ) -> torch.Tensor:
        """``_prefill`` in blocks of ``PREFILL_BLOCK_ROWS`` query rows, each against only the
        keys it can see; the causal mask touches only the diagonal band. (PyTorch's CPU
        SDPA is slower than this in bf16, see ``_prefill``.)"""
        num_rows = q.shape[0]
        hkv, g, hd = self.num_kv_heads, self.num_heads // self.num_kv_heads, self.head_dim
        # [Hkv, G, L, hd], pre-scaled (exact in bf16 when the scale is a power of two).
        scale = self.scale if scale is None else scale
        qg = (q * scale).view(num_rows, hkv, g, hd).permute(1, 2, 0, 3).contiguous()
        # Keys head-major and read transposed by the matmul ([Hkv, hd, ctx] as a view):
        # moving whole 64-value rows is ~10x cheaper than the element-wise transpose a
        # contiguous [Hkv, hd, ctx] needs. Measured at 1 thread (bf16, one layer): a 16-row
        # chunk after 3,000 cached keys 0.80 -> 0.39 ms for the copy and the scores, 64 rows
        # 1.71 -> 1.46 ms (the deep short chunks the adaptive budget makes of a long prompt).
        kt = k.permute(1, 0, 2).contiguous().transpose(1, 2)  # [Hkv, hd, ctx]
        vt = v.permute(1, 0, 2).contiguous()  # [Hkv, ctx, hd]
        out = torch.empty_like(qg)
        for r0 in range(0, num_rows, PREFILL_BLOCK_ROWS):
            r1 = min(num_rows, r0 + PREFILL_BLOCK_ROWS)
            n, kend = r1 - r0, start + r1  # this block's rows see keys [0, kend)
            qb = qg[:, :, r0:r1].reshape(hkv, g * n, hd)
            scores = torch.bmm(qb, kt[:, :, :kend]).view(hkv, g, n, kend)
            band = scores[..., start + r0 : kend]  # [Hkv, G, n, n]: keys of the block's rows
            band.masked_fill_(self._causal_mask(n, q.device), float("-inf"))
            probs = torch.softmax(scores, dim=-1)  # fp32 inside; 5x faster than dtype=fp32
            probs = probs.view(hkv, g * n, kend)
            out[:, :, r0:r1] = torch.bmm(probs, vt[:, :kend]).view(hkv, g, n, hd)
        return out.permute(2, 0, 1, 3).reshape(num_rows, self.num_heads, hd)

    def _short(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        group: _ShortGroup,
        opts: _Opts,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Short chunks as decodes with ``r`` query rows each: [m * r, H, hd] -> same."""
        m, r = group.m, group.r
        h, hkv, hd = self.num_heads, self.num_kv_heads, self.head_dim
        width = hkv * hd
        block_ids, mask, num_blocks = group.block_ids, group.mask, group.num_blocks
        if opts.window is not None:  # only the blocks the rows' windows reach
            windowed = _windowed_short(group, opts.window, k_cache.shape[1])
            block_ids, mask, num_blocks = windowed.block_ids, windowed.mask, windowed.num_blocks
        seq = num_blocks * k_cache.shape[1]
        total_blocks = block_ids.numel()
        kd = torch.index_select(
            k_cache, 0, block_ids, out=self._buffer(0, k_cache, total_blocks)
        ).view(m, seq, width)
        vd = torch.index_select(
            v_cache, 0, block_ids, out=self._buffer(1, v_cache, total_blocks)
        ).view(m, seq, width)
        # Queries block-diagonal over KV heads, as in ``_decode``.
        qb = q.new_zeros(m * r, h, hkv, hd)
        qb[:, self._head_idx, self._kv_head_idx] = q * opts.scale
        scores = torch.bmm(qb.view(m, r * h, width), kd.transpose(1, 2)).view(m, r, h, seq)
        self._cap(scores, opts)
        scores.masked_fill_(mask, float("-inf"))
        sink = None if sinks is None else sinks.view(1, 1, h, 1)
        probs = _softmax(scores, sink).view(m, r * h, seq)
        o = torch.bmm(probs, vd).view(m * r, h, hkv, hd)
        return o[:, self._head_idx, self._kv_head_idx]

    def _causal_mask(self, n: int, device: torch.device) -> torch.Tensor:
        """[n, n] bool, True above the diagonal (the keys a row must not see)."""
        mask = self._masks.get((n, device))
        if mask is None:
            mask = torch.ones(n, n, dtype=torch.bool, device=device).triu_(1)
            self._masks[(n, device)] = mask
        return mask

    def _decode(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        group: _DecodeGroup,
        opts: _Opts,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One group of decode rows: [n, H, hd] -> [n, H, hd]. Under a window only the
        blocks the rows' windows reach are gathered."""
        n = q.shape[0]
        block_ids, mask, num_blocks = group.block_ids, group.pad_mask, group.num_blocks
        if opts.window is not None:
            windowed = _windowed_decodes(group, opts.window, k_cache.shape[1])
            block_ids, mask, num_blocks = windowed.block_ids, windowed.mask, windowed.num_blocks
        seq = num_blocks * k_cache.shape[1]
        width = self.num_kv_heads * self.head_dim
        total_blocks = block_ids.numel()
        kd = torch.index_select(k_cache, 0, block_ids, out=self._buffer(0, k_cache, total_blocks))
        vd = torch.index_select(v_cache, 0, block_ids, out=self._buffer(1, v_cache, total_blocks))
        kd = kd.view(n, seq, width)  # [n, S, Hkv * hd]
        vd = vd.view(n, seq, width)
        # Queries block-diagonal over KV heads: row h is non-zero in head h // G's columns.
        qb = q.new_zeros(n, self.num_heads, self.num_kv_heads, self.head_dim)
        qb[:, self._head_idx, self._kv_head_idx] = q * opts.scale
        scores = torch.bmm(qb.view(n, self.num_heads, width), kd.transpose(1, 2))  # [n, H, S]
        self._cap(scores, opts)
        scores.masked_fill_(mask, float("-inf"))
        # fp32 inside; 5x faster than dtype=fp32
        probs = _softmax(scores, None if sinks is None else sinks.view(1, -1, 1))
        o = torch.bmm(probs, vd).view(n, self.num_heads, self.num_kv_heads, self.head_dim)
        return o[:, self._head_idx, self._kv_head_idx]  # each head's own KV head block

    @staticmethod
    def _cap(scores: torch.Tensor, opts: _Opts) -> None:
        """Soft-cap scaled scores in place: c * tanh(s / c)."""
        if opts.softcap is not None:
            scores.div_(opts.softcap).tanh_().mul_(opts.softcap)


def _softmax(scores: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
    """Softmax over the last dim; with ``sinks`` (fp32, broadcast against ``scores[..., :1]``)
    each row's denominator also has ``exp(sink)`` (the sink takes its share, with no value).
    Rows whose keys are all masked (-inf) then get zeros."""
    if sinks is None:
        return torch.softmax(scores, dim=-1)
    x = scores.float()
    top = torch.maximum(x.amax(dim=-1, keepdim=True), sinks)
    e = (x - top).exp_()
    return e.div_(e.sum(dim=-1, keepdim=True) + (sinks - top).exp()).to(scores.dtype)


def _windowed_short(group: _ShortGroup, window: int, block_size: int) -> _WindowedDecodes:
    """``group`` under ``window`` (built once per step and W): each sequence's blocks from
    the one holding its first row's first key (``limit - W``, or 0) to its last row's last;
    the mask hides, per row, the keys past its own position and before its own window."""
    out = group.windowed.get(window)
    if out is None:
        m, bs = group.m, block_size
        limits = group.limits.view(m, group.r)  # [m, r] keys each row sees
        first = (limits[:, 0] - window).clamp(min=0) // bs  # [m] first block each reads
        end = (limits[:, -1] + bs - 1) // bs  # [m] one past its last (padding repeats it)
        count = int((end - first).max())
        cols = first[:, None] + torch.arange(count, device=limits.device)  # [m, count]
        table = group.block_ids.view(m, group.num_blocks)
        ids = table.gather(1, cols.clamp(max=group.num_blocks - 1))
        ids = ids.masked_fill(cols >= end[:, None], 0)  # past a sequence's end: the null block
        key_pos = first[:, None] * bs + torch.arange(count * bs, device=limits.device)
        key_pos = key_pos.view(m, 1, 1, -1)  # [m, 1, 1, S]
        hidden = (key_pos >= group.limits) | (key_pos < group.limits - window)  # [m, r, 1, S]
        out = _WindowedDecodes(ids.reshape(-1), hidden, count)
        group.windowed[window] = out
    return out


def _windowed_decodes(group: _DecodeGroup, window: int, block_size: int) -> _WindowedDecodes:
    """``group`` under ``window`` (built once per step and W): each row's blocks from the one
    holding its window's first key, ``len - W`` (or 0), to its last."""
    out = group.windowed.get(window)
    if out is None:
        n, bs = group.seq_lens.numel(), block_size
        lens = group.seq_lens.view(-1)  # [n]
        first = (lens - window).clamp(min=0) // bs  # [n] first block each row reads
        end = (lens + bs - 1) // bs  # [n] one past its last
        count = int((end - first).max())
        cols = first[:, None] + torch.arange(count, device=lens.device)  # [n, count]
        table = group.block_ids.view(n, group.num_blocks)
        ids = table.gather(1, cols.clamp(max=group.num_blocks - 1))
        ids = ids.masked_fill(cols >= end[:, None], 0)  # past a row's end: the null block
        key_pos = first[:, None] * bs + torch.arange(count * bs, device=lens.device)
        hidden = (key_pos >= lens[:, None]) | (key_pos < lens[:, None] - window)
        out = _WindowedDecodes(ids.reshape(-1), hidden[:, None, :], count)
        group.windowed[window] = out
    return out
