"""Attention backends behind one interface, chosen by availability ("auto")."""

from __future__ import annotations

import torch

from chunkserve.attention.base import AttentionBackend, BatchLayout

BACKENDS = ("auto", "torch")


def get_attention_backend(
    name: str, device: torch.device, num_heads: int, num_kv_heads: int, head_dim: int
) -> AttentionBackend:
    """Return the backend called ``name``; optional kernels are imported lazily here."""
    if name not in BACKENDS:
        raise ValueError(f"attention_backend: must be one of {BACKENDS}, got {name!r}")
    from chunkserve.attention.torch_ref import TorchAttentionBackend

    return TorchAttentionBackend(num_heads, num_kv_heads, head_dim)


__all__ = ["AttentionBackend", "BatchLayout", "get_attention_backend"]
