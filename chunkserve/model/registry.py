"""Which class serves which checkpoint: HF ``architectures`` / ``model_type`` and GGUF
``general.architecture`` -> a family (``ModelConfig.architecture``) -> a class implementing
``CausalLM``. The worker, model runner, CUDA graphs, draft model and tensor parallel see only
the protocol; a family registers itself with ``@register`` in its own module, with a
``GGUFSpec`` per GGUF architecture it loads (how llama.cpp wrote it: see ``loader``).
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch

from chunkserve.attention.base import AttentionSpec
from chunkserve.config import ModelConfig, rope_type

if TYPE_CHECKING:
    from chunkserve.attention.base import AttentionBackend, BatchLayout
    from chunkserve.distributed.group import TPGroup
    from chunkserve.distributed.shard import ShardPlan

logger = logging.getLogger(__name__)

# The modules whose classes register themselves (imported on first lookup).
_FAMILY_MODULES = (
    "llama",
    "qwen",
    "granite",
    "olmo2",
    "smollm3",
    "phi3",
    "gemma",
    "mixtral",
    "qwen_moe",
    "olmoe",
    "deepseek",
    "gpt_oss",
)


@dataclass(frozen=True)
class KVGroups:
    """How the KV cache's layers form groups (a hybrid cache; see ``kv_cache``): ``windows``
    per group (None: full attention, W: sliding window), and per layer its group and its
    pool slot (its index within the group). Every group has ``num_slots`` layers, so layer
    slot j of all groups shares one pool tensor, and a block id holds ``num_slots`` layers'
    K/V of one group."""

    windows: tuple[int | None, ...]
    layer_group: tuple[int, ...]
    layer_slot: tuple[int, ...]
    num_slots: int

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    @property
    def gives_back(self) -> bool:
        """Whether any group gives blocks back (has a window)."""
        return any(w is not None for w in self.windows)


def form_kv_groups(layer_windows: Sequence[int | None]) -> KVGroups:
    """Group layers of one attention kind (full first, then windows from the smallest),
    ``gcd`` of the kinds' layer counts per group: Gemma 3 270M (3 full, 15 sliding layers)
    -> 6 groups of 3 layers, 1 full and 5 sliding; one kind -> one group of every layer."""
    kinds = sorted(set(layer_windows), key=lambda w: (w is not None, w or 0))
    by_kind = {w: [i for i, lw in enumerate(layer_windows) if lw == w] for w in kinds}
    size = math.gcd(*(len(layers) for layers in by_kind.values()))
    windows: list[int | None] = []
    layer_group = [0] * len(layer_windows)
    layer_slot = [0] * len(layer_windows)
    for w in kinds:
        layers = by_kind[w]
        for start in range(0, len(layers), size):
            for slot, layer in enumerate(layers[start : start + size]):
                layer_group[layer], layer_slot[layer] = len(windows), slot
            windows.append(w)
    return KVGroups(tuple(windows), tuple(layer_group), tuple(layer_slot), size)


@dataclass(frozen=True)
class KVLayout:
    """What the model needs of the KV cache: ``num_layers`` layers of ``num_kv_heads``
    (this rank's) x ``head_dim``; ``sliding_window``: the window every layer attends within
    (None: all keys, or only some layers have one); ``layer_windows``: each layer's window
    (empty: ``sliding_window`` on every layer). ``latent``: multi-head latent attention
    (DeepSeek): a layer's entry for a token is one vector of ``head_dim`` values (the
    compressed latent and the rope part; ``num_kv_heads`` 1), not a K and a V per head: its
    pool holds it once, and the layer's (k, v) cache pair is that one tensor twice."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    sliding_window: int | None = None
    layer_windows: tuple[int | None, ...] = ()
    latent: bool = False

    @property
    def kv_parts(self) -> int:
        """Tensors a layer's cache entry has: K and V (2), or the latent (1)."""
        return 1 if self.latent else 2

    def groups(self, hybrid: bool = True) -> KVGroups:
        """The KV groups of this model's layers; ``hybrid`` False: one group of every layer
        with full attention (every block kept: no window gives any back)."""
        if not hybrid:
            return form_kv_groups([None] * self.num_layers)
        return form_kv_groups(self.layer_windows or [self.sliding_window] * self.num_layers)

    def bytes_per_token(self, dtype_size: int, hybrid: bool = True) -> int:
        """Bytes of K and V (or the latent) one token slot of a block takes (over one
        group's layers)."""
        num_slots = self.groups(hybrid).num_slots
        return self.kv_parts * num_slots * self.num_kv_heads * self.head_dim * dtype_size


