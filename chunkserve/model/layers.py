"""The parts decoder families share: parallel linear layers that load their own shard of a
checkpoint tensor, vocabulary-parallel embedding and LM head, RMSNorm variants, rotary
embeddings (default, linear, dynamic, llama3, yarn, longrope; partial rotary), activations,
the gated MLP and the attention module that calls an ``AttentionBackend``.

Numerics follow HF transformers' eager path: norms in fp32, cast back before the weight
multiply (Gemma's ``1 + w`` norm: the multiply in fp32, then cast).

Weight loading: every layer that holds a checkpoint tensor says, for each HF name it takes,
where the tensor goes (a parameter, or a row slice of a fused one), which part of the
checkpoint tensor this tensor-parallel rank keeps, and the tensor's full shape in the
checkpoint (``Target``). ``DecoderLM.load_weights`` streams the checkpoint through them.

Quantized weights (a GGUF kept in its bits, ``quant``): the linear layers, the embedding,
the LM head (and ``moe``'s experts) own a ``WeightSlot``: their float weight is not allocated
until a float tensor arrives, and a quantized one is kept as a ``QuantizedWeight`` (its rank's
rows, or its block-aligned columns: a cut inside a block is a ValueError naming the tensor),
multiplied by ``linear`` through its kernel. Nothing outside the model knows, but for
``DecoderLM.weights_format`` (the step-time profile is kept per format).

Tensor parallel (``distributed.shard``): column-parallel layers hold their rank's output rows
(its heads, its MLP columns), row-parallel ones their input columns and sum the ranks' partial
outputs (an all-reduce); norms are replicated, except a norm over all heads' q/k (OLMo 2),
whose sum of squares is summed over the ranks.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from chunkserve.attention.base import AttentionSpec
from chunkserve.config import HIDDEN_ACTS, ROPE_TYPES, ModelConfig, rope_type
from chunkserve.distributed.shard import ShardPlan
from chunkserve.quant.weight import QuantizedWeight, concat_rows

if TYPE_CHECKING:
    from chunkserve.attention.base import AttentionBackend, BatchLayout
    from chunkserve.distributed.group import TPGroup

logger = logging.getLogger(__name__)


class Target(NamedTuple):
    """Where one checkpoint tensor goes: ``dst`` (a parameter or a view of one) takes
    ``tensor[src]``; ``shape`` is the tensor's full shape in the checkpoint. ``slot``: the
    layer's weight when it may arrive quantized (``WeightSlot``; ``dst`` is then a view of a
    weight not yet allocated, and the slot takes part ``part``, quantized or not)."""

    dst: torch.Tensor
    src: tuple[slice, ...]
    shape: tuple[int, ...]
    slot: WeightSlot | None = None
    part: int = 0

    def take(self, tensor: torch.Tensor) -> None:
        """Copy the float tensor's ``tensor[src]`` into place (allocating a deferred weight)."""
        dst = self.dst if self.slot is None else self.slot.float_part(self.part)
        if dst.is_meta and dst.numel():
            raise RuntimeError("model: a float weight copied into an unallocated parameter")
        dst.copy_(tensor[self.src])


WHOLE = (slice(None),)


def _param(*shape: int, dtype: torch.dtype, device: torch.device) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)


# ---- weights that may stay quantized -------------------------------------------------------
# A weight of a linear layer, the embedding or the LM head [out, in]: a float tensor, a
# ``QuantizedWeight`` (kept in the checkpoint's bits), or a list of those (a fused layer whose
# parts arrived in different quantized types: one matmul per part, then a concat).
Weight = torch.Tensor | QuantizedWeight | list[QuantizedWeight]


