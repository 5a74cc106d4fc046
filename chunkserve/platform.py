"""Device and dtype selection."""

from __future__ import annotations

import functools
import logging
import os
import platform
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("device: 'cuda' was asked for but CUDA is not available")
    return torch.device(name)


@functools.cache
def _cpu_flags() -> str:
    """/proc/cpuinfo's text ("" where there is none), read once."""
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""


def cpu_has_native_bf16() -> bool:
    """True when the CPU computes bf16 natively (AVX512-BF16 or AMX): bf16 matmuls are then
    several times faster than fp32; elsewhere bf16 is emulated and slower."""
    flags = _cpu_flags()
    return "avx512_bf16" in flags or "amx_bf16" in flags


def cpu_has_amx_bf16() -> bool:
    """True when the CPU has AMX-BF16 tiles (torch's bf16 matmuls run on them through
    oneDNN: the CPU attention backend sends fewer bf16 rows to its own kernel)."""
    return "amx_bf16" in _cpu_flags()


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """``auto``: bf16 on GPUs that support it and on CPUs with native bf16, else fp32."""
    if name != "auto":
        dtype = _DTYPES[name]
        if device.type == "cpu" and dtype == torch.float16:
            logger.warning(
                "float16 on CPU is very slow (no native fp16 matmul); prefer bfloat16 or float32"
            )
        return dtype
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.bfloat16 if cpu_has_native_bf16() else torch.float32


def configure_cpu_runtime() -> None:
    """Bound oneDNN's per-shape caches; call before the process's first matmul.

    Every step has a different token count and context length, so the default caches (1,024
    oneDNN primitives, 1,024 ideep entries) fill with one-off shapes: measured on the offline
    benchmark, peak RSS 2.36 GiB, against 1.69 GiB at 64 and 16 entries with the same speed.
    (MKL's memory manager is turned off in ``chunkserve/__init__``: MKL reads that setting
    when torch is imported.) Users' own settings win."""
    os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "64")
    os.environ.setdefault("LRU_CACHE_CAPACITY", "16")
    _keep_large_allocations_mapped()


# glibc mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3


@functools.cache
def _keep_large_allocations_mapped() -> bool:
    """Serve the attention's multi-MB temporaries from the heap instead of fresh mmaps.

    A prefill chunk deep into a long prompt allocates score matrices of 10-40 MB per layer.
    Above glibc's mmap threshold (dynamic, at most 32 MB) each one is a fresh mapping that
    page-faults on first touch and is unmapped on free: measured at 1 thread, a 128-token
    chunk at position 3,584 took 420-555 ms a step, and 260-270 ms with large blocks kept in
    the heap (shallow chunks and decodes unchanged). Users' MALLOC_*_THRESHOLD_ settings
    win; elsewhere than glibc this does nothing."""
    if os.environ.get("MALLOC_MMAP_THRESHOLD_") or os.environ.get("MALLOC_TRIM_THRESHOLD_"):
        return False
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
        ok = libc.mallopt(_M_MMAP_THRESHOLD, 128 << 20) == 1
        ok = libc.mallopt(_M_TRIM_THRESHOLD, 256 << 20) == 1 and ok
    except (OSError, AttributeError):
        return False
    return ok
