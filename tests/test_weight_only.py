"""Weight-only int8 / int4 (chunkserve.quant.weight_only): quantization error within its
bound (half a step of each value's scale), ``matmul`` (torch's weight-only kernels on few
rows, dequantize + F.linear on many) against x @ dequantize().T over decode and prefill row
counts in fp32 and bf16, the loading edits (rows, cols, permute_rows, concat_rows) on the
quantized bits, and bad group sizes / methods refused by name."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from chunkserve.quant import weight_only
from chunkserve.quant.weight import GGUFWeight, QuantizedWeight, concat_rows
from chunkserve.quant.weight_only import Int4Weight, Int8Weight, quantize_weight

ROWS_M = [1, 3, 16, 64, 300]
OUT, IN = 37, 384  # odd rows; 384 = 3 groups of 128, 6 of 64, 12 of 32


def float_weight(out: int = OUT, cols: int = IN, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out, cols, generator=g) * 0.05
    w[3] = 0.0  # an all-zero row (scale must not divide by zero)
    w[4, :64] += 1.0  # a row / group with an offset (asymmetric int4 pays off)
    return w


def make(kind: str, w: torch.Tensor, name: str = "blk.0.w") -> QuantizedWeight:
    if kind == "int8":
        return Int8Weight.quantize(w, name)
    group = int(kind.split("-g")[1])
    return Int4Weight.quantize(w, group, name, symmetric=kind.startswith("int4s"))


KINDS = ["int8", "int4-g32", "int4-g64", "int4-g128", "int4s-g64"]


@pytest.fixture(scope="module", params=KINDS)
def weight(request) -> tuple[str, torch.Tensor, QuantizedWeight]:
    w = float_weight()
    return request.param, w, make(request.param, w)


def step(kind: str, q: QuantizedWeight) -> torch.Tensor:
    """Each value's quantization step [out, in]."""
    if isinstance(q, Int8Weight):
        return q.scale[:, None].expand(q.shape)
    assert isinstance(q, Int4Weight)
    return q.scale.repeat_interleave(q.group_size, dim=1)


def test_quantize_error_within_half_a_step(weight):
    kind, w, q = weight
    deq = q.dequantize()
    assert deq.shape == w.shape and deq.dtype == torch.float32
    err = (deq - w).abs()
    assert bool((err <= step(kind, q) / 2 * (1 + 1e-5) + 1e-7).all()), float(err.max())
    assert torch.equal(deq[3], torch.zeros(IN))  # zero row exactly zero
    # Overall: int8 ~0.2% of the values' size, int4 ~5-10%.
    rel = float((deq - w).norm() / w.norm())
    assert rel < (0.01 if kind == "int8" else 0.12), rel
    assert q.dequantize(torch.bfloat16).dtype == torch.bfloat16


