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

from chunkserve.quant import formats
from chunkserve.quant.weight import GGUFWeight, QuantizedWeight, concat_rows

ALL = [T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q4_K, T.Q5_K, T.Q6_K]
K_QUANTS = {T.Q4_K, T.Q5_K, T.Q6_K}
# Byte offsets of each block's f16 scale fields (overwritten with sane values in random
# K-quant blocks so no inf/nan turns up).
F16_FIELDS = {T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,)}
ROWS_M = [1, 3, 16, 64, 300]


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


@pytest.mark.parametrize("m", ROWS_M)
def test_matmul_against_gguf_py_dequantize(weight, m):
    qtype, raw, w = weight
    ref_w = torch.from_numpy(np.asarray(gguf_dequantize(raw, qtype), np.float32))
    x = torch.randn(m, w.in_features, generator=torch.Generator().manual_seed(m))
    want = x @ ref_w.T
    got = w.matmul(x)
    assert got.shape == (m, 37) and got.dtype == torch.float32
    rel = (got - want).norm() / want.norm()
    assert rel < 1e-2, float(rel)
    got_bf16 = w.matmul(x.bfloat16())
    assert got_bf16.dtype == torch.bfloat16
    assert (got_bf16.float() - want).norm() / want.norm() < 2e-2


def test_reference_is_the_dequantized_model(weight, monkeypatch):
    """The reference path is F.linear on the dequantized weight cast to x's dtype, bit for
    bit, also when it works in row tiles."""
    from chunkserve.quant import weight as weight_mod

    _, _, w = weight
    x = torch.randn(5, w.in_features).bfloat16()
    want = torch.nn.functional.linear(x, w.dequantize(torch.bfloat16))
    assert torch.equal(weight_mod.reference_matmul(w, x), want)
    monkeypatch.setattr(weight_mod, "REFERENCE_TILE_VALUES", w.in_features * 5)
    assert torch.equal(weight_mod.reference_matmul(w, x), want)


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
    assert isinstance(w, QuantizedWeight)