@runtime_checkable
class CausalLM(Protocol):
    """A model the engine serves.

    - ``forward(layout, kv_caches, attn, attn_meta)``: hidden states [T, hidden] of a step's
      flat batch (``BatchLayout``), writing its K/V into ``kv_caches`` (one (k, v) per layer,
      as ``kv_layout`` describes) through the attention backend;
    - ``compute_logits(hidden)``: fp32 logits [S, vocab] of the rows that sample (on
      tensor-parallel rank 0; None on the others);
    - ``load_weights(iter of (HF name, tensor), quantization)``: a ValueError naming a
      missing, unexpected or misshapen tensor (``quantization`` "int8"/"int4": the linear
      layers' float weights quantized as they arrive); ``init_dummy_weights(seed)``: random
      weights of the right shapes;
    - ``fused_ops`` / ``supports_fused_ops``: the GPU's fused elementwise kernels;
    - ``supports_cuda_graphs`` (optional, default True): False where a step cannot be
      captured in a CUDA graph (a mixture of experts' host-side loop over its experts).
    """

    config: ModelConfig
    dtype: torch.dtype
    fused_ops: bool
    supports_fused_ops: bool

    def __call__(
        self,
        layout: BatchLayout,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        attn: AttentionBackend,
        attn_meta: object,
    ) -> torch.Tensor: ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None: ...

    def load_weights(
        self, weights: Iterable[tuple[str, torch.Tensor]], quantization: str | None = None
    ) -> None: ...

    def init_dummy_weights(self, seed: int = 0) -> None: ...

    def kv_layout(self) -> KVLayout: ...

    @classmethod
    def kv_layout_for(cls, config: ModelConfig, num_kv_heads: int) -> KVLayout: ...


@dataclass(frozen=True)
class GGUFSplit:
    """A tensor llama.cpp stores fused that the family loads as parts: the GGUF tensor is cut
    along its rows (HF's dim 0) into ``parts`` (HF names after ``model.layers.N.``) of
    ``sizes(config)`` rows each."""

    parts: tuple[str, ...]
    sizes: Callable[[ModelConfig], tuple[int, ...]]


@dataclass(frozen=True)
class GGUFJoin:
    """An HF tensor llama.cpp stores as other tensors (or changed): the GGUF block tensors
    ``parts`` (after ``blk.N.``; their arrays in HF's axis order, [..., rows, cols]) give
    ``combine(config, arrays)``, the HF tensor ``hf`` (after ``model.layers.N.``). The loader
    holds each part until the others of its block arrive; one left without them is a
    ValueError naming it. Several joins may give one HF name (a file has one of them).

    ``lazy`` (optional): the same tensor as a ``lazy.LazyTensor`` made of the parts as
    ``LazyTensor``s, whose ``[src]`` reads only what of the parts ``src`` needs (a
    tensor-parallel rank's share); without it the parts are read whole."""

    hf: str
    parts: tuple[str, ...]
    combine: Callable[[ModelConfig, list[Any]], Any]
    lazy: Callable[[ModelConfig, list[Any]], Any] | None = None


@dataclass(frozen=True)
class GGUFSpec:
    """How llama.cpp's converter writes one family as GGUF ``general.architecture`` ``arch``
    (read by ``loader``, which applies it; see the loader's docstring for the whole recipe).

    - ``tensors``: GGUF block tensor name (after ``blk.N.``) -> HF name (after
      ``model.layers.N.``), added to or replacing the loader's Llama table;
    - ``splits``: fused GGUF block tensors (after ``blk.N.``) -> their HF parts;
    - ``permuted_qk``: the converter permuted Q/K rows for llama.cpp's interleaved rope
      (its ``LlamaModel.permute``: Llama and the converters derived from it), undone on load;
    - ``norm_offset``: the converter stored every ``*norm.weight`` as ``w + norm_offset``
      (Gemma: 1.0, its norms multiply by ``1 + w``); the loader subtracts it;
    - ``keys``: GGUF metadata key (after ``{arch}.``) -> ``ModelConfig`` field, or
      (field, conversion of the value), for keys beyond the loader's common ones;
    - ``config_tensors``: small GGUF tensors that are config (e.g. rope factors) -> the
      ``ModelConfig`` field that gets their values as a tuple of floats;
    - ``config``: ``ModelConfig`` fields the GGUF has no key for (llama.cpp hard-codes them);
    - ``derive``: fields computed from those read so far (a dict of ``ModelConfig`` fields ->
      more fields), e.g. a layer pattern llama.cpp hard-codes from ``block_count`` (or
      ``architecture``: Mixtral is written as ``llama`` with experts). A field
      name starting with "_" in ``keys`` or ``config_tensors`` is a scratch value for
      ``derive`` (e.g. parts of a rope scaling dict), dropped before ``ModelConfig``;
    - ``experts``: a mixture of experts' stacked GGUF block tensors (after ``blk.N.``, e.g.
      ``ffn_gate_exps.weight``, [E, rows, cols]) -> the HF name of one expert's tensor with
      ``{}`` for its index (after ``model.layers.N.``): loaded expert by expert;
    - ``joins``: HF tensors made of several GGUF tensors, or of one changed (``GGUFJoin``:
      MLA's ``kv_b_proj`` from ``attn_k_b`` and ``attn_v_b``, GPT-OSS's interleaved
      ``gate_up_proj`` from ``ffn_gate_exps`` and ``ffn_up_exps``).
    """

    arch: str
    tensors: Mapping[str, str] = field(default_factory=dict)
    splits: Mapping[str, GGUFSplit] = field(default_factory=dict)
    permuted_qk: bool = False
    norm_offset: float = 0.0
    keys: Mapping[str, str | tuple[str, Callable[[Any], Any]]] = field(default_factory=dict)
    config_tensors: Mapping[str, str] = field(default_factory=dict)
    config: Mapping[str, Any] = field(default_factory=dict)
    derive: Callable[[dict[str, Any]], dict[str, Any]] | None = None
    experts: Mapping[str, str] = field(default_factory=dict)
    joins: tuple[GGUFJoin, ...] = ()

    def join_of(self, part: str) -> GGUFJoin | None:
        """The join GGUF block tensor ``part`` (after ``blk.N.``) is a part of, or None."""
        return next((j for j in self.joins if part in j.parts), None)


