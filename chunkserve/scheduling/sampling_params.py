"""A request's sampling parameters (the public ``SamplingParams``), its structured-output
and KV-transfer parameters, and the caps one request may ask for. Each checks itself in
``validate()``. ``SamplingParams`` validates itself when built; the front end's edge check
(``InputProcessor.check``) validates it again only if a field was set since
(``validate_if_changed``), so an unchanged request is validated once.

Pure Python (no torch).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import json as _json
from dataclasses import dataclass
from typing import Any

MAX_LOGPROBS = 20
# Temperatures below this sample greedily (vLLM's rule: logits / 1e-40 overflow to inf, and
# the softmax of infinities is NaN).
SAMPLING_EPS = 1e-5
# Caps on what one request may ask the engine to check every token (stop strings are
# searched in the detokenised text, stop ids and biases looked up per step).
MAX_STOP_STRINGS = 32
MAX_STOP_STRING_CHARS = 512
MAX_STOP_TOKEN_IDS = 256
MAX_LOGIT_BIAS = 300
LOGIT_BIAS_LIMIT = 100.0
# Integer fields travel as 64-bit values (torch generators take an unsigned 64-bit seed).
INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1
SEED_MAX = (1 << 64) - 1
INT32_MAX = (1 << 31) - 1


def _check(cond: bool, name: str, message: str) -> None:
    if not cond:
        raise ValueError(f"{name}: {message}")


# Caps on a structured-output constraint (compiled once per distinct one, and cached).
MAX_GRAMMAR_CHARS = 64 << 10
MAX_CHOICES = 256
# What may come before a constrained output (``StructuredOutputsParams.reasoning``).
REASONING_FORMATS = ("think", "optional_think", "harmony")


MAX_URL_CHARS = 2048


@dataclass
class KVTransferParams:
    """Prefill/decode disaggregation (``chunkserve.disagg``): exactly one of

    - ``prefill_url``, to a decode instance: compute this prompt's KV cache on that prefill
      instance (``http(s)://host:port``), receive it here, then sample every token here;
    - ``send``, to a prefill instance: a connector handle (``disagg.connector.KVHandle`` as
      a dict, made by the decode instance that asks): where this prompt's KV blocks go.
    """

    prefill_url: str | None = None
    send: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        name = "kv_transfer_params"
        _check(
            (self.prefill_url is None) != (self.send is None),
            name,
            "give exactly one of 'prefill_url' (to a decode instance) and 'send' (to a "
            "prefill instance)",
        )
        url = self.prefill_url
        _check(
            url is None
            or (
                isinstance(url, str)
                and url.startswith(("http://", "https://"))
                and len(url) <= MAX_URL_CHARS
            ),
            f"{name}.prefill_url",
            f"must be an http(s):// URL of at most {MAX_URL_CHARS} characters, got {url!r}",
        )
        _check(
            self.send is None or isinstance(self.send, dict),
            f"{name}.send",
            "must be an object (a KV connector handle)",
        )


@dataclass
class StructuredOutputsParams:
    """Constrain the output to a grammar: exactly one of ``json`` (a JSON schema, as a dict
    or its text), ``json_object`` (any JSON object), ``regex``, ``choice`` (one of these
    strings) or ``grammar`` (EBNF, xgrammar's dialect of GBNF). vLLM's names.

    Pure data; ``structured.grammar_of`` turns it into a grammar (the edge checks that it
    compiles: ``input_processor.InputProcessor``)."""

    json: str | dict | None = None
    """A JSON schema; a dict is kept as its JSON text."""
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool = False
    # The request field it came from, named in errors (``response_format`` for OpenAI's).
    origin: str = "structured_outputs"
    reasoning: str | None = None
    """Reasoning the model writes before the constrained output, free (any text), so the
    constraint starts where the reasoning ends: None (at the first token), ``"think"``
    (reasoning from the first token up to ``</think>``: DeepSeek-R1, whose template opens
    ``<think>`` in the prompt), ``"optional_think"`` (a ``<think>...</think>`` block, or
    none: Qwen3; up to 4 spaces or newlines may follow ``</think>``) or ``"harmony"``
    (GPT-OSS: an optional analysis message, then the constrained output as the final
    channel's body). The server sets it from ``--reasoning-parser``; ``max_tokens`` counts
    the reasoning's tokens too."""

    def __post_init__(self) -> None:
        if isinstance(self.choice, tuple):
            self.choice = list(self.choice)
        if isinstance(self.json, dict):
            # Kept as its text: one form to cache by, capped in size like a text schema,
            # and any JSON number crosses the process boundary (msgpack's are 64-bit).
            try:
                self.json = _json.dumps(self.json)
            except (TypeError, ValueError, RecursionError) as exc:
                raise ValueError(f"{self.field('json')}: not JSON ({exc})") from None
        self.validate()

    @property
    def kind(self) -> str:
        """Which constraint this is: json | json_object | regex | choice | grammar."""
        for name in ("json", "regex", "choice", "grammar"):
            if getattr(self, name) is not None:
                return name
        return "json_object"

    def field(self, name: str | None = None) -> str:
        """The name of a field as errors give it."""
        if self.origin == "structured_outputs":
            return f"structured_outputs.{name or self.kind}"
        return self.origin

    def validate(self) -> None:
        given = [n for n in ("json", "regex", "choice", "grammar") if getattr(self, n) is not None]
        if self.json_object is True:
            given.append("json_object")
        _check(
            len(given) == 1,
            self.origin,
            "give exactly one of json, json_object, regex, choice or grammar"
            + (f" (got {', '.join(given)})" if given else ""),
        )
        _check(isinstance(self.json_object, bool), self.field("json_object"), "must be a boolean")
        _check(
            self.reasoning is None or self.reasoning in REASONING_FORMATS,
            self.field("reasoning"),
            f"must be one of {', '.join(REASONING_FORMATS)} or null, got {self.reasoning!r}",
        )
        name = self.field()
        kind = self.kind
        if kind in ("json", "regex", "grammar"):  # a schema is text by now (__post_init__)
            text = getattr(self, kind)
            what = "a JSON schema (an object, or its text)" if kind == "json" else "a string"
            _check(isinstance(text, str) and text.strip() != "", name, f"must be {what}")
            _check(len(text) <= MAX_GRAMMAR_CHARS, name, f"at most {MAX_GRAMMAR_CHARS} characters")
        elif kind == "choice":
            choice = self.choice
            _check(
                isinstance(choice, list)
                and 0 < len(choice) <= MAX_CHOICES
                and all(isinstance(c, str) and c for c in choice),
                name,
                f"must be a list of 1 to {MAX_CHOICES} non-empty strings",
            )
            _check(
                sum(len(c) for c in choice) <= MAX_GRAMMAR_CHARS,
                name,
                f"at most {MAX_GRAMMAR_CHARS} characters in all",
            )

    def key(self) -> tuple[str, str, str | None]:
        """What identifies the compiled grammar: (kind, its text, the reasoning before it)."""
        kind = self.kind
        if kind == "choice":
            return kind, _json.dumps(self.choice), self.reasoning
        if kind == "json_object":
            return kind, "", self.reasoning
        return kind, getattr(self, kind), self.reasoning


@dataclass
class SamplingParams:
    """How to pick tokens and when to stop. Field names follow vLLM and the OpenAI API."""

    max_tokens: int | None = 16
    """Most tokens to generate; None: up to ``max_model_len``."""
    temperature: float = 1.0
    """0 (or below ``SAMPLING_EPS``) means greedy."""
    top_p: float = 1.0
    top_k: int = 0
    """0 or -1 disables top-k."""
    min_p: float = 0.0
    seed: int | None = None
    """Per-request seed: the same tokens whatever else shares the batch."""
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: str | list[str] | None = None
    """Strings that end generation; trimmed from the text."""
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    """vLLM's: every prompt token's logprob (the first's None) and its top-n alternatives
    (0..20), computed over each prefill chunk's rows. Such a request bypasses the prefix
    cache (a cached prefix has no logits to give): its whole prompt is computed."""
    """Return the sampled token's logprob and the top-n alternatives (0..20)."""
    skip_special_tokens: bool = True
    keep_special_token_ids: list[int] | None = None
    """Special tokens written into the text even with ``skip_special_tokens`` (the markers a
    tool-call or reasoning parser reads, e.g. Mistral's ``[TOOL_CALLS]``); others are still
    skipped."""
    include_stop_str_in_output: bool = False
    logit_bias: dict[int, float] | None = None
    """Added to the logits of these token ids before sampling (OpenAI's semantics: -100
    bans a token, 100 all but forces it); logprobs stay those of the model."""
    structured_outputs: StructuredOutputsParams | None = None
    """Constrain the output to a JSON schema, regex, choice or grammar (see
    ``StructuredOutputsParams``); a dict of its fields is taken too. Logprobs are then of
    the masked distribution."""
    kv_transfer_params: KVTransferParams | None = None
    """Prefill/decode disaggregation (``KVTransferParams``; a dict of its fields is taken
    too): where this prompt's KV cache comes from or goes."""

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.keep_special_token_ids = (
            list(self.keep_special_token_ids) if self.keep_special_token_ids else None
        )
        self.logit_bias = dict(self.logit_bias) if self.logit_bias else None
        if isinstance(self.structured_outputs, dict):
            try:
                self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
            except TypeError as exc:
                raise ValueError(f"structured_outputs: {exc}") from None
        if isinstance(self.kv_transfer_params, dict):
            try:
                self.kv_transfer_params = KVTransferParams(**self.kv_transfer_params)
            except TypeError as exc:
                raise ValueError(f"kv_transfer_params: {exc}") from None
        self.validate()

    def __setattr__(self, name: str, value: Any) -> None:
        object.__setattr__(self, name, value)
        object.__setattr__(self, "_validated", False)  # a field changed since validate()
        given = self.__dict__.get("fields_set")
        if given is not None and name in _FIELD_NAMES:
            given.add(name)  # set after construction: the caller's choice

    def with_defaults(self, defaults: dict[str, Any]) -> SamplingParams:
        """These parameters with ``defaults`` (field -> value: a model's generation config)
        in every field the caller left unset (not in ``fields_set``); ``self`` is unchanged
        (one object may serve many prompts). ``ValueError`` naming a field if the mix is
        out of range (``min_tokens`` above a default ``max_tokens``)."""
        # One rebuilt without ``__init__`` (decoded from a message) counts as all set.
        given = self.__dict__.get("fields_set", _FIELD_NAMES)
        apply = {k: v for k, v in defaults.items() if k not in given}
        if not apply:
            return self
        out = copy.copy(self)
        object.__setattr__(out, "fields_set", set(given))
        for key, value in apply.items():
            object.__setattr__(out, key, value)
        out.validate()
        return out

    def validate_if_changed(self) -> None:
        """``validate()``, unless it passed and no field was set since. (A list or dict
        changed in place is not seen: call ``validate()`` after that.)"""
        if not self.__dict__.get("_validated", False):
            self.validate()

    def validate(self) -> None:
        """``ValueError`` naming the first field out of range."""
        self._validate()
        object.__setattr__(self, "_validated", True)

    def _validate(self) -> None:
        _check(
            self.max_tokens is None or (_is_int(self.max_tokens) and self.max_tokens >= 1),
            "max_tokens",
            f"must be an integer >= 1, got {self.max_tokens!r}",
        )
        _check(
            _is_number(self.temperature) and self.temperature >= 0.0,
            "temperature",
            f"must be >= 0, got {self.temperature!r}",
        )
        _check(
            _is_number(self.top_p) and 0.0 < self.top_p <= 1.0,
            "top_p",
            f"must be in (0, 1], got {self.top_p!r}",
        )
        _check(
            _is_int(self.top_k) and -1 <= self.top_k <= INT32_MAX,
            "top_k",
            f"must be -1, 0 (disabled) or a positive integer up to {INT32_MAX} (more than "
            f"the vocabulary keeps every token), got {self.top_k!r}",
        )
        _check(
            _is_number(self.min_p) and 0.0 <= self.min_p <= 1.0,
            "min_p",
            f"must be in [0, 1], got {self.min_p!r}",
        )
        _check(
            self.seed is None or (_is_int(self.seed) and INT64_MIN <= self.seed <= SEED_MAX),
            "seed",
            f"must be an integer in [-2^63, 2^64), got {self.seed!r}",
        )
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(
                _is_number(value) and -2.0 <= value <= 2.0,
                name,
                f"must be in [-2, 2], got {value!r}",
            )
        _check(
            _is_number(self.repetition_penalty) and self.repetition_penalty > 0.0,
            "repetition_penalty",
            f"must be > 0, got {self.repetition_penalty!r}",
        )
        _check(
            all(isinstance(s, str) and s for s in self.stop), "stop", "must be non-empty strings"
        )
        _check(
            len(self.stop) <= MAX_STOP_STRINGS
            and all(len(s) <= MAX_STOP_STRING_CHARS for s in self.stop),
            "stop",
            f"at most {MAX_STOP_STRINGS} strings of at most {MAX_STOP_STRING_CHARS} characters",
        )
        _check(
            all(_is_int(t) and 0 <= t <= INT32_MAX for t in self.stop_token_ids)
            and len(self.stop_token_ids) <= MAX_STOP_TOKEN_IDS,
            "stop_token_ids",
            f"must be at most {MAX_STOP_TOKEN_IDS} token ids (non-negative integers)",
        )
        bias = self.logit_bias or {}
        _check(
            len(bias) <= MAX_LOGIT_BIAS
            and all(_is_int(t) and 0 <= t <= INT32_MAX for t in bias)
            and all(
                _is_number(b) and -LOGIT_BIAS_LIMIT <= b <= LOGIT_BIAS_LIMIT for b in bias.values()
            ),
            "logit_bias",
            f"must map at most {MAX_LOGIT_BIAS} token ids to biases in "
            f"[-{LOGIT_BIAS_LIMIT:g}, {LOGIT_BIAS_LIMIT:g}]",
        )
        _check(
            _is_int(self.min_tokens) and 0 <= self.min_tokens <= INT32_MAX,
            "min_tokens",
            f"must be an integer >= 0, got {self.min_tokens!r}",
        )
        _check(
            self.max_tokens is None or self.min_tokens <= self.max_tokens,
            "min_tokens",
            f"({self.min_tokens}) must be <= max_tokens ({self.max_tokens})",
        )
        _check(
            self.logprobs is None
            or (isinstance(self.logprobs, int) and 0 <= self.logprobs <= MAX_LOGPROBS),
            "logprobs",
            f"must be in [0, {MAX_LOGPROBS}], got {self.logprobs!r}",
        )
        _check(
            self.prompt_logprobs is None
            or (_is_int(self.prompt_logprobs) and 0 <= self.prompt_logprobs <= MAX_LOGPROBS),
            "prompt_logprobs",
            f"must be in [0, {MAX_LOGPROBS}], got {self.prompt_logprobs!r}",
        )
        _check(
            self.prompt_logprobs is None
            or self.kv_transfer_params is None
            or self.kv_transfer_params.prefill_url is None,
            "prompt_logprobs",
            "not available with kv_transfer_params.prefill_url (a prompt prefilled by another "
            "instance has no logits here)",
        )
        for name, cls in (
            ("structured_outputs", StructuredOutputsParams),
            ("kv_transfer_params", KVTransferParams),
        ):
            nested = getattr(self, name)
            _check(
                nested is None or isinstance(nested, cls),
                name,
                f"must be a {cls.__name__} or a dict of its fields",
            )
            if nested is not None:
                nested.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS

    @property
    def has_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )


_FIELD_NAMES = frozenset(f.name for f in dataclasses.fields(SamplingParams))
_dataclass_init = SamplingParams.__init__


@functools.wraps(_dataclass_init)
def _init_recording_given(self: SamplingParams, *args: Any, **kwargs: Any) -> None:
    """The dataclass's ``__init__``, then ``fields_set``: the fields the caller named
    (positionally or by keyword), as pydantic's ``model_fields_set``. A field set later
    (``params.temperature = 0.5``) joins it. Defaults of a model's generation config fill
    only the others (``with_defaults``): "unset" is told from "set to the default"."""
    _dataclass_init(self, *args, **kwargs)
    names = [f.name for f in dataclasses.fields(SamplingParams)]
    object.__setattr__(self, "fields_set", set(names[: len(args)]) | set(kwargs))


SamplingParams.__init__ = _init_recording_given  # type: ignore[method-assign]


def _is_number(x: object) -> bool:
    """A finite int or float (not a bool, not NaN or infinite)."""
    if not isinstance(x, (int, float)) or isinstance(x, bool):
        return False
    return x == x and x not in (float("inf"), float("-inf"))


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)
