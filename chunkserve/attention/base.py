"""Attention backend interface and the per-step batch layout every backend consumes.

A step's tokens are one flat batch, prefill chunks first, then decodes::

    row:        0 ............ 127 | 128 ....... 164 | 165 | 166 | 167
    request:    A (chunk)          | B (chunk)       | C   | D   | E      (decodes)
    position:   256 ........... 383 | 0 .......... 36 | 901 | 77  | 1200
    sees keys:  A[0 .. 256 + i]    | B[0 .. i]       | C[0..901] | D[0..77] | E[0..1200]

``cu_seqlens_q`` = [0, 128, 165, 166, 167, 168]; ``seq_lens_k`` = [384, 37, 902, 78, 1201].
Every row writes its K/V to ``slot_mapping[row]`` before attention reads the paged cache.

The pool is allocated uninitialised (its pages cost memory only once written), so a block is
zeroed when its first slot is written (``fresh_block_ids``): padded reads of a block's unwritten
tail then see zeros, never garbage that could be NaN (masked weights are 0, but 0 * NaN is NaN).
Block 0 (the null block), the padding entry of block tables, is zeroed when the pool is
created and never written.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class AttentionSpec:
    """What one layer's attention computes beyond plain causal softmax attention; the
    model passes it to ``AttentionBackend.forward`` per layer (``None`` there: all defaults).

    - ``scale``: the factor on q . k before the softmax; ``None`` means ``head_dim ** -0.5``
      (Gemma 2 uses ``query_pre_attn_scalar ** -0.5``).
    - ``sliding_window`` W: the query at absolute position ``p`` sees the keys at positions
      ``max(0, p - W + 1) .. p`` (W keys, itself included), as HF transformers' sliding
      window mask (``kv_idx > q_idx - W``) and its configs' ``sliding_window`` mean it. So
      query ``i`` of a chunk starting at position ``s`` sees ``max(0, s+i-W+1) .. s+i``,
      whatever the chunk size, block size or cached prefix. ``None``: no window.
    - ``logit_softcap`` c: scores (already scaled) become ``c * tanh(scores / c)`` before
      masking and softmax (Gemma 2's ``attn_logit_softcapping``). ``None``: none.
    - ``sinks``: the layer has attention sinks (GPT-OSS): a learned logit per query head,
      passed to ``forward`` as ``sinks`` [num_heads], joins each row's softmax denominator
      (``exp(s_h)`` beside the keys' terms) and adds no value: a row may attend to
      "nothing". False: none.
    """

    scale: float | None = None
    sliding_window: int | None = None
    logit_softcap: float | None = None
    sinks: bool = False

    def __post_init__(self) -> None:
        if self.scale is not None and not (math.isfinite(self.scale) and self.scale > 0):
            raise ValueError(f"scale: must be a finite number > 0, got {self.scale!r}")
        w = self.sliding_window
        if w is not None and (isinstance(w, bool) or not isinstance(w, int) or w < 1):
            raise ValueError(f"sliding_window: must be an int >= 1 or None, got {w!r}")
        c = self.logit_softcap
        if c is not None and not (math.isfinite(c) and c > 0):
            raise ValueError(f"logit_softcap: must be a finite number > 0 or None, got {c!r}")
        if not isinstance(self.sinks, bool):
            raise ValueError(f"sinks: must be True or False, got {self.sinks!r}")

    def resolve_scale(self, head_dim: int) -> float:
        return head_dim**-0.5 if self.scale is None else float(self.scale)


@dataclass
class BatchLayout:
    """Per-step metadata, built once by the model runner. ``B = P + D`` sequences."""

    # T = real rows, then padding rows up to a bucket size (token 0, position 0); padding
    # rows write no KV, attention leaves them zero and nothing reads them back.
    # All index tensors are int64 views of one buffer copied to the device once per step.
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64, absolute position of each row in its request
    slot_mapping: torch.Tensor  # [T] int64, flat KV slot each row writes
    fresh_block_ids: torch.Tensor  # [F] int64, blocks whose first slot this step writes
    cu_seqlens_q: torch.Tensor  # [B + 1] int64, row offsets of each sequence
    seq_lens_k: torch.Tensor  # [B] int64, keys each sequence sees after this step
    block_tables: torch.Tensor  # [B, max_blocks] int64, padded with 0
    logits_indices: torch.Tensor  # [S] int64, rows whose logits are sampled
    num_prefill_seqs: int  # P: the first P sequences are prefill chunks
    num_prefill_tokens: int
    num_decode_tokens: int  # D: one row per decode
    # Host copies, so backends that loop in Python never synchronise with the device.
    query_start_host: list[int]  # [B + 1]
    context_start_host: list[int]  # [B] position of each sequence's first row
    seq_lens_k_host: list[int]  # [B]
    block_tables_host: list[list[int]]  # [B][num_blocks of that sequence]
    block_size: int
    # A hybrid KV cache (``kv_cache``: several KV groups): per group, this layout with the
    # group's slot_mapping, fresh_block_ids and block tables (the other fields shared), and
    # per layer its group. None: one group, this layout serves every layer.
    kv_groups: list[BatchLayout] | None = None
    layer_group: tuple[int, ...] | None = None

    def layer_views(self, attn_meta: Any, num_layers: int) -> list[tuple[BatchLayout, Any]]:
        """Per layer, the layout and the attention metadata its calls take: with KV
        groups, ``attn_meta`` is the list of the groups' metadata (``prepare`` of each)."""
        if self.kv_groups is None or self.layer_group is None:
            return [(self, attn_meta)] * num_layers
        return [(self.kv_groups[g], attn_meta[g]) for g in self.layer_group]

    def decodes_only(self) -> BatchLayout:
        """This layout without its prefill chunks: the decode rows (and the padding after
        them) as rows 0.., their sequences as 0..; no fresh blocks (whoever calls this
        writes the step's K/V first: multi-head latent attention attends its chunks
        itself and only the decodes through the backend)."""
        p, rows = self.num_prefill_seqs, self.num_prefill_tokens
        if p == 0:
            return self
        return BatchLayout(
            input_ids=self.input_ids[rows:],
            positions=self.positions[rows:],
            slot_mapping=self.slot_mapping[rows:],
            fresh_block_ids=self.fresh_block_ids[:0],
            cu_seqlens_q=self.cu_seqlens_q[p:] - rows,
            seq_lens_k=self.seq_lens_k[p:],
            block_tables=self.block_tables[p:],
            logits_indices=self.logits_indices[:0],
            num_prefill_seqs=0,
            num_prefill_tokens=0,
            num_decode_tokens=self.num_decode_tokens,
            query_start_host=[q - rows for q in self.query_start_host[p:]],
            context_start_host=self.context_start_host[p:],
            seq_lens_k_host=self.seq_lens_k_host[p:],
            block_tables_host=self.block_tables_host[p:],
            block_size=self.block_size,
        )

    @property
    def num_tokens(self) -> int:
        """Real rows; the tensors may carry padding rows after them."""
        return self.num_prefill_tokens + self.num_decode_tokens

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_k_host)


class AttentionBackend(ABC):
    """Writes new K/V into the paged cache and attends over it, for one mixed batch.

    Contract (every implementation must match the torch reference on random mixed batches):
    - ``q``: [T, num_heads, head_dim]; ``k``, ``v``: [T, num_kv_heads, head_dim];
    - ``k_cache``, ``v_cache``: [num_blocks, block_size, num_kv_heads, head_dim];
    - row r of a prefill chunk starting at position p attends to keys 0..p+i of its own
      request (i = r's index within the chunk); a decode row attends to its own request's
      keys 0..position; nothing crosses requests;
    - with a ``spec`` (``AttentionSpec``), its scale, and keys ``max(0, p+i-W+1)..p+i``
      under a sliding window W, and scores soft-capped; ``spec=None`` is the default scale,
      no window, no cap (and no extra cost);
    - returns [T, num_heads, head_dim] in ``q.dtype``.
    """

    name: str = "abstract"
    # True when forward launches only fixed-shape work for a decode-only layout (no host
    # values that change between steps), so the step can be captured as a CUDA graph.
    supports_cuda_graphs: bool = False
    # The deterministic mode's attention arithmetic, where machines may differ in it ("": one
    # arithmetic everywhere the backend runs): instances that must give the same bits (a
    # prefill/decode pair) must name the same one.
    arithmetic: str = ""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5

    def supports(self, spec: AttentionSpec | None) -> str | None:
        """None if ``forward`` computes ``spec``, else why not (naming what is missing).
        The base takes only specs with nothing but a scale; backends override."""
        if spec is None:
            return None
        missing = [
            name
            for name, value in (
                ("sliding_window", spec.sliding_window),
                ("logit_softcap", spec.logit_softcap),
                ("attention sinks", spec.sinks or None),
            )
            if value is not None
        ]
        if missing:
            return (
                f"the {self.name} attention backend does not implement {' or '.join(missing)}"
                " (the torch and cpu backends do)"
            )
        return None

    def check_spec(self, spec: AttentionSpec | None) -> None:
        """Raise a ValueError naming what ``spec`` asks that this backend lacks."""
        why = self.supports(spec)
        if why is not None:
            raise ValueError(f"attention spec {spec}: {why}")

    @abstractmethod
    def prepare(self, layout: BatchLayout) -> Any:
        """Per-step metadata shared by all layers (called once per step)."""

    @staticmethod
    def write_kv(
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        layout: BatchLayout,
    ) -> None:
        """Zero blocks written for the first time, then scatter the step's K/V to its slots."""
        if layout.fresh_block_ids.numel():
            k_cache.index_fill_(0, layout.fresh_block_ids, 0)
            v_cache.index_fill_(0, layout.fresh_block_ids, 0)
        num_kv_heads, head_dim = k.shape[1], k.shape[2]
        t = layout.num_tokens  # padding rows write nothing: the null block stays zero
        slots = layout.slot_mapping[:t]
        k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, k[:t])
        v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, v[:t])

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        layout: BatchLayout,
        metadata: Any,
        spec: AttentionSpec | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Write ``k``/``v`` at ``layout.slot_mapping`` and return the attention output.
        ``spec``: this layer's scale, window and soft-cap (None: the defaults); one this
        backend does not support (``supports``) is a ValueError. ``sinks``: [num_heads]
        the layer's sink logits when ``spec.sinks``."""
