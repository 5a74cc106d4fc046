"""The CPU attention kernel (``csrc/paged_attention.c``): compiled on first use with the
machine's C compiler, cached by what it was built from, called through ctypes.

Why C: a decode step's attention on a CPU is bound by reading the KV cache. The torch path
gathers each decode's blocks into a padded buffer and runs batched matmuls over it, which
moves K and V through memory twice and reads the padding; the kernel reads each sequence's
own blocks once, in place (measured at 2 threads on the 2-core EPYC, batch 64, the embedded
model's 30 layers: context 256, 118 -> 45 ms fp32 and 51 -> 29 ms bf16; context 1,024,
541 -> 240 ms fp32, near this VM's read bandwidth).

Built, cached and loaded by ``chunkserve.cbuild`` (``-O3 -march=native`` for the CPU it
runs on; threads on torch's own OpenMP runtime).

No compiler, or a failed build, is not an error: ``load()`` returns None (the reason in
``load_error()``) and the engine runs the torch backend.
"""

from __future__ import annotations

import ctypes
import logging
import os
from pathlib import Path

import torch

from chunkserve import cbuild

logger = logging.getLogger("chunkserve.attention")

SOURCE = Path(__file__).resolve().parent / "csrc" / "paged_attention.c"
# -ffast-math lets the compiler vectorise the reductions; finite math stays on (the
# kernel's running maximum starts at -inf).
CFLAGS = ("-O3", "-march=native", "-ffast-math", "-fno-finite-math-only", "-fPIC", "-fopenmp")
# What the C side refuses (it returns a code and the caller falls back to torch).
MAX_BLOCK_SIZE = 64
MAX_HEAD_DIM = 256
DTYPES = {torch.float32: 0, torch.bfloat16: 1}


class PagedAttentionKernel:
    """``paged_attention(q, k_cache, v_cache, out, batch)``: attention for runs of query rows
    straight from the paged cache (see ``csrc/paged_attention.c``)."""

    def __init__(self, lib: ctypes.CDLL, path: Path) -> None:
        self.path = path
        fn = lib.paged_attention
        ptr, i64 = ctypes.c_void_p, ctypes.c_int64
        fn.argtypes = [ptr, ptr, ptr, ptr, ctypes.c_int, ptr, i64, ptr, ptr, ptr, i64]
        fn.argtypes += [i64, i64, i64, i64, ctypes.c_float, i64, ctypes.c_float, ptr, i64, i64]
        fn.restype = ctypes.c_int
        self._fn = fn
        lib.paged_attention_bf16_tiles.restype = ctypes.c_int
        # Built with the bf16 tile path (the CPU has AVX512-BF16): bf16 chunks run at about
        # twice the rate of the fp32 tiles (see csrc).
        self.bf16_tiles = bool(lib.paged_attention_bf16_tiles())
        lib.paged_attention_amx.argtypes = [ctypes.c_int64, ctypes.c_int64]
        lib.paged_attention_amx.restype = ctypes.c_int
        self._amx = lib.paged_attention_amx
        lib.paged_attention_allow_amx.argtypes = [ctypes.c_int]
        self._allow_amx = lib.paged_attention_allow_amx
        self.allow_amx(amx_allowed())

    def amx(self, head_dim: int, block_size: int) -> bool:
        """Whether the deterministic mode's bf16 tiles run on AMX here (the build has
        AMX-BF16, the OS grants the tile state, the shapes fit, ``allow_amx``); else on
        AVX512-BF16, with other bits: the mode's bf16 results are the same on machines of one
        kind, not across kinds."""
        return bool(self._amx(head_dim, block_size))

    def allow_amx(self, allow: bool) -> None:
        """False: the deterministic mode's bf16 tiles stay off AMX in this process (they then
        give the bits of a CPU with AVX512-BF16 and no AMX); set from
        ``CHUNKSERVE_ATTENTION_AMX`` when the kernel loads."""
        self._allow_amx(int(allow))

    def __call__(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        out: torch.Tensor,
        tables: torch.Tensor,
        q_start: torch.Tensor,
        q_len: torch.Tensor,
        ctx_lens: torch.Tensor,
        scale: float,
        window: int | None = None,
        softcap: float | None = None,
        sinks: torch.Tensor | None = None,
        fixed_range: int = 0,
    ) -> None:
        """Rows ``q_start[s] .. q_start[s] + q_len[s] - 1`` of ``q`` [T, H, D] attend to the
        first ``ctx_lens[s]`` keys of sequence ``s`` (row j sees ``ctx - q_len + 1 + j``, or
        with a ``window`` W only the last W of those), whose blocks are ``tables[s]``; the
        result goes to the same rows of ``out``. Scores are ``scale * q . k``, soft-capped to
        ``softcap * tanh(s / softcap)`` when one is given. ``sinks`` (fp32 [H]): attention
        sinks, one logit per query head added to every row's softmax denominator. Every
        tensor contiguous, on the CPU; the index tensors int64. ``fixed_range`` F > 0:
        batch-invariant (the deterministic mode): every run of rows on the tile path, a
        sequence's blocks reduced in ranges of F aligned on multiples of F, whatever the
        batch or the thread count; bf16 on AMX tiles where ``amx`` says so (groups of 64
        keys, aligned), else on the AVX512-BF16 tiles."""
        _, block_size, num_kv_heads, head_dim = k_cache.shape
        if sinks is not None and (
            sinks.dtype != torch.float32 or sinks.shape != (q.shape[1],) or sinks.stride(0) != 1
        ):
            raise ValueError(
                f"sinks: must be float32 [{q.shape[1]}] and contiguous, got {sinks.dtype} "
                f"{tuple(sinks.shape)}"
            )
        rc = self._fn(
            q.data_ptr(),
            k_cache.data_ptr(),
            v_cache.data_ptr(),
            out.data_ptr(),
            DTYPES[q.dtype],
            tables.data_ptr(),
            tables.stride(0),
            q_start.data_ptr(),
            q_len.data_ptr(),
            ctx_lens.data_ptr(),
            ctx_lens.numel(),
            q.shape[1],
            num_kv_heads,
            head_dim,
            block_size,
            scale,
            window or 0,
            softcap or 0.0,
            None if sinks is None else sinks.data_ptr(),
            torch.get_num_threads(),
            fixed_range,
        )
        if rc:  # the backend only sends what the kernel takes: a bug, not a fallback
            raise RuntimeError(f"paged_attention kernel refused its arguments (code {rc})")


def amx_allowed() -> bool:
    """``CHUNKSERVE_ATTENTION_AMX=0``: the deterministic mode's bf16 attention stays off AMX
    (so an AMX machine computes the bits of an AVX512-BF16 one, e.g. a prefill instance paired
    with a decode instance on a CPU without AMX)."""
    return os.environ.get("CHUNKSERVE_ATTENTION_AMX", "1") != "0"


def supports(dtype: torch.dtype, block_size: int, head_dim: int) -> bool:
    return dtype in DTYPES and block_size <= MAX_BLOCK_SIZE and head_dim <= MAX_HEAD_DIM


def load() -> PagedAttentionKernel | None:
    """The kernel, built or taken from the cache once per process; None if it cannot be
    built here (``load_error()`` says why)."""
    return _once.get()


def load_error() -> str | None:
    return _once.error


def _load() -> PagedAttentionKernel:
    lib, path = cbuild.load_library(SOURCE, CFLAGS)
    return PagedAttentionKernel(lib, path)


_once = cbuild.OnceLoaded(
    _load, logger, logging.INFO, "CPU attention kernel unavailable (%s); using torch"
)
