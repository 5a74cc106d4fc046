"""Weight-only int8 / int4 quantization of float (bf16 / fp32) checkpoints, done at load
(``--quantization int8|int4``): the weights are kept in 8 or 4 bits, activations stay float.

- ``Int8Weight``: symmetric, one fp32 scale per output channel (row):
  ``w[r, c] ~ scale[r] * q[r, c]``, ``q`` int8 in -127..127, ``scale[r] = max|w[r]| / 127``.
  The error of each value is at most ``scale[r] / 2``.
- ``Int4Weight``: per group of ``group_size`` (32, 64 or 128) consecutive input columns of one
  row, asymmetric: ``w ~ scale * q + low``, ``q`` in 0..15, ``scale = (max - min) / 15``,
  ``low = min`` of the group (symmetric=True: ``w ~ scale * (q - 8)``, ``scale = max|w| / 7``,
  ``low = -8 * scale``: the same arithmetic with a fixed zero). The error of each value is at
  most ``scale / 2`` of its group. Storage: two 4-bit values a byte (uint8 [out, in / 2],
  column ``2j`` in the low nibble of byte ``j``, ``2j + 1`` in the high one) and fp32
  ``scale`` / ``low`` [out, in / group_size].

Kernels (``matmul``): torch's own weight-only CPU kernels, ``torch._weight_int8pack_mm``
(int8 weight, per-channel scales) and ``torch._weight_int4pack_mm_for_cpu`` (int4 packed by
``torch._convert_weight_to_int4pack_for_cpu``, per-group scales and zeros) where they
measured faster than dequantizing and multiplying: on few rows (decode) in bf16. On many
rows (prefill), and in fp32 (torch's fp32 kernels are slow), the weight is dequantized in
row tiles straight to x's dtype and multiplied by ``F.linear`` (torch's kernels cost about a
pass over the weight per row: ``benchmarks/weight_only_kernels.py`` measured). The
thresholds are ``INT8_KERNEL_ROWS`` and ``INT4_KERNEL_ROWS``.

The int4 kernel's packed layout interleaves rows and columns, so the nibble storage above
stays the canonical form (``rows`` / ``cols`` / ``permute_rows`` / ``concat_rows`` edit it);
the packed copy is made on the first kernel call and kept (``nbytes`` counts it).

``--quantization int4`` (groups of 32, ``LOAD_GROUP_SIZE``) does not use ``Int4Weight``: it
writes GGML Q4_1 blocks (``quantize_blocks``: per 32 values an fp16 ``d`` and ``m`` and 16
bytes of nibbles, ``w ~ d * q + m``, the same asymmetric int4 in groups of 32) and keeps them
as a ``GGUFWeight``, the object a GGUF file's tensors load as: 5 bits a weight (an
``Int4Weight`` holds 6, and 12 once torch's packed copy and its bf16 scales exist), the
block kernels of ``quant.kernels`` (int8 activations on bf16 rows, float ones in fp32,
dequantized tiles for fp32 prefill and, on AMX-BF16 CPUs, bf16's; the deterministic mode's
row-invariant path), and splits on
block boundaries for tensor parallelism. The fp16 ``d`` / ``m`` cost ~0.05% of the error
(``benchmarks/results/int4_q4_1.md``). ``Int4Weight`` stays for groups of 64 / 128 (the
Python API, ``quant_quality.py``'s ``int4-g64``) and for a weight beyond fp16's range.

``--quantization int8`` likewise writes GGML Q8_0 blocks (per 32 values an fp16 ``d``, 32
int8, ``w ~ d * q``): 8.5 bits a weight against ``Int8Weight``'s 8.07, 0.4-0.7x its error
(a scale per 32 values, not per row), and faster from 4 rows up on the block kernels (equal
at 1 row): ``benchmarks/results/int4_q4_1.md``. ``Int8Weight`` stays for columns that are
not a multiple of 32 and weights beyond fp16's range.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F

from chunkserve.quant import formats
from chunkserve.quant.weight import GGUFWeight, QuantizedWeight

INT4_GROUP_SIZES = (32, 64, 128)
# Rows of x up to which torch's weight-only kernels beat dequantize + F.linear here, per
# x dtype (benchmarks/weight_only_kernels.py, 2-core Xeon, 1 thread, [5632 x 2048], a busy
# machine): in bf16 the int4 kernel takes 0.7 ms at M=1 (the bf16 matmul ~3 ms), 46 ms at
# M=16 (dequantizing: ~400 ms), 580 ms at M=256 (dequantizing: 370 ms); int8's 2.4 ms at
# M=1, 70 ms at M=16 (dequantizing: 77 ms). In fp32 torch's kernels are scalar loops (int4:
# 250 ms at M=1 against 110 ms dequantizing; never used).
INT8_KERNEL_ROWS = {torch.bfloat16: 16, torch.float32: 1}
INT4_KERNEL_ROWS = {torch.bfloat16: 64, torch.float32: 0}
# torch's int4 packing takes a multiple of this many rows (the kernel's copy is padded).
KERNEL_ROW_MULTIPLE = 16
# The dequantizing path works on row tiles of about this many values (2 MiB in bf16).
TILE_VALUES = 1 << 20
METHODS = ("int8", "int4")


def _as_float_matrix(w: torch.Tensor, name: str) -> torch.Tensor:
    if not isinstance(w, torch.Tensor) or w.dim() != 2:
        raise ValueError(f"{name}: weight-only quantization takes a 2-D [out, in] tensor")
    if not w.is_floating_point():
        raise ValueError(f"{name}: weight-only quantization takes a float tensor, got {w.dtype}")
    if w.shape[0] == 0 or w.shape[1] == 0:
        raise ValueError(f"{name}: an empty weight {tuple(w.shape)}")
    return w.detach().to(device="cpu", dtype=torch.float32)


def _index(index: np.ndarray | torch.Tensor, n: int, name: str) -> torch.Tensor:
    idx = torch.as_tensor(np.asarray(index), dtype=torch.int64).reshape(-1)
    if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= n):
        raise ValueError(f"{name}: row index outside 0:{n}")
    return idx


def _tiled(weight: Int8Weight | Int4Weight, x: torch.Tensor) -> torch.Tensor:
    """The dequantizing path: ``x @ w.T`` (x [T, in]) over row tiles of the weight, each
    dequantized straight into x's dtype (``_tile_linear``): a tile small enough to stay in
    cache between its dequantization and its product."""
    out_features, in_features = weight.shape
    tile = max(1, TILE_VALUES // in_features)
    if tile >= out_features:
        return weight._tile_linear(x, 0, out_features)
    out = x.new_empty(x.shape[0], out_features)
    for r0 in range(0, out_features, tile):
        r1 = min(r0 + tile, out_features)
        out[:, r0:r1] = weight._tile_linear(x, r0, r1)
    return out


class Int8Weight(QuantizedWeight):
    """int8 values ``q`` [out, in] and fp32 per-row ``scale`` [out] (module docstring)."""

    qtype = "int8"

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, name: str = "weight") -> None:
        if q.dtype != torch.int8 or q.dim() != 2:
            raise ValueError(f"{name}: int8 values must be an int8 [out, in] tensor")
        if scale.shape != (q.shape[0],):
            raise ValueError(f"{name}: scale of shape {tuple(scale.shape)} for {q.shape[0]} rows")
        self.q = q.contiguous()
        self.scale = scale.to(torch.float32).contiguous()
        self.name = name
        self.shape = (q.shape[0], q.shape[1])
        self._scales: dict[torch.dtype, torch.Tensor] = {}  # scale in x's dtype, per dtype

    @classmethod
    def quantize(cls, w: torch.Tensor, name: str = "weight") -> Int8Weight:
        """``w`` float [out, in] -> per-output-channel symmetric int8."""
        wf = _as_float_matrix(w, name)
        amax = wf.abs().amax(dim=1)
        scale = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
        q = torch.round(wf / scale[:, None]).clamp_(-127, 127).to(torch.int8)
        return cls(q, scale, name)

    @property
    def nbytes(self) -> int:
        extra = sum(
            s.numel() * s.element_size() for s in self._scales.values() if s is not self.scale
        )
        return self.q.numel() + 4 * self.scale.numel() + extra

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return (self.q.to(torch.float32) * self.scale[:, None]).to(dtype)

    def embedding(self, ids: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        flat = _index(ids, self.shape[0], self.name)
        rows = self.q.index_select(0, flat).to(torch.float32) * self.scale[flat, None]
        return rows.to(dtype).reshape(*ids.shape, self.shape[1])

    def rows(self, first: int, end: int) -> Int8Weight:
        self._check_range("rows", first, end, self.shape[0])
        return Int8Weight(self.q[first:end].clone(), self.scale[first:end].clone(), self.name)

    def cols(self, first: int, end: int) -> Int8Weight:
        # Scales are per row: any column range is a whole quantization unit.
        self._check_range("columns", first, end, self.shape[1])
        return Int8Weight(self.q[:, first:end].clone(), self.scale.clone(), self.name)

    def permute_rows(self, index: np.ndarray | torch.Tensor) -> Int8Weight:
        idx = _index(index, self.shape[0], self.name)
        return Int8Weight(self.q.index_select(0, idx), self.scale.index_select(0, idx), self.name)

    @classmethod
    def _concat_rows(cls, parts: Sequence[QuantizedWeight]) -> Int8Weight:
        ws = [p for p in parts if isinstance(p, Int8Weight)]
        return Int8Weight(
            torch.cat([p.q for p in ws]),
            torch.cat([p.scale for p in ws]),
            "+".join(p.name for p in ws),
        )

    def _scale_as(self, dtype: torch.dtype) -> torch.Tensor:
        scale = self._scales.get(dtype)
        if scale is None:
            scale = self._scales[dtype] = self.scale.to(dtype)
        return scale

    def _tile_linear(self, x: torch.Tensor, r0: int, r1: int) -> torch.Tensor:
        # The scale is per output channel: x @ (q * s).T = (x @ q.T) * s (int8 values are
        # exact in bf16).
        return F.linear(x, self.q[r0:r1].to(x.dtype)) * self._scale_as(x.dtype)[r0:r1]

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        self._check_x(x)
        x2 = x.reshape(-1, self.shape[1])
        if x2.shape[0] <= INT8_KERNEL_ROWS.get(x.dtype, 0):
            scale = self._scale_as(x.dtype)
            y = torch._weight_int8pack_mm(x2.contiguous(), self.q, scale)
        else:
            y = _tiled(self, x2)
        return y.reshape(*x.shape[:-1], self.shape[0])


class Int4Weight(QuantizedWeight):
    """4-bit values two a byte ``packed`` uint8 [out, in / 2], fp32 ``scale`` and ``low``
    [out, in / group_size] (module docstring)."""

    qtype = "int4"

    def __init__(
        self,
        packed: torch.Tensor,
        scale: torch.Tensor,
        low: torch.Tensor,
        group_size: int,
        name: str = "weight",
    ) -> None:
        check_group_size(group_size, name)
        if packed.dtype != torch.uint8 or packed.dim() != 2:
            raise ValueError(f"{name}: int4 values must be a uint8 [out, in / 2] tensor")
        out, in_features = packed.shape[0], packed.shape[1] * 2
        groups = (out, in_features // group_size)
        if in_features % group_size or scale.shape != groups or low.shape != groups:
            raise ValueError(
                f"{name}: int4 scales {tuple(scale.shape)} / zeros {tuple(low.shape)} for "
                f"{out} x {in_features} values in groups of {group_size}"
            )
        self.packed = packed.contiguous()
        self.scale = scale.to(torch.float32).contiguous()
        self.low = low.to(torch.float32).contiguous()
        self.group_size = group_size
        self.name = name
        self.shape = (out, in_features)
        self._kernel: torch.Tensor | None = None  # torch's packed layout, made on first use
        self._zeros: dict[torch.dtype, torch.Tensor] = {}  # [in / g, out, 2] scales and zeros
        self._group_params: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor]] = {}

    @classmethod
    def quantize(
        cls,
        w: torch.Tensor,
        group_size: int = 128,
        name: str = "weight",
        symmetric: bool = False,
    ) -> Int4Weight:
        """``w`` float [out, in] -> int4 in groups of ``group_size`` input columns
        (asymmetric min/max by default)."""
        check_group_size(group_size, name)
        wf = _as_float_matrix(w, name)
        out, in_features = wf.shape
        if in_features % group_size:
            raise ValueError(
                f"group_size: {name}'s {in_features} input features are not a multiple of "
                f"{group_size}"
            )
        g = wf.reshape(out, in_features // group_size, group_size)
        if symmetric:
            amax = g.abs().amax(dim=-1)
            scale = torch.where(amax > 0, amax / 7.0, torch.ones_like(amax))
            low = -8.0 * scale
        else:
            lo, hi = g.amin(dim=-1), g.amax(dim=-1)
            span = hi - lo
            scale = torch.where(span > 0, span / 15.0, torch.ones_like(span))
            low = lo
        q = torch.round((g - low[..., None]) / scale[..., None]).clamp_(0, 15).to(torch.uint8)
        q = q.reshape(out, in_features)
        return cls(q[:, 0::2] | (q[:, 1::2] << 4), scale, low, group_size, name)

    def _values(self) -> torch.Tensor:
        """The 4-bit values, uint8 [out, in] (0..15)."""
        q = torch.empty(self.shape, dtype=torch.uint8)
        q[:, 0::2] = self.packed & 15
        q[:, 1::2] = self.packed >> 4
        return q

    def _like(self, packed, scale, low) -> Int4Weight:
        return Int4Weight(packed, scale, low, self.group_size, self.name)

    @property
    def nbytes(self) -> int:
        extra = 0 if self._kernel is None else self._kernel.numel()
        extra += sum(z.numel() * z.element_size() for z in self._zeros.values())
        extra += sum(
            2 * s.numel() * s.element_size()
            for s, _ in self._group_params.values()
            if s is not self.scale
        )
        return self.packed.numel() + 4 * (self.scale.numel() + self.low.numel()) + extra

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        out, in_features = self.shape
        g = self._values().to(torch.float32).reshape(out, -1, self.group_size)
        w = g * self.scale[..., None] + self.low[..., None]
        return w.reshape(out, in_features).to(dtype)

    def embedding(self, ids: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        idx = _index(ids, self.shape[0], self.name)
        sel = self._like(
            self.packed.index_select(0, idx),
            self.scale.index_select(0, idx),
            self.low.index_select(0, idx),
        )
        return sel.dequantize(dtype).reshape(*ids.shape, self.shape[1])

    def rows(self, first: int, end: int) -> Int4Weight:
        self._check_range("rows", first, end, self.shape[0])
        return self._like(
            self.packed[first:end].clone(),
            self.scale[first:end].clone(),
            self.low[first:end].clone(),
        )

    def cols(self, first: int, end: int) -> Int4Weight:
        self._check_range("columns", first, end, self.shape[1])
        g = self.group_size
        if first % g or end % g:
            raise ValueError(
                f"{self.name}: columns {first}:{end} cut an int4 group of {g} values "
                f"(a split must fall on a multiple of group_size {g})"
            )
        return self._like(
            self.packed[:, first // 2 : end // 2].clone(),
            self.scale[:, first // g : end // g].clone(),
            self.low[:, first // g : end // g].clone(),
        )

    def permute_rows(self, index: np.ndarray | torch.Tensor) -> Int4Weight:
        idx = _index(index, self.shape[0], self.name)
        return self._like(
            self.packed.index_select(0, idx),
            self.scale.index_select(0, idx),
            self.low.index_select(0, idx),
        )

    @classmethod
    def _concat_rows(cls, parts: Sequence[QuantizedWeight]) -> Int4Weight | None:
        ws = [p for p in parts if isinstance(p, Int4Weight)]
        if len({p.group_size for p in ws}) != 1:
            return None
        return Int4Weight(
            torch.cat([p.packed for p in ws]),
            torch.cat([p.scale for p in ws]),
            torch.cat([p.low for p in ws]),
            ws[0].group_size,
            "+".join(p.name for p in ws),
        )

    def _groups_as(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``scale`` and ``low`` in ``dtype`` (cached per dtype)."""
        pair = self._group_params.get(dtype)
        if pair is None:
            pair = self._group_params[dtype] = (self.scale.to(dtype), self.low.to(dtype))
        return pair

    def _tile_linear(self, x: torch.Tensor, r0: int, r1: int) -> torch.Tensor:
        packed = self.packed[r0:r1]
        values = torch.stack((packed & 15, packed >> 4), dim=-1).to(x.dtype)
        scale, low = self._groups_as(x.dtype)
        w = values.view(r1 - r0, -1, self.group_size)
        w = torch.addcmul(low[r0:r1, :, None], w, scale[r0:r1, :, None])
        return F.linear(x, w.view(r1 - r0, self.shape[1]))

    def _kernel_args(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """torch's packed values and its [in / g, rows, 2] scales and zeros, ``rows`` padded
        to a multiple of ``KERNEL_ROW_MULTIPLE`` (the packing's requirement) with zero rows."""
        pad = -self.shape[0] % KERNEL_ROW_MULTIPLE
        if self._kernel is None:
            values = F.pad(self._values().to(torch.int32), (0, 0, 0, pad))
            self._kernel = torch._convert_weight_to_int4pack_for_cpu(values, 1)
        zeros = self._zeros.get(dtype)
        if zeros is None:
            # The kernel computes (q - 8) * scale + zero: zero = low + 8 * scale.
            sz = torch.stack((self.scale, self.low + 8.0 * self.scale), dim=-1)
            sz = F.pad(sz, (0, 0, 0, 0, 0, pad))
            zeros = self._zeros[dtype] = sz.transpose(0, 1).contiguous().to(dtype)
        return self._kernel, zeros

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        self._check_x(x)
        x2 = x.reshape(-1, self.shape[1])
        if x2.shape[0] <= INT4_KERNEL_ROWS.get(x.dtype, 0):
            packed, zeros = self._kernel_args(x.dtype)
            y = torch._weight_int4pack_mm_for_cpu(x2.contiguous(), packed, self.group_size, zeros)
            y = y[:, : self.shape[0]]
        else:
            y = _tiled(self, x2)
        return y.reshape(*x.shape[:-1], self.shape[0])


def check_group_size(group_size: object, name: str = "weight") -> int:
    if (
        isinstance(group_size, bool)
        or not isinstance(group_size, int)
        or group_size not in INT4_GROUP_SIZES
    ):
        raise ValueError(
            f"group_size: must be one of {INT4_GROUP_SIZES} (for {name}), got {group_size!r}"
        )
    return group_size


# The int4 group ``--quantization int4`` prefers: 32, as llama.cpp's Q4_0 / Q4_1 (this is
# round-to-nearest, no calibration). ``benchmarks/results/int4_group_sizes.md`` (1 thread,
# 2048x2048 and 5632x2048): torch's int4 kernel and the dequantized tiles take the same time
# at every group size (within 5%, the noise), the weight's error is 0.78x group 128's on
# normal values and 0.65x on heavy-tailed ones (Student-t(4)), and its bytes are 1.26x (11
# bits a weight against 8.75, the kernel's packed copy included). Perplexity
# (``quant_quality_int4_groups.md``, SmolLM2 135M): group 64 costs +33%; group 32 is exact
# there (that copy's weights are Q4_1's, groups of 32).
LOAD_GROUP_SIZE = 32


def load_group_size(in_features: int, preferred: int | None = None) -> int | None:
    """The int4 group for a weight of ``in_features`` columns quantized at load: the largest
    of ``INT4_GROUP_SIZES`` up to ``preferred`` (default ``LOAD_GROUP_SIZE``) that divides
    the columns, None when none does."""
    preferred = check_group_size(LOAD_GROUP_SIZE if preferred is None else preferred)
    fits = [g for g in INT4_GROUP_SIZES if g <= preferred and in_features % g == 0]
    return max(fits) if fits else None


# The GGML block formats ``quantize_blocks`` writes: (values a block, asymmetric, the q range).
BLOCK_FORMATS = {"Q4_0": (False, 0, 15), "Q4_1": (True, 0, 15), "Q8_0": (False, -127, 127)}
FP16_MAX = 65504.0


def _f16_toward(v: torch.Tensor, wrong: torch.Tensor, direction: float) -> torch.Tensor:
    """fp16 ``v`` with the entries where ``wrong`` moved one step toward ``direction``."""
    step = torch.nextafter(v, torch.full_like(v, direction))
    return torch.where(wrong, step, v)


def quantize_blocks(
    w: torch.Tensor, qtype: str = "Q4_1", name: str = "weight"
) -> GGUFWeight | None:
    """``w`` float [out, in] (in a multiple of 32) -> GGML blocks of 32 values as a
    ``GGUFWeight`` (the object a GGUF file's tensors load as: its kernels, row-invariant
    path, block-boundary splits): ``Q4_1`` (asymmetric, ``w ~ d * q + m``, q in 0..15),
    ``Q4_0`` (symmetric, ``w ~ d * (q - 8)``) or ``Q8_0`` (``w ~ d * q``, q in -127..127),
    ``d`` and ``m`` fp16. None where a block's ``d`` or ``m`` does not fit fp16 (|w| beyond
    65504: the caller keeps ``Int4Weight`` / ``Int8Weight``, fp32 scales).

    ``d`` and ``m`` are the fp32 choice (Q4_1: ``m = min``, ``d = (max - min) / 15``; Q4_0:
    ``d = max|w| / 7``; Q8_0: ``d = max|w| / 127``) rounded to the nearest fp16, then moved
    one fp16 step outward where the rounding left a value of the block outside the grid
    (``m`` above the min, ``d`` too small to reach the max), and each q is chosen with the
    fp16 ``d`` and ``m`` the kernels read. So every value's error is at most half its
    block's fp16 step (``d / 2``), as with fp32 scales, with a ``d`` within ~0.1% of the fp32
    one; values that are already such blocks (a dequantized Q4_1 model) come back bit for
    bit."""
    if qtype not in BLOCK_FORMATS:
        raise ValueError(
            f"{name}: quantize_blocks takes one of {tuple(BLOCK_FORMATS)}, got {qtype!r}"
        )
    asym, qmin, qmax = BLOCK_FORMATS[qtype]
    fmt = formats.get(qtype)
    wf = _as_float_matrix(w, name)
    out, in_features = wf.shape
    if in_features % fmt.block_values:
        raise ValueError(
            f"{name}: {in_features} input features are not a multiple of {qtype}'s "
            f"{fmt.block_values}-value blocks"
        )
    g = wf.reshape(out, in_features // fmt.block_values, fmt.block_values)
    lo, hi = g.amin(dim=-1), g.amax(dim=-1)
    if float(torch.maximum(hi.abs(), lo.abs()).max()) > FP16_MAX:
        return None
    if asym:
        m16 = lo.to(torch.float16)
        m16 = _f16_toward(m16, m16.float() > lo, float("-inf"))  # m <= min
        m = m16.float()
        d16 = ((hi - m) / qmax).to(torch.float16)
        d16 = _f16_toward(d16, d16.float() * qmax + m < hi, float("inf"))  # reaches max
        top = hi
    else:
        top = torch.maximum(hi, -lo)  # max |w|
        m = None
        steps = qmax if qmin < 0 else 7
        d16 = (top / steps).to(torch.float16)
        d16 = _f16_toward(d16, d16.float() * steps < top, float("inf"))
    if not bool(torch.isfinite(d16).all()):
        return None
    d = d16.float()
    safe = torch.where(d > 0, d, torch.ones_like(d))[..., None]
    if asym:
        q = torch.round((g - m[..., None]) / safe).clamp_(qmin, qmax)
    elif qtype == "Q4_0":
        q = (torch.round(g / safe) + 8).clamp_(qmin, qmax)
    else:
        q = torch.round(g / safe).clamp_(qmin, qmax)
    nb = g.shape[1]
    head = [d16.view(torch.uint8).reshape(out, nb, 2)]
    if asym:
        head.append(m16.view(torch.uint8).reshape(out, nb, 2))
    if qtype == "Q8_0":
        body = q.to(torch.int8).view(torch.uint8)
    else:  # byte j: value j in the low nibble, value j + 16 in the high one
        q = q.to(torch.uint8)
        body = q[..., :16] | (q[..., 16:] << 4)
    data = torch.cat([*head, body], dim=-1).reshape(out, nb * fmt.block_bytes)
    return GGUFWeight(data, fmt, name)


def quantize_weight(
    w: torch.Tensor, method: str, name: str = "weight", group_size: int = 128
) -> QuantizedWeight:
    """``w`` [out, in] quantized by ``method`` ("int8" or "int4", in groups of
    ``group_size``); a ValueError naming ``quantization`` for another method. int8 is GGML
    Q8_0 and int4 in groups of 32 (the load's, ``LOAD_GROUP_SIZE``) GGML Q4_1
    (``quantize_blocks``: ``GGUFWeight``s at 8.5 / 5 bits a weight on our block kernels);
    int8 of columns not a multiple of 32, int4 in other groups, or a weight beyond fp16's
    range: ``Int8Weight`` / ``Int4Weight``."""
    if method == "int8":
        if w.dim() == 2 and w.shape[-1] % 32 == 0:
            q = quantize_blocks(w, "Q8_0", name)
            if q is not None:
                return q
        return Int8Weight.quantize(w, name)
    if method == "int4":
        if group_size == 32:
            q = quantize_blocks(w, "Q4_1", name)
            if q is not None:
                return q
        return Int4Weight.quantize(w, group_size, name)
    raise ValueError(f"quantization: must be one of {METHODS}, got {method!r}")
