"""CPU kernels for GGML block-quantized weights (``csrc/quant_gemm.c``), built on first use
and cached by ``chunkserve.cbuild``, called through ctypes.

- ``gemm``: bf16 activations' kernel (``GGUFWeight.matmul``: every row count, but up to
  ``INT8_MAX_ROWS`` rows where torch's bf16 GEMM runs on AMX or the kernel has no SIMD path,
  see ``int8_row_limit``; every row count in the deterministic mode,
  ``matmul_row_invariant``). The activations are quantized to int8 per row and per 32
  values and dotted with the weight's blocks in integer
  arithmetic (AVX512-VNNI here; AVX2 intrinsics on CPUs without AVX512, with AVX-VNNI where
  they have it; portable C elsewhere), then one float32 chain per output element over the K
  groups in a fixed order:
  the same arithmetic whatever M, the thread count or the SIMD path, so a row's result does
  not depend on the rows beside it. NR = 16 output rows are decoded at a time into a
  vpdpbusd-shaped tile, reused by every x row (see the C file); with 16 or more rows and
  AMX-INT8 here (``amx``), the integer dots are AMX tile products, the float chains the same.
  Its error against the dequantized float product is that of the int8 activations, ~0.5% of
  the output's norm.
- ``gemm_float``: float32 activations' decode rows (and bf16's with
  ``CHUNKSERVE_QUANT_FLOAT_KERNEL=1``), with dequantized tiles multiplied in torch beyond
  ``DECODE_MAX_ROWS`` rows. Each weight block is
  dequantized in registers with exactly ``formats.dequantize``'s float32 arithmetic (rounded
  to bf16 when x is bf16) and multiplied with x's rows in float32 with float32 sums: closer to
  the dequantized model (only the order of the sums differs) but 1.2-2.5x slower than bf16
  ``F.linear`` per decode call here, and a row's last bits then depend on its step's size.
- ``dequantize``: rows of the weight to float32 or bfloat16, bit for bit as gguf-py (and
  ``formats.dequantize``), for the prefill tiles.

No compiler, or a failed build, is not an error: ``load()`` returns None (the reason in
``load_error()``, logged once) and ``GGUFWeight.matmul`` runs its torch reference.
``CHUNKSERVE_QUANT_KERNELS=0`` turns the kernels off (the reference everywhere).
"""

from __future__ import annotations

import ctypes
import logging
import os
from pathlib import Path

import torch

from chunkserve import cbuild
from chunkserve.platform import cpu_has_amx_bf16

logger = logging.getLogger("chunkserve.quant")

SOURCE = Path(__file__).resolve().parent / "csrc" / "quant_gemm.c"
# No fast-math and no contraction: ``quant_dequant`` must round exactly as gguf-py does.
CFLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fPIC", "-fopenmp")
DTYPES = {torch.float32: 0, torch.bfloat16: 1}
# With the float opt-in, up to this many rows a product runs the float decode kernel; more
# rows dequantize tiles and multiply in torch.
DECODE_MAX_ROWS = 8
SIMD_PATHS = {2: "AVX512-VNNI", 3: "AVX2 + AVX-VNNI", 1: "AVX2", 0: "portable C"}


# bf16 activations on a CPU with AMX-BF16: up to this many rows a product runs the
# int8-activation kernel (faster than bf16 F.linear there:
# ``benchmarks/results/quant_kernels_t1.md``); more rows dequantize tiles and multiply in torch
# (oneDNN's AMX bf16 GEMM), but in the deterministic mode (every row count). See
# ``int8_row_limit``.
INT8_MAX_ROWS = 64


def int8_row_limit(amx_bf16: bool, simd: str) -> int | None:
    """The most rows of a bf16 product the int8-activation kernel takes (None: any), by
    whether torch's bf16 GEMM runs on AMX tiles here (``amx_bf16``, the CPU's flag) and the
    kernel's SIMD path. Without AMX-BF16 a SIMD kernel beats the dequantized tiles + torch at
    every row count: on the 2-core AMD EPYC (AVX512-VNNI and AVX512-BF16, 1 thread, quiet)
    1.3-1.7x at 64 to 2,048 rows for Q4_0/Q4_1/Q8_0 on the embedded model's shapes
    (``benchmarks/results/quant_kernels_epyc_prefill_t1.md``), 1.03-1.43x for K-quants; with
    torch limited to AVX2 (a CPU without AVX512), the AVX2 kernel 6-10x at 64 and 512 rows
    (``quant_kernels_avx2_torch_avx2_t1_cpu``). With AMX-BF16 (the Xeon), torch's tiles win
    past 64 rows; so does torch's GEMM against the portable C kernel (no SIMD path)."""
    return INT8_MAX_ROWS if amx_bf16 or simd == SIMD_PATHS[0] else None


# The process environment's bytes (POSIX): the switches below are read on every product
# (~120 a decode step of the embedded model), and ``os.environ.get`` encodes the name and
# decodes the value each time (~1-5 us here); a look-up in its dict of bytes is ~50 ns and
# sees ``os.environ`` edits (tests set these switches per test).
_ENVIRON: dict[bytes, bytes] | None = getattr(os.environ, "_data", None)
if os.name != "posix" or not isinstance(_ENVIRON, dict):
    _ENVIRON = None


