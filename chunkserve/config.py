"""Configuration: frozen dataclasses validated in ``__post_init__`` with ``ValueError``.

``EngineConfig`` is what a user sets (``LLM(**kwargs)``, CLI flags). ``ModelConfig`` is read
from the model file. ``SchedulerConfig`` is the pure-Python slice the scheduler needs.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass, field
from typing import Any

DTYPES = ("auto", "bfloat16", "float16", "float32")
DEVICES = ("auto", "cpu", "cuda")
SCHEDULING_POLICIES = ("fcfs", "priority")
DISAGGREGATION_MODES = (None, "prefill", "decode")
KV_CONNECTORS = ("shm", "torch")
PREFILL_ORDERS = ("shortest", "arrival")
LOAD_FORMATS = ("auto", "dummy")
DETERMINISTIC_QUANT_KERNELS = ("int8", "bf16")
QUANTIZATIONS = (None, "int8", "int4")
ATTENTION_BACKENDS = ("auto", "cpu", "torch", "triton")

# Default KV-cache budget on CPU. The embedded model needs 23,040 bytes per token in bf16,
# so 1 GiB holds ~46k tokens, and the whole process stays under 2 GiB.
DEFAULT_CPU_KV_CACHE_MEMORY = 1 << 30
# On a GPU the pool takes this fraction of the memory left free after the weights.
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9
DEFAULT_MAX_NUM_SEQS = 128
# The budget of chunking off when none is named (whole prompts; one over it runs alone).
DEFAULT_MAX_NUM_BATCHED_TOKENS = 512
# Adaptive budgets: most tokens one step may carry (when nothing decodes, prefill takes all
# of it). vLLM's default budget for online serving on large GPUs; min(.., max_model_len).
DEFAULT_BUDGET_CAP = 8192
# Adaptive budget by default (``budget.BudgetController``): a step carrying prefill takes the
# share of time the measured prefill load needs, and at most this many times as long as its
# decodes alone would (the streams slow down at most this much, whatever the hardware).
DEFAULT_DECODE_SLOWDOWN = 2.0
# Adaptive budget: the share of token gaps long steps may take (``budget`` module doc), and
# the most a user may give them (past a few percent a p99 ITL is theirs, not the ordinary
# steps').
DEFAULT_LONG_STEP_SHARE = 0.005
MAX_LONG_STEP_SHARE = 0.05
BUDGET_POLICIES = ("static", "adaptive", "itl-target")
SPECULATIVE_METHODS = ("ngram", "draft_model")
MAX_SPECULATIVE_TOKENS = 16


# What ``model.layers`` implements: rope scaling types and MLP activations (HF's names).
ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn", "longrope")
HIDDEN_ACTS = ("silu", "swish", "gelu_pytorch_tanh", "gelu_tanh")


# DeepSeek's routers (``ModelConfig.topk_method``): V2's softmax ones, V3's "noaux_tc"
# (sigmoid scores with a correction bias).
TOPK_METHODS = ("greedy", "group_limited_greedy", "noaux_tc")


def rope_type(scaling: dict[str, Any] | None) -> str:
    """The type of an HF ``rope_scaling`` / ``rope_parameters`` dict ("default" if none)."""
    scaling = scaling or {}
    return str(scaling.get("rope_type", scaling.get("type", "default")))


def _require(cond: bool, name: str, message: str) -> None:
    if not cond:
        raise ValueError(f"{name}: {message}")


@dataclass(frozen=True)
class ModelConfig:
    """Architecture of a decoder model, as read from a GGUF or ``config.json``:
    ``architecture`` names its family in ``model.registry`` (HF's ``model_type``)."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # HF-style rope scaling ({"rope_type": "llama3", "factor": ..., ...}) or None.
    rope_scaling: dict[str, Any] | None = field(default=None, hash=False, compare=False)
    attention_bias: bool = False
    hidden_act: str = "silu"
    # The share of each head's dimensions that rotate (Phi-4-mini 0.75): ``rotary_dim``.
    partial_rotary_factor: float = 1.0
    # The window of sliding-window attention (Mistral, Qwen2 with use_sliding_window), or
    # None: every layer attends to all earlier keys.
    sliding_window: int | None = None
    # The layers that have the window (Qwen2: from ``max_window_layers`` on; a config's
    # ``layer_types``); None: every layer.
    window_layers: tuple[int, ...] | None = None
    mlp_bias: bool = False
    # Granite's multipliers: embeddings, the softmax scale (None: head_dim ** -0.5; Gemma's
    # ``query_pre_attn_scalar ** -0.5``), the residual branches; logits are divided by
    # ``logits_scaling``.
    embedding_multiplier: float = 1.0
    attention_multiplier: float | None = None
    residual_multiplier: float = 1.0
    logits_scaling: float = 1.0
    # Layers without rotary embeddings (SmolLM3: every 4th).
    no_rope_layers: tuple[int, ...] = ()
    # ``longrope`` (Phi-3.5 / 4): rotate with ``long_factor`` rather than ``short_factor``.
    # transformers picks by the sequence's length (long once it exceeds
    # ``original_max_position_embeddings``); we pick once, by max_model_len
    # (``model.registry.serving_config``).
    longrope_long: bool = False
    # Soft-capping c (x -> c * tanh(x / c)) of the attention scores (Gemma 2's
    # ``attn_logit_softcapping``) and of the final logits (``final_logit_softcapping``).
    attn_logit_softcap: float | None = None
    final_logit_softcap: float | None = None
    # Gemma 3: the rope base of the sliding-window layers (``window_layers``; every layer if
    # None), which rotate with it unscaled; the other layers use ``rope_theta`` and
    # ``rope_scaling``. None: one rope for every layer.
    rope_local_theta: float | None = None
    # llama.cpp's ``rope_freqs`` (a GGUF's form of Llama 3's rope scaling): each of the
    # rotary_dim / 2 frequencies is divided by its factor; None: none.
    rope_freq_factors: tuple[float, ...] | None = None
    # Mixture of experts (``model.moe``): ``num_experts`` routed experts (0: a dense model),
    # ``num_experts_per_tok`` of them per token, each a gated MLP of
    # ``moe_intermediate_size`` columns (None: ``intermediate_size``); ``norm_topk_prob``:
    # the chosen experts' softmax weights renormalised to sum to 1; a shared expert of
    # ``shared_expert_intermediate_size`` columns (0: none) gated by sigmoid(x w) (Qwen2-MoE);
    # ``moe_layers``: the layers with experts (None: every layer), the others a dense MLP of
    # ``intermediate_size`` (Qwen2/3-MoE's ``mlp_only_layers`` / ``decoder_sparse_step``).
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int | None = None
    norm_topk_prob: bool = False
    shared_expert_intermediate_size: int = 0
    moe_layers: tuple[int, ...] | None = None
    # DeepSeek's router (``model.moe``): ``topk_method`` None is the softmax top-k above;
    # "greedy" / "group_limited_greedy": softmax scores, top-k over the experts of the
    # ``topk_group`` best of ``n_group`` groups (a group scored by its best expert), the
    # chosen weights times ``routed_scaling_factor``; "noaux_tc" (DeepSeek-V3): sigmoid
    # scores, experts chosen by score + a learned per-expert correction bias, a group scored
    # by its best two, weights the chosen scores (renormalised by ``norm_topk_prob``) times
    # ``routed_scaling_factor``; ``shared_expert_gate`` False: the shared expert is added
    # ungated (DeepSeek's ``n_shared_experts``).
    topk_method: str | None = None
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    shared_expert_gate: bool = True
    # DeepSeek-V3's multi-token-prediction layers: stored in the checkpoint after the
    # decoder's ``num_layers`` (``model.layers.{num_layers + i}``), not run; skipped at load.
    num_nextn_predict_layers: int = 0
    # Multi-head latent attention (DeepSeek-V2; ``model.deepseek``): set iff
    # ``kv_lora_rank`` is. Keys and values come from a ``kv_lora_rank`` latent per token
    # (the KV cache keeps it and the rope part, ``head_dim`` = qk_rope_head_dim); queries
    # through a ``q_lora_rank`` bottleneck (None: one projection); per head
    # ``qk_nope_head_dim`` + ``head_dim`` query/key dims and ``v_head_dim`` value dims.
    kv_lora_rank: int | None = None
    q_lora_rank: int | None = None
    qk_nope_head_dim: int = 0
    v_head_dim: int = 0
    # GPT-OSS: attention sinks (a learned logit per query head in every layer's softmax
    # denominator), and its experts' clamped SwiGLU: ``(up + 1) * g * sigmoid(alpha * g)``
    # with g = gate clamped above at ``swiglu_limit`` and up clamped to +-``swiglu_limit``
    # (None: the config's ``hidden_act`` gate, ``act(gate) * up``).
    attention_sinks: bool = False
    swiglu_limit: float | None = None
    swiglu_alpha: float = 1.702

    def is_moe_layer(self, layer: int) -> bool:
        """Whether ``layer``'s MLP is a mixture of experts."""
        return self.num_experts > 0 and (self.moe_layers is None or layer in self.moe_layers)

    @property
    def expert_intermediate_size(self) -> int:
        return self.moe_intermediate_size or self.intermediate_size

    def is_window_layer(self, layer: int) -> bool:
        """Whether ``layer`` is one of the sliding-window layers (by the config's layer types,
        whether or not the window is reachable: Gemma 3's local rope follows them)."""
        return self.window_layers is None or layer in self.window_layers

    def layer_window(self, layer: int) -> int | None:
        """Layer ``layer``'s sliding window, or None (it attends to every earlier key)."""
        if self.sliding_window is None:
            return None
        if self.window_layers is not None and layer not in self.window_layers:
            return None
        return self.sliding_window

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    def __post_init__(self) -> None:
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "max_position_embeddings",
        ):
            _require(getattr(self, name) > 0, name, "must be positive")
        _require(
            self.num_heads % self.num_kv_heads == 0,
            "num_kv_heads",
            f"{self.num_heads} heads are not a multiple of {self.num_kv_heads} KV heads",
        )
        # Fields that change the numbers: one we have not implemented is refused here,
        # before any weight loads.
        _require(
            self.hidden_act in HIDDEN_ACTS,
            "hidden_act",
            f"activation {self.hidden_act!r} is not supported (supported: "
            f"{', '.join(HIDDEN_ACTS)})",
        )
        kind = rope_type(self.rope_scaling)
        _require(
            kind in ROPE_TYPES,
            "rope_scaling",
            f"rope type {kind!r} is not supported (supported: {', '.join(ROPE_TYPES)})",
        )
        needs = {
            "linear": ("factor",),
            "dynamic": ("factor",),
            "llama3": ("factor", "original_max_position_embeddings"),
            "yarn": ("factor",),
            "longrope": ("short_factor", "long_factor", "original_max_position_embeddings"),
        }.get(kind, ())
        for key in needs:
            _require(
                key in (self.rope_scaling or {}),
                "rope_scaling",
                f"rope type {kind!r} needs {key!r}",
            )
        if kind == "longrope":
            for key in ("short_factor", "long_factor"):
                factors = self.rope_scaling[key]  # type: ignore[index]
                _require(
                    isinstance(factors, (list, tuple))
                    and len(factors) == self.rotary_dim // 2
                    and all(isinstance(x, (int, float)) and x > 0 for x in factors),
                    "rope_scaling",
                    f"longrope's {key!r} must be {self.rotary_dim // 2} positive numbers (one "
                    f"per rotary dimension pair), got {factors!r}",
                )
            _require(
                int(self.rope_scaling["original_max_position_embeddings"]) > 1,  # type: ignore[index]
                "rope_scaling",
                "longrope's 'original_max_position_embeddings' must be above 1",
            )
        _require(
            self.rope_freq_factors is None
            or (len(self.rope_freq_factors) == self.rotary_dim // 2 and kind == "default"),
            "rope_freq_factors",
            f"needs {self.rotary_dim // 2} factors (rotary_dim / 2) and no other rope scaling "
            f"(got {len(self.rope_freq_factors or ())} with rope type {kind!r})",
        )
        _require(
            0 < self.partial_rotary_factor <= 1 and self.rotary_dim % 2 == 0,
            "partial_rotary_factor",
            f"{self.partial_rotary_factor} of head_dim {self.head_dim} is not an even "
            f"number of dimensions in (0, head_dim]",
        )
        _require(
            self.sliding_window is None or self.sliding_window > 0,
            "sliding_window",
            "must be positive",
        )
        _require(
            self.window_layers is None or all(0 <= i < self.num_layers for i in self.window_layers),
            "window_layers",
            f"must be layer indices below num_layers ({self.num_layers})",
        )
        for name in (
            "attn_logit_softcap",
            "final_logit_softcap",
            "rope_local_theta",
            "swiglu_limit",
        ):
            value = getattr(self, name)
            _require(
                value is None or (math.isfinite(value) and value > 0),
                name,
                f"must be a finite number > 0 or None, got {value!r}",
            )
        _require(
            math.isfinite(self.swiglu_alpha) and self.swiglu_alpha > 0,
            "swiglu_alpha",
            f"must be a finite number > 0, got {self.swiglu_alpha!r}",
        )
        _require(self.num_experts >= 0, "num_experts", "must not be negative")
        if self.num_experts:
            _require(
                1 <= self.num_experts_per_tok <= self.num_experts,
                "num_experts_per_tok",
                f"must be in 1..num_experts ({self.num_experts}), got {self.num_experts_per_tok}",
            )
            _require(
                self.moe_intermediate_size is None or self.moe_intermediate_size > 0,
                "moe_intermediate_size",
                "must be positive",
            )
            _require(
                self.shared_expert_intermediate_size >= 0,
                "shared_expert_intermediate_size",
                "must not be negative",
            )
            _require(
                self.moe_layers is None or all(0 <= i < self.num_layers for i in self.moe_layers),
                "moe_layers",
                f"must be layer indices below num_layers ({self.num_layers})",
            )
        if self.topk_method is not None:
            _require(
                self.topk_method in TOPK_METHODS,
                "topk_method",
                f"{self.topk_method!r} is not supported (supported: {', '.join(TOPK_METHODS)})",
            )
            _require(
                self.n_group >= 1 and self.num_experts % self.n_group == 0,
                "n_group",
                f"must be >= 1 and divide num_experts ({self.num_experts}), got {self.n_group}",
            )
            _require(
                1 <= self.topk_group <= self.n_group
                and self.num_experts_per_tok <= self.topk_group * self.num_experts // self.n_group,
                "topk_group",
                f"must be in 1..n_group ({self.n_group}) with num_experts_per_tok "
                f"({self.num_experts_per_tok}) experts in its groups, got {self.topk_group}",
            )
            _require(
                self.topk_method != "noaux_tc"
                or self.n_group == 1
                or self.num_experts // self.n_group >= 2,
                "n_group",
                f"noaux_tc scores a group by its best two experts: {self.n_group} groups of "
                f"{self.num_experts} experts leave fewer than two per group",
            )
        if self.kv_lora_rank is not None:
            for name in ("kv_lora_rank", "qk_nope_head_dim", "v_head_dim"):
                _require(getattr(self, name) > 0, name, "must be positive")
            _require(
                self.q_lora_rank is None or self.q_lora_rank > 0,
                "q_lora_rank",
                "must be positive or None",
            )
        _require(
            all(0 <= i < self.num_layers for i in self.no_rope_layers),
            "no_rope_layers",
            f"layer indices must be in 0..{self.num_layers - 1}",
        )

    def kv_bytes_per_token(self, dtype_size: int, num_kv_heads: int | None = None) -> int:
        """Bytes of K and V cache one token takes over all layers (of ``num_kv_heads`` KV
        heads: a tensor-parallel rank's share; default all)."""
        if self.kv_lora_rank is not None:  # latent attention: one latent vector, every rank
            return self.num_layers * (self.kv_lora_rank + self.head_dim) * dtype_size
        heads = self.num_kv_heads if num_kv_heads is None else num_kv_heads
        return 2 * self.num_layers * heads * self.head_dim * dtype_size


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (``--speculative-config``, vLLM's JSON form). Each step, a decode
    carries up to ``num_speculative_tokens`` draft tokens that the target verifies in the same
    forward pass as the step's prefill chunks (``speculative``).

    - ``ngram``: prompt lookup, no extra model: the longest suffix of the sequence of
      ``prompt_lookup_max`` down to ``prompt_lookup_min`` tokens that occurred before proposes
      the tokens that followed it.
    - ``draft_model``: a small model of the same vocabulary (``model``: a .gguf file or an HF
      directory; it may be the target itself) proposes them, its KV cache kept in step with
      the target's blocks. ``model`` may be a hub id (``revision``: its branch, tag or commit).
    """

    method: str
    num_speculative_tokens: int = 4
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4
    model: str | None = None
    revision: str | None = None
    """The draft model's revision when ``model`` is a hub id (a branch, tag or commit)."""
    disable_by_batch_size: int | None = None
    """No drafts in a step with more running decodes than this (None: no limit)."""
    min_acceptance_rate: float = 0.1
    """A request whose drafts are accepted less often than this (over its last
    ``ACCEPTANCE_WINDOW`` draft tokens) stops speculating for a while (0: never)."""

    def __post_init__(self) -> None:
        name = "speculative_config"
        _require(
            self.method in SPECULATIVE_METHODS,
            f"{name}.method",
            f"must be one of {SPECULATIVE_METHODS}, got {self.method!r}",
        )
        _require(
            _is_int(self.num_speculative_tokens)
            and 1 <= self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS,
            f"{name}.num_speculative_tokens",
            f"must be an integer in [1, {MAX_SPECULATIVE_TOKENS}], got "
            f"{self.num_speculative_tokens!r}",
        )
        for field_name in ("prompt_lookup_min", "prompt_lookup_max"):
            value = getattr(self, field_name)
            _require(
                _is_int(value) and 1 <= value <= 64,
                f"{name}.{field_name}",
                f"must be an integer in [1, 64], got {value!r}",
            )
        _require(
            self.prompt_lookup_min <= self.prompt_lookup_max,
            f"{name}.prompt_lookup_min",
            f"({self.prompt_lookup_min}) must be <= prompt_lookup_max ({self.prompt_lookup_max})",
        )
        if self.method == "draft_model":
            _require(
                isinstance(self.model, str) and bool(self.model),
                f"{name}.model",
                "the draft model's path is required with method draft_model",
            )
        else:
            _require(self.model is None, f"{name}.model", "only method draft_model takes a model")
        _require(
            self.revision is None or (isinstance(self.revision, str) and bool(self.revision)),
            f"{name}.revision",
            f"must be a non-empty string (a branch, tag or commit), got {self.revision!r}",
        )
        _require(
            self.revision is None or self.model is not None,
            f"{name}.revision",
            "belongs to a draft model (method draft_model with a model)",
        )
        _require(
            self.disable_by_batch_size is None
            or (_is_int(self.disable_by_batch_size) and self.disable_by_batch_size >= 1),
            f"{name}.disable_by_batch_size",
            f"must be an integer >= 1 or null, got {self.disable_by_batch_size!r}",
        )
        _require(
            isinstance(self.min_acceptance_rate, (int, float))
            and not isinstance(self.min_acceptance_rate, bool)
            and 0.0 <= self.min_acceptance_rate < 1.0,
            f"{name}.min_acceptance_rate",
            f"must be in [0, 1), got {self.min_acceptance_rate!r}",
        )

    @classmethod
    def parse(cls, value: Any) -> SpeculativeConfig | None:
        """From a JSON object (text), a dict or a SpeculativeConfig; None stays None."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"speculative_config: not valid JSON ({exc})") from None
        if not isinstance(value, dict):
            raise ValueError(
                f"speculative_config: must be a JSON object, got {type(value).__name__}"
            )
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(value) - names)
        if unknown:
            raise ValueError(
                f"speculative_config.{unknown[0]}: unknown key (known: {', '.join(sorted(names))})"
            )
        if "method" not in value:
            raise ValueError(f"speculative_config.method: required, one of {SPECULATIVE_METHODS}")
        return cls(**value)

    def describe(self) -> str:
        if self.method == "ngram":
            what = f"ngram {self.prompt_lookup_min}..{self.prompt_lookup_max}"
        else:
            what = f"draft model {self.model}"
        off = (
            f", off above {self.disable_by_batch_size} decodes"
            if self.disable_by_batch_size
            else ""
        )
        return f"{what}, {self.num_speculative_tokens} tokens{off}"


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


# The fields of a ``generation_config.json`` that are requests' default sampling
# parameters (vLLM's ``--generation-config auto``); ``max_new_tokens`` is ``max_tokens``.
GENERATION_DEFAULT_KEYS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "max_new_tokens",
)


def parse_generation_overrides(value: Any) -> dict[str, Any] | None:
    """``override_generation_config``: a dict or its JSON text, keys among
    ``GENERATION_DEFAULT_KEYS``, numbers as values (their ranges are checked with the
    sampling parameters' own rules when the engine loads)."""
    name = "override_generation_config"
    if value is None:
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{name}: not valid JSON ({exc})") from None
    if not isinstance(value, dict):
        raise ValueError(f"{name}: must be a JSON object, got {type(value).__name__}")
    for key, v in value.items():
        _require(
            key in GENERATION_DEFAULT_KEYS,
            f"{name}.{key}",
            f"unknown key (known: {', '.join(GENERATION_DEFAULT_KEYS)})",
        )
        _require(
            v is None or (isinstance(v, (int, float)) and not isinstance(v, bool)),
            f"{name}.{key}",
            f"must be a number, got {v!r}",
        )
    return dict(value)


@dataclass(frozen=True)
class SchedulerConfig:
    """What the scheduler needs; built by the engine from ``EngineConfig``."""

    max_num_batched_tokens: int
    max_num_seqs: int
    max_model_len: int
    block_size: int
    enable_chunked_prefill: bool = True
    policy: str = "fcfs"
    # How the prefill share of a chunked step is handed out (after the policy's priorities):
    # "shortest": the prompts with the least left to compute first (waiting ones aged by
    # their wait), and a prefill in progress that got nothing last step moves one block
    # before them; "arrival": prefills in progress, then waiting requests, in policy order.
    prefill_order: str = "shortest"
    # Admission control (SGLang's new_token_ratio): a waiting request is admitted only if the
    # free blocks cover its whole prompt plus, for it and every running request, this
    # fraction of the outputs still to come (clipped at ``output_estimate_clip`` tokens).
    # The ratio decays to the minimum over ``new_token_ratio_decay_steps`` steps and jumps
    # back after a preemption. 0 reserves prompts only (greedy admission, more preemption).
    # Fairness across long prefills (0: no limit). A prompt with more than
    # long_prefill_token_threshold tokens left is "long": it gets at most that many tokens a
    # step, and at most max_long_partial_prefills long prompts are mid-prefill at once.
    max_num_partial_prefills: int = 0
    max_long_partial_prefills: int = 0
    long_prefill_token_threshold: int = 0
    init_new_token_ratio: float = 0.7
    min_new_token_ratio: float = 0.15
    new_token_ratio_decay_steps: int = 600
    output_estimate_clip: int = 4096
    # Speculative decoding: no draft tokens in a step with more decodes than this (0: no
    # limit). Drafts come with the requests (``Request.draft_token_ids``).
    spec_disable_by_batch_size: int = 0

    def __post_init__(self) -> None:
        _require(
            0.0 <= self.min_new_token_ratio <= self.init_new_token_ratio <= 1.0,
            "new_token_ratio",
            "need 0 <= min_new_token_ratio <= init_new_token_ratio <= 1",
        )
        _require(
            self.new_token_ratio_decay_steps >= 1, "new_token_ratio_decay_steps", "must be >= 1"
        )
        for name in ("max_num_partial_prefills", "max_long_partial_prefills"):
            _require(getattr(self, name) >= 0, name, "must be >= 0 (0: no limit)")
        _require(
            self.long_prefill_token_threshold >= 0, "long_prefill_token_threshold", "must be >= 0"
        )
        _require(self.max_num_batched_tokens >= 1, "max_num_batched_tokens", "must be >= 1")
        _require(self.max_num_seqs >= 1, "max_num_seqs", "must be >= 1")
        _require(self.max_model_len >= 2, "max_model_len", "must be >= 2")
        _require(self.block_size >= 1, "block_size", "must be >= 1")
        _require(
            self.policy in SCHEDULING_POLICIES,
            "scheduling_policy",
            f"must be one of {SCHEDULING_POLICIES}, got {self.policy!r}",
        )
        _require(
            self.prefill_order in PREFILL_ORDERS,
            "prefill_order",
            f"must be one of {PREFILL_ORDERS}, got {self.prefill_order!r}",
        )
        if self.enable_chunked_prefill:
            # Stall-free batching serves every running decode every step, so the token
            # budget must cover a full batch of decodes (vLLM enforces the same).
            _require(
                self.max_num_batched_tokens >= self.max_num_seqs,
                "max_num_batched_tokens",
                f"({self.max_num_batched_tokens}) must be >= max_num_seqs "
                f"({self.max_num_seqs}) when chunked prefill is on",
            )


@dataclass(frozen=True)
class BudgetPolicy:
    """How each step's token budget is chosen.

    - ``static``: every step has ``max_num_batched_tokens`` (a user's explicit budget, or
      chunking off).
    - ``adaptive`` (the default): the online cost model picks each step's prefill share so
      that a step with prefill costs ``decode_slowdown`` times the recent mean decode step,
      or more when the measured prefill load needs it (``budget.BudgetController``); with
      nothing decoding, a step may take many times a step's fixed cost; never more than
      ``max_num_batched_tokens`` (the cap).
    - ``itl-target``: the share keeps the predicted step under ``itl_slo_s`` (with a margin
      learnt from measured steps), up to the cap.

    In both online policies a step with prefill waiting carries at least one KV block of it.
    """

    kind: str
    max_num_batched_tokens: int  # static: the budget; online: the cap
    decode_slowdown: float | None = None
    itl_slo_s: float | None = None
    # Adaptive: the share of token gaps long steps may take (waiting prompts prefilled whole
    # in one step of up to the longest step; ``budget.BudgetController``); 0: none.
    long_step_share: float = 0.0

    def __post_init__(self) -> None:
        _require(
            self.kind in BUDGET_POLICIES,
            "budget_policy",
            f"must be one of {BUDGET_POLICIES}, got {self.kind!r}",
        )
        _require(self.max_num_batched_tokens >= 1, "max_num_batched_tokens", "must be >= 1")
        if self.kind == "adaptive":
            _require(
                self.decode_slowdown is not None and self.decode_slowdown >= 1.0,
                "max_decode_slowdown",
                f"must be >= 1, got {self.decode_slowdown!r}",
            )
        if self.kind == "itl-target":
            _require(
                self.itl_slo_s is not None and self.itl_slo_s > 0, "itl_slo_ms", "must be > 0 ms"
            )
        _require(
            0.0 <= self.long_step_share <= MAX_LONG_STEP_SHARE
            and (self.kind == "adaptive" or self.long_step_share == 0.0),
            "long_step_share",
            f"must be in [0, {MAX_LONG_STEP_SHARE}] (adaptive budget only), got "
            f"{self.long_step_share!r}",
        )

    @property
    def is_online(self) -> bool:
        return self.kind != "static"

    def describe(self) -> str:
        """One phrase for the start-up line and logs, starting with the policy's name."""
        if self.kind == "static":
            return f"static: {self.max_num_batched_tokens} tokens per step"
        if self.kind == "adaptive":
            return (
                f"adaptive: steps with prefill <= {self.decode_slowdown:g}x their decodes "
                f"alone, more if the prefill load needs it; long steps for waiting prompts "
                f"that fit one whole in {100 * self.long_step_share:g}% of token gaps; cap "
                f"{self.max_num_batched_tokens} tokens"
            )
        return (
            f"itl-target: {1e3 * (self.itl_slo_s or 0):g} ms, cap "
            f"{self.max_num_batched_tokens} tokens"
        )


@dataclass(frozen=True)
class Flag:
    """How a field of ``EngineConfig`` appears on the command line: ``engine_args`` makes
    the argparse option from this, the field's name, type and default (one source: a new
    field with a ``Flag`` is a new flag, with its default and help).

    - ``name``: the flag without ``--`` (default: the field's name with ``-`` for ``_``);
      ``aliases``: other spellings (``--tp``).
    - ``help``: the ``--help`` text (argparse's format: ``%%`` for ``%``).
    - ``choices``: the values allowed (``None`` in them is the absent flag).
    - ``unit="bytes"``: a size, written ``1073741824``, ``512MiB``, ``2GiB`` or ``1.5G``.
    - A bool field: default False gives ``--name``; default True gives only ``--no-name``,
      or both forms with ``both=True``.
    - A field whose type admits text (``str | dict | ...``) takes its value as text.
    """

    help: str | None = None
    name: str | None = None
    aliases: tuple[str, ...] = ()
    choices: tuple[Any, ...] | None = None
    unit: str | None = None
    both: bool = False


FLAG = "flag"  # the key of a field's ``Flag`` in its metadata


def _flag(default: Any, help: str | None = None, **flag: Any) -> Any:
    """A field of ``EngineConfig`` with its command-line flag."""
    return field(default=default, metadata={FLAG: Flag(help, **flag)})


@dataclass(frozen=True, kw_only=True)
class EngineConfig:
    """Everything a user can set on the engine. Unknown keys raise ``TypeError``.

    Each field is also an engine flag of the commands (``engine_args``), in this order, with
    the default and the help its ``Flag`` gives."""

    model: str | None = _flag(
        None,
        "a .gguf file, an HF directory or a hub id (org/name; org/name:Q4_K_M for one GGUF "
        "of a repository) (default: embedded SmolLM2-135M)",
    )
    """Path to a ``.gguf`` file or an HF directory (config.json + *.safetensors), or a
    Hugging Face Hub id (``org/name``, found in the HF cache, else downloaded: ``model.hub``;
    ``org/name:QUANT`` for one GGUF file of a repository). A local path that exists wins.
    None: the embedded SmolLM2-135M-Instruct."""
    tokenizer: str | None = _flag(None, "tokenizer directory (tokenizer.json) or hub id")
    """Tokenizer directory (tokenizer.json) or hub id; default: from the model."""
    revision: str | None = _flag(
        None, "hub models: the branch, tag or commit of --model (default: main)"
    )
    """A hub id's revision: a branch, a tag or a commit (default ``main``)."""
    tokenizer_revision: str | None = _flag(
        None, "hub tokenizers: the branch, tag or commit of --tokenizer (default: main)"
    )
    """A hub tokenizer's revision (``tokenizer`` a hub id); default ``main``."""
    download_dir: str | None = _flag(
        None,
        "the HF cache hub models are found in and downloaded to (default: HF_HUB_CACHE, "
        "HF_HOME/hub or ~/.cache/huggingface/hub)",
    )
    """The HF cache directory (the ``models--org--name`` layout) hub ids are looked up in
    and downloaded to; default ``HF_HUB_CACHE``, ``HF_HOME/hub`` or huggingface_hub's. With
    ``HF_HUB_OFFLINE=1`` nothing is downloaded."""
    generation_config: str = _flag(
        "auto",
        "default sampling parameters of requests that leave them unset: 'auto' from the "
        "model's generation_config.json, 'vllm' none (the engine's defaults), or a folder "
        "holding a generation_config.json",
    )
    """Where requests' default sampling parameters come from (vLLM's flag):
    ``auto``: the model's ``generation_config.json`` (its ``temperature``, ``top_p``,
    ``top_k``, ``min_p``, ``repetition_penalty``, and ``max_new_tokens`` as the default
    ``max_tokens``), applied to each request field the request leaves unset; ``vllm``: none;
    a folder: its ``generation_config.json``, whose ``max_new_tokens`` also limits every
    request's ``max_tokens`` (as in vLLM's server)."""
    override_generation_config: dict | str | None = _flag(  # noqa: RUF009 (a field)
        None,
        "JSON of sampling defaults over (or, with --generation-config vllm, instead of) "
        'the generation config\'s, e.g. {"temperature": 0.5}',
    )
    """Default sampling parameters as a dict (or its JSON text) in ``generation_config.json``
    names, merged over the generation config's (``generation_config`` ``vllm``: the only
    defaults); its ``max_new_tokens`` also limits every request's ``max_tokens`` (vLLM)."""
    dtype: str = _flag("auto", choices=DTYPES)
    """auto: bf16 on GPUs and on CPUs with native bf16, else fp32."""
    device: str = _flag("auto", choices=DEVICES)
    max_model_len: int | None = _flag(None)
    """Longest prompt + output; default: the model's context length."""
    block_size: int = _flag(16)
    """Tokens per KV-cache block."""
    kv_cache_memory: int | None = _flag(
        None, "bytes for the KV cache (e.g. 1GiB); default 1 GiB on CPU", unit="bytes"
    )
    """Bytes for the KV pool; default 1 GiB on CPU, 90% of free memory on a GPU (tensor
    parallel: per rank, each holding its share of the KV heads)."""
    max_num_batched_tokens: int | None = _flag(
        None,
        "token budget per step: given alone, every step has it (static); with "
        "--max-decode-slowdown, --long-step-share or --itl-slo-ms, the most an adaptive step "
        "carries (default: "
        "adaptive, cap min(8192, max-model-len); 512 with chunking off)",
    )
    """Token budget of one step, decodes plus prefill chunks. Given alone (no
    ``itl_slo_ms``, no ``max_decode_slowdown``): every step has this budget (static, as in
    vLLM). Otherwise the most an adaptive step may carry (default min(8192,
    max_model_len)). None with chunking off: 512."""
    max_num_seqs: int | None = _flag(None)
    """Most requests running at once; default 128, or the token budget if that is smaller."""
    enable_chunked_prefill: bool = _flag(
        True,
        "whole prompts in prefill-only steps (decodes stall): the baseline",
        name="chunked-prefill",
    )
    """False: whole prompts in prefill-only steps, which stall decodes (the baseline)."""
    scheduling_policy: str = _flag("fcfs", choices=SCHEDULING_POLICIES)
    prefill_order: str = _flag(
        "shortest",
        "how a step's prefill share is handed out: shortest (default; prefills in "
        "progress move a block each, then the prompts with least left, aged by their wait) "
        "or arrival (policy order)",
        choices=PREFILL_ORDERS,
    )
    """How a chunked step's prefill share is handed out, after the policy's priorities:
    ``shortest``: the prompts with the least left to compute go first (a waiting prompt's
    length shrinks as it waits, so a long one is not passed over for ever), and a prefill in
    progress that got nothing in the last step moves one KV block before them (every prompt
    in progress advances at least every other step): a short prompt arriving while a long
    one is chunked gets its first token in a step or two. ``arrival``: in policy order."""
    enable_prefix_caching: bool = _flag(
        True, "reuse cached KV of shared prompt prefixes (default: on)", both=True
    )
    """Reuse the KV of full blocks whose prefix was computed before (chained block hashes)."""
    hybrid_kv_cache: bool = _flag(
        True,
        "KV groups per attention kind: sliding-window layers give back the blocks out of "
        "their window (default: on; off: every layer keeps every block)",
        both=True,
    )
    """A model with sliding-window layers keeps one block table per group of layers of one
    attention kind, and the sliding groups give back the blocks that left their window
    (``scheduling.kv_cache``). False: one table, every block kept (the baseline)."""
    max_num_partial_prefills: int = _flag(0, "most prompts mid-prefill at once (0: no limit)")
    """Most prompts mid-prefill at once (0: no limit)."""
    max_long_partial_prefills: int = _flag(
        1, "most long prompts mid-prefill at once; short ones start first (0: no limit)"
    )
    """Most long prompts mid-prefill at once; shorter prompts start ahead of waiting long
    ones (0: no limit)."""
    long_prefill_token_threshold: int | None = _flag(
        None,
        "prompts with more tokens left are long: at most this many tokens and half the "
        "budget per step before short ones start (default 4%% of max-model-len; 0: off)",
    )
    """A prompt with more tokens left than this is long: it takes at most this many tokens,
    and at most half the budget, per step before shorter prompts are admitted (leftover
    budget goes back to it). None: 4% of max_model_len; 0: no prompt is long (limits on long
    prompts off)."""
    max_decode_slowdown: float | None = _flag(
        None,
        "adaptive budget (the default, 2.0): a step that carries prefill may take at "
        "most this many times as long as its decodes alone, unless the measured prefill load "
        "needs more (with --max-num-batched-tokens: the cap)",
    )
    """Adaptive budget (the default when no budget is named; 2.0): a step that carries
    prefill may take this many times as long as the recent mean step of its decodes alone,
    as the online step-time cost model predicts it, or more when the measured prefill load
    needs a bigger share of the machine. Named with ``max_num_batched_tokens``, that is the
    cap of the adaptive budget."""
    long_step_share: float | None = _flag(
        None,
        "adaptive budget (default 0.005): the share of token gaps that long steps may "
        "take, each prefilling waiting prompts whole that no step under the slowdown fits, "
        "in one step of up to 25x the step's fixed cost; 0: never (named, the budget is "
        "adaptive; with --max-num-batched-tokens: the cap)",
    )
    """Adaptive budget (default 0.005): the share of token gaps (a decode in a step) that
    long steps may take. A long step prefills waiting prompts whole, each of which no step
    under ``max_decode_slowdown`` fits whole, in one step of up to 25x the step's fixed cost
    (their first token as whole-prompt prefill would give it, one bounded stall of the
    streams). 0: never (every step with prefill stays under the slowdown). Named with
    ``max_num_batched_tokens``, as ``max_decode_slowdown``: the budget is adaptive, capped
    there."""
    itl_slo_ms: float | None = _flag(
        None,
        "inter-token latency target: choose each step's budget online to stay under it",
    )
    """Inter-token latency target: each step's budget is chosen online from a step-time cost
    model so the step stays under it (decodes are never dropped; prefill still gets one KV
    block a step)."""
    cost_profile: str | None = _flag(
        None,
        "cost model JSON from `chunkserve profile` (with an adaptive budget, the "
        "default: the saved one, if any); every step's prediction is logged and exported "
        "beside its time",
    )
    """Profile JSON from ``chunkserve profile``; with an online budget (adaptive or
    ``itl_slo_ms``) the default is the one saved beside the model for this device, dtype and
    thread count, if any (else the model starts safe and learns). With a profile, every
    step's predicted time is logged and exported beside its measured time
    (``chunkserve:step_time_over_predicted``)."""
    schedule_conservativeness: float = _flag(
        1.0, "KV room kept for running requests' outputs when admitting (SGLang's flag)"
    )
    """Scales the KV room reserved for running requests' future outputs when admitting new
    ones (SGLang's flag): higher admits later and preempts less; 0 admits as soon as the
    prompt fits (vLLM-like: more preemption)."""
    seed: int = _flag(0, "sampler seed of unseeded requests")
    """Seed of the sampler for requests that carry no seed of their own."""
    num_threads: int | None = _flag(None, "torch threads on CPU")
    """torch intra-op threads on CPU; default: torch's choice."""
    attention_backend: str = _flag("auto", choices=ATTENTION_BACKENDS)
    """auto: triton on CUDA when Triton is installed, else torch (the reference)."""
    deterministic: bool = _flag(
        False,
        "batch-invariant kernels: a request's tokens and logprobs do not depend on its batch, "
        "chunking, cached prefix, preemption or speculation (CPU, the C attention kernel)",
    )
    """Deterministic inference: every op computes a row the same way whatever the batch, so
    a request gets bitwise-identical token ids and logprobs (in bf16 as in fp32) however it
    is batched, chunked, cached, preempted or speculated (in bf16 at any ``num_threads``;
    fp32 matmuls depend on the thread count, so a prefill/decode pair must run the same):
    the matmuls run on fixed 64-row tiles (``model.layers.RowTiling``) and every attention
    row in the C kernel's tile path over key ranges aligned on fixed blocks
    (``cpu_kernels``).
    CPU only, with the ``cpu`` attention backend (a clear error otherwise). Mixture-of-experts
    models too: an expert's matmul runs on the same row tiles however many of the step's
    tokens picked it. Tensor (and expert) parallel: a request's results do not depend on its
    batch, chunking, cache or preemption within one tensor-parallel size and layout (every
    rank's matmuls tiled, the all-reduce adding the ranks' parts in rank order whatever the
    step's size: ``TPGroup.all_reduce``), but they are not one process's bits, nor another
    size's or expert parallel's: a row-parallel matmul adds its ranks' partial products, a
    different reduction from the unsharded one (``tests/test_deterministic_e2e.py``)."""
    deterministic_quant_kernel: str = _flag(
        "int8",
        "the deterministic mode's kernel for GGUF block-quantized weights: int8 (any CPU) or "
        "bf16 (AMX-BF16: faster prefill, slower batch-1 decode)",
        choices=DETERMINISTIC_QUANT_KERNELS,
    )
    """The batch-invariant kernel of GGUF block-quantized weights (``--deterministic``; the
    plain mode picks its own): ``int8``, the int8-activation kernel (``quant.kernels.gemm``,
    AVX512-VNNI, AMX-INT8, AVX2 or portable C, the same bits on each); ``bf16``, AMX-BF16
    tiles over the weight dequantized to bf16 on every call (``quant.kernels.gemm_bf16``;
    CPUs with AMX-BF16 only, else a ``ValueError`` naming this option at load). Measured on
    the AMX Xeon (embedded model, 1 thread, quiet): the mode's 2,048-token prefill step
    1.20x the plain mode's with int8, 0.98x with bf16, but batch-1 decode 1.06x with int8
    and 1.80x with bf16 (``benchmarks/results/deterministic_quiet5_*.json``). Instances that
    must agree (a prefill/decode pair) must choose the same."""
    load_format: str = _flag(
        "auto",
        "dummy: random weights of the model's shapes (benchmarks; no weight files needed)",
        choices=LOAD_FORMATS,
    )
    """auto: read the weights from the model; dummy: random weights of the model's shapes,
    made on the device (benchmarks of shapes whose weights are not at hand; a directory with
    only config.json and a tokenizer is then enough)."""
    gguf_dequantize: bool = _flag(
        False,
        "GGUF files: dequantize the weights at load instead of keeping them in their "
        "quantized bits (CPU; on CUDA they are always dequantized)",
    )
    """A GGUF file's quantized tensors (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K) are
    kept in their bits on a CPU (about the file's size in memory; the matmuls read the
    blocks) unless this is set: then they are dequantized to ``dtype`` at load (as on CUDA,
    always). Other tensor types are dequantized either way."""
    quantization: str | None = _flag(
        None,
        "float (HF) checkpoints: quantize the linear layers' weights at load, weight-only "
        "(int8 / int4: GGUF Q8_0 / Q4_1 blocks of 32 columns) (CPU)",
        choices=QUANTIZATIONS,
    )
    """Weight-only quantization of a float (bf16/fp32 HF safetensors) checkpoint at load:
    each linear layer's weight is quantized as it streams in (``quant.weight_only``) into
    GGUF blocks of 32 input columns and run as a GGUF file's are: int8 as Q8_0 (one fp16
    scale a block, 8.5 bits a weight), int4 as Q4_1 (asymmetric, fp16 scale and min, 5 bits
    a weight): ``benchmarks/results/int4_q4_1.md``. The
    embedding, the LM head, norms, MoE experts and routers stay float. A GGUF file (already
    quantized) or an HF checkpoint with its own ``quantization_config`` is refused, as vLLM
    does; CPU only."""
    enforce_eager: bool = _flag(False, "never use CUDA graphs (CUDA only)")
    """Never use CUDA graphs (on CUDA, decode-only steps otherwise replay graphs captured at
    padded batch sizes)."""
    fused_ops: bool = _flag(
        True,
        "plain torch ops instead of the fused Triton norm/rotary/SiLU kernels (CUDA only)",
    )
    """On CUDA with Triton: fused RMSNorm(+residual), rotary and SiLU-mul kernels (False:
    plain torch ops)."""
    speculative_config: SpeculativeConfig | dict | str | None = _flag(  # noqa: RUF009 (a field)
        None,
        'speculative decoding as JSON (vLLM\'s form): {"method": "ngram", '
        '"num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4} or '
        '{"method": "draft_model", "model": PATH, "num_speculative_tokens": 4}; also '
        '"disable_by_batch_size", "min_acceptance_rate", "revision"',
    )
    """Speculative decoding (``SpeculativeConfig``; a dict or JSON text in vLLM's form, e.g.
    ``{"method": "ngram", "num_speculative_tokens": 4}``). None: off."""
    tensor_parallel_size: int = _flag(
        1,
        "split the model over this many processes (torch.distributed: gloo on CPU, NCCL "
        "on CUDA); on CPU each takes --num-threads (default: the cores / ranks on the node)",
        aliases=("--tp",),
    )
    """Ranks the model's layers are split across (Megatron-style, on torch.distributed: gloo
    on CPU, NCCL on CUDA), one process each; each holds its share of the weights and of the
    KV cache. On CPU each rank takes ``num_threads`` (default: the cores / local ranks)."""
    nnodes: int = _flag(
        1, "nodes the tensor-parallel ranks span (MASTER_ADDR/MASTER_PORT name node 0)"
    )
    """Nodes the tensor-parallel ranks span (``MASTER_ADDR``/``MASTER_PORT`` name rank 0's
    node when more than one); each node runs ``tensor_parallel_size / nnodes`` ranks."""
    node_rank: int = _flag(0, "this node's index: 0 serves, the others run their ranks headless")
    """This node's index among ``nnodes``: node 0 serves; the others only compute."""
    tensor_parallel_shm: bool = _flag(
        True, "tensor-parallel ranks on one CPU host sum over gloo instead of shared memory"
    )
    """Ranks on one CPU host sum their partial outputs through shared memory (gloo's
    per-call latency is ~100x a decode layer's work on a small VM); False: every
    collective on gloo."""
    enable_expert_parallel: bool = _flag(
        False,
        "mixture-of-experts models: divide the experts among the tensor-parallel ranks "
        "(whole experts each) instead of splitting every expert's columns",
    )
    """A mixture of experts over ``tensor_parallel_size`` ranks: each rank holds whole
    experts (a contiguous range), rather than its share of every expert's columns; a
    token's choices are computed on its experts' ranks and summed by the all-reduce after
    the layer (vLLM's ``--enable-expert-parallel``). A model without experts is refused."""
    disaggregation_mode: str | None = _flag(
        None,
        "prefill/decode disaggregation: 'prefill' computes prompts' KV and sends it to "
        "the decode instance that asked; 'decode' receives it and samples every token "
        "(put `chunkserve router` in front)",
        choices=DISAGGREGATION_MODES,
    )
    """Prefill/decode disaggregation (SGLang's ``--disaggregation-mode``): ``prefill``
    computes prompts' KV caches and sends them to the decode instance that asked
    (``chunkserve.disagg``); ``decode`` takes requests naming a prefill instance
    (``kv_transfer_params.prefill_url``, set by ``chunkserve router``), receives their KV
    and samples every token. None: colocated (requests naming one are refused)."""
    kv_connector: str = _flag(
        "shm",
        "decode side: how KV blocks arrive: shared memory (one host, the default) or "
        "torch.distributed point-to-point (separate hosts)",
        choices=KV_CONNECTORS,
    )
    """How a decode instance receives KV blocks: ``shm`` (a shared-memory file per transfer:
    both instances on one host) or ``torch`` (torch.distributed point-to-point: gloo on CPU,
    NCCL on CUDA; separate hosts). The prefill side follows what each handle names."""
    kv_transfer_host: str = _flag(
        "127.0.0.1", "--kv-connector torch: the address this decode instance listens on"
    )
    """``kv_connector="torch"``: the address a decode instance listens on for prefill
    instances (one they can reach)."""
    log_stats_interval: int = _flag(
        20,
        "decode-only steps summed into one info line (1: a line per step)",
        name="decode-log-interval",
    )
    """Log a summary line every this many decode-only steps (prefill/mixed steps always)."""

    def __post_init__(self) -> None:
        object.__setattr__(
            self, "speculative_config", SpeculativeConfig.parse(self.speculative_config)
        )
        object.__setattr__(
            self,
            "override_generation_config",
            parse_generation_overrides(self.override_generation_config),
        )
        for name in ("model", "tokenizer", "revision", "tokenizer_revision", "download_dir"):
            value = getattr(self, name)
            if isinstance(value, os.PathLike):  # LLM(model=Path(...))
                value = os.fspath(value)
                object.__setattr__(self, name, value)
            _require(
                value is None or (isinstance(value, str) and value.strip() != ""),
                name,
                f"must be a non-empty string, got {value!r}",
            )
        _require(
            isinstance(self.generation_config, str) and self.generation_config.strip() != "",
            "generation_config",
            f"must be 'auto', 'vllm' or a folder holding generation_config.json, got "
            f"{self.generation_config!r}",
        )
        _require(self.dtype in DTYPES, "dtype", f"must be one of {DTYPES}, got {self.dtype!r}")
        _require(self.device in DEVICES, "device", f"must be one of {DEVICES}, got {self.device!r}")
        _require(
            self.load_format in LOAD_FORMATS,
            "load_format",
            f"must be one of {LOAD_FORMATS}, got {self.load_format!r}",
        )
        _require(
            self.quantization in QUANTIZATIONS,
            "quantization",
            f"must be one of {QUANTIZATIONS[1:]} (or None), got {self.quantization!r}",
        )
        _require(
            self.deterministic_quant_kernel in DETERMINISTIC_QUANT_KERNELS,
            "deterministic_quant_kernel",
            f"must be one of {DETERMINISTIC_QUANT_KERNELS}, got "
            f"{self.deterministic_quant_kernel!r}",
        )
        _require(
            self.deterministic or self.deterministic_quant_kernel == "int8",
            "deterministic_quant_kernel",
            f"{self.deterministic_quant_kernel!r} is the deterministic mode's kernel: set "
            f"deterministic=True (--deterministic) too",
        )
        _require(
            self.attention_backend in ATTENTION_BACKENDS,
            "attention_backend",
            f"must be one of {ATTENTION_BACKENDS}, got {self.attention_backend!r}",
        )
        _require(
            self.max_model_len is None or self.max_model_len >= 2, "max_model_len", "must be >= 2"
        )
        _require(
            self.block_size >= 1 and self.block_size <= 1024, "block_size", "must be in [1, 1024]"
        )
        _require(
            self.kv_cache_memory is None or self.kv_cache_memory > 0,
            "kv_cache_memory",
            "must be a positive number of bytes",
        )
        _require(
            self.max_num_batched_tokens is None or self.max_num_batched_tokens >= 1,
            "max_num_batched_tokens",
            "must be >= 1",
        )
        _require(
            self.max_num_seqs is None or self.max_num_seqs >= 1, "max_num_seqs", "must be >= 1"
        )
        _require(self.itl_slo_ms is None or self.itl_slo_ms > 0, "itl_slo_ms", "must be > 0 ms")
        _require(
            self.max_decode_slowdown is None or self.max_decode_slowdown >= 1.0,
            "max_decode_slowdown",
            f"must be >= 1 (a step with prefill costs at least its decodes alone), got "
            f"{self.max_decode_slowdown!r}",
        )
        _require(
            self.max_decode_slowdown is None or self.itl_slo_ms is None,
            "max_decode_slowdown",
            "belongs to the adaptive budget; itl_slo_ms sets another target (give one)",
        )
        _require(
            self.long_step_share is None
            or (
                isinstance(self.long_step_share, (int, float))
                and 0.0 <= self.long_step_share <= MAX_LONG_STEP_SHARE
            ),
            "long_step_share",
            f"must be in [0, {MAX_LONG_STEP_SHARE}], got {self.long_step_share!r}",
        )
        _require(
            self.long_step_share is None
            or (self.itl_slo_ms is None and self.enable_chunked_prefill),
            "long_step_share",
            "belongs to the adaptive budget (not with itl_slo_ms or chunking off)",
        )
        _require(
            self.max_decode_slowdown is None or self.enable_chunked_prefill,
            "max_decode_slowdown",
            "needs chunked prefill (with chunking off every prompt is prefilled whole)",
        )
        _require(
            self.prefill_order in PREFILL_ORDERS,
            "prefill_order",
            f"must be one of {PREFILL_ORDERS}, got {self.prefill_order!r}",
        )
        _require(
            self.scheduling_policy in SCHEDULING_POLICIES,
            "scheduling_policy",
            f"must be one of {SCHEDULING_POLICIES}, got {self.scheduling_policy!r}",
        )
        _require(self.num_threads is None or self.num_threads >= 1, "num_threads", "must be >= 1")
        _require(self.log_stats_interval >= 1, "log_stats_interval", "must be >= 1")
        _require(
            _is_int(self.tensor_parallel_size) and self.tensor_parallel_size >= 1,
            "tensor_parallel_size",
            f"must be an integer >= 1, got {self.tensor_parallel_size!r}",
        )
        _require(
            _is_int(self.nnodes) and self.nnodes >= 1,
            "nnodes",
            f"must be an integer >= 1, got {self.nnodes!r}",
        )
        _require(
            _is_int(self.nnodes) and self.tensor_parallel_size % self.nnodes == 0,
            "nnodes",
            f"{self.nnodes} nodes cannot hold {self.tensor_parallel_size} tensor-parallel ranks "
            f"evenly",
        )
        _require(
            self.disaggregation_mode in DISAGGREGATION_MODES,
            "disaggregation_mode",
            f"must be one of {DISAGGREGATION_MODES}, got {self.disaggregation_mode!r}",
        )
        _require(
            self.kv_connector in KV_CONNECTORS,
            "kv_connector",
            f"must be one of {KV_CONNECTORS}, got {self.kv_connector!r}",
        )
        _require(
            self.disaggregation_mode is None or self.tensor_parallel_size == 1,
            "disaggregation_mode",
            "prefill/decode instances run one rank each (tensor_parallel_size 1)",
        )
        spec = self.speculative_config
        _require(
            self.disaggregation_mode != "decode"
            or not isinstance(spec, SpeculativeConfig)
            or spec.method != "draft_model",
            "speculative_config",
            "a draft model needs its own prefill of each prompt, which a decode instance "
            "does not run; use method ngram",
        )
        _require(
            _is_int(self.node_rank) and 0 <= self.node_rank < self.nnodes,
            "node_rank",
            f"must be in [0, nnodes - 1 = {self.nnodes - 1}], got {self.node_rank!r}",
        )
        for name in ("max_num_partial_prefills", "max_long_partial_prefills"):
            _require(getattr(self, name) >= 0, name, "must be >= 0 (0: no limit)")
        _require(
            self.long_prefill_token_threshold is None or self.long_prefill_token_threshold >= 0,
            "long_prefill_token_threshold",
            "must be >= 0",
        )
        _require(
            0.0 <= self.schedule_conservativeness <= 10.0,
            "schedule_conservativeness",
            "must be in [0, 10]",
        )

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineConfig:
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise TypeError(f"unknown engine option(s): {', '.join(unknown)}")
        return cls(**kwargs)

    def resolve_max_model_len(self, model_config: ModelConfig) -> int:
        """The context length the engine serves: the user's, or the model's."""
        return self.max_model_len or model_config.max_position_embeddings

    def budget_policy(self, max_model_len: int) -> BudgetPolicy:
        """How steps get their token budget, every default resolved: a named target wins;
        a budget named alone is static; nothing named (with chunking on) is adaptive."""
        cap = self.max_num_batched_tokens or min(DEFAULT_BUDGET_CAP, max_model_len)
        if self.itl_slo_ms is not None:
            return BudgetPolicy("itl-target", cap, itl_slo_s=self.itl_slo_ms / 1e3)
        if (
            self.max_decode_slowdown is not None
            or self.long_step_share is not None
            or (self.max_num_batched_tokens is None and self.enable_chunked_prefill)
        ):
            slowdown = self.max_decode_slowdown or DEFAULT_DECODE_SLOWDOWN
            share = self.long_step_share
            return BudgetPolicy(
                "adaptive",
                cap,
                decode_slowdown=slowdown,
                long_step_share=DEFAULT_LONG_STEP_SHARE if share is None else share,
            )
        return BudgetPolicy("static", self.max_num_batched_tokens or DEFAULT_MAX_NUM_BATCHED_TOKENS)

    def scheduler_config(self, max_model_len: int) -> SchedulerConfig:
        """The scheduler's slice, with every default resolved."""
        budget = self.budget_policy(max_model_len).max_num_batched_tokens
        max_num_seqs = self.max_num_seqs
        if max_num_seqs is None:
            max_num_seqs = DEFAULT_MAX_NUM_SEQS
            if self.enable_chunked_prefill:
                max_num_seqs = min(max_num_seqs, budget)
        threshold = self.long_prefill_token_threshold
        if threshold is None:
            threshold = max(1, int(0.04 * max_model_len))  # vLLM's default
        return SchedulerConfig(
            max_num_batched_tokens=budget,
            max_num_seqs=max_num_seqs,
            max_model_len=max_model_len,
            block_size=self.block_size,
            enable_chunked_prefill=self.enable_chunked_prefill,
            policy=self.scheduling_policy,
            prefill_order=self.prefill_order,
            max_num_partial_prefills=self.max_num_partial_prefills,
            max_long_partial_prefills=self.max_long_partial_prefills,
            long_prefill_token_threshold=threshold,
            init_new_token_ratio=min(1.0, 0.7 * self.schedule_conservativeness),
            min_new_token_ratio=min(1.0, 0.15 * self.schedule_conservativeness),
            spec_disable_by_batch_size=(
                (self.speculative_config.disable_by_batch_size or 0)
                if self.speculative_config
                else 0
            ),
        )

    def replace(self, **changes: Any) -> EngineConfig:
        return dataclasses.replace(self, **changes)
