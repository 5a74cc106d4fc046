"""Our GGUF decoding against gguf-py's: the dequantiser (chunkserve.quant.formats) bit for
bit, on the embedded file's own tensors and on blocks gguf-py's ``quantize`` writes for
every type we decode ourselves (other types go to gguf-py); the reader
(chunkserve.model.gguf_reader) field for field and tensor for tensor."""

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize

from chunkserve.model.gguf_reader import GGUFReader
from chunkserve.model.loader import open_gguf
from chunkserve.quant import formats

OURS = [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.F16]


def assert_same_bits(ours: np.ndarray, ref: np.ndarray) -> None:
    assert ours.dtype == np.float32 and ours.shape == ref.shape
    # Bit patterns, so -0.0 against 0.0 or any last-bit rounding difference fails too.
    assert np.array_equal(ours.view(np.uint32), np.asarray(ref, np.float32).view(np.uint32))


def awkward_rows() -> np.ndarray:
    """[8, 128] float32: normal values plus blocks that are all zero, constant, one huge
    value, negative only, exact quant steps, and extremes near f16's range."""
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((8, 128)) * 2).astype(np.float32)
    x[0, :32] = 0.0
    x[0, 32:64] = 1.5
    x[1, :32] = 0.0
    x[1, 7] = 1000.0
    x[2, :32] = -np.abs(x[2, :32])
    x[3, :32] = np.arange(32, dtype=np.float32) - 16
    x[4, :32] = np.linspace(-6e4, 6e4, 32, dtype=np.float32)
    x[5, :] = rng.standard_normal(128).astype(np.float32) * 1e-3
    return x


@pytest.mark.parametrize("qtype", OURS, ids=lambda q: q.name)
def test_blocks_written_by_gguf_py(qtype):
    data = gguf_quantize(awkward_rows(), qtype)
    assert formats.supported(qtype)
    assert_same_bits(formats.dequantize(data, qtype), gguf_dequantize(data, qtype))


def test_every_type_in_the_embedded_file(gguf_path):
    """Rows of the first tensor of each type in the embedded file (the Q8_0 embedding, Q4_1
    weights) decode exactly as gguf-py decodes them; F32 tensors are used as they are."""
    seen = set()
    for t in open_gguf(gguf_path).tensors:
        if t.tensor_type == T.F32 or t.tensor_type in seen:
            continue
        seen.add(t.tensor_type)
        assert formats.supported(t.tensor_type), t.tensor_type.name
        rows = t.data[:64]
        assert_same_bits(
            formats.dequantize(rows, t.tensor_type), gguf_dequantize(rows, t.tensor_type)
        )
    assert {T.Q4_1, T.Q8_0} <= seen


def test_other_types_go_to_gguf_py():
    data = gguf_quantize(awkward_rows(), T.BF16)
    assert not formats.supported(T.BF16)
    assert_same_bits(formats.dequantize(data, T.BF16), gguf_dequantize(data, T.BF16))


def test_rows_of_partial_blocks_are_refused():
    with pytest.raises(ValueError, match="Q4_1"):
        formats.dequantize(np.zeros((2, 30), np.uint8), T.Q4_1)


def test_reader_reads_what_gguf_py_reads(gguf_path):
    import gguf

    ours, theirs = GGUFReader(gguf_path), gguf.GGUFReader(gguf_path)
    assert type(ours.data) is np.ndarray and not ours.data.flags.writeable
    assert list(ours.fields) == list(theirs.fields)
    for name, a in ours.fields.items():
        b = theirs.fields[name]
        assert (a.offset, a.types, a.data) == (b.offset, b.types, b.data), name
        assert len(a.parts) == len(b.parts), name
        for x, y in zip(a.parts, b.parts, strict=True):
            assert x.dtype == y.dtype and np.array_equal(x, y), name
    assert (ours.data_offset, ours.alignment) == (theirs.data_offset, theirs.alignment)
    assert len(ours.tensors) == len(theirs.tensors) > 0
    for a, b in zip(ours.tensors, theirs.tensors, strict=True):
        assert (a.name, a.tensor_type, a.data_offset) == (b.name, b.tensor_type, b.data_offset)
        assert np.array_equal(a.shape, b.shape) and a.data.shape == b.data.shape
        assert a.data.dtype == b.data.dtype and np.array_equal(a.data, b.data), a.name
        assert not a.data.flags.writeable
