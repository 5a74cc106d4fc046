"""Attention backends behind one interface, chosen by availability ("auto")."""

from __future__ import annotations

import importlib.util
import logging
import os
from collections.abc import Iterable

import torch

from chunkserve.attention.base import AttentionBackend, AttentionSpec, BatchLayout
from chunkserve.config import ATTENTION_BACKENDS

logger = logging.getLogger(__name__)


def triton_usable(device: torch.device) -> bool:
    """Triton kernels run on CUDA devices, or anywhere under Triton's interpreter
    (``TRITON_INTERPRET=1``, used by the CPU tests)."""
    if importlib.util.find_spec("triton") is None:
        return False
    return device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


def get_attention_backend(
    name: str,
    device: torch.device,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype = torch.float32,
    block_size: int = 16,
    deterministic: bool = False,
) -> AttentionBackend:
    """Return the backend called ``name``; optional kernels are imported lazily here.
    ``auto``: triton on CUDA when Triton is installed; on a CPU the C kernel's backend when
    it builds here and takes the dtype, block size and head size, else the torch reference."""
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"attention_backend: must be one of {ATTENTION_BACKENDS}, got {name!r}")
    if deterministic:  # only the C kernel reduces every row the same way whatever the batch
        if device.type != "cpu" or name not in ("auto", "cpu"):
            raise ValueError(
                f"deterministic: needs the 'cpu' attention backend on a CPU (batch-invariant "
                f"attention is the C kernel's); got attention_backend {name!r} on {device}"
            )
        name = "cpu"
    if name == "auto":
        if device.type == "cuda":
            name = "triton" if triton_usable(device) else "torch"
        else:
            name = "cpu" if _cpu_kernel(device, dtype, block_size, head_dim) else "torch"
    if name == "triton":
        if not triton_usable(device):
            raise ValueError(
                f"attention_backend: 'triton' needs the triton package and a CUDA device "
                f"(or TRITON_INTERPRET=1); device is {device}"
            )
        from chunkserve.attention.triton_paged import TritonAttentionBackend

        return TritonAttentionBackend(num_heads, num_kv_heads, head_dim)
    if name == "cpu":
        kernel = _cpu_kernel(device, dtype, block_size, head_dim)
        if kernel is None:
            from chunkserve.attention import cpu_kernels

            why = cpu_kernels.load_error() or (
                f"it takes {sorted(str(d) for d in cpu_kernels.DTYPES)}, block_size <= "
                f"{cpu_kernels.MAX_BLOCK_SIZE} and head_dim <= {cpu_kernels.MAX_HEAD_DIM} on "
                f"a CPU; got {dtype}, {block_size}, {head_dim} on {device}"
            )
            field = "deterministic: needs" if deterministic else "attention_backend:"
            raise ValueError(f"{field} 'cpu' is not usable here: {why}")
        from chunkserve.attention.cpu_paged import CpuAttentionBackend

        return CpuAttentionBackend(
            num_heads,
            num_kv_heads,
            head_dim,
            kernel,
            dtype,
            deterministic=deterministic,
            block_size=block_size,
        )
    from chunkserve.attention.torch_ref import TorchAttentionBackend

    return TorchAttentionBackend(num_heads, num_kv_heads, head_dim)


def select_attention_backend(
    name: str,
    device: torch.device,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype = torch.float32,
    block_size: int = 16,
    deterministic: bool = False,
    specs: Iterable[AttentionSpec] = (),
    who: str = "model",
) -> AttentionBackend:
    """The backend a model (the target, or a draft model) attends with: ``name`` as
    ``get_attention_backend`` resolves it (``auto``: the C kernel's where it builds and
    takes the shapes, else torch's), and where ``auto`` picked a backend without something
    in ``specs`` (what the model's layers need: windows, soft-caps, sinks), the torch
    backend, which has them all (a log line). A backend named explicitly is kept: the
    caller's ``check_attention`` then refuses what it lacks, by name."""
    backend = get_attention_backend(
        name, device, num_heads, num_kv_heads, head_dim, dtype, block_size, deterministic
    )
    if name == "auto" and any(backend.supports(spec) is not None for spec in specs):
        logger.info(
            "attention backend (%s): %s lacks what the model's attention needs; using torch",
            who,
            type(backend).__name__,
        )
        backend = get_attention_backend(
            "torch", device, num_heads, num_kv_heads, head_dim, dtype, block_size, deterministic
        )
    return backend


def _cpu_kernel(device: torch.device, dtype: torch.dtype, block_size: int, head_dim: int):
    """The C kernel when it serves this configuration, else None."""
    from chunkserve.attention import cpu_kernels

    if device.type != "cpu" or not cpu_kernels.supports(dtype, block_size, head_dim):
        return None
    return cpu_kernels.load()


__all__ = [
    "AttentionBackend",
    "AttentionSpec",
    "BatchLayout",
    "get_attention_backend",
    "select_attention_backend",
    "triton_usable",
]
