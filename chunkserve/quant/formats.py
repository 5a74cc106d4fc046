"""GGML block formats and their numpy dequantisation, bit for bit as gguf-py's.

Every format stores a row of ``K`` values as ``K / block_values`` blocks of ``block_bytes``
bytes; a row never shares a block with the next. Layouts (byte offsets within one block):

```
legacy, 32 values:  Q4_0 [d f16][16 B nibbles]              value = d * (q - 8)
                    Q4_1 [d][m f16][16 B nibbles]           value = d * q + m
                    Q5_0 [d][qh u32][16 B nibbles]          value = d * (q - 16)
                    Q5_1 [d][m][qh u32][16 B nibbles]       value = d * q + m
                    Q8_0 [d][32 x int8]                     value = d * q
  nibbles: byte j holds value j (low) and value j + 16 (high); bit i of qh is value i's 5th bit.
K-quants, 256 values in sub-blocks:
  Q4_K [d][dmin][12 B: 8 6-bit scales + 8 6-bit mins][128 B nibbles]
       sub-block s (32 values) = d * sc[s] * q - dmin * m[s]; byte 32 * (s // 2) + l holds
       value l of sub-block s in its low (s even) or high (s odd) nibble
  Q5_K as Q4_K with [32 B qh] before the nibbles: bit s of qh[l] is the 5th bit of value l
       of sub-block s
  Q6_K [128 B ql][64 B qh][16 x int8 scale][d f16], 16 sub-blocks of 16 values,
       value = d * sc[i // 16] * (q - 32); per half h of 128 values, value i takes its low
       nibble from ql[64 h + i % 64] (low nibble if i < 64, else high) and its top 2 bits
       from qh[32 h + i % 32] >> 2 (i // 32)
```

The passes here are few and in place (gguf-py's numpy ``dequantize`` builds many temporaries:
~3 s for the embedded 135M Q4_1 file on 2 cores, paid by every server, core or rank start-up).
The results equal gguf-py's bit for bit: the same float32 products and sums in the same
order, no fused multiply-add; tests/test_quant.py checks every format against gguf-py. Other
types go to gguf-py unchanged.

numpy, not torch: this runs once per load, single-threaded by design; torch's intra-op
threads gain nothing on these memory-bound passes and lose badly on a busy machine.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True)
class Format:
    name: str
    code: int  # GGMLQuantizationType value, fixed by the GGUF format
    block_values: int
    block_bytes: int


FORMATS: dict[int, Format] = {
    f.code: f
    for f in (
        Format("Q4_0", 2, 32, 2 + 16),
        Format("Q4_1", 3, 32, 2 + 2 + 16),
        Format("Q5_0", 6, 32, 2 + 4 + 16),
        Format("Q5_1", 7, 32, 2 + 2 + 4 + 16),
        Format("Q8_0", 8, 32, 2 + 32),
        Format("Q4_K", 12, 256, 2 + 2 + 12 + 128),
        Format("Q5_K", 13, 256, 2 + 2 + 12 + 32 + 128),
        Format("Q6_K", 14, 256, 128 + 64 + 16 + 2),
    )
}
BY_NAME: dict[str, Format] = {f.name: f for f in FORMATS.values()}
_F16 = 1


def get(qtype: Any) -> Format:
    """The block format of a GGMLQuantizationType (or its code, or its name)."""
    if isinstance(qtype, str):
        if qtype not in BY_NAME:
            raise ValueError(f"unknown GGML block format {qtype!r}; known: {sorted(BY_NAME)}")
        return BY_NAME[qtype]
    code = int(qtype)
    if code not in FORMATS:
        raise ValueError(
            f"GGML type {_type_name(code)} is not a block format kept quantized; "
            f"known: {sorted(BY_NAME)}"
        )
    return FORMATS[code]


def _type_name(code: int) -> str:
    from gguf import GGMLQuantizationType

    try:
        return GGMLQuantizationType(code).name
    except ValueError:
        return str(code)


def supported(qtype: Any) -> bool:
    """Whether ``dequantize`` handles this GGMLQuantizationType itself (not through gguf-py)."""
    return int(qtype) in FORMATS or int(qtype) == _F16


def dequantize(data: np.ndarray, qtype: Any) -> np.ndarray:
    """float32 values of a GGUF tensor's raw data (as ``GGUFReader`` gives it: rows of bytes
    for block types, float16 for F16), shaped as gguf-py's ``dequantize`` shapes them. Types
    this module lacks go to gguf-py."""
    code = int(qtype)
    if code == _F16:
        return np.asarray(data).view(np.float16).astype(np.float32)
    if code not in FORMATS:
        from gguf.quants import dequantize as gguf_dequantize

        return gguf_dequantize(data, qtype)
    fmt = FORMATS[code]
    raw = np.asarray(data).view(np.uint8)
    if raw.ndim == 0 or raw.shape[-1] % fmt.block_bytes:
        raise ValueError(
            f"GGUF {fmt.name} tensor of byte shape {raw.shape}: "
            f"rows are not whole {fmt.block_bytes}-byte blocks"
        )
    out_shape = (*raw.shape[:-1], raw.shape[-1] // fmt.block_bytes * fmt.block_values)
    blocks = raw.reshape(-1, fmt.block_bytes)
    return _DEQUANT[fmt.name](blocks).reshape(out_shape)


def _f16(blocks: np.ndarray, start: int) -> np.ndarray:
    """The f16 field at byte ``start`` of each block, as a float32 column."""
    return np.ascontiguousarray(blocks[:, start : start + 2]).view(np.float16).astype(np.float32)


def _unpack(packed: np.ndarray, qh: np.ndarray | None) -> np.ndarray:
    """[n, 32] uint8 quants from 16 packed bytes per block (and, for Q5, the fifth bits)."""
    q = np.empty((packed.shape[0], 32), dtype=np.uint8)
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


def k_scales_mins(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[n, 8] uint8 6-bit scales and mins of Q4_K/Q5_K blocks from their 12 packed bytes:
    bytes 0-3 hold scales 0-3 (low 6 bits) and the top 2 bits of scales 4-7, bytes 4-7 the
    same for the mins, bytes 8-11 the low 4 bits of scales 4-7 (low nibble) and mins 4-7."""
    a, b, c = scales[:, 0:4], scales[:, 4:8], scales[:, 8:12]
    sc = np.concatenate([a & 0x3F, (c & 0x0F) | ((a >> 2) & 0x30)], axis=1)
    mn = np.concatenate([b & 0x3F, (c >> 4) | ((b >> 2) & 0x30)], axis=1)
    return sc, mn


