"""Quantized weights (chunkserve.quant): every GGML block format dequantized bit for bit as
gguf-py does, ``GGUFWeight.matmul`` against gguf-py's dequantize + a float matmul over decode
and prefill row counts, and the loading edits (rows, cols, permute_rows, concat_rows) on the
quantized bits. gguf-py cannot write K-quants: their blocks are random bytes with sane f16
scales, which covers every bit pattern of the quants and the packed 6-bit scales."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize

from chunkserve.quant import formats, kernels
from chunkserve.quant import weight as weight_mod
from chunkserve.quant.weight import GGUFWeight, QuantizedWeight, concat_rows

ALL = [T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q4_K, T.Q5_K, T.Q6_K]
K_QUANTS = {T.Q4_K, T.Q5_K, T.Q6_K}
# Byte offsets of each block's f16 scale fields (overwritten with sane values in random
# K-quant blocks so no inf/nan turns up).
F16_FIELDS = {T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,)}
ROWS_M = [1, 3, 8, 16, 64, 300]


def odd_k(qtype: T) -> int:
    """An in_features that is an odd number of blocks."""
    return 256 * 3 if qtype in K_QUANTS else 32 * 7


def make_raw(qtype: T, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """uint8 [rows, row_bytes]: gguf-py's own quantization of normal floats for the formats
    it writes; random blocks with f16 scales ~0.01 for the K-quants."""
    rng = np.random.default_rng(seed)
    if qtype not in K_QUANTS:
        return gguf_quantize(rng.standard_normal((rows, cols)).astype(np.float32), qtype)
    fmt = formats.get(qtype)
    raw = rng.integers(0, 256, (rows, cols // 256 * fmt.block_bytes), dtype=np.uint8)
    blocks = raw.reshape(-1, fmt.block_bytes)
    for off in F16_FIELDS[qtype]:
        scale = (rng.random((blocks.shape[0], 1)) * 0.02 + 0.001).astype(np.float16)
        blocks[:, off : off + 2] = scale.view(np.uint8)
    return raw


def same_bits(ours: np.ndarray, ref: np.ndarray) -> bool:
    ref = np.asarray(ref, np.float32)
    return (
        ours.dtype == np.float32
        and ours.shape == ref.shape
        and np.array_equal(ours.view(np.uint32), ref.view(np.uint32))
    )


@pytest.mark.parametrize("qtype", ALL, ids=lambda q: q.name)
def test_dequantize_is_gguf_py_bit_for_bit(qtype):
    raw = make_raw(qtype, 9, odd_k(qtype), seed=1)
    assert formats.supported(qtype)
    assert same_bits(formats.dequantize(raw, qtype), gguf_dequantize(raw, qtype))
    w = GGUFWeight.from_gguf(raw, int(qtype), "w")
    assert w.shape == (9, odd_k(qtype)) and w.qtype == qtype.name and w.nbytes == raw.nbytes
    assert same_bits(w.dequantize().numpy(), gguf_dequantize(raw, qtype))


def test_k_quant_blocks_written_from_the_definition():
    """Blocks built field by field from the format's definition decode to the values the
    definition gives (so a dequantizer agreeing with gguf-py also agrees with the format)."""
    # Q4_K: d = 0.5, dmin = 0.25; scale s = s + 1 and min s = 2 s (6-bit packing below);
    # quant of value l in sub-block s = (l + s) % 16.
    sc, mn = np.arange(8) + 1, 2 * np.arange(8)
    packed = np.zeros(12, np.uint8)
    packed[0:4] = (sc[:4] & 63) | ((sc[4:] >> 4) << 6)
    packed[4:8] = (mn[:4] & 63) | ((mn[4:] >> 4) << 6)
    packed[8:12] = (sc[4:] & 15) | ((mn[4:] & 15) << 4)
    q = (np.arange(32)[None, :] + np.arange(8)[:, None]) % 16  # [sub-block, value]
    nibbles = np.zeros(128, np.uint8)
    for s in range(8):
        nibbles[32 * (s // 2) : 32 * (s // 2) + 32] |= (q[s] << (4 * (s % 2))).astype(np.uint8)
    head = np.array([0.5, 0.25], np.float16).view(np.uint8)
    block = np.concatenate([head, packed, nibbles])[None]
    want = (0.5 * sc[:, None] * q - 0.25 * mn[:, None]).reshape(1, 256)
    assert np.array_equal(formats.dequantize(block, T.Q4_K), want.astype(np.float32))
    # Q6_K: d = 0.125, scale of sub-block j (16 values) = j - 8; 6-bit quant of value i = i % 64.
    i = np.arange(256)
    qv = i % 64
    ql, qh = np.zeros(128, np.uint8), np.zeros(64, np.uint8)
    for h in range(2):
        for k in range(128):
            v = qv[128 * h + k]
            ql[64 * h + k % 64] |= (v & 15) << (4 * (k // 64))
            qh[32 * h + k % 32] |= (v >> 4) << (2 * (k // 32))
    scales = (np.arange(16) - 8).astype(np.int8).view(np.uint8)
    block = np.concatenate([ql, qh, scales, np.array([0.125], np.float16).view(np.uint8)])[None]
    want = 0.125 * (np.arange(16) - 8)[i // 16] * (qv - 32)
    assert np.array_equal(formats.dequantize(block, T.Q6_K), want[None].astype(np.float32))


@pytest.fixture(scope="module", params=ALL, ids=lambda q: q.name)
def weight(request) -> tuple[T, np.ndarray, GGUFWeight]:
    qtype = request.param
    raw = make_raw(qtype, 37, odd_k(qtype), seed=2)
    return qtype, raw, GGUFWeight.from_gguf(raw, int(qtype), "blk.0.w")


needs_kernels = pytest.mark.skipif(
    kernels.load() is None, reason=f"the quant C kernels: {kernels.load_error()}"
)


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want).norm() / want.norm())


def int8_activations(x: torch.Tensor) -> torch.Tensor:
    """x as the int8 kernel sees it: per 32 values, codes round(x * 127 / max|x|) (to
    even) times max|x| / 127, all in float32."""
    blocks = x.float().reshape(x.shape[0], -1, 32)
    amax = blocks.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, 127 / amax, torch.zeros_like(amax))
    return (torch.round(blocks * inv) * (amax / 127)).reshape(x.shape)


@pytest.mark.parametrize("path", ["kernel", "reference"])
@pytest.mark.parametrize("m", ROWS_M)
def test_matmul_against_gguf_py_dequantize(weight, m, path, monkeypatch):
    """Both dtypes, every path, within float tolerance of gguf-py's dequantize + a float
    matmul (the kernel's int8 activations cost ~0.5%; a wrong scale, code or offset anywhere
    costs far more than 1.5%)."""
    if path == "kernel" and kernels.load() is None:
        pytest.skip(f"the quant C kernels: {kernels.load_error()}")
    if path == "reference":
        monkeypatch.setenv("CHUNKSERVE_QUANT_KERNELS", "0")
    qtype, raw, w = weight
    ref_w = torch.from_numpy(np.asarray(gguf_dequantize(raw, qtype), np.float32))
    x = torch.randn(m, w.in_features, generator=torch.Generator().manual_seed(m))
    want = x @ ref_w.T
    got = w.matmul(x)
    assert got.shape == (m, 37) and got.dtype == torch.float32
    assert rel_err(got, want) < 1.5e-2
    got_bf16 = w.matmul(x.bfloat16())
    assert got_bf16.dtype == torch.bfloat16
    assert rel_err(got_bf16, want) < 2e-2
    if path == "reference":  # exactly the dequantized model
        assert torch.equal(got, torch.nn.functional.linear(x, w.dequantize()))
        assert torch.equal(
            got_bf16, torch.nn.functional.linear(x.bfloat16(), w.dequantize(torch.bfloat16))
        )


def avx2_build(flags: tuple[str, ...], paths: tuple[str, ...]) -> kernels.QuantKernels:
    if kernels.load() is None or kernels.load().simd == "portable C":
        pytest.skip("no AVX2 here")
    try:
        k = kernels._load(flags)
    except RuntimeError as e:  # e.g. a compiler without -mno-avxvnni
        pytest.skip(f"no build with {flags}: {e}")
    assert k.simd in paths and not k.amx
    return k


@pytest.fixture(scope="module")
def avx2_kernels() -> kernels.QuantKernels:
    """A build of the kernels without AVX512 (the AVX2 intrinsics, with AVX-VNNI's 256-bit
    vpdpbusd where the CPU has it), where the CPU has AVX2."""
    return avx2_build(("-mno-avx512f",), ("AVX2", "AVX2 + AVX-VNNI"))


@pytest.fixture(scope="module")
def avx2_maddubs_kernels() -> kernels.QuantKernels:
    """A build without AVX512 nor AVX-VNNI: the AVX2 path's vpmaddubsw integer dots."""
    return avx2_build(("-mno-avx512f", "-mno-avxvnni"), ("AVX2",))


