"""Attention backends behind one interface, chosen by availability ("auto")."""

from __future__ import annotations

import importlib.util
import os

import torch

from chunkserve.attention.base import AttentionBackend, BatchLayout
from chunkserve.config import ATTENTION_BACKENDS


def triton_usable(device: torch.device) -> bool:
    """Triton kernels run on CUDA devices, or anywhere under Triton's interpreter
    (``TRITON_INTERPRET=1``, used by the CPU tests)."""
    if importlib.util.find_spec("triton") is None:
        return False
    return device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


def get_attention_backend(
    name: str, device: torch.device, num_heads: int, num_kv_heads: int, head_dim: int
) -> AttentionBackend:
    """Return the backend called ``name``; optional kernels are imported lazily here.
    ``auto``: triton on CUDA when Triton is installed, else the torch reference."""
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"attention_backend: must be one of {ATTENTION_BACKENDS}, got {name!r}")
    if name == "auto":
        name = "triton" if device.type == "cuda" and triton_usable(device) else "torch"
    if name == "triton":
        if not triton_usable(device):
            raise ValueError(
                f"attention_backend: 'triton' needs the triton package and a CUDA device "
                f"(or TRITON_INTERPRET=1); device is {device}"
            )
        from chunkserve.attention.triton_paged import TritonAttentionBackend

        return TritonAttentionBackend(num_heads, num_kv_heads, head_dim)
    from chunkserve.attention.torch_ref import TorchAttentionBackend

    return TorchAttentionBackend(num_heads, num_kv_heads, head_dim)


__all__ = ["AttentionBackend", "BatchLayout", "get_attention_backend", "triton_usable"]
