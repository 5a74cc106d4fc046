"""GGUF block dequantisation for the simple llama.cpp block types, in few in-place passes.

gguf-py's numpy ``dequantize`` builds many temporaries per tensor (~3 s for the embedded
135M Q4_1 file on 2 cores), and every server, core or tensor-parallel rank start-up pays it.
The block types here are the legacy ones: 32 values per block, an f16 scale ``d``, for the
``_1`` types an f16 offset ``m``, for Q5 a 32-bit little-endian mask of fifth bits, then the
packed values (low nibbles are values 0-15, high nibbles 16-31). The results equal gguf-py's
bit for bit: the same float32 products and sums (``d * q`` then ``+ m``, no fused
multiply-add); tests/test_dequant.py checks every type against gguf-py. Other types go to
gguf-py unchanged.

numpy, not torch: this runs once per load, single-threaded by design; torch's intra-op
threads gain nothing on these memory-bound passes and lose badly on a busy machine.
"""

from __future__ import annotations

from typing import Any

import numpy as np

BLOCK = 32  # values per block, for every block type here

# GGMLQuantizationType value (fixed by the GGUF format) -> (name, bytes per block).
_TYPES = {
    2: ("Q4_0", 2 + 16),
    3: ("Q4_1", 2 + 2 + 16),
    6: ("Q5_0", 2 + 4 + 16),
    7: ("Q5_1", 2 + 2 + 4 + 16),
    8: ("Q8_0", 2 + 32),
}
_F16 = 1


def supported(qtype: Any) -> bool:
    """Whether ``dequantize`` handles this GGMLQuantizationType itself (not through gguf-py)."""
    return int(qtype) in _TYPES or int(qtype) == _F16


def dequantize(data: np.ndarray, qtype: Any) -> np.ndarray:
    """float32 values of a GGUF tensor's raw data (as ``GGUFReader`` gives it: rows of bytes
    for block types, float16 for F16), shaped as gguf-py's ``dequantize`` shapes them. Types
    this module lacks go to gguf-py."""
    code = int(qtype)
    if code == _F16:
        return np.asarray(data).view(np.float16).astype(np.float32)
    if code not in _TYPES:
        from gguf.quants import dequantize as gguf_dequantize

        return gguf_dequantize(data, qtype)
    name, type_size = _TYPES[code]
    raw = np.asarray(data).view(np.uint8)
    if raw.ndim == 0 or raw.shape[-1] % type_size:
        raise ValueError(
            f"GGUF {name} tensor of byte shape {raw.shape}: "
            f"rows are not whole {type_size}-byte blocks"
        )
    out_shape = (*raw.shape[:-1], raw.shape[-1] // type_size * BLOCK)
    blocks = raw.reshape(-1, type_size)
    return _DEQUANT[name](blocks).reshape(out_shape)


def _f16(blocks: np.ndarray, start: int) -> np.ndarray:
    """The f16 field at byte ``start`` of each block, as a float32 column."""
    return np.ascontiguousarray(blocks[:, start : start + 2]).view(np.float16).astype(np.float32)


def _unpack(packed: np.ndarray, qh: np.ndarray | None) -> np.ndarray:
    """[n, 32] uint8 quants from 16 packed bytes per block (and, for Q5, the fifth bits)."""
    q = np.empty((packed.shape[0], BLOCK), dtype=np.uint8)
    np.bitwise_and(packed, 0x0F, out=q[:, :16])
    np.right_shift(packed, 4, out=q[:, 16:])
    if qh is not None:
        # Bit i of the little-endian 32-bit mask (bit i % 8 of byte i // 8) is value i's 5th bit.
        bits = np.unpackbits(qh, axis=1, bitorder="little")
        np.left_shift(bits, 4, out=bits)
        np.bitwise_or(q, bits, out=q)
    return q


def _scaled(q: np.ndarray, d: np.ndarray, bias: float | None = None) -> np.ndarray:
    out = q.astype(np.float32)
    if bias is not None:
        out -= np.float32(bias)  # small integers: exact, as gguf-py's int8 subtraction
    out *= d
    return out


def _q4_0(blocks: np.ndarray) -> np.ndarray:
    return _scaled(_unpack(blocks[:, 2:], None), _f16(blocks, 0), 8)


def _q4_1(blocks: np.ndarray) -> np.ndarray:
    out = _scaled(_unpack(blocks[:, 4:], None), _f16(blocks, 0))
    out += _f16(blocks, 2)
    return out


def _q5_0(blocks: np.ndarray) -> np.ndarray:
    return _scaled(_unpack(blocks[:, 6:], blocks[:, 2:6]), _f16(blocks, 0), 16)


def _q5_1(blocks: np.ndarray) -> np.ndarray:
    out = _scaled(_unpack(blocks[:, 8:], blocks[:, 4:8]), _f16(blocks, 0))
    out += _f16(blocks, 2)
    return out


def _q8_0(blocks: np.ndarray) -> np.ndarray:
    q = np.ascontiguousarray(blocks[:, 2:]).view(np.int8)
    return _scaled(q, _f16(blocks, 0))


_DEQUANT = {"Q4_0": _q4_0, "Q4_1": _q4_1, "Q5_0": _q5_0, "Q5_1": _q5_1, "Q8_0": _q8_0}