def _k_nibbles(qs: np.ndarray) -> np.ndarray:
    """[n, 8, 32] uint8: the 4-bit quants of Q4_K/Q5_K from their 128 bytes per block."""
    n = qs.shape[0]
    q = np.empty((n, 4, 2, 32), dtype=np.uint8)
    packed = qs.reshape(n, 4, 32)
    np.bitwise_and(packed, 0x0F, out=q[:, :, 0])
    np.right_shift(packed, 4, out=q[:, :, 1])
    return q.reshape(n, 8, 32)


def _k_scaled(q: np.ndarray, blocks: np.ndarray) -> np.ndarray:
    """(d * sc) * q - dmin * m per sub-block, in gguf-py's float32 order."""
    sc, mn = k_scales_mins(blocks[:, 4:16])
    d = _f16(blocks, 0) * sc.astype(np.float32)
    dm = _f16(blocks, 2) * mn.astype(np.float32)
    out = q.astype(np.float32)
    out *= d[:, :, None]
    out -= dm[:, :, None]
    return out.reshape(-1, 256)


def _q4_k(blocks: np.ndarray) -> np.ndarray:
    return _k_scaled(_k_nibbles(blocks[:, 16:144]), blocks)


def _q5_k(blocks: np.ndarray) -> np.ndarray:
    q = _k_nibbles(blocks[:, 48:176])
    n = blocks.shape[0]
    # unpackbits: index 8 l + s is bit s of qh[l], the 5th bit of value l of sub-block s.
    bits = np.unpackbits(blocks[:, 16:48], axis=1, bitorder="little").reshape(n, 32, 8)
    np.left_shift(bits, 4, out=bits)
    q |= bits.transpose(0, 2, 1)
    return _k_scaled(q, blocks)


_Q6_SHIFTS = np.array([0, 2, 4, 6], dtype=np.uint8)[:, None]


def _q6_k(blocks: np.ndarray) -> np.ndarray:
    n = blocks.shape[0]
    q = np.empty((n, 2, 2, 64), dtype=np.uint8)  # [block, half, nibble, byte]
    ql = blocks[:, :128].reshape(n, 2, 64)
    np.bitwise_and(ql, 0x0F, out=q[:, :, 0])
    np.right_shift(ql, 4, out=q[:, :, 1])
    hi = (blocks[:, 128:192].reshape(n, 2, 1, 32) >> _Q6_SHIFTS) & 0x03  # [n, 2, 4, 32]
    np.left_shift(hi, 4, out=hi)
    q = q.reshape(n, 2, 128)
    q |= hi.reshape(n, 2, 128)
    out = q.reshape(n, 16, 16).astype(np.float32)
    out -= np.float32(32)  # small integers: exact, as gguf-py's int8 subtraction
    sc = np.ascontiguousarray(blocks[:, 192:208]).view(np.int8).astype(np.float32)
    out *= (_f16(blocks, 208) * sc)[:, :, None]
    return out.reshape(n, 256)


_DEQUANT = {
    "Q4_0": _q4_0,
    "Q4_1": _q4_1,
    "Q5_0": _q5_0,
    "Q5_1": _q5_1,
    "Q8_0": _q8_0,
    "Q4_K": _q4_k,
    "Q5_K": _q5_k,
    "Q6_K": _q6_k,
}
