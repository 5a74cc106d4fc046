"""Quantized HF checkpoints, dequantized as they load (on the CPU, to the model's dtype):
the formats the published mixture-of-experts models ship in. ``config.json``'s
``quantization_config.quant_method`` says which; any other method is a ValueError naming it.

- **MXFP4** (``"mxfp4"``, GPT-OSS's experts; the OCP microscaling format): a tensor ``X`` is
  stored as ``X_blocks`` (uint8 [..., G, 16]: each byte two E2M1 4-bit values, the low
  nibble first, so a group of 32 values a row of 16 bytes) and ``X_scales`` (uint8 [..., G]:
  each group's E8M0 scale, 2 ** (s - 127)). E2M1 is sign, 2 exponent bits, 1 mantissa bit:
  codes 0-7 are 0, 0.5, 1, 1.5, 2, 3, 4, 6 and codes 8-15 their negatives. The blocks hold
  each expert's matrix as [out, in] (the 32-value groups run along ``in``); the HF
  parameter ``X`` is [in, out] (``x @ X``), so the dequantized tensor is transposed back, as
  transformers' ``dequantize`` does (``mlp.experts.gate_up_proj``: [E, H, 2 * I]).
- **Block FP8** (``"fp8"`` with ``weight_block_size`` [bm, bn], DeepSeek-V3 / Qwen3-FP8): a
  weight ``X.weight`` is float8 (e4m3) with ``X.weight_scale_inv`` (fp32 [ceil(M / bm),
  ceil(N / bn)]): the weight is ``fp8 * scale`` over each bm x bn block (the edge blocks
  partial). Tensors the config leaves unquantized (embeddings, norms, routers) load as they
  are. Static activation scales (``activation_scheme`` "static") are refused: we compute
  with the dequantized weights and unquantized activations, which is what "dynamic" means
  up to the activations' own rounding.

The two tensors of a pair may come in either order, from different shards: the first is
held until its partner arrives; one left without its partner is a ValueError naming it.

Tensor parallel: a rank keeps a slice of most tensors (``layers.Target``: ``tensor[src]``,
a tuple of slices). ``dequantize_stream(lazy=True)`` (the loader's) yields a quantized
tensor as a ``LazyDequant``, whose ``[src]`` dequantizes only the blocks the slice touches
(MXFP4: the rows it selects and the 32-value groups its input range covers; FP8: the rows
and columns it selects with their blocks' scales), so a rank dequantizes its share of the
checkpoint, not the whole of it; the loader's raw tensors are ``lazy.LazyTensor``s, so it
reads only those blocks from the file too (``benchmarks/tp_dequant.py`` measures both).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import torch

logger = logging.getLogger(__name__)

QUANT_METHODS = ("mxfp4", "fp8")
# E2M1 values of the 16 codes (sign bit 3).
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
FP8_DTYPES = (torch.float8_e4m3fn,)


def quant_method(cfg: dict[str, Any]) -> str | None:
    """The checkpoint's quantization method from ``config.json`` (None: unquantized); one we
    do not load is a ValueError naming it."""
    q = cfg.get("quantization_config")
    if not q:
        return None
    method = q.get("quant_method")
    if method not in QUANT_METHODS:
        raise ValueError(
            f"model: config.json: quantization_config.quant_method {method!r} is not "
            f"supported (supported: {', '.join(QUANT_METHODS)}, dequantized at load)"
        )
    if method == "fp8":
        block = q.get("weight_block_size")
        if not (
            isinstance(block, list)
            and len(block) == 2
            and all(isinstance(b, int) and b > 0 for b in block)
        ):
            raise ValueError(
                f"model: config.json: quantization_config.weight_block_size {block!r}: only "
                f"block-wise FP8 ([rows, cols] per scale, e.g. [128, 128]) is supported"
            )
        if q.get("activation_scheme", "dynamic") != "dynamic":
            raise ValueError(
                f"model: config.json: quantization_config.activation_scheme "
                f"{q['activation_scheme']!r} is not supported (only 'dynamic')"
            )
        fmt = q.get("fmt", "e4m3")
        if fmt != "e4m3":
            raise ValueError(
                f"model: config.json: quantization_config.fmt {fmt!r} is not supported "
                f"(only 'e4m3')"
            )
    return method


def weight_block_size(cfg: dict[str, Any]) -> tuple[int, int]:
    bm, bn = cfg["quantization_config"]["weight_block_size"]
    return int(bm), int(bn)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """fp32 [..., G * 32] from MXFP4 ``blocks`` [..., G, 16] and ``scales`` [..., G]."""
    _check_mxfp4(blocks, scales)
    lut = torch.tensor(E2M1, dtype=torch.float32)
    values = torch.stack((lut[(blocks & 0x0F).long()], lut[(blocks >> 4).long()]), dim=-1)
    values = values.flatten(-2)  # [..., G, 32]: low nibble, high nibble, ...
    exps = scales.to(torch.int32) - 127
    values = torch.ldexp(values, exps[..., None].float())
    return values.flatten(-2)


def dequantize_fp8_blocks(
    weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]
) -> torch.Tensor:
    """fp32 [M, N] from a float8 ``weight`` [M, N] and its per-block scales [ceil(M / bm),
    ceil(N / bn)]."""
    _check_fp8(weight, scale_inv, block)
    bm, bn = block
    m, n = weight.shape[-2:]
    s = scale_inv.float().repeat_interleave(bm, dim=-2)[..., :m, :]
    s = s.repeat_interleave(bn, dim=-1)[..., :n]
    return weight.float() * s


class LazyDequant:
    """A quantized checkpoint tensor, dequantized only where it is read: ``shape`` is the
    dequantized tensor's; ``t[src]`` (a tuple of slices, as ``layers.Target`` reads a
    checkpoint tensor) is ``dequantized[src]`` in ``dtype``, computed from the blocks ``src``
    touches only. The pair's shapes are checked when it is made."""

    def __init__(
        self,
        method: str,
        parts: dict[str, torch.Tensor],
        dtype: torch.dtype,
        block: tuple[int, int] = (0, 0),
    ) -> None:
        self.method, self.dtype, self.block = method, dtype, block
        if method == "mxfp4":
            self.blocks, self.scales = parts["blocks"], parts["scales"]
            _check_mxfp4(self.blocks, self.scales)
            *lead, out, groups, _ = self.blocks.shape
            self.shape = torch.Size((*lead, groups * 32, out))  # [..., in, out]
        else:
            self.weight, self.scale = parts["weight"], parts["scale"]
            _check_fp8(self.weight, self.scale, block)
            self.shape = self.weight.shape

    def __getitem__(self, src: tuple[slice, ...]) -> torch.Tensor:
        if not isinstance(src, tuple):
            src = (src,)
        if not all(isinstance(s, slice) for s in src) or len(src) > len(self.shape):
            raise TypeError(f"LazyDequant: index by a tuple of slices, got {src!r}")
        src = (*src, *[slice(None)] * (len(self.shape) - len(src)))
        out_shape = torch.empty(self.shape, device="meta")[src].shape
        if out_shape.numel() == 0:
            return torch.empty(out_shape, dtype=self.dtype)
        if self.method == "mxfp4":
            return self._mxfp4(src).to(self.dtype)
        return self._fp8(src).to(self.dtype)

    def _mxfp4(self, src: tuple[slice, ...]) -> torch.Tensor:
        *lead, rows, cols = src  # rows: the input dim (grouped by 32), cols: the output dim
        start, stop, step = rows.indices(self.shape[-2])
        g0, g1 = start // 32, -(-stop // 32)
        sel = (*lead, cols, slice(g0, g1))
        values = dequantize_mxfp4(self.blocks[sel], self.scales[sel]).transpose(-1, -2)
        return values[..., start - 32 * g0 : stop - 32 * g0 : step, :]

    def _fp8(self, src: tuple[slice, ...]) -> torch.Tensor:
        *lead, rows, cols = src
        bm, bn = self.block
        m, n = self.shape[-2:]
        r = torch.arange(m)[rows] // bm
        c = torch.arange(n)[cols] // bn
        scale = self.scale[(*lead,)].float().index_select(-2, r).index_select(-1, c)
        return self.weight[src].float() * scale

    def full(self) -> torch.Tensor:
        return self[(slice(None),)]