_CLASSES: dict[str, type] = {}  # family -> class
_HF_ARCHS: dict[str, str] = {}  # HF architectures entry -> family
_GGUF_SPECS: dict[str, tuple[str, GGUFSpec]] = {}  # GGUF general.architecture -> family, spec
_loaded = False


# GGUF architectures a family knows and does not load yet -> why (a family module fills it).
GGUF_REFUSED: dict[str, str] = {}


def register(
    family: str, *, hf: Iterable[str] = (), gguf: Iterable[GGUFSpec] = ()
) -> Callable[[type], type]:
    """Class decorator: ``family`` (HF's ``model_type``) is served by the class; ``hf``: its
    ``architectures`` names; ``gguf``: how llama.cpp writes it, one ``GGUFSpec`` per
    ``general.architecture`` it loads from."""

    def deco(cls: type) -> type:
        _CLASSES[family] = cls
        for name in hf:
            _HF_ARCHS[name] = family
        for spec in gguf:
            if not isinstance(spec, GGUFSpec):
                raise TypeError(f"register({family!r}): gguf= takes GGUFSpec, not {spec!r}")
            _GGUF_SPECS[spec.arch] = (family, spec)
        return cls

    return deco


def _load() -> None:
    global _loaded
    if not _loaded:
        _loaded = True
        for module in _FAMILY_MODULES:
            importlib.import_module(f"chunkserve.model.{module}")


def supported_families() -> list[str]:
    _load()
    return sorted(_CLASSES)


def _unsupported(what: str, value: Any, names: Iterable[str]) -> ValueError:
    return ValueError(
        f"model: {what} {value!r} is not supported (supported: {', '.join(sorted(names))})"
    )


def family_of_hf(config: dict[str, Any]) -> str:
    """The family of an HF ``config.json``: its ``architectures`` entry, else its
    ``model_type`` (a config without either is Llama's, as older ones were)."""
    _load()
    archs = config.get("architectures") or []
    for arch in archs:
        if arch in _HF_ARCHS:
            return _HF_ARCHS[arch]
    model_type = config.get("model_type")
    if model_type in _CLASSES:
        return str(model_type)
    if archs:
        raise _unsupported("architecture", archs[0], _HF_ARCHS)
    if model_type is None:
        return "llama"
    raise _unsupported("model_type", model_type, _CLASSES)


def family_of_gguf(arch: str) -> str:
    return gguf_spec(arch)[0]


def gguf_spec(arch: str) -> tuple[str, GGUFSpec]:
    """The family serving GGUF ``general.architecture`` ``arch`` and how llama.cpp wrote it."""
    _load()
    if arch in GGUF_REFUSED:
        raise ValueError(f"model: GGUF architecture {arch!r}: {GGUF_REFUSED[arch]}")
    if arch not in _GGUF_SPECS:
        raise _unsupported("GGUF architecture", arch, _GGUF_SPECS)
    return _GGUF_SPECS[arch]


def model_class(config: ModelConfig) -> type:
    _load()
    if config.architecture not in _CLASSES:
        raise _unsupported("architecture", config.architecture, _CLASSES)
    return _CLASSES[config.architecture]