class WeightSlot:
    """The weight of a layer (``module.weight``, ``module.qweight``; other attribute names
    ``attr`` / ``qattr``) that the checkpoint may give quantized, in ``sizes`` row parts
    (fused Q/K/V, gate/up; one part otherwise) of ``cols`` columns. ``stack``: the weight is
    a stack of that many matrices [stack, rows / stack, cols] (a mixture's experts), the
    parts running through them in order, and its quantized form one weight per matrix.

    The model is built before the weights stream in, so the float parameter is not
    allocated then: it is a meta tensor (its views say the targets' shapes) until a float
    part arrives (``float_part``: the parameter is allocated, ``zeros`` for the padded
    vocabulary rows of an embedding) or the model gets random weights (``materialize``).
    Quantized parts are kept as they come (``put``); when the load ends (``finish``) a layer
    whose parts all came quantized holds them as ``qweight`` (one weight, or one per part
    when their types differ) and no float weight at all; parts of both kinds (rare: a file
    mixing float and quantized parts of one fused layer) are dequantized into the float
    weight, with a log line."""

    def __init__(
        self,
        module: nn.Module,
        sizes: list[int],
        cols: int,
        dtype: torch.dtype,
        device: torch.device,
        *,
        rows: int | None = None,
        zeros: bool = False,
        attr: str = "weight",
        qattr: str = "qweight",
        stack: int | None = None,
    ) -> None:
        self.module, self.sizes, self.cols = module, sizes, cols
        self.rows = sum(sizes) if rows is None else rows  # padded rows (a vocabulary shard)
        self.dtype, self.device, self.zeros = dtype, device, zeros
        self.attr, self.qattr, self.stack = attr, qattr, stack
        self.shape = (self.rows, cols) if stack is None else (stack, self.rows // stack, cols)
        self.quantized: dict[int, QuantizedWeight] = {}
        self.has_float = False
        # A layer whose weight is read as a float tensor by its family's maths (DeepSeek's
        # kv_b, absorbed into the queries) sets this False: quantized parts are dequantized.
        self.accepts_quantized = True
        setattr(
            module,
            attr,
            nn.Parameter(torch.empty(self.shape, dtype=dtype, device="meta"), requires_grad=False),
        )
        setattr(module, qattr, None)

    @property
    def weight(self) -> torch.Tensor | None:
        return getattr(self.module, self.attr)

    @property
    def qweight(self) -> Weight | None:
        return getattr(self.module, self.qattr)

    @property
    def deferred(self) -> bool:
        return self.weight is not None and self.weight.is_meta

    def materialize(self) -> torch.Tensor:
        """The float weight, allocated on first use."""
        if self.deferred:
            make = torch.zeros if self.zeros else torch.empty
            param = make(self.shape, dtype=self.dtype, device=self.device)
            setattr(self.module, self.attr, nn.Parameter(param, requires_grad=False))
        return self.weight

    def _part_rows(self, part: int) -> slice:
        first = sum(self.sizes[:part])
        return slice(first, first + self.sizes[part])

    def float_part(self, part: int) -> torch.Tensor:
        """Where part ``part`` goes when it arrives as a float tensor."""
        self.has_float = True
        return self.materialize().view(-1, self.cols)[self._part_rows(part)]

    def put(self, part: int, weight: QuantizedWeight) -> None:
        if tuple(weight.shape) != (self.sizes[part], self.cols):
            raise ValueError(
                f"model: a quantized part of shape {tuple(weight.shape)} for a weight part of "
                f"{(self.sizes[part], self.cols)}"
            )
        self.quantized[part] = weight

    def finish(self) -> None:
        """After the load: hold the quantized parts (see the class docstring)."""
        if not self.quantized:
            return
        parts = [self.quantized[i] for i in range(len(self.sizes)) if i in self.quantized]
        if self.has_float or len(parts) != len(self.sizes):
            logger.info(
                "model: %s has float and quantized parts: dequantized (%s)",
                type(self.module).__name__,
                ", ".join(sorted({p.qtype for p in parts})),
            )
            weight = self.materialize().view(-1, self.cols)
            for i, q in self.quantized.items():
                weight[self._part_rows(i)].copy_(q.dequantize(self.dtype))
            self.quantized.clear()
            return
        if self.stack is None:
            held: Weight | list[Weight] = _joined(parts)
        else:
            per = len(parts) // self.stack
            held = [_joined(parts[i : i + per]) for i in range(0, len(parts), per)]
        setattr(self.module, self.qattr, held)
        setattr(self.module, self.attr, None)
        self.quantized.clear()
        for part in quantized_parts(held):  # repacked for the kernels now, not in the first step
            part.prepare(self.dtype, self.device)


def quantized_parts(weight: Weight | list | None) -> list[QuantizedWeight]:
    """The quantized weights a layer's weight holds (none for a float one)."""
    if isinstance(weight, list):
        return [w for part in weight for w in quantized_parts(part)]
    return [weight] if isinstance(weight, QuantizedWeight) else []


def _joined(parts: list[QuantizedWeight]) -> Weight:
    """Parts stacked by rows as one weight where they share a type, else the list."""
    if len(parts) == 1:
        return parts[0]
    whole = concat_rows(parts)
    return parts if whole is None else whole


def take_quantized(weight: QuantizedWeight, src: tuple[slice, ...], name: str) -> QuantizedWeight:
    """``weight[src]`` of a quantized checkpoint tensor, ``src`` a target's (a row range:
    a column-parallel rank's rows, a fused part; a column range: a row-parallel rank's
    columns, which must fall on the quantization blocks' boundaries: else a ValueError
    naming ``name`` and the block size)."""
    for axis, cut in enumerate(src):
        if cut.step not in (None, 1):
            raise ValueError(f"model: weight {name!r}: a strided cut of a quantized weight")
        n = weight.shape[axis]
        first, end, _ = cut.indices(n)
        if (first, end) == (0, n):
            continue
        if axis == 0:
            weight = weight.rows(first, end)
            continue
        try:
            weight = weight.cols(first, end)
        except ValueError as exc:
            raise ValueError(
                f"model: weight {name!r}: this tensor-parallel rank's columns {first}..{end} "
                f"cut its {weight.qtype} blocks ({exc}); use another tensor_parallel_size or "
                f"dequantize the file's weights at load"
            ) from None
    return weight.owned()  # a weight over a file's map: only what this rank keeps, copied


def weight_nbytes(weight: Weight | None) -> int:
    """Resident bytes of a layer's weight (0 for a float weight not yet allocated)."""
    if weight is None:
        return 0
    if isinstance(weight, list):  # parts, or a stack's matrices
        return sum(weight_nbytes(w) for w in weight)
    if isinstance(weight, QuantizedWeight):
        return weight.nbytes
    return 0 if weight.is_meta else weight.nbytes


def weight_format(weight: Weight | None) -> set[str]:
    """The quantized types of a layer's weight (empty for a float one)."""
    if isinstance(weight, list):
        return set().union(*(weight_format(w) for w in weight))
    if isinstance(weight, QuantizedWeight):
        return {weight.qtype}
    return set()


def _row_invariant(weight: Weight, x: torch.Tensor) -> bool:
    """A quantized weight (or parts) whose kernel computes every row alone with the same
    arithmetic whatever the row count: the deterministic mode needs no row tiling for it."""
    parts = weight if isinstance(weight, list) else [weight]
    return all(isinstance(w, QuantizedWeight) and w.row_invariant(x) for w in parts)


def _matmul(
    x: torch.Tensor, weight: Weight, bias: torch.Tensor | None, row_invariant: bool = False
) -> torch.Tensor:
    """``x W^T + b`` for a float, quantized or per-part quantized weight (``row_invariant``:
    a quantized weight's row-invariant kernel, ``_row_invariant``)."""
    if isinstance(weight, torch.Tensor):
        return F.linear(x, weight, bias)
    if isinstance(weight, QuantizedWeight):
        y = weight.matmul_row_invariant(x) if row_invariant else weight.matmul(x)
        return y if bias is None else y + bias
    parts = weight
    ys = [w.matmul_row_invariant(x) if row_invariant else w.matmul(x) for w in parts]
    y = ys[0] if len(ys) == 1 else torch.cat(ys, dim=-1)
    return y if bias is None else y + bias


# ---- norms ---------------------------------------------------------------------------------
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


class RMSNorm(nn.Module):
    """RMSNorm over the last dimension. ``offset``: Gemma's variant, ``x * (1 + w)`` in fp32.
    ``fp32_weight``: the weight multiplies the fp32 normed values before the cast (GPT-OSS's,
    whose norms transformers keeps in fp32), not the values cast back first (Llama's).
    ``group`` with ``full_width``: the normed dimension is split over tensor-parallel ranks
    (a norm over all heads' q or k, OLMo 2): the sum of squares is summed over them."""

    def __init__(
        self,
        width: int,
        eps: float,
        dtype: torch.dtype,
        device: torch.device,
        *,
        offset: bool = False,
        fp32_weight: bool = False,
        full_width: int | None = None,
        group: TPGroup | None = None,
        weight_slice: slice | None = None,
    ) -> None:
        super().__init__()
        self.weight = _param(width, dtype=dtype, device=device)
        self.eps = eps
        self.offset = offset
        self.fp32_weight = fp32_weight
        self.full_width = full_width or width
        self.group = group
        self.weight_slice = weight_slice or slice(None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.group is not None:
            xf = x.float()
            ss = self.group.all_reduce(xf.pow(2).sum(-1, keepdim=True))
            xf = xf * torch.rsqrt(ss / self.full_width + self.eps)
        elif self.offset or self.fp32_weight:
            xf = x.float()
            xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        else:
            return rms_norm(x, self.weight, self.eps)
        if self.offset:
            return (xf * (1.0 + self.weight.float())).to(x.dtype)
        if self.fp32_weight:
            return (xf * self.weight.float()).to(x.dtype)
        return self.weight * xf.to(x.dtype)

    def targets(self, name: str) -> dict[str, Target]:
        return {name: Target(self.weight, (self.weight_slice,), (self.full_width,))}


# ---- rotary embeddings ---------------------------------------------------------------------
def rope_inv_freq(
    config: ModelConfig, max_positions: int | None = None
) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [rotary_dim // 2] in fp32 and the factor cos/sin are scaled by
    (yarn's attention factor; 1 otherwise), with HF's rope scaling variants. ``dynamic``
    (NTK) is fixed at ``max_positions``: HF's values for a sequence of that length (HF's
    default frequencies while it is within ``max_position_embeddings``)."""
    dim = config.rotary_dim
    base = config.rope_theta
    exps = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    inv_freq = 1.0 / (base**exps)
    scaling = config.rope_scaling or {}
    kind = rope_type(scaling)
    if config.rope_freq_factors is not None:  # llama.cpp's rope_freqs (default type only)
        return inv_freq / torch.tensor(config.rope_freq_factors, dtype=torch.float32), 1.0
    if kind == "default":
        return inv_freq, 1.0
    if kind == "longrope":
        return _longrope(config, scaling, base, exps)
    factor = float(scaling["factor"])
    if kind == "linear":
        return inv_freq / factor, 1.0
    if kind == "dynamic":
        orig = config.max_position_embeddings
        length = max_positions or orig
        if length <= orig:
            return inv_freq, 1.0
        base = base * ((factor * length / orig) - (factor - 1)) ** (dim / (dim - 2))
        return 1.0 / (base**exps), 1.0
    if kind == "llama3":
        low = float(scaling.get("low_freq_factor", 1.0))
        high = float(scaling.get("high_freq_factor", 4.0))
        old_len = float(scaling["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, smoothed, scaled), 1.0
    if kind == "yarn":
        return _yarn(config, scaling, factor, dim, base, exps)
    raise ValueError(f"rope_scaling: type {kind!r} is not supported (supported: {ROPE_TYPES})")


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(
    config: ModelConfig, scaling: dict, factor: float, dim: int, base: float, exps: torch.Tensor
) -> tuple[torch.Tensor, float]:
    """YaRN: frequencies blended between interpolated (low) and extrapolated (high) by a
    linear ramp over the dimensions whose wavelengths fall between ``beta_slow`` and
    ``beta_fast`` rotations of the original context; cos/sin scaled by the attention factor."""
    orig = scaling.get("original_max_position_embeddings") or config.max_position_embeddings
    attention_factor = scaling.get("attention_factor")
    mscale, mscale_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if attention_factor is None:
        if mscale and mscale_all:
            attention_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all)
        else:
            attention_factor = _yarn_mscale(factor)
    beta_fast = scaling.get("beta_fast") or 32
    beta_slow = scaling.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(orig / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolate = 1 - ramp
    pos_freqs = base**exps
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolate) + (1.0 / pos_freqs) * extrapolate
    return inv_freq, float(attention_factor)


def _longrope(
    config: ModelConfig, scaling: dict, base: float, exps: torch.Tensor
) -> tuple[torch.Tensor, float]:
    """LongRoPE (Phi-3.5 / 4): each frequency divided by its own factor, ``short_factor``'s
    or ``long_factor``'s (``config.longrope_long``); cos/sin scaled by ``attention_factor``,
    by default sqrt(1 + ln(s) / ln(original)) with s = ``factor`` or, as Phi-3's configs
    leave it out, max_position_embeddings / original_max_position_embeddings (1 if s <= 1)."""
    orig = int(scaling["original_max_position_embeddings"])
    factor = scaling.get("factor")
    if factor is None:
        factor = config.max_position_embeddings / orig
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(orig))
    key = "long_factor" if config.longrope_long else "short_factor"
    ext = torch.tensor(scaling[key], dtype=torch.float32)
    return 1.0 / (ext * base**exps), float(attention_factor)


class RotaryEmbedding(nn.Module):
    """Precomputed cos/sin tables [max_positions, rotary_dim] indexed by absolute position
    (HF's half-split "rotate_half" layout). ``rotary_dim`` < head_dim: partial rotary, the
    first ``rotary_dim`` dimensions of each head rotate."""

    def __init__(self, config: ModelConfig, max_positions: int, device: torch.device) -> None:
        super().__init__()
        inv_freq, attention_factor = rope_inv_freq(config, max_positions)
        pos = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(pos, inv_freq)  # [P, rd/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [P, rd]
        self.rotary_dim = config.rotary_dim
        self.partial = config.rotary_dim < config.head_dim
        self.register_buffer("cos", (emb.cos() * attention_factor).to(device), persistent=False)
        self.register_buffer("sin", (emb.sin() * attention_factor).to(device), persistent=False)

    def forward(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # [T, 1, rd]: broadcast over heads.
        return (
            self.cos[positions].to(dtype)[:, None, :],
            self.sin[positions].to(dtype)[:, None, :],
        )


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def apply_partial_rope(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int
) -> torch.Tensor:
    return torch.cat((apply_rope(x[..., :rotary_dim], cos, sin), x[..., rotary_dim:]), dim=-1)


# ---- activations ---------------------------------------------------------------------------
def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu_pytorch_tanh": _gelu_tanh,
    "gelu_tanh": _gelu_tanh,
}
assert set(ACTIVATIONS) == set(HIDDEN_ACTS)


# ---- batch-invariant matmuls (the deterministic mode) --------------------------------------
class RowTiling(NamedTuple):
    """How the deterministic mode runs a matmul so that a row's result does not depend on the
    batch it is in: the rows padded with zeros to a multiple of ``multiple`` and multiplied
    in slices of at most ``most`` rows (a multiple of ``multiple``).

    Why: oneDNN picks its kernel and blocking by the number of rows M (and the threads); on
    this CPU a row's bf16 result differs between M = 1, 33, 100 and 2,048 even though row 0's
    does not, and an fp32 row between M = 1, 2-15 and 16 or more. Calls of exactly 64 rows
    computed every row the same, at any position, for every weight shape of the embedded
    model (its 49,152-row LM head too, and the 29,127- and 20,025-row tiles its quantized
    head is dequantized in), at 1 and at 2 threads, and bf16's the same at 1 and 2 threads;
    calls of 128 rows computed every row as the 64-row calls do, at any position, at 1 and 2
    threads, in bf16 and fp32 (re-measured on the Xeon with AMX-BF16, 27 Nov): hence slices
    of 128 rows with a last one of 64 (a 2,048-row prefill's matmuls ~1.5x faster than in
    64-row calls). Larger slices are not safe: 256-row calls of the down projection
    (K = 1,536) differ between 1 and 2 threads in bf16, 512-row calls of the QKV and down
    projections from 64-row calls at 2 threads. fp32's down projection also differs between
    1 and 2 threads (even in 64-row calls): fp32 results depend on the thread count."""

    multiple: int
    most: int


DETERMINISTIC_TILING = RowTiling(multiple=64, most=128)


def linear(
    x: torch.Tensor,
    weight: Weight,
    bias: torch.Tensor | None = None,
    tiling: RowTiling | None = None,
) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` over x's rows [T, in] (``weight`` float or quantized:
    ``Weight``); with ``tiling`` batch-invariant (see ``RowTiling``; a quantized weight whose
    kernel is row-invariant, the GGUF int8-activation kernel, needs no tiling; other ones
    then always run on calls of the same number of rows)."""
    if tiling is None:
        return _matmul(x, weight, bias)
    if _row_invariant(weight, x):
        return _matmul(x, weight, bias, row_invariant=True)
    t = x.shape[0]
    padded = -(-t // tiling.multiple) * tiling.multiple
    if padded != t:
        x = torch.cat((x, x.new_zeros(padded - t, x.shape[1])))
    if padded <= tiling.most:
        return _matmul(x, weight, bias)[:t]
    # Slices of ``most`` rows, the last one shorter (a multiple of ``multiple``).
    bounds = [(r0, min(r0 + tiling.most, padded)) for r0 in range(0, padded, tiling.most)]
    if isinstance(weight, QuantizedWeight | list):  # tiles dequantized once for all slices
        weights = weight if isinstance(weight, list) else [weight]
        ys = [w.matmul_slices(x, bounds) for w in weights]
        y = ys[0] if len(ys) == 1 else torch.cat(ys, dim=-1)
        return (y if bias is None else y + bias)[:t]
    first = _matmul(x[: tiling.most], weight, bias)
    out = x.new_empty(padded, first.shape[1])
    out[: tiling.most] = first
    for r0, r1 in bounds[1:]:
        out[r0:r1] = _matmul(x[r0:r1], weight, bias)
    return out[:t]


# ---- parallel linear layers ----------------------------------------------------------------
class ColumnParallelLinear(nn.Module):
    """``y = x W^T + b`` with W's output rows made of parts (fused Q/K/V, gate/up), each a
    checkpoint tensor of which this rank holds a contiguous row range: ``parts`` is a list of
    (checkpoint rows, (first, end) rows this rank takes)."""

    def __init__(
        self,
        in_features: int,
        parts: list[tuple[int, tuple[int, int]]],
        bias: bool,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        super().__init__()
        self.in_features = in_features
        self.parts = parts
        self.sizes = [end - first for _, (first, end) in parts]
        out = sum(self.sizes)
        self.weight: nn.Parameter | None
        self.qweight: QuantizedWeight | list[QuantizedWeight] | None
        self.slot = WeightSlot(self, self.sizes, in_features, dtype, device)
        self.slots = [self.slot]
        self.bias = _param(out, dtype=dtype, device=device) if bias else None
        self.tiling: RowTiling | None = None  # the deterministic mode's (``RowTiling``)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight if self.qweight is None else self.qweight
        return linear(x, w, self.bias, self.tiling)

    def targets(self, names: list[str]) -> dict[str, Target]:
        """``names``: each part's checkpoint name without ``.weight`` / ``.bias``."""
        out: dict[str, Target] = {}
        row = 0
        for i, (name, size, (rows, (first, end))) in enumerate(
            zip(names, self.sizes, self.parts, strict=True)
        ):
            src = (slice(first, end),)
            out[name + ".weight"] = Target(
                self.weight[row : row + size], src, (rows, self.in_features), self.slot, i
            )
            if self.bias is not None:
                out[name + ".bias"] = Target(self.bias[row : row + size], src, (rows,))
            row += size
        return out

    def fused_targets(self, name: str) -> dict[str, list[Target]]:
        """The parts stored as one checkpoint tensor ``name`` (without ``.weight``), their
        rows one after another (Phi-3's ``qkv_proj``: [q; k; v], ``gate_up_proj``: [gate;
        up]): each part's rows of this rank, taken from that part's place in the tensor (a
        tensor-parallel rank's q heads, its KV heads; its gate and its up columns)."""
        total = sum(rows for rows, _ in self.parts)
        weights: list[Target] = []
        biases: list[Target] = []
        row = offset = 0
        for i, (size, (rows, (first, end))) in enumerate(zip(self.sizes, self.parts, strict=True)):
            src = (slice(offset + first, offset + end),)
            weights.append(
                Target(self.weight[row : row + size], src, (total, self.in_features), self.slot, i)
            )
            if self.bias is not None:
                biases.append(Target(self.bias[row : row + size], src, (total,)))
            row += size
            offset += rows
        out = {name + ".weight": weights}
        if biases:
            out[name + ".bias"] = biases
        return out


class RowParallelLinear(nn.Module):
    """``y = sum over ranks of x_r W_r^T (+ b)``: this rank holds input columns
    ``[first, end)`` of a checkpoint tensor with ``in_features`` columns; the all-reduce
    follows (or is left to the caller: ``reduce=False``)."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        cols: tuple[int, int],
        bias: bool,
        dtype: torch.dtype,
        device: torch.device,
        group: TPGroup | None,
    ) -> None:
        super().__init__()
        self.in_features, self.out_features, self.cols = in_features, out_features, cols
        self.weight: nn.Parameter | None
        self.qweight: QuantizedWeight | list[QuantizedWeight] | None
        self.slot = WeightSlot(self, [out_features], cols[1] - cols[0], dtype, device)
        self.slots = [self.slot]
        self.bias = _param(out_features, dtype=dtype, device=device) if bias else None
        self.group = group
        self.tiling: RowTiling | None = None  # the deterministic mode's (``RowTiling``)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's partial product, without the all-reduce or the bias."""
        w = self.weight if self.qweight is None else self.qweight
        return linear(x, w, tiling=self.tiling)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.matmul(x)
        if self.group is not None:
            y = self.group.all_reduce(y)
        return y if self.bias is None else y + self.bias

    def targets(self, name: str) -> dict[str, Target]:
        out = {
            name + ".weight": Target(
                self.weight,
                (slice(None), slice(*self.cols)),
                (self.out_features, self.in_features),
                self.slot,
            )
        }
        if self.bias is not None:
            out[name + ".bias"] = Target(self.bias, WHOLE, (self.out_features,))
        return out


class VocabParallelEmbedding(nn.Module):
    """[T] token ids -> [T, hidden]. Vocabulary-parallel: each rank holds ``ceil(V / N)``
    rows (the last rank's tail is zero padding), looks up the ids in its rows (zeros for the
    others') and the all-reduce sums the ranks' parts."""

    def __init__(
        self,
        config: ModelConfig,
        shard: ShardPlan,
        dtype: torch.dtype,
        device: torch.device,
        group: TPGroup | None,
    ) -> None:
        super().__init__()
        self.vocab_size, self.hidden = config.vocab_size, config.hidden_size
        self.shard, self.group, self.dtype = shard, group, dtype
        v0, v1 = shard.vocab
        # A quantized shard holds its real rows only (no token id reaches the padding).
        self.weight: nn.Parameter | None
        self.qweight: QuantizedWeight | None
        self.slot = WeightSlot(
            self, [v1 - v0], config.hidden_size, dtype, device, rows=shard.vocab_shard, zeros=True
        )
        self.slots = [self.slot]

    def _lookup(self, ids: torch.Tensor) -> torch.Tensor:
        if self.qweight is None:
            return F.embedding(ids, self.weight)
        return self.qweight.embedding(ids, self.dtype)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.group is None:
            return self._lookup(input_ids)
        local = input_ids - self.shard.vocab_start
        outside = (local < 0) | (local >= self.shard.vocab_shard)
        x = self._lookup(local.masked_fill(outside, 0))
        return self.group.all_reduce(x.masked_fill_(outside[:, None], 0))

    def targets(self, name: str) -> dict[str, Target]:
        v0, v1 = self.shard.vocab
        return {
            name: Target(
                self.weight[: v1 - v0],
                (slice(v0, v1),),
                (self.vocab_size, self.hidden),
                self.slot,
            )
        }


class ParallelLMHead(nn.Module):
    """Hidden rows -> fp32 logits [S, V], vocabulary-parallel like the embedding (the ranks'
    logits gathered to rank 0; None on the others). Tied: the embedding's weight."""

    def __init__(
        self,
        config: ModelConfig,
        embedding: VocabParallelEmbedding,
        dtype: torch.dtype,
        device: torch.device,
        group: TPGroup | None,
    ) -> None:
        super().__init__()
        self.tied = config.tie_word_embeddings
        self.vocab_size, self.hidden = config.vocab_size, config.hidden_size
        self.shard, self.group = embedding.shard, group
        self.weight: nn.Parameter | None
        self.qweight: QuantizedWeight | None
        self._embedding = (embedding,)  # a tuple: not registered as a submodule twice
        self.slot: WeightSlot | None = None
        self.slots: list[WeightSlot] = []  # tied: the embedding's
        if self.tied:
            self.tie()
        else:
            v0, v1 = self.shard.vocab
            self.slot = WeightSlot(
                self, [v1 - v0], self.hidden, dtype, device, rows=self.shard.vocab_shard,
                zeros=True,
            )  # fmt: skip
            self.slots = [self.slot]
        self.tiling: RowTiling | None = None  # the deterministic mode's (``RowTiling``)

    def tie(self) -> None:
        """A tied head: the embedding's weight, float or quantized (again after loading)."""
        if self.tied:
            embedding = self._embedding[0]
            self.weight, self.qweight = embedding.weight, embedding.qweight

    def forward(self, x: torch.Tensor) -> torch.Tensor | None:
        w = self.weight if self.qweight is None else self.qweight
        logits = linear(x, w, tiling=self.tiling).float()  # [S, V], or [S, V / N] on a rank
        if self.group is None:
            return logits
        if logits.shape[1] < self.shard.vocab_shard:  # a quantized shard: no padding rows
            logits = F.pad(logits, (0, self.shard.vocab_shard - logits.shape[1]))
        return self.group.gather_vocab(logits, self.vocab_size)

    def targets(self, name: str) -> dict[str, Target]:
        if self.tied:
            return {}
        v0, v1 = self.shard.vocab
        return {
            name: Target(
                self.weight[: v1 - v0],
                (slice(v0, v1),),
                (self.vocab_size, self.hidden),
                self.slot,
            )
        }


# ---- MLP -----------------------------------------------------------------------------------
# On a CPU, a step of more rows runs its MLP in slices of this many: the intermediate
# activations (gate and up, 2 x 1,536 wide for the embedded model: 25 MB at 2,048 fp32 rows,
# and SiLU's and the product's copies) are the largest temporaries of a step, and the heap
# keeps its high-water mark resident (measured: the offline benchmark's peak RSS 50 MiB
# higher at a 2,048-token budget than at 512). Matmuls of 512 rows already run at the
# large-matrix rate.
MLP_SLICE_ROWS = 512


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)): gate and up one column-parallel matmul (this rank's MLP
    columns of each), down row-parallel; the all-reduce after down is the caller's
    (``reduce``), so a layer can fuse it with what follows."""

    def __init__(
        self,
        config: ModelConfig,
        shard: ShardPlan,
        dtype: torch.dtype,
        device: torch.device,
        group: TPGroup | None,
    ) -> None:
        super().__init__()
        inter = shard.intermediate
        size = config.intermediate_size
        self.gate_up = ColumnParallelLinear(
            config.hidden_size, [(size, inter), (size, inter)], config.mlp_bias, dtype, device
        )
        self.down = RowParallelLinear(
            size, config.hidden_size, inter, config.mlp_bias, dtype, device, group
        )
        self.intermediate_size = shard.intermediate_size
        self.act = ACTIVATIONS[config.hidden_act]
        self.is_silu = self.act is F.silu

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The MLP over ``x``'s rows; on a CPU in slices of ``MLP_SLICE_ROWS``."""
        t = x.shape[0]
        if t <= MLP_SLICE_ROWS or x.device.type != "cpu" or self.gate_up.tiling is not None:
            return self.down.forward(self._inner(x))
        out = torch.empty_like(x)
        for r0 in range(0, t, MLP_SLICE_ROWS):
            rows = slice(r0, r0 + MLP_SLICE_ROWS)
            out[rows] = self.down.matmul(self._inner(x[rows]))
        if self.down.group is not None:
            out = self.down.group.all_reduce(out)
        return out if self.down.bias is None else out + self.down.bias

    def _inner(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up.forward(x).chunk(2, dim=-1)
        return self.act(gate) * up

    def targets(self, prefix: str, fused: str | None = None) -> dict[str, Target | list[Target]]:
        """``fused``: the checkpoint's name of one gate-and-up tensor (Phi-3's
        ``gate_up_proj``), else separate ``gate_proj`` and ``up_proj``."""
        gate_up: dict[str, Target | list[Target]] = {}
        if fused is None:
            gate_up.update(self.gate_up.targets([prefix + "gate_proj", prefix + "up_proj"]))
        else:
            gate_up.update(self.gate_up.fused_targets(prefix + fused))
        return {**gate_up, **self.down.targets(prefix + "down_proj")}


# ---- attention -----------------------------------------------------------------------------
class Attention(nn.Module):
    """Grouped-query attention over the paged KV cache: fused QKV projection (this rank's
    heads), optional q/k norms (``qk_norm``: "head", one RMSNorm over each head's dims as
    Qwen3; "all", over all heads' dims as OLMo 2), rotary embeddings (full, partial, or none
    for a layer without), the backend's attention, the output projection (all-reduced).

    ``spec``: what the backend computes beyond causal attention at ``head_dim ** -0.5`` (the
    layer's softmax scale, sliding window, score soft-cap, sinks; ``registry.layer_spec``), or
    None; with ``spec.sinks`` the layer holds its query heads' sink logits (``sinks``, this
    rank's heads) and passes them to the backend. ``norm_offset``: the q/k norms are Gemma's
    ``1 + w``. ``o_bias``: the output projection has a bias (GPT-OSS)."""

    def __init__(
        self,
        config: ModelConfig,
        shard: ShardPlan,
        dtype: torch.dtype,
        device: torch.device,
        group: TPGroup | None,
        *,
        qkv_bias: bool,
        qk_norm: str | None = None,
        use_rope: bool = True,
        spec: AttentionSpec | None = None,
        norm_offset: bool = False,
        o_bias: bool = False,
    ) -> None:
        super().__init__()
        hd = config.head_dim
        self.spec = spec
        self.num_heads, self.num_kv_heads, self.head_dim = shard.num_heads, shard.num_kv_heads, hd
        self.q_size, self.kv_size = self.num_heads * hd, self.num_kv_heads * hd
        (q0, q1), (k0, k1) = shard.q_heads, shard.kv_heads
        q_rows = (q0 * hd, q1 * hd)
        kv_rows = (k0 * hd, k1 * hd)
        full_q, full_kv = config.num_heads * hd, config.num_kv_heads * hd
        self.qkv = ColumnParallelLinear(
            config.hidden_size,
            [(full_q, q_rows), (full_kv, kv_rows), (full_kv, kv_rows)],
            qkv_bias,
            dtype,
            device,
        )
        self.o = RowParallelLinear(full_q, config.hidden_size, q_rows, o_bias, dtype, device, group)
        self.q_heads, self.total_heads = shard.q_heads, config.num_heads
        self.sinks = None
        if spec is not None and spec.sinks:
            # fp32 whatever the model's dtype: every backend adds the sink to an fp32 running
            # maximum and denominator, so a bf16 copy would be converted every layer, every
            # step (checkpoints store sinks in bf16 or fp32: both load exactly).
            self.sinks = _param(self.num_heads, dtype=torch.float32, device=device)
        self.qk_norm = qk_norm
        self.q_norm = self.k_norm = None
        eps = config.rms_norm_eps
        if qk_norm == "head":
            self.q_norm = RMSNorm(hd, eps, dtype, device, offset=norm_offset)
            self.k_norm = RMSNorm(hd, eps, dtype, device, offset=norm_offset)
        elif qk_norm == "all":
            self.q_norm = RMSNorm(
                self.q_size, eps, dtype, device, full_width=full_q, group=group,
                weight_slice=slice(*q_rows),
            )  # fmt: skip
            self.k_norm = RMSNorm(
                self.kv_size, eps, dtype, device, full_width=full_kv, group=group,
                weight_slice=slice(*kv_rows),
            )  # fmt: skip
        elif qk_norm is not None:
            raise ValueError(f"qk_norm: {qk_norm!r} is not one of 'head', 'all'")
        self.use_rope = use_rope
        self.rotary_dim = config.rotary_dim

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        attn: AttentionBackend,
        layout: BatchLayout,
        attn_meta: object,
    ) -> torch.Tensor:
        t = x.shape[0]
        qkv = self.qkv.forward(x)
        q, k, v = qkv.split((self.q_size, self.kv_size, self.kv_size), dim=-1)
        if self.qk_norm == "all":
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        if self.qk_norm == "head":
            q, k = self.q_norm(q), self.k_norm(k)
        if self.use_rope:
            if self.rotary_dim == self.head_dim and self.qk_norm is None:
                # q's and k's heads side by side in qkv's rows: rotated in one pass (the same
                # elementwise arithmetic as one pass each; half the ops of a step).
                qk = qkv[:, : self.q_size + self.kv_size].view(t, -1, self.head_dim)
                qk = apply_rope(qk, cos, sin)
                q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
            elif self.rotary_dim == self.head_dim:
                q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
            else:
                q = apply_partial_rope(q, cos, sin, self.rotary_dim)
                k = apply_partial_rope(k, cos, sin, self.rotary_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if self.sinks is None:
            o = attn.forward(q, k, v, k_cache, v_cache, layout, attn_meta, self.spec)
        else:
            o = attn.forward(q, k, v, k_cache, v_cache, layout, attn_meta, self.spec, self.sinks)
        return self.o.forward(o.view(t, self.q_size))

    def targets(self, prefix: str, fused: str | None = None) -> dict[str, Target | list[Target]]:
        """``fused``: the checkpoint's name of one Q/K/V tensor (Phi-3's ``qkv_proj``), else
        separate ``q_proj``, ``k_proj`` and ``v_proj``."""
        out: dict[str, Target | list[Target]] = {}
        if fused is None:
            out.update(self.qkv.targets([prefix + "q_proj", prefix + "k_proj", prefix + "v_proj"]))
        else:
            out.update(self.qkv.fused_targets(prefix + fused))
        out.update(self.o.targets(prefix + "o_proj"))
        if self.q_norm is not None:
            out.update(self.q_norm.targets(prefix + "q_norm.weight"))
            out.update(self.k_norm.targets(prefix + "k_norm.weight"))
        if self.sinks is not None:
            out[prefix + "sinks"] = Target(self.sinks, (slice(*self.q_heads),), (self.total_heads,))
        return out