def _check_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> None:
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(
            f"MXFP4: blocks and scales must be uint8, got {blocks.dtype}, {scales.dtype}"
        )
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != 16:
        raise ValueError(
            f"MXFP4: blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} do not "
            f"match ([..., G, 16] and [..., G])"
        )


def _check_fp8(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> None:
    bm, bn = block
    m, n = weight.shape[-2:]
    want = (-(-m // bm), -(-n // bn))
    if tuple(scale_inv.shape[-2:]) != want:
        raise ValueError(
            f"FP8: scales {tuple(scale_inv.shape)} do not match a {tuple(weight.shape)} weight "
            f"in {bm} x {bn} blocks (expected {want})"
        )


def dequantize_stream(
    items: Iterator[tuple[str, torch.Tensor]],
    method: str,
    dtype: torch.dtype,
    cfg: dict[str, Any],
    lazy: bool = False,
) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors (``items``: name, raw tensor) with each quantized pair
    replaced by its dequantized tensor in ``dtype`` (see the module docstring); ``lazy``: by
    a ``LazyDequant`` (dequantized where a rank reads it)."""
    held: dict[str, dict[str, torch.Tensor]] = {}
    count = 0
    block = weight_block_size(cfg) if method == "fp8" else (0, 0)
    logger.info(
        "model: %s checkpoint: quantized weights dequantized to %s at load, on the CPU",
        method,
        str(dtype).removeprefix("torch."),
    )
    for name, t in items:
        pair = _pair(name, t, method)
        if pair is None:
            yield name, t.to(dtype)
            continue
        key, part = pair
        held.setdefault(key, {})[part] = t
        parts = held[key]
        if len(parts) < 2:
            continue
        del held[key]
        try:
            w = LazyDequant(method, parts, dtype, block)
        except ValueError as exc:
            raise ValueError(f"model: {method} checkpoint: {key!r}: {exc}") from None
        count += 1
        yield key, w if lazy else w.full()  # type: ignore[misc]
    if held:
        key = sorted(held)[0]
        have = sorted(held[key])
        raise ValueError(
            f"model: {method} checkpoint: {key!r} has only its {have[0]} tensor "
            f"({len(held)} incomplete)"
        )
    logger.info("model: %s checkpoint: %d tensors dequantized", method, count)


def _pair(name: str, t: torch.Tensor, method: str) -> tuple[str, str] | None:
    """(the dequantized tensor's name, which part) for a quantized pair's tensor, else None."""
    if method == "mxfp4":
        for part in ("blocks", "scales"):
            if name.endswith("_" + part):
                return name[: -len(part) - 1], part
        return None
    if name.endswith(".weight_scale_inv"):
        return name[: -len("_scale_inv")], "scale"
    if name.endswith(".weight") and t.dtype in FP8_DTYPES:
        return name, "weight"
    if t.dtype.is_floating_point and t.element_size() == 1:  # float8 of any kind
        raise ValueError(
            f"model: fp8 checkpoint: {name!r} is {t.dtype} and not an e4m3 weight with scales"
        )
    return None