def test_storage_is_what_the_format_says(weight):
    kind, w, _ = weight
    q = make(kind, w)  # fresh: no kernel copy made yet
    if isinstance(q, Int8Weight):
        assert q.q.dtype == torch.int8 and int(q.q.abs().max()) <= 127
        assert q.nbytes == OUT * IN + 4 * OUT
    else:
        assert q.packed.shape == (OUT, IN // 2) and q.packed.dtype == torch.uint8
        assert q.nbytes == OUT * IN // 2 + 8 * OUT * (IN // q.group_size)
    assert q.qtype == kind.split("-")[0].rstrip("s")
    if isinstance(q, Int4Weight):  # torch's packed copy (rows padded to 48) is counted
        before = q.nbytes
        q.matmul(torch.zeros(1, IN, dtype=torch.bfloat16))
        assert q.nbytes == before + 48 * IN // 2 + 2 * 2 * 48 * (IN // q.group_size)


@pytest.mark.parametrize("m", ROWS_M)
def test_matmul_against_the_dequantized_weight(weight, m):
    _, _, q = weight
    x = torch.randn(m, IN, generator=torch.Generator().manual_seed(m))
    want = x @ q.dequantize().T
    got = q.matmul(x)
    assert got.shape == (m, OUT) and got.dtype == torch.float32
    assert float((got - want).norm() / want.norm()) < 1e-5
    got_bf16 = q.matmul(x.bfloat16())
    assert got_bf16.dtype == torch.bfloat16
    assert float((got_bf16.float() - want).norm() / want.norm()) < 2e-2
    # Leading dimensions are kept.
    assert torch.equal(q.matmul(x.reshape(1, m, IN)), got.reshape(1, m, OUT))


@pytest.mark.parametrize("kind", ["int8", "int4-g64"])
def test_both_paths_are_taken_and_agree(kind, monkeypatch):
    """The same rows through torch's kernel and through dequantize + F.linear."""
    q = make(kind, float_weight(seed=1))
    x = torch.randn(8, IN, generator=torch.Generator().manual_seed(0))
    calls = []
    real = weight_only._tiled
    monkeypatch.setattr(weight_only, "_tiled", lambda *a: calls.append(1) or real(*a))
    always = {torch.float32: 64, torch.bfloat16: 64}
    monkeypatch.setattr(weight_only, "INT8_KERNEL_ROWS", always)
    monkeypatch.setattr(weight_only, "INT4_KERNEL_ROWS", always)
    kernel = q.matmul(x)
    assert not calls  # torch's kernel
    monkeypatch.setattr(weight_only, "INT8_KERNEL_ROWS", {})
    monkeypatch.setattr(weight_only, "INT4_KERNEL_ROWS", {})
    tiled = q.matmul(x)
    assert calls  # the second product went the dequantizing way
    torch.testing.assert_close(kernel, tiled, rtol=1e-5, atol=1e-5)
    # Tiles of a few rows give the untiled product (up to the GEMM's blocking, which may
    # change with the number of output columns: the AMD EPYC's fp32 F.linear differs in the
    # last bit between 5 and 37 of them).
    monkeypatch.setattr(weight_only, "TILE_VALUES", IN * 5)
    torch.testing.assert_close(q.matmul(x), tiled, rtol=1e-6, atol=1e-6)


def test_embedding_rows(weight):
    _, _, q = weight
    full = q.dequantize()
    ids = torch.tensor([[3, 0], [36, 4]])
    assert torch.equal(q.embedding(ids), full[ids])
    assert torch.equal(q.embedding(ids, torch.bfloat16), full[ids].bfloat16())
    with pytest.raises(ValueError, match="blk.0.w"):
        q.embedding(torch.tensor([OUT]))


def test_rows_cols_permute_concat(weight):
    _kind, _, q = weight
    full = q.dequantize()
    part = q.rows(5, 20)
    assert type(part) is type(q) and part.shape == (15, IN)
    assert torch.equal(part.dequantize(), full[5:20])
    group = getattr(q, "group_size", 32)
    cols = q.cols(group, 3 * group)
    assert cols.shape == (OUT, 2 * group)
    assert torch.equal(cols.dequantize(), full[:, group : 3 * group])
    x = torch.randn(2, 2 * group)
    torch.testing.assert_close(cols.matmul(x), x @ full[:, group : 3 * group].T)
    index = np.random.default_rng(0).permutation(OUT)
    assert torch.equal(q.permute_rows(index).dequantize(), full[index])
    assert torch.equal(q.permute_rows(torch.from_numpy(index)).dequantize(), full[index])
    both = concat_rows([q.rows(0, 10), q.rows(10, OUT)])
    assert type(both) is type(q) and torch.equal(both.dequantize(), full)
    x = torch.randn(1, IN)
    torch.testing.assert_close(both.matmul(x), q.matmul(x))


def test_int8_cols_anywhere_int4_cols_on_groups():
    w = float_weight()
    q8 = Int8Weight.quantize(w, "blk.1.ffn_down")
    assert torch.equal(q8.cols(5, 17).dequantize(), q8.dequantize()[:, 5:17])
    q4 = Int4Weight.quantize(w, 64, "blk.1.ffn_down")
    with pytest.raises(ValueError, match="blk.1.ffn_down: columns 0:96 cut an int4 group of 64"):
        q4.cols(0, 96)
    with pytest.raises(ValueError, match="blk.1.ffn_down: columns"):
        q4.cols(0, IN + 64)


def test_concat_rows_of_other_group_sizes_or_types_is_none():
    w = float_weight()
    a, b = Int4Weight.quantize(w, 64), Int4Weight.quantize(w, 128)
    assert concat_rows([a, b]) is None
    assert concat_rows([a, Int8Weight.quantize(w)]) is None
    assert concat_rows([a, a]).shape == (2 * OUT, IN)


@pytest.mark.parametrize("bad", [0, 16, 48, 256, 64.0, True, "64"])
def test_bad_group_size_is_refused_by_name(bad):
    with pytest.raises(ValueError, match="group_size: must be one of"):
        Int4Weight.quantize(float_weight(), bad)


def test_bad_input_is_refused_by_name():
    with pytest.raises(ValueError, match="group_size: blk.2.attn_q's 96 input features"):
        Int4Weight.quantize(torch.randn(4, 96), 64, "blk.2.attn_q")
    with pytest.raises(ValueError, match="quantization: must be one of"):
        quantize_weight(torch.randn(4, 64), "int3")
    with pytest.raises(ValueError, match="lm: weight-only quantization takes a float"):
        Int8Weight.quantize(torch.zeros(4, 64, dtype=torch.int32), "lm")
    with pytest.raises(ValueError, match="lm: weight-only quantization takes a 2-D"):
        Int8Weight.quantize(torch.zeros(64), "lm")
    q = quantize_weight(torch.randn(4, 64), "int4", "o", group_size=32)
    with pytest.raises(ValueError, match="o: input of 32 features"):
        q.matmul(torch.zeros(1, 32))
    with pytest.raises(ValueError, match="o: rows 2:5"):
        q.rows(2, 5)
    q8 = quantize_weight(torch.randn(4, 64), "int8")
    assert isinstance(q8, GGUFWeight) and q8.qtype == "Q8_0" and q8.nbytes == 4 * 2 * 34
    assert isinstance(quantize_weight(torch.randn(4, 48), "int8"), Int8Weight)  # not blocks


# --- int4 at the load's group (32) as GGML Q4_1 blocks (``weight_only.quantize_blocks``) ---


def heavy_tailed(out: int = OUT, cols: int = IN, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out, cols, generator=g) / torch.rand(out, cols, generator=g).clamp_min(0.05)
    return w * 0.01  # ~1/u tails: blocks whose span one value sets


def block_params(q: GGUFWeight) -> tuple[torch.Tensor, torch.Tensor]:
    """Each value's fp16 d and m (zeros for formats without m) as float32 [out, in]."""
    fmt = q.format
    blocks = q.data.reshape(q.shape[0], -1, fmt.block_bytes)
    d = blocks[..., 0:2].contiguous().view(torch.float16).float()
    m = blocks[..., 2:4].contiguous().view(torch.float16).float() if fmt.name == "Q4_1" else 0 * d
    return (
        d.repeat_interleave(32, dim=1).reshape(q.shape),
        m.repeat_interleave(32, dim=1).reshape(q.shape),
    )


@pytest.mark.parametrize("values", ["normal", "heavy"])
@pytest.mark.parametrize(
    ("qtype", "ref"), [("Q4_1", "int4-g32"), ("Q4_0", "int4s-g32"), ("Q8_0", "int8")]
)
def test_blocks_error_within_half_their_fp16_step(values, qtype, ref):
    """Every value within half its block's fp16 d (the q's picked with the rounded d / m);
    the whole error within 0.2% of the fp32-scale weight's; gguf-py reads the same values."""
    from gguf.quants import dequantize as gguf_dequantize

    w = float_weight() if values == "normal" else heavy_tailed()
    q = weight_only.quantize_blocks(w, qtype, "blk.0.w")
    assert isinstance(q, GGUFWeight) and q.qtype == qtype and q.shape == w.shape
    deq = q.dequantize()
    assert np.array_equal(gguf_dequantize(q.data.numpy(), q.format.code), deq.numpy())
    d, _ = block_params(q)
    err = (deq - w).abs()
    assert bool((err <= d / 2 * (1 + 1e-5) + 1e-7).all()), float((err / d).max())
    rel = float((deq - w).norm() / w.norm())
    rel_fp32 = float((make(ref, w).dequantize() - w).norm() / w.norm())
    if qtype == "Q8_0":
        assert rel < rel_fp32  # blocks of 32 against one scale a row
    else:
        assert rel < rel_fp32 * 1.002, (rel, rel_fp32)
    if values == "normal":
        assert torch.equal(deq[3], torch.zeros(IN))  # the zero row exactly zero


def test_int4_group_32_is_q4_1_at_five_bits():
    w = float_weight()
    q = quantize_weight(w, "int4", "blk.0.ffn_up", group_size=32)
    assert isinstance(q, GGUFWeight) and q.qtype == "Q4_1" and q.name == "blk.0.ffn_up"
    assert q.nbytes * 8 == 5 * OUT * IN  # d, m (fp16) and 32 nibbles: 20 bytes a block
    x = torch.randn(3, IN)
    torch.testing.assert_close(q.matmul(x), x @ q.dequantize().T, rtol=1e-4, atol=1e-4)
    # Other groups stay Int4Weight; a block's d / m beyond fp16 too (fp32 scales).
    assert isinstance(quantize_weight(w, "int4", group_size=64), Int4Weight)
    big = w.clone()
    big[5, 7] = 1e5
    assert isinstance(quantize_weight(big, "int4", group_size=32), Int4Weight)
    # Values already on a Q4_1 grid (a dequantized Q4_1 model) come back bit for bit.
    again = quantize_weight(q.dequantize(), "int4", group_size=32)
    assert torch.equal(again.data, q.data)


def test_blocks_refuse_bad_input_by_name():
    with pytest.raises(ValueError, match="blk.1.w: 48 input features are not a multiple"):
        weight_only.quantize_blocks(torch.randn(4, 48), "Q4_1", "blk.1.w")
    with pytest.raises(ValueError, match="blk.1.w: quantize_blocks takes one of"):
        weight_only.quantize_blocks(torch.randn(4, 64), "Q5_K", "blk.1.w")