BUILDS = {"avx2": "avx2_kernels", "avx2_maddubs": "avx2_maddubs_kernels"}


def build(path: str, request) -> kernels.QuantKernels:
    return request.getfixturevalue(BUILDS[path]) if path in BUILDS else kernels.load()


@needs_kernels
@pytest.mark.parametrize("path", ["simd", "portable", "avx2", "avx2_maddubs"])
@pytest.mark.parametrize("m", [1, 3, 7, 16, 64])
def test_int8_kernel_is_the_product_with_int8_activations(weight, m, path, request):
    """Tight: the int8-activation kernel (its SIMD path, its portable C path, and the AVX2
    build without AVX512) equals the float product of the dequantized weight with the
    int8-quantized activations, up to float summation order; bf16 input rows are quantized
    from their exact float values."""
    k = build(path, request)
    portable = path == "portable"
    qtype, _, _ = weight
    # 21 rows (a 16-row tile and a partial one) and an even number of 32-value chunks.
    raw = make_raw(qtype, 21, odd_k(qtype) + formats.get(qtype).block_values, seed=3)
    w = GGUFWeight.from_gguf(raw, int(qtype), "w")
    ref_w = torch.from_numpy(np.asarray(gguf_dequantize(raw, qtype), np.float32))
    x = torch.randn(m, w.in_features, generator=torch.Generator().manual_seed(10 + m))
    for xin in (x, x.bfloat16()):
        got = k.gemm(int(qtype), w.data, xin, portable=portable)
        want = int8_activations(xin).double() @ ref_w.double().T
        assert got.dtype == xin.dtype
        tol = 1e-5 if xin.dtype == torch.float32 else 5e-3  # bf16 output rounding
        assert rel_err(got.double(), want) < tol


