"""Reference attention over the paged cache in plain PyTorch (any device; the CPU path and
the oracle GPU kernels are tested against).

Per layer: one scatter of the step's new K/V by ``slot_mapping``; one SDPA call per prefill
chunk (few per step); and all decodes of the step batched into one padded gather plus one
attention call, a key-length mask hiding the padding. Masks and gather indices are built once
per step in ``prepare`` and shared by every layer.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from chunkserve.attention.base import AttentionBackend, BatchLayout


@dataclass
class _PrefillChunk:
    row_start: int
    row_end: int
    ctx_len: int
    # None when the chunk starts at position 0: it attends causally to its own fresh K/V.
    block_ids: torch.Tensor | None  # [num_blocks] int64
    mask: torch.Tensor | None  # [q_len, ctx_len] bool, True = may attend


@dataclass
class _TorchMetadata:
    prefills: list[_PrefillChunk] = field(default_factory=list)
    decode_row_start: int = 0
    num_decodes: int = 0
    decode_block_ids: torch.Tensor | None = None  # [D * max_blocks] int64
    decode_pad_mask: torch.Tensor | None = None  # [D, 1, 1, S] bool, True = padding
    decode_kv_len: int = 0  # S = max_blocks * block_size


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def prepare(self, layout: BatchLayout) -> _TorchMetadata:
        device = layout.input_ids.device
        bs = layout.block_size
        meta = _TorchMetadata()
        for i in range(layout.num_prefill_seqs):
            start_row, end_row = layout.query_start_host[i], layout.query_start_host[i + 1]
            ctx_len = layout.seq_lens_k_host[i]
            pos0 = layout.context_start_host[i]
            if pos0 == 0:
                meta.prefills.append(_PrefillChunk(start_row, end_row, ctx_len, None, None))
                continue
            num_blocks = -(-ctx_len // bs)
            block_ids = torch.tensor(
                layout.block_tables_host[i][:num_blocks], device=device, dtype=torch.int64
            )
            q_pos = torch.arange(pos0, pos0 + end_row - start_row, device=device)
            mask = torch.arange(ctx_len, device=device)[None, :] <= q_pos[:, None]
            meta.prefills.append(_PrefillChunk(start_row, end_row, ctx_len, block_ids, mask))

        num_decodes = layout.num_decode_tokens
        if num_decodes:
            p = layout.num_prefill_seqs
            max_len = max(layout.seq_lens_k_host[p:])
            max_blocks = -(-max_len // bs)
            meta.decode_row_start = layout.num_prefill_tokens
            meta.num_decodes = num_decodes
            meta.decode_block_ids = layout.block_tables[p:, :max_blocks].reshape(-1).long()
            meta.decode_kv_len = max_blocks * bs
            key_pos = torch.arange(meta.decode_kv_len, device=device)
            pad = key_pos[None, :] >= layout.seq_lens_k[p:, None]
            meta.decode_pad_mask = pad[:, None, None, :]
        return meta

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        layout: BatchLayout,
        metadata: _TorchMetadata,
    ) -> torch.Tensor:
        num_kv_heads, head_dim = self.num_kv_heads, self.head_dim
        # Slot-major views of the pools: [num_blocks * block_size, num_kv_heads, head_dim].
        k_slots = k_cache.view(-1, num_kv_heads, head_dim)
        v_slots = v_cache.view(-1, num_kv_heads, head_dim)
        k_slots.index_copy_(0, layout.slot_mapping, k)
        v_slots.index_copy_(0, layout.slot_mapping, v)

        out = torch.empty_like(q)  # [T, num_heads, head_dim]
        for chunk in metadata.prefills:
            rows = slice(chunk.row_start, chunk.row_end)
            qc = q[rows].transpose(0, 1)  # [H, q_len, hd]
            if chunk.block_ids is None:
                kc = k[rows].transpose(0, 1)  # [Hkv, q_len, hd]
                vc = v[rows].transpose(0, 1)
                o = F.scaled_dot_product_attention(
                    qc, kc, vc, is_causal=True, scale=self.scale, enable_gqa=True
                )
            else:
                kc = k_cache.index_select(0, chunk.block_ids).view(-1, num_kv_heads, head_dim)
                vc = v_cache.index_select(0, chunk.block_ids).view(-1, num_kv_heads, head_dim)
                kc = kc[: chunk.ctx_len].transpose(0, 1)  # [Hkv, ctx_len, hd]
                vc = vc[: chunk.ctx_len].transpose(0, 1)
                o = F.scaled_dot_product_attention(
                    qc, kc, vc, attn_mask=chunk.mask, scale=self.scale, enable_gqa=True
                )
            out[rows] = o.transpose(0, 1)

        if metadata.num_decodes:
            r0 = metadata.decode_row_start
            out[r0:] = self._decode(q[r0:], k_cache, v_cache, metadata)
        return out

    def _decode(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: _TorchMetadata
    ) -> torch.Tensor:
        """All decode rows at once: one padded gather of their blocks, one attention."""
        num_decodes, seq = meta.num_decodes, meta.decode_kv_len
        g = self.num_heads // self.num_kv_heads
        shape = (num_decodes, seq, self.num_kv_heads, self.head_dim)
        kd = k_cache.index_select(0, meta.decode_block_ids).view(shape)  # [D, S, Hkv, hd]
        vd = v_cache.index_select(0, meta.decode_block_ids).view(shape)
        qd = q.view(num_decodes, self.num_kv_heads, g, self.head_dim)  # [D, Hkv, G, hd]
        scores = torch.einsum("dkgh,dskh->dkgs", qd, kd).float()  # [D, Hkv, G, S]
        scores.mul_(self.scale).masked_fill_(meta.decode_pad_mask, float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(q.dtype)
        o = torch.einsum("dkgs,dskh->dkgh", probs, vd)  # [D, Hkv, G, hd]
        return o.reshape(num_decodes, self.num_heads, self.head_dim)
