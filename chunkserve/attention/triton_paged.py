"""Paged attention for one mixed batch, in Triton (CUDA GPUs; Triton's interpreter runs the
same kernels on a CPU, which is how the CPU tests check them).

Two kernels per layer: one writes the step's K/V at ``slot_mapping``; one attends, launched
once over the prefill chunks and once over the decodes. An attention program owns BLOCK_Q
query tokens of one sequence and one KV head, that is BLOCK_Q x G query rows (G query heads
share the KV head; G is padded to a power of two), so every K/V tile read from the pool
serves the whole group::

    program (sequence s, query block b, KV head h), rows m = (token t, head g in group):
        t = m // G_PAD, g = m % G_PAD
        query   q[cu_seqlens_q[s] + b * BLOCK_Q + t, h * G + g]
        position  ctx_start(s) + b * BLOCK_Q + t,   ctx_start = seq_lens_k[s] - query length
        keys    0 .. last row's position, BLOCK_N at a time; key n lives at slot
                block_tables[s, n // block_size] * block_size + n % block_size
        mask    key n visible to row m iff n <= position(m)   (causal over the cached prefix)
                and, under a sliding window W, n > position(m) - W

Softmax is online in fp32 (exp2, the scale folded in); the output is in q's dtype. A layer's
``AttentionSpec`` is honoured whole: a window starts the key loop at the tile holding the
block's first row's window start and reads no key before it (a sliding KV group has given
those blocks back), so a decode reads W keys whatever its context; a soft-cap c maps the
scaled scores to ``c * tanh(s / c)``; attention sinks start each row's softmax with the
head's sink logit as its running maximum and a denominator of 1 (a key with no value). Keys past
a sequence's length are never read, so blocks need no zeroing, and a decode-only step runs on
a fixed grid whose padding rows (seq_len 1, block table of null blocks) are harmless: that is
what lets decode steps replay as CUDA graphs.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from chunkserve.attention.base import AttentionBackend, AttentionSpec, BatchLayout

LOG2_E = 1.4426950408889634
LOG2E: tl.constexpr = tl.constexpr(LOG2_E)


# Per-step values are not specialised on (value 1, divisibility by 16, pointer alignment):
# each new combination would compile another variant mid-serving (~1 s on an H100).
@triton.jit(do_not_specialize_on_alignment=["slot_ptr"])
def _write_kv_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cb,
    stride_cs,
    stride_ch,
    block_size,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Row t of k/v [T, Hkv, hd] to slot ``slot_ptr[t]`` of the pools [N, bs, Hkv, hd]."""
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h < NUM_KV_HEADS)[:, None] & (offs_d < HEAD_DIM)[None, :]
    dst = (slot // block_size) * stride_cb + (slot % block_size) * stride_cs
    dst = dst + offs_h[:, None] * stride_ch + offs_d[None, :]
    k = tl.load(k_ptr + t * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask)
    tl.store(k_cache_ptr + dst, k, mask=mask)
    v = tl.load(v_ptr + t * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask)
    tl.store(v_cache_ptr + dst, v, mask=mask)


@triton.jit(
    do_not_specialize=["seq_offset", "stride_bt"],
    do_not_specialize_on_alignment=["block_tables_ptr", "cu_seqlens_q_ptr", "seq_lens_ptr"],
)
def _paged_attention_kernel(
    out_ptr,
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    cu_seqlens_q_ptr,
    seq_lens_ptr,
    seq_offset,
    scale_log2,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_bt,
    block_size,
    G: tl.constexpr,
    G_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr,
    DOT_FP32: tl.constexpr,
    window=0,
    softcap=1.0,
    sinks_ptr=None,
    HAS_WINDOW: tl.constexpr = False,
    HAS_SOFTCAP: tl.constexpr = False,
    HAS_SINKS: tl.constexpr = False,
):
    seq = tl.program_id(0) + seq_offset
    q_block = tl.program_id(1)
    kv_head = tl.program_id(2)
    q_start = tl.load(cu_seqlens_q_ptr + seq)
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
    if q_block * BLOCK_Q < q_len:
        seq_len = tl.load(seq_lens_ptr + seq)
        ctx_start = seq_len - q_len

        offs_m = tl.arange(0, BLOCK_M)
        tok = q_block * BLOCK_Q + offs_m // G_PAD
        grp = offs_m % G_PAD
        row_ok = (offs_m // G_PAD < BLOCK_Q) & (tok < q_len) & (grp < G)
        head = kv_head * G + grp
        q_pos = ctx_start + tok
        offs_d = tl.arange(0, BLOCK_D)
        d_ok = offs_d < HEAD_DIM
        rows = (q_start + tok).to(tl.int64)
        q_mask = row_ok[:, None] & d_ok[None, :]
        q = tl.load(
            q_ptr + rows[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
            mask=q_mask,
            other=0.0,
        )  # [BLOCK_M, BLOCK_D]
        if DOT_FP32:
            q = q.to(tl.float32)

        # The block's last row sees keys [0, kv_end); under a window its first row none
        # before kv_lo (nor does any later row).
        kv_end = ctx_start + tl.minimum(q_len, (q_block + 1) * BLOCK_Q)
        kv_lo = 0
        if HAS_WINDOW:
            kv_lo = tl.maximum(ctx_start + q_block * BLOCK_Q - window + 1, 0)
        if HAS_SINKS:  # the sink: a running maximum of its logit, a denominator of 1
            m_i = tl.load(sinks_ptr + head, mask=row_ok, other=0.0).to(tl.float32) * LOG2E
            l_i = tl.full([BLOCK_M], 1.0, tl.float32)
        else:
            m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
            l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        table = block_tables_ptr + seq.to(tl.int64) * stride_bt
        offs_n = tl.arange(0, BLOCK_N)
        for start in range((kv_lo // BLOCK_N) * BLOCK_N, kv_end, BLOCK_N):
            key = start + offs_n
            key_ok = (key < kv_end) & (key >= kv_lo)
            block = tl.load(table + key // block_size, mask=key_ok, other=0).to(tl.int64)
            base = block * stride_cb + (key % block_size) * stride_cs + kv_head * stride_ch
            k = tl.load(
                k_cache_ptr + base[None, :] + offs_d[:, None],
                mask=key_ok[None, :] & d_ok[:, None],
                other=0.0,
            )  # [BLOCK_D, BLOCK_N]
            if DOT_FP32:
                k = k.to(tl.float32)
            s = tl.dot(q, k, input_precision=PRECISION)  # [BLOCK_M, BLOCK_N]
            if HAS_SOFTCAP:  # c * tanh(scaled / c), tanh by exp2 (finite at any score)
                e = tl.exp2((2.0 * scale_log2 / softcap) * s)
                s = softcap * (1.0 - 2.0 / (e + 1.0)) * LOG2E
            else:
                s = s * scale_log2
            visible = (key[None, :] <= q_pos[:, None]) & key_ok[None, :]
            if HAS_WINDOW:
                visible = visible & (key[None, :] > q_pos[:, None] - window)
            s = tl.where(visible, s, float("-inf"))
            # A row may see no key of a tile (the tile before its window, a padding row):
            # its maximum stays -inf, and exp2 then runs against 0 instead (no NaN).
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m_i - m_use)
            p = tl.exp2(s - m_use[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(
                v_cache_ptr + base[:, None] + offs_d[None, :],
                mask=key_ok[:, None] & d_ok[None, :],
                other=0.0,
            )  # [BLOCK_N, BLOCK_D]
            if DOT_FP32:
                v = v.to(tl.float32)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            m_i = m_new
        l_i = tl.where(l_i > 0.0, l_i, 1.0)  # a row that saw nothing (padding) gives 0
        out = acc / l_i[:, None]
        tl.store(
            out_ptr + rows[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=q_mask,
        )


@dataclass
class _TritonMetadata:
    num_prefill_seqs: int
    max_prefill_len: int  # longest chunk of the step (sizes the prefill grid)
    num_decode_seqs: int


def _next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


class TritonAttentionBackend(AttentionBackend):
    name = "triton"
    supports_cuda_graphs = True

    # Rows (query tokens x group heads) per prefill program, and keys per tile.
    PREFILL_ROWS = 128
    BLOCK_N = 64

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        super().__init__(num_heads, num_kv_heads, head_dim)
        self.group = num_heads // num_kv_heads
        self.group_pad = _next_pow2(self.group)
        self.block_d = max(16, _next_pow2(head_dim))
        # Heads of 256 (Gemma 3) halve the key tile and the prefill rows: at 64 x 128 rows
        # an fp32 program wanted 288 KiB of shared memory (an H200 has 227).
        wide = self.block_d >= 256
        self.block_n = self.BLOCK_N // 2 if wide else self.BLOCK_N
        rows = self.PREFILL_ROWS // 2 if wide else self.PREFILL_ROWS
        self.prefill_q = max(1, rows // self.group_pad)
        self.prefill_m = max(16, self.prefill_q * self.group_pad)
        self.decode_m = max(16, self.group_pad)
        self.prefill_warps = 8 if self.block_d >= 128 else 4

    def supports(self, spec: AttentionSpec | None) -> str | None:
        return None  # every scale, window, soft-cap and attention sinks

    def prepare(self, layout: BatchLayout) -> _TritonMetadata:
        p = layout.num_prefill_seqs
        qs = layout.query_start_host
        max_len = max((qs[i + 1] - qs[i] for i in range(p)), default=0)
        return _TritonMetadata(p, max_len, layout.num_seqs - p)

    @staticmethod
    def write_kv(
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        layout: BatchLayout,
    ) -> None:
        """Every row, padding rows included (their slots are in the null block, which this
        backend never reads); no zeroing of fresh blocks (reads stop at each length)."""
        num_rows, num_kv_heads, head_dim = k.shape
        if num_rows == 0:
            return
        _write_kv_kernel[(num_rows,)](
            k,
            v,
            k_cache,
            v_cache,
            layout.slot_mapping,
            k.stride(0),
            k.stride(1),
            v.stride(0),
            v.stride(1),
            k_cache.stride(0),
            k_cache.stride(1),
            k_cache.stride(2),
            k_cache.shape[1],
            NUM_KV_HEADS=num_kv_heads,
            HEAD_DIM=head_dim,
            BLOCK_H=_next_pow2(num_kv_heads),
            BLOCK_D=_next_pow2(head_dim),
        )

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        layout: BatchLayout,
        metadata: _TritonMetadata,
        spec: AttentionSpec | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        scale = self.scale
        if (sinks is not None) != (spec is not None and spec.sinks):
            raise ValueError("sinks: passed exactly when the layer's spec has sinks")
        window, cap = None, None
        if spec is not None:
            scale = spec.resolve_scale(self.head_dim)
            window, cap = spec.sliding_window, spec.logit_softcap
        if k.stride(2) != 1 or q.stride(2) != 1 or k_cache.stride(3) != 1:
            raise ValueError("triton attention: head_dim must be the contiguous dimension")
        self.write_kv(k, v, k_cache, v_cache, layout)
        out = torch.empty_like(q)  # [T, H, hd]
        if q.shape[0] > layout.num_tokens:
            out[layout.num_tokens :] = 0  # padding rows of an eager step (none in graphs)
        precision = "ieee" if q.dtype == torch.float32 else "tf32"
        # Triton's interpreter computes bf16/fp16 dots wrongly (3.6): there, dot in fp32.
        dot_fp32 = os.environ.get("TRITON_INTERPRET") == "1"
        common = dict(
            stride_qt=q.stride(0),
            stride_qh=q.stride(1),
            stride_ot=out.stride(0),
            stride_oh=out.stride(1),
            stride_cb=k_cache.stride(0),
            stride_cs=k_cache.stride(1),
            stride_ch=k_cache.stride(2),
            stride_bt=layout.block_tables.stride(0),
            block_size=k_cache.shape[1],
            G=self.group,
            G_PAD=self.group_pad,
            HEAD_DIM=self.head_dim,
            BLOCK_D=self.block_d,
            BLOCK_N=self.block_n,
            PRECISION=precision,
            DOT_FP32=dot_fp32,
            window=window or 0,
            softcap=cap or 1.0,
            sinks_ptr=None if sinks is None else _fp32(sinks),
            HAS_WINDOW=window is not None,
            HAS_SOFTCAP=cap is not None,
            HAS_SINKS=sinks is not None,
        )
        args = (
            out,
            q,
            k_cache,
            v_cache,
            layout.block_tables,
            layout.cu_seqlens_q,
            layout.seq_lens_k,
        )
        scale_log2 = scale * LOG2_E
        meta = metadata
        if meta.num_prefill_seqs:
            grid = (
                meta.num_prefill_seqs,
                triton.cdiv(meta.max_prefill_len, self.prefill_q),
                self.num_kv_heads,
            )
            _paged_attention_kernel[grid](
                *args,
                0,
                scale_log2,
                **common,
                BLOCK_Q=self.prefill_q,
                BLOCK_M=self.prefill_m,
                num_warps=self.prefill_warps,
                num_stages=2,
            )
        if meta.num_decode_seqs:
            grid = (meta.num_decode_seqs, 1, self.num_kv_heads)
            _paged_attention_kernel[grid](
                *args,
                meta.num_prefill_seqs,
                scale_log2,
                **common,
                BLOCK_Q=1,
                BLOCK_M=self.decode_m,
                num_warps=4,
                num_stages=2,
            )
        return out


def _fp32(sinks: torch.Tensor) -> torch.Tensor:
    """The sink logits as the kernel reads them: the model keeps them in fp32 already (no copy
    per layer and step); other callers' are converted."""
    if sinks.dtype == torch.float32 and sinks.is_contiguous():
        return sinks
    return sinks.float().contiguous()