def float_product_bound(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> bool:
    """``got`` is x @ w.T (x, w float32-exact values) up to float32 summation order: within
    1e-5 of sum |x| |w| per output (the sum's own rounding scale), plus bf16 output rounding
    when ``got`` is bf16."""
    want = x.double() @ w.double().T
    bound = 1e-5 * (x.double().abs() @ w.double().abs().T)
    if got.dtype == torch.bfloat16:
        bound = bound + 2.0**-8 * want.abs()
    return bool(((got.double() - want).abs() <= bound).all())


@needs_kernels
@pytest.mark.parametrize("path", ["simd", "portable", "avx2"])
def test_float_decode_kernel_is_the_dequantized_product(weight, path, request):
    """The float decode kernel (opt-in; its SIMD path, portable C, a build without AVX512) is
    the float product of gguf-py's dequantized weight (rounded to bf16 for bf16 rows, the
    weight in x's dtype as the prefill path multiplies it) with x, up to float32 summation
    order: every format, M = 1..8, an odd number of blocks (and 37 rows: odd thread splits).
    The int8-activation kernel is ~1e-3 off: this bound tells them apart (checked below)."""
    k = build(path, request)
    qtype, raw, w = weight
    ref_w = torch.from_numpy(np.asarray(gguf_dequantize(raw, qtype), np.float32))
    for m in range(1, kernels.DECODE_MAX_ROWS + 1):
        x = torch.randn(m, w.in_features, generator=torch.Generator().manual_seed(20 + m))
        got = k.gemm_float(int(qtype), w.data, x, portable=path == "portable")
        assert got.dtype == torch.float32 and got.shape == (m, 37)
        assert float_product_bound(got, x, ref_w), (qtype.name, m)
        xb = x.bfloat16()
        got = k.gemm_float(int(qtype), w.data, xb, portable=path == "portable")
        assert got.dtype == torch.bfloat16
        assert float_product_bound(got, xb.float(), ref_w.bfloat16().float()), (qtype.name, m)
    if path == "simd":  # the bound is tight enough to reject the int8 activations
        x = torch.randn(4, w.in_features, generator=torch.Generator().manual_seed(3))
        assert not float_product_bound(k.gemm(int(qtype), w.data, x), x, ref_w)


@needs_kernels
@pytest.mark.parametrize("path", ["simd", "portable", "avx2", "avx2_maddubs"])
def test_a_row_has_the_same_bits_in_any_step(weight, path, request):
    """The int8-activation kernel is batch-invariant: 300 rows multiplied in steps of 1, 8,
    64 and 300 rows, at 1 and 2 threads, give the same bits (chunked == unchunked == TP needs
    it), and its SIMD path, its portable C and the AVX2 builds (AVX-VNNI and vpmaddubsw) give
    the same bits too (one arithmetic per output element: see quant_gemm.c)."""
    k = build(path, request)
    qtype, _, w = weight
    code, portable = int(qtype), path == "portable"
    x = torch.randn(300, w.in_features, generator=torch.Generator().manual_seed(5)) * 3
    x[7] = 0.0  # a zero row: zero codes and scales
    x[9, :40] = 1e-30  # a chunk of tiny values (and one straddling them and normal ones)
    old = torch.get_num_threads()
    try:
        for xin in (x, x.bfloat16()):
            torch.set_num_threads(1)
            whole = k.gemm(code, w.data, xin, portable=portable)
            for step in (1, 8, 64):
                rows = [k.gemm(code, w.data, xin[r : r + step], portable=portable)
                        for r in range(0, 300, step)]  # fmt: skip
                assert torch.equal(torch.cat(rows), whole), (qtype.name, step)
            torch.set_num_threads(2)
            assert torch.equal(k.gemm(code, w.data, xin, portable=portable), whole)
            assert torch.equal(k.gemm(code, w.data, xin[:8], portable=portable), whole[:8])
            if path != "simd":
                assert torch.equal(whole, kernels.load().gemm(code, w.data, xin)), qtype.name
    finally:
        torch.set_num_threads(old)


@needs_kernels
@pytest.mark.parametrize("path", ["avx2", "avx2_maddubs"])
def test_avx2_paths_give_the_native_bits(weight, path, request):
    """The AVX2 intrinsics (a build without AVX512; with and without AVX-VNNI) against the
    native build: the int8-activation kernel's bits over M = 1, 3, 16, 64, 300 rows (x with a
    zero row, tiny values, chunks of +-127 codes among small ones: vpmaddubsw's int16
    saturation would show), an odd number of blocks, 37 output rows (a partial tile half),
    float32 and bf16 x, at 1 and 2 threads; the float decode kernel bit for bit as its
    portable C (the same summation order), and the dequantization as gguf-py's."""
    k, native = build(path, request), kernels.load()
    qtype, raw, w = weight
    code = int(qtype)
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(300, w.in_features, generator=gen) * 3
    x[0] = 0.0
    x[2, :40] = 1e-30
    x[4, ::5] = 100.0  # chunks of codes at +-127 beside small ones
    x[5, ::3] = -100.0
    old = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            for xin in (x, x.bfloat16()):
                for m in (1, 3, 16, 64, 300):
                    got, want = k.gemm(code, w.data, xin[:m]), native.gemm(code, w.data, xin[:m])
                    assert torch.equal(got, want), (qtype.name, m, xin.dtype, threads)
                for m in range(1, kernels.DECODE_MAX_ROWS + 1):
                    got = k.gemm_float(code, w.data, xin[:m])
                    want = native.gemm_float(code, w.data, xin[:m], portable=True)
                    assert torch.equal(got, want), (qtype.name, m, xin.dtype, threads)
            for dtype in (torch.float32, torch.bfloat16):
                ours = k.dequantize(code, w.data, w.in_features, dtype)
                assert torch.equal(
                    ours, native.dequantize(code, w.data, w.in_features, dtype, True)
                )
    finally:
        torch.set_num_threads(old)
    assert same_bits(k.dequantize(code, w.data, w.in_features, torch.float32).numpy(),
                     gguf_dequantize(raw, qtype))  # fmt: skip


@needs_kernels
def test_matmul_picks_its_path_by_dtype_and_rows(weight, monkeypatch):
    """bf16 x: the int8-activation kernel at every row count where torch's bf16 GEMM is not
    on AMX; with AMX-BF16 up to ``INT8_MAX_ROWS`` rows, dequantized tiles beyond (torch's
    product, the dequantized model's); ``matmul_row_invariant`` the int8 kernel at every row
    count. float32 x (an fp32 engine: float arithmetic only): the float
    decode kernel up to ``DECODE_MAX_ROWS`` rows (the dequantized product up to summation
    order), the tiles beyond, and no row-invariant path. ``CHUNKSERVE_QUANT_FLOAT_KERNEL=1``
    gives bf16 the float paths too."""
    qtype, _, w = weight
    k = kernels.load()
    code = int(qtype)
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(kernels.INT8_MAX_ROWS + 3, w.in_features, generator=gen)
    xb = x.bfloat16()
    for most in (kernels.INT8_MAX_ROWS, None):  # an AMX-BF16 machine's limit, the others'
        monkeypatch.setattr(k, "int8_max_rows", most)
        for rows in (xb[:1], xb[:8], xb[: kernels.INT8_MAX_ROWS]):
            assert torch.equal(w.matmul(rows), k.gemm(code, w.data, rows))
        many = torch.nn.functional.linear(xb, w.dequantize(torch.bfloat16))
        assert torch.equal(w.matmul(xb), many if most else k.gemm(code, w.data, xb))
    assert w.row_invariant(xb) and torch.equal(w.matmul_row_invariant(xb), k.gemm(code, w.data, xb))
    assert not w.row_invariant(x) and not w.row_invariant(x.half())
    tiles = torch.nn.functional.linear(x, w.dequantize())
    assert torch.equal(w.matmul(x), tiles)
    assert torch.equal(w.matmul(x[:8]), k.gemm_float(code, w.data, x[:8]))
    # Summation order only: within 2e-5 of sum |x| |w| (the scale of the sums' rounding).
    scale = 2e-5 * (x[:8].abs() @ w.dequantize().abs().T)
    assert bool(((w.matmul(x[:8]) - tiles[:8]).abs() <= scale).all()), qtype.name
    monkeypatch.setenv("CHUNKSERVE_QUANT_FLOAT_KERNEL", "1")
    assert not w.row_invariant(xb)
    assert torch.equal(w.matmul(xb[:8]), k.gemm_float(code, w.data, xb[:8]))


def test_int8_row_limit_follows_where_torch_bf16_runs():
    """The int8 kernel's row limit: ``INT8_MAX_ROWS`` where torch's bf16 GEMM has AMX tiles
    or the kernel has no SIMD path, none elsewhere; the loaded kernels' from this CPU."""
    from chunkserve.platform import cpu_has_amx_bf16

    most = kernels.INT8_MAX_ROWS
    assert kernels.int8_row_limit(True, "AVX512-VNNI") == most
    assert kernels.int8_row_limit(True, "portable C") == most
    assert kernels.int8_row_limit(False, "portable C") == most
    for simd in ("AVX512-VNNI", "AVX2 + AVX-VNNI", "AVX2"):
        assert kernels.int8_row_limit(False, simd) is None
    k = kernels.load()
    if k is not None:
        assert k.int8_max_rows == kernels.int8_row_limit(cpu_has_amx_bf16(), k.simd)


def test_the_modes_products_are_named_by_their_arithmetic(monkeypatch):
    """``invariant_arithmetic``: the kernel named where bf16 rows take it, "reference" where
    they take the dequantized tiles (no kernels, the float opt-in), "float" in fp32."""
    from chunkserve.quant.weight import invariant_arithmetic

    cpu = torch.device("cpu")
    assert invariant_arithmetic("int8", torch.float32, cpu) == "float"
    want = "bf16" if kernels.load() is not None else "reference"
    assert invariant_arithmetic("bf16", torch.bfloat16, cpu) == want
    monkeypatch.setenv("CHUNKSERVE_QUANT_FLOAT_KERNEL", "1")
    assert invariant_arithmetic("int8", torch.bfloat16, cpu) == "reference"


needs_amx_bf16 = pytest.mark.skipif(
    kernels.load() is None or not kernels.load().amx_bf16, reason="no AMX-BF16 here"
)


@needs_amx_bf16
def test_bf16_kernel_is_batch_invariant(weight):
    """``gemm_bf16`` (the deterministic mode's AMX-BF16 opt-in): 300 rows multiplied in
    steps of 1, 8, 17 and 64 rows (the weight dequantized per 16 rows) and whole (dequantized
    once), at 1 and 2 threads, give the same bits; the product is the bf16-dequantized one
    (up to the order of the fp32 sums); ``matmul_row_invariant`` takes it after
    ``set_invariant_kernel("bf16")``, which unpacks a packed weight."""
    qtype, _, w = weight
    k = kernels.load()
    code = int(qtype)
    x = torch.randn(300, w.in_features, generator=torch.Generator().manual_seed(5)) * 3
    x[7] = 0.0
    xb = x.bfloat16()
    old = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        whole = k.gemm_bf16(code, w.data, xb)
        for step in (1, 8, 17, 64):
            rows = [k.gemm_bf16(code, w.data, xb[r : r + step]) for r in range(0, 300, step)]
            assert torch.equal(torch.cat(rows), whole), (qtype.name, step)
        torch.set_num_threads(2)
        assert torch.equal(k.gemm_bf16(code, w.data, xb), whole)
        assert torch.equal(k.gemm_bf16(code, w.data, xb[:5]), whole[:5])
    finally:
        torch.set_num_threads(old)
    want = torch.nn.functional.linear(xb.float(), w.dequantize(torch.bfloat16).float())
    assert rel_err(whole, want) < 4e-3, qtype.name
    assert torch.equal(whole[7], torch.zeros_like(whole[7]))
    assert torch.equal(w.matmul_row_invariant(xb), k.gemm(code, w.data, xb))
    mine = w.rows(0, w.out_features)  # the shared weight stays on the int8 kernel
    mine.pack()
    assert mine.set_invariant_kernel("bf16") and mine.packed is None
    assert not mine.pack()  # never packed again
    assert torch.equal(mine.matmul_row_invariant(xb), whole)
    assert torch.equal(mine.matmul_row_invariant(xb.reshape(3, 100, -1)).reshape(300, -1), whole)
    assert torch.equal(w.matmul_row_invariant(xb), k.gemm(code, w.data, xb))


@needs_kernels
def test_the_bf16_kernel_choice_needs_amx_bf16(weight):
    """``set_invariant_kernel``: 'int8' anywhere; 'bf16' only where ``gemm_bf16`` runs (a
    ValueError naming the engine's option elsewhere, the weight unchanged); another name a
    ValueError."""
    _, _, w = weight
    mine = w.rows(0, w.out_features)
    assert mine.set_invariant_kernel("int8") and mine.invariant_kernel == "int8"
    with pytest.raises(ValueError, match="deterministic_quant_kernel: 'int8' or 'bf16'"):
        mine.set_invariant_kernel("fp8")
    if kernels.load().amx_bf16:
        assert mine.set_invariant_kernel("bf16") and mine.invariant_kernel == "bf16"
    else:
        with pytest.raises(ValueError, match="deterministic_quant_kernel: 'bf16' needs.*AMX"):
            mine.set_invariant_kernel("bf16")
        assert mine.invariant_kernel == "int8"


@needs_kernels
def test_threads_split_rows_without_changing_a_bit(weight):
    """Each output comes from one thread's rows whatever the thread count: 1 and 2 threads
    (and a thread count over the rows) give the same bits."""
    _, _, w = weight
    x = torch.randn(3, w.in_features).bfloat16()
    old = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = [w.matmul(x), w.matmul(x.repeat(30, 1))]
        torch.set_num_threads(2)
        two = [w.matmul(x), w.matmul(x.repeat(30, 1))]
        small = w.rows(0, 1).matmul(x)
    finally:
        torch.set_num_threads(old)
    assert all(torch.equal(a, b) for a, b in zip(one, two, strict=True))
    assert torch.equal(small, one[0][:, :1])


@needs_kernels
@pytest.mark.parametrize("portable", [False, True], ids=["simd", "portable"])
def test_kernel_dequantize_is_gguf_py_bit_for_bit(weight, portable):
    qtype, raw, w = weight
    ref = np.asarray(gguf_dequantize(raw, qtype), np.float32)
    k = kernels.load()
    ours = k.dequantize(int(qtype), w.data, w.in_features, torch.float32, portable)
    assert same_bits(ours.numpy(), ref)
    ours = k.dequantize(int(qtype), w.data, w.in_features, torch.bfloat16, portable)
    assert torch.equal(ours, torch.from_numpy(ref).bfloat16())


def test_failed_build_falls_back_to_the_reference(tmp_path, monkeypatch, caplog):
    """No working compiler: the build's error is kept and logged, and matmul runs the
    reference (equal to the dequantized model)."""
    monkeypatch.setenv("CHUNKSERVE_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CC", "/nonexistent/cc")
    monkeypatch.setattr(kernels, "_once", kernels._fresh())
    with caplog.at_level("WARNING", logger="chunkserve.quant"):
        assert kernels.load() is None
    assert "nonexistent" in kernels.load_error()
    assert "using the torch reference" in caplog.text
    w = GGUFWeight.from_gguf(make_raw(T.Q4_0, 5, 64), int(T.Q4_0), "w")
    x = torch.randn(2, 64)
    assert torch.equal(w.matmul(x), torch.nn.functional.linear(x, w.dequantize()))


@needs_kernels
def test_kernel_cache_is_keyed_and_reused(tmp_path, monkeypatch):
    monkeypatch.setenv("CHUNKSERVE_CACHE_DIR", str(tmp_path))
    first = kernels._load()
    assert [first.path] == sorted((tmp_path / "kernels").glob("quant_gemm-*.so"))
    mtime = first.path.stat().st_mtime_ns
    assert kernels._load().path == first.path and first.path.stat().st_mtime_ns == mtime


def test_reference_is_the_dequantized_model(weight, monkeypatch):
    """The reference path is F.linear on the dequantized weight cast to x's dtype, bit for
    bit; over the tile size, F.linear of each 5-row tile (a GEMM may block a tile
    differently from the whole weight, so only the tiles' own products are exact)."""
    _, _, w = weight
    x = torch.randn(5, w.in_features).bfloat16()
    dense = w.dequantize(torch.bfloat16)
    assert torch.equal(weight_mod.reference_matmul(w, x), torch.nn.functional.linear(x, dense))
    monkeypatch.setattr(weight_mod, "REFERENCE_TILE_VALUES", w.in_features * 5)
    tiles = [torch.nn.functional.linear(x, dense[r : r + 5]) for r in range(0, 37, 5)]
    assert torch.equal(weight_mod.reference_matmul(w, x), torch.cat(tiles, dim=1))


def test_embedding_rows(weight):
    _, _, w = weight
    full = w.dequantize()
    ids = torch.tensor([[3, 0], [36, 3]])
    assert torch.equal(w.embedding(ids), full[ids])
    assert torch.equal(w.embedding(ids, torch.bfloat16), full[ids].bfloat16())
    with pytest.raises(ValueError, match="blk.0.w"):
        w.embedding(torch.tensor([37]))


def test_rows_cols_permute_concat(weight):
    qtype, _, w = weight
    full = w.dequantize()
    block = formats.get(qtype).block_values
    part = w.rows(5, 20)
    assert isinstance(part, GGUFWeight) and part.shape == (15, w.in_features)
    assert torch.equal(part.dequantize(), full[5:20])
    assert part.nbytes == w.nbytes * 15 // 37  # its own bytes, not a view of the whole
    cols = w.cols(block, 3 * block)
    assert cols.shape == (37, 2 * block)
    assert torch.equal(cols.dequantize(), full[:, block : 3 * block])
    index = np.random.default_rng(0).permutation(37)
    assert torch.equal(w.permute_rows(index).dequantize(), full[index])
    assert torch.equal(w.permute_rows(torch.from_numpy(index)).dequantize(), full[index])
    both = concat_rows([w.rows(0, 10), w.rows(10, 37)])
    assert isinstance(both, GGUFWeight) and torch.equal(both.dequantize(), full)


@pytest.mark.parametrize("qtype", [T.Q4_0, T.Q6_K], ids=lambda q: q.name)
def test_cols_refuse_a_cut_inside_a_block(qtype):
    w = GGUFWeight.from_gguf(make_raw(qtype, 4, odd_k(qtype)), int(qtype), "blk.3.ffn_down")
    block = formats.get(qtype).block_values
    with pytest.raises(ValueError, match=f"blk.3.ffn_down.*{qtype.name} block of {block}"):
        w.cols(0, block + 16)
    with pytest.raises(ValueError, match="blk.3.ffn_down"):
        w.cols(8, 2 * block)
    with pytest.raises(ValueError, match="blk.3.ffn_down: columns"):
        w.cols(0, odd_k(qtype) + block)


def test_concat_rows_of_different_formats_is_none():
    a = GGUFWeight.from_gguf(make_raw(T.Q4_K, 4, 256), int(T.Q4_K), "q")
    b = GGUFWeight.from_gguf(make_raw(T.Q6_K, 4, 256), int(T.Q6_K), "k")
    c = GGUFWeight.from_gguf(make_raw(T.Q4_0, 4, 64), int(T.Q4_0), "v")
    assert concat_rows([a, b]) is None
    assert concat_rows([a, a]).shape == (8, 256)
    with pytest.raises(ValueError, match="in_features"):
        concat_rows([a, c])


def test_bad_input_is_refused_by_name():
    with pytest.raises(ValueError, match="BF16"):
        GGUFWeight.from_gguf(np.zeros((2, 64), np.uint8), int(T.BF16), "x")
    with pytest.raises(ValueError, match="token_embd.*34-byte blocks"):
        GGUFWeight.from_gguf(np.zeros((2, 30), np.uint8), int(T.Q8_0), "token_embd")
    w = GGUFWeight.from_gguf(make_raw(T.Q8_0, 3, 64), int(T.Q8_0), "output")
    with pytest.raises(ValueError, match="output: input of 32 features"):
        w.matmul(torch.zeros(1, 32))
    with pytest.raises(ValueError, match="output: rows 2:5"):
        w.rows(2, 5)
    assert w.matmul(torch.zeros(0, 64)).shape == (0, 3)
    assert isinstance(w, QuantizedWeight)


def test_the_embedded_files_own_tensors(gguf_path):
    """The embedded model's real tensors kept in their bits: the first tensor of each block
    type (its Q8_0 embedding, its Q4_1 weights) multiplies within tolerance of the float
    product at decode and prefill rows, and its embedding rows are gguf-py's values."""
    from chunkserve.model.loader import open_gguf

    seen = set()
    for t in open_gguf(gguf_path).tensors:
        if int(t.tensor_type) not in formats.FORMATS or t.tensor_type in seen:
            continue
        seen.add(t.tensor_type)
        w = GGUFWeight.from_gguf(t.data[:96], int(t.tensor_type), t.name)
        dense = torch.from_numpy(np.asarray(gguf_dequantize(t.data[:96], t.tensor_type)))
        assert torch.equal(w.embedding(torch.tensor([5, 0, 95])), dense[[5, 0, 95]])
        for m in (1, 4, 40):
            x = torch.randn(m, w.in_features, generator=torch.Generator().manual_seed(m))
            assert rel_err(w.matmul(x.bfloat16()), x @ dense.T) < 2e-2, (t.name, m)
    assert {T.Q4_1, T.Q8_0} <= seen


@pytest.mark.parametrize("kernel", [True, False], ids=["kernels", "reference"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_matmul_slices_is_matmul_of_each_slice(kernel, dtype, monkeypatch):
    """The deterministic mode's row slices (``matmul_slices``: the weight dequantized once
    for all slices) give each slice bitwise what ``matmul`` of that slice alone gives, with
    the weight in one tile and in several (a tile of 7 rows: columns of the output written
    apart), and through ``linear`` with the mode's tiling (rows padded to the tile)."""
    from chunkserve.model.layers import RowTiling, linear

    if not kernel:
        monkeypatch.setattr(kernels, "load", lambda: None)
    elif kernels.load() is None:
        pytest.skip(f"no quant kernels: {kernels.load_error()}")
    w = GGUFWeight.from_gguf(make_raw(T.Q4_1, 20, 64), int(T.Q4_1), "w")
    x = torch.randn(48, 64).to(dtype)
    for tile_values in (weight_mod.REFERENCE_TILE_VALUES, 7 * 64):
        monkeypatch.setattr(weight_mod, "REFERENCE_TILE_VALUES", tile_values)
        slices = [(0, 32), (32, 48)]
        got = w.matmul_slices(x, slices)
        want = torch.cat([w.matmul(x[r0:r1]) for r0, r1 in slices])
        assert torch.equal(got, want), tile_values
        y = linear(x[:37], w, tiling=RowTiling(16, 32))
        pad = torch.cat((x[32:37], x.new_zeros(11, 64)))
        assert torch.equal(y, torch.cat((want[:32], w.matmul(pad)[:5]))), tile_values


@needs_kernels
def test_the_deterministic_tiling_skips_row_invariant_weights(weight, monkeypatch):
    """The deterministic mode's row tiling (64- and 128-row calls) is not needed for the int8
    kernel: bf16, one row-invariant call for 130 rows, the kernel's own bits; fp32 (or the
    float opt-in), not row-invariant: the rows are tiled."""
    from chunkserve.model.layers import DETERMINISTIC_TILING, linear

    _, _, w = weight
    calls: list[tuple[str, int]] = []
    matmul, invariant = GGUFWeight.matmul, GGUFWeight.matmul_row_invariant
    monkeypatch.setattr(
        GGUFWeight, "matmul", lambda s, x: calls.append(("plain", len(x))) or matmul(s, x)
    )
    monkeypatch.setattr(
        GGUFWeight,
        "matmul_row_invariant",
        lambda s, x: calls.append(("invariant", len(x))) or invariant(s, x),
    )
    x = torch.randn(130, w.in_features).bfloat16()
    want = kernels.load().gemm(int(weight[0]), w.data, x)
    assert torch.equal(linear(x, w, None, DETERMINISTIC_TILING), want)
    assert calls == [("invariant", 130)]
    for xin in (x.float(), x):
        calls.clear()
        monkeypatch.setenv("CHUNKSERVE_QUANT_FLOAT_KERNEL", "1" if xin is x else "0")
        linear(xin, w, None, DETERMINISTIC_TILING)
        assert calls and all(kind == "plain" for kind, _ in calls), calls
        assert sum(n for _, n in calls) == 192  # padded to the tiling's multiple (64)


PACKABLE = [T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1]


@needs_kernels
@pytest.mark.parametrize("qtype", PACKABLE, ids=lambda q: q.name)
def test_packed_weights_give_the_file_layouts_bits(qtype):
    """A weight repacked for the batch-1 kernel (``kernels.pack``, the C file's "packed
    weights") holds the file's bytes (unpacked back exactly, any rows) and gives the file
    layout's bits on every path: one row (its own kernel), the unpacked tile paths (2-15
    rows), AMX (16+), portable C, bf16 and float32 x, 1 and 2 threads, a row alone or in a
    step of 300."""
    k = kernels.load()
    code = int(qtype)
    raw = make_raw(qtype, 48, odd_k(qtype), seed=3)
    data = torch.from_numpy(raw.copy())
    if not k.packable(code, 48):
        pytest.skip(f"packing needs an AVX512-VNNI build (this one: {k.simd})")
    assert not k.packable(code, 37)
    assert not k.packable(int(T.Q4_K), 48) and not k.packable(int(T.Q6_K), 48)
    packed = k.pack(code, data, odd_k(qtype))
    assert packed.shape == data.shape and not torch.equal(packed, data)
    assert torch.equal(k.unpack(code, packed, odd_k(qtype)), data)
    ids = torch.tensor([47, 0, 16, 5, 5])
    assert torch.equal(k.unpack(code, packed, odd_k(qtype), ids), data[ids])
    x = torch.randn(300, odd_k(qtype), generator=torch.Generator().manual_seed(6)) * 3
    x[7] = 0.0
    old = torch.get_num_threads()
    try:
        for xin in (x, x.bfloat16()):
            for threads in (1, 2):
                torch.set_num_threads(threads)
                for portable in (False, True):
                    whole = k.gemm(code, data, xin, portable=portable)
                    assert torch.equal(k.gemm_packed(code, packed, xin, portable), whole)
                    for m in (1, 3, 16, 17):
                        for r in (0, 7, 283):
                            got = k.gemm_packed(code, packed, xin[r : r + m], portable)
                            assert torch.equal(got, whole[r : r + m]), (qtype.name, m, r)
    finally:
        torch.set_num_threads(old)


@needs_kernels
@pytest.mark.parametrize("qtype", PACKABLE, ids=lambda q: q.name)
def test_a_weight_packs_at_its_first_decode_product(qtype, monkeypatch):
    """``GGUFWeight.matmul`` packs a weight at its first int8-activation product (not for
    float32 x, nor with ``CHUNKSERVE_QUANT_PACK=0``), and the load's ``prepare`` for a bf16
    CPU engine, in the same bytes, and every use of it
    (products on each path, embedding rows, dequantize, the loading edits) gives what the
    file's layout gives."""
    if not kernels.load().packable(int(qtype), 48):
        pytest.skip(f"packing needs an AVX512-VNNI build (this one: {kernels.load().simd})")
    raw = make_raw(qtype, 48, odd_k(qtype), seed=4)
    plain = GGUFWeight.from_gguf(raw, int(qtype), "blk.1.w")
    w = GGUFWeight.from_gguf(raw, int(qtype), "blk.1.w")
    x = torch.randn(70, w.in_features, generator=torch.Generator().manual_seed(7))
    xb = x.bfloat16()
    monkeypatch.setenv("CHUNKSERVE_QUANT_PACK", "0")
    assert not plain.pack() and plain.packed is None  # kept in the file's layout for good
    monkeypatch.delenv("CHUNKSERVE_QUANT_PACK")
    assert torch.equal(w.matmul(x[:2]), plain.matmul(x[:2])) and w.packed is None  # float32
    assert torch.equal(w.matmul(xb[:1]), plain.matmul(xb[:1]))
    assert w.packed is not None and w.nbytes == plain.nbytes == raw.nbytes
    assert torch.equal(w.data, plain.data)
    for rows in (xb[:1], xb[:5], xb[:16], xb[:64], xb):
        assert torch.equal(w.matmul(rows), plain.matmul(rows))
        assert torch.equal(w.matmul_row_invariant(rows), plain.matmul_row_invariant(rows))
    assert torch.equal(w.matmul(x[:3]), plain.matmul(x[:3]))
    assert torch.equal(w.matmul(x), plain.matmul(x))
    ids = torch.tensor([[3, 47], [16, 3]])
    assert torch.equal(w.embedding(ids, torch.bfloat16), plain.embedding(ids, torch.bfloat16))
    assert torch.equal(w.dequantize(), plain.dequantize())
    assert torch.equal(w.rows(5, 21).data, plain.rows(5, 21).data)
    assert torch.equal(w.cols(32, 96).data, plain.cols(32, 96).data)
    monkeypatch.setenv("CHUNKSERVE_QUANT_KERNELS", "0")  # the reference, from unpacked rows
    assert torch.equal(w.matmul(xb[:2]), plain.matmul(xb[:2]))
    monkeypatch.delenv("CHUNKSERVE_QUANT_KERNELS")
    loaded = GGUFWeight.from_gguf(raw, int(qtype), "blk.1.w")  # the load's call (``prepare``)
    loaded.prepare(torch.float32, torch.device("cpu"))
    assert loaded.packed is None
    loaded.prepare(torch.bfloat16, torch.device("cpu"))
    assert loaded.packed is not None and torch.equal(loaded.data, plain.data)