def build_model(
    config: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    max_positions: int,
    shard: ShardPlan | None = None,
    group: TPGroup | None = None,
) -> CausalLM:
    """The family's model with uninitialised weights (tensor parallel: this rank's share)."""
    cls = model_class(config)
    return cls(config, dtype, device, max_positions=max_positions, shard=shard, group=group)


def kv_layout(config: ModelConfig, num_kv_heads: int | None = None) -> KVLayout:
    """The KV cache the family's model of ``config`` needs, before it is built, with
    ``num_kv_heads`` KV heads (a tensor-parallel rank's; default all)."""
    heads = config.num_kv_heads if num_kv_heads is None else num_kv_heads
    return model_class(config).kv_layout_for(config, heads)


def check_servable(config: ModelConfig, max_model_len: int, name: str = "model") -> None:
    """A ValueError, before any weight loads, for a model we do not serve (an unknown
    family). What the attention must compute (a sliding window) is checked against the
    chosen backend by the worker (``attention_specs``)."""
    model_class(config)


def layer_spec(config: ModelConfig, layer: int) -> AttentionSpec | None:
    """What layer ``layer``'s attention computes beyond causal softmax attention at
    ``head_dim ** -0.5`` (its softmax scale, window, score soft-cap), or None."""
    spec = AttentionSpec(
        scale=config.attention_multiplier,
        sliding_window=config.layer_window(layer),
        logit_softcap=config.attn_logit_softcap,
        sinks=config.attention_sinks,
    )
    return None if spec == AttentionSpec() else spec


def attention_specs(config: ModelConfig) -> set[AttentionSpec]:
    """What the model's layers ask of the attention backend beyond causal attention."""
    specs = {layer_spec(config, layer) for layer in range(config.num_layers)}
    return {s for s in specs if s is not None}


def check_attention(backend: AttentionBackend, config: ModelConfig, name: str = "model") -> None:
    """A ValueError naming what the model's attention needs and ``backend`` lacks (a
    sliding window or a score soft-cap on a backend without): never a silently different
    answer."""
    for spec in sorted(attention_specs(config), key=repr):
        reason = backend.supports(spec)
        if reason is None:
            continue
        needs = []
        if spec.sliding_window is not None:
            needs.append(f"sliding window attention (sliding_window={spec.sliding_window})")
        if spec.logit_softcap is not None:
            needs.append(
                f"soft-capped attention scores (attn_logit_softcapping={spec.logit_softcap})"
            )
        if spec.sinks:
            needs.append("attention sinks")
        advice = "choose another --attention-backend"
        if spec.logit_softcap is None and not spec.sinks and spec.sliding_window is not None:
            advice += f", or --max-model-len {spec.sliding_window} or less"
        raise ValueError(
            f"{name}: this {config.architecture} model uses {' and '.join(needs)} and "
            f"{reason}; {advice}"
        )


def without_unreachable_window(config: ModelConfig, max_model_len: int) -> ModelConfig:
    """``config`` without its sliding window when no sequence can outgrow it (a window of
    ``max_model_len`` or more changes nothing): any backend then serves the model."""
    if config.sliding_window is None or config.sliding_window < max_model_len:
        return config
    # The layers' types stay (Gemma 3's local rope follows them).
    return dataclasses.replace(config, sliding_window=None)


def serving_config(config: ModelConfig, max_model_len: int) -> ModelConfig:
    """``config`` as served at ``max_model_len``: without a window no sequence can outgrow
    (``without_unreachable_window``), and with longrope's factors chosen.

    LongRoPE (Phi-3.5 / 4): transformers rotates every position of a sequence with
    ``short_factor`` while the sequence is at most ``original_max_position_embeddings``
    long and with ``long_factor`` once it is longer, recomputing the whole KV cache when a
    sequence crosses over. Cached keys are rotated once here, so the choice is made once, as
    vLLM does, by ``max_model_len``: at most the original length, short factors (exactly
    transformers' answer for every sequence that can be served); longer, long factors for
    every sequence (transformers' answer for the sequences longer than the original
    length; shorter ones differ from it, which is logged as a warning here: pass
    --max-model-len <= original_max_position_embeddings for transformers' answer on short
    sequences)."""
    config = without_unreachable_window(config, max_model_len)
    if rope_type(config.rope_scaling) != "longrope":
        return config
    original = int(config.rope_scaling["original_max_position_embeddings"])  # type: ignore[index]
    use_long = max_model_len > original
    if use_long:
        logger.warning(
            "%s: longrope: max_model_len %d > original_max_position_embeddings %d, so every "
            "sequence is rotated with long_factor; transformers uses short_factor for "
            "sequences of at most %d tokens (pass --max-model-len %d for its answer there)",
            config.architecture, max_model_len, original, original, original,
        )  # fmt: skip
    return dataclasses.replace(config, longrope_long=use_long)