def _env_is(name: bytes, value: bytes) -> bool:
    """Whether the environment variable ``name`` is set to ``value``."""
    if _ENVIRON is None:
        return os.environ.get(name.decode()) == value.decode()
    return _ENVIRON.get(name) == value


def float_kernel() -> bool:
    """``CHUNKSERVE_QUANT_FLOAT_KERNEL=1``: bf16 activations, too, take the float decode
    kernel and dequantized prefill tiles instead of the int8-activation kernel (closer to the
    dequantized model, slower)."""
    return _env_is(b"CHUNKSERVE_QUANT_FLOAT_KERNEL", b"1")


def int8_activations(x: torch.Tensor) -> bool:
    """Whether a product with x quantizes x to int8 (``gemm``): bf16 activations on a CPU,
    unless ``float_kernel()``. float32 activations keep float arithmetic (an fp32 engine is
    the one that computes as the dequantized model does)."""
    return x.dtype == torch.bfloat16 and x.device.type == "cpu" and not float_kernel()


class QuantKernels:
    def __init__(self, lib: ctypes.CDLL, path: Path) -> None:
        self.path = path
        ptr, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
        gemm_args = [i32, ptr, i64, i64, i64, ptr, i32, i64, ptr, i32]
        for fn in (
            lib.quant_gemm,
            lib.quant_gemm_portable,
            lib.quant_gemm_packed,
            lib.quant_gemm_packed_portable,
            lib.quant_gemm_f32,
            lib.quant_gemm_f32_portable,
        ):
            fn.argtypes, fn.restype = gemm_args, i32
        for fn in (lib.quant_dequant, lib.quant_dequant_portable):
            fn.argtypes, fn.restype = [i32, ptr, i64, i64, i64, ptr, i32, i32], i32
        lib.quant_packable.argtypes, lib.quant_packable.restype = [i32, i64], i32
        lib.quant_pack.argtypes, lib.quant_pack.restype = [i32, ptr, i64, i64, i64, ptr], i32
        lib.quant_unpack.argtypes = [i32, ptr, i64, i64, i64, ptr, i64, i64, ptr]
        lib.quant_unpack.restype = i32
        self._packable, self._pack = lib.quant_packable, lib.quant_pack
        self._unpack = lib.quant_unpack
        self._gemm_packed = lib.quant_gemm_packed
        self._packed_portable = lib.quant_gemm_packed_portable
        lib.quant_gemm_simd.restype = i32
        lib.quant_gemm_amx.restype = i32
        lib.quant_gemm_bf16.argtypes = [i32, ptr, i64, i64, i64, ptr, i64, ptr, i32]
        lib.quant_gemm_bf16.restype = i32
        lib.quant_gemm_bf16_available.restype = i32
        self._gemm_bf16 = lib.quant_gemm_bf16
        self._gemm, self._portable = lib.quant_gemm, lib.quant_gemm_portable
        self._gemm_f32, self._f32_portable = lib.quant_gemm_f32, lib.quant_gemm_f32_portable
        self._dequant, self._dequant_portable = lib.quant_dequant, lib.quant_dequant_portable
        # The decode path this build runs (what the compiler targets with -march=native).
        self.simd = SIMD_PATHS[lib.quant_gemm_simd()]
        # Whether the int8 kernel's larger products (16+ rows) run on AMX-INT8 tiles.
        self.amx = bool(lib.quant_gemm_amx())
        # Whether ``gemm_bf16`` runs here (AMX-BF16 built and allowed by the OS).
        self.amx_bf16 = bool(lib.quant_gemm_bf16_available())
        # The most rows of a bf16 product ``gemm`` takes here (None: any; ``int8_row_limit``).
        self.int8_max_rows = int8_row_limit(cpu_has_amx_bf16(), self.simd)

    def gemm(self, code: int, data: torch.Tensor, x: torch.Tensor, portable: bool = False):
        """x [M, K] (contiguous float32/bf16) times the block rows ``data`` (uint8 [N,
        row_bytes], format ``code``) transposed: [M, N] in x's dtype, x quantized to int8;
        each output element's arithmetic is the same whatever M, the threads or ``portable``."""
        return self._call(self._portable if portable else self._gemm, code, data, x)

    def gemm_packed(
        self, code: int, packed: torch.Tensor, x: torch.Tensor, portable: bool = False
    ) -> torch.Tensor:
        """``gemm`` with the weight packed (``pack``): the same bits."""
        return self._call(self._packed_portable if portable else self._gemm_packed, code, packed, x)

    def packable(self, code: int, rows: int) -> bool:
        """Whether ``pack`` takes a weight of this format and number of rows (the 32-value
        formats: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0; rows a multiple of 16)."""
        return bool(self._packable(code, rows))

    def pack(self, code: int, data: torch.Tensor, k: int) -> torch.Tensor:
        """The file's block rows ``data`` (uint8 [N, row_bytes]) reordered for the batch-1
        kernel (the C file's "packed weights"): uint8 [N, row_bytes], the same bytes."""
        n, row_bytes = data.shape
        out = torch.empty(n, row_bytes, dtype=torch.uint8)  # [N, row_bytes], packed order
        if self._pack(code, data.data_ptr(), row_bytes, n, k, out.data_ptr()):
            raise RuntimeError(f"quant_pack refused a format {code} weight of {n} rows")
        return out

    def unpack(
        self, code: int, packed: torch.Tensor, k: int, rows: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Rows ``rows`` (int64 [n]; None: all) of a packed weight as the file stores them:
        uint8 [n, row_bytes]."""
        n, row_bytes = packed.shape
        if rows is not None:
            rows = rows.to(torch.int64).contiguous()
        count = n if rows is None else rows.numel()
        out = torch.empty(count, row_bytes, dtype=torch.uint8)  # [n, row_bytes]
        rc = self._unpack(
            code, packed.data_ptr(), row_bytes, n, k, None if rows is None else rows.data_ptr(),
            0, count, out.data_ptr(),
        )  # fmt: skip
        if rc:
            raise RuntimeError(f"quant_unpack refused its arguments (code {rc})")
        return out

    def gemm_bf16(self, code: int, data: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """x [M, K] (contiguous bf16) times the block rows ``data`` dequantized to bf16 (as
        ``dequantize``), transposed: [M, N] bf16, on AMX-BF16 tiles with one fp32 accumulator
        per output element over K in a fixed order, whatever M or the threads (only where
        ``amx_bf16``)."""
        n, row_bytes = data.shape
        m, k = x.shape
        out = torch.empty(m, n, dtype=torch.bfloat16)  # [M, N]
        rc = self._gemm_bf16(
            code, data.data_ptr(), row_bytes, n, k, x.data_ptr(), m, out.data_ptr(),
            torch.get_num_threads(),
        )  # fmt: skip
        if rc:
            raise RuntimeError(f"quant_gemm_bf16 refused its arguments (code {rc})")
        return out

    def gemm_float(self, code: int, data: torch.Tensor, x: torch.Tensor, portable: bool = False):
        """As ``gemm`` in float arithmetic: the weight dequantized exactly (in x's dtype), x in
        float32, float32 sums."""
        return self._call(self._f32_portable if portable else self._gemm_f32, code, data, x)

    def _call(self, fn, code: int, data: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        n, row_bytes = data.shape
        m, k = x.shape
        out = torch.empty(m, n, dtype=x.dtype)  # [M, N]
        rc = fn(
            code, data.data_ptr(), row_bytes, n, k, x.data_ptr(), DTYPES[x.dtype], m,
            out.data_ptr(), torch.get_num_threads(),
        )  # fmt: skip
        if rc:
            raise RuntimeError(f"quant_gemm refused its arguments (code {rc})")
        return out

    def dequantize(
        self, code: int, data: torch.Tensor, k: int, dtype: torch.dtype, portable: bool = False
    ):
        """The block rows ``data`` as [N, k] floats in ``dtype`` (float32 or bf16)."""
        n, row_bytes = data.shape
        out = torch.empty(n, k, dtype=dtype)  # [N, K]
        rc = (self._dequant_portable if portable else self._dequant)(
            code, data.data_ptr(), row_bytes, n, k, out.data_ptr(), DTYPES[dtype],
            torch.get_num_threads(),
        )  # fmt: skip
        if rc:
            raise RuntimeError(f"quant_dequant refused its arguments (code {rc})")
        return out


def packing() -> bool:
    """Whether weights are repacked for the batch-1 kernel (``GGUFWeight.pack``);
    ``CHUNKSERVE_QUANT_PACK=0``: they keep the file's layout."""
    return not _env_is(b"CHUNKSERVE_QUANT_PACK", b"0")


def built() -> QuantKernels | None:
    """The kernels whatever ``CHUNKSERVE_QUANT_KERNELS`` says (a packed weight unpacks its
    rows with them), or None where they cannot be built."""
    return _once.get()


def enabled() -> bool:
    return not _env_is(b"CHUNKSERVE_QUANT_KERNELS", b"0")


def load() -> QuantKernels | None:
    """The kernels, built or taken from the cache once per process; None if they cannot be
    built here (``load_error()`` says why) or are turned off."""
    return _once.get() if enabled() else None


def load_error() -> str | None:
    return _once.error


def _load(extra_cflags: tuple[str, ...] = ()) -> QuantKernels:
    """Build (or take from the cache) and load; ``extra_cflags`` builds another variant,
    e.g. ``-mno-avx512f`` for the AVX2 path on an AVX512 machine (tests)."""
    lib, path = cbuild.load_library(SOURCE, CFLAGS + extra_cflags)
    return QuantKernels(lib, path)


def _fresh() -> cbuild.OnceLoaded[QuantKernels]:
    return cbuild.OnceLoaded(
        _load,
        logger,
        logging.WARNING,
        "quantized-weight CPU kernels unavailable (%s); using the torch reference "
        "(dequantize, then matmul)",
    )


_once = _fresh()
