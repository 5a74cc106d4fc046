"""OpenAI-compatible request bodies (pydantic) and their mapping to ``SamplingParams``.

Unknown fields are ignored, as OpenAI's and vLLM's servers do, except those a client relies
on and this server cannot honour (``UNSUPPORTED_FIELDS``, ``best_of`` other than ``n``): a
400 names them. Structured outputs come as OpenAI's ``response_format`` (``json_object``,
``json_schema``), vLLM's ``structured_outputs`` object or its older ``guided_json``,
``guided_regex``, ``guided_choice`` and ``guided_grammar``; at most one of them. Known
fields are type-checked (a wrong type is a 400 naming the field). Extensions follow vLLM's
names: ``top_k``, ``min_p``, ``repetition_penalty``, ``stop_token_ids``, ``ignore_eos``,
``min_tokens``, ``priority``, ``include_stop_str_in_output``, ``skip_special_tokens``,
``stream_options.continuous_usage_stats``. Chat requests take ``tools``, ``tool_choice`` and
``parallel_tool_calls`` (``tools.py``); ``/v1/completions`` refuses them.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from chunkserve.engine.input_processor import check_unicode
from chunkserve.entrypoints.openai.tools import ToolSpec, check_tools
from chunkserve.scheduling.sampling_params import SamplingParams, StructuredOutputsParams

MAX_N = 16
# Sequences one request may start (prompts x n): OpenAI's cap on n; the rest of the queue
# belongs to other clients.
MAX_SEQUENCES_PER_REQUEST = 128


class StreamOptions(BaseModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False
    """vLLM's extension: a usage object in every chunk (the tokens so far)."""


# Fields clients send that this server does not implement: a 400 naming them beats silently
# ignoring them (a client asking for JSON or tools would get free text back as a success).
UNSUPPORTED_FIELDS = (
    "tools",
    "tool_choice",
    "functions",
    "function_call",
    "parallel_tool_calls",
    "suffix",
    "audio",
    "prediction",
)


class _SamplingFields(BaseModel):
    # Extra fields are kept (not validated) so that ``unsupported`` can name them.
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    n: int = Field(default=1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    priority: int = 0
    ignore_eos: bool = False
    min_tokens: int = 0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    logit_bias: dict[str, float] | None = None
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    best_of: int | None = None
    # vLLM's: every prompt token's logprob and top-n (0..20), in each choice.
    prompt_logprobs: int | None = None
    # Prefill/decode disaggregation (``chunkserve router`` sets it; vLLM's name).
    kv_transfer_params: dict[str, Any] | None = None

    def unsupported(self) -> str | None:
        """The first field this server refuses (it cannot honour it), if any."""
        extra = self.model_extra or {}
        for name in UNSUPPORTED_FIELDS:
            if extra.get(name) not in (None, [], {}, False):
                return name
        if self.best_of is not None and self.best_of != self.n:
            return "best_of"
        return None

    def token_biases(self) -> dict[int, float] | None:
        """``logit_bias`` with its keys (token ids sent as strings, as OpenAI's are) as
        integers; ``ValueError`` naming the field for a key that is not one."""
        if not self.logit_bias:
            return None
        out = {}
        for key, value in self.logit_bias.items():
            try:
                token = int(key)
            except ValueError:
                raise ValueError(f"logit_bias: {key!r} is not a token id") from None
            out[token] = value
        return out

    def structured(self) -> StructuredOutputsParams | None:
        """The output constraint the request asks for, if any; ``ValueError`` naming the
        field for a malformed one or for more than one."""
        found: list[tuple[str, StructuredOutputsParams]] = []
        rf = self.response_format
        if rf is not None:
            kind = rf.get("type", "text")
            if kind == "json_object":
                found.append(
                    (
                        "response_format",
                        StructuredOutputsParams(json_object=True, origin="response_format"),
                    )
                )
            elif kind == "json_schema":
                spec = rf.get("json_schema")
                schema = spec.get("schema") if isinstance(spec, dict) else None
                if not isinstance(schema, dict):
                    raise ValueError(
                        "response_format.json_schema: must be an object with a 'schema' "
                        "(the JSON schema)"
                    )
                origin = "response_format.json_schema.schema"
                found.append(
                    ("response_format", StructuredOutputsParams(json=schema, origin=origin))
                )
            elif kind != "text":
                raise ValueError(
                    f"response_format.type: must be 'text', 'json_object' or 'json_schema', "
                    f"got {kind!r}"
                )
        if self.structured_outputs is not None:
            # Fields sent as null are absent (clients serialise every field of vLLM's).
            fields = {k: v for k, v in self.structured_outputs.items() if v is not None}
            unknown = sorted(set(fields) - {"json", "regex", "choice", "grammar", "json_object"})
            if unknown:
                raise ValueError(f"structured_outputs.{unknown[0]}: not a supported field")
            if fields.get("json_object") is False:
                fields.pop("json_object")
            found.append(("structured_outputs", StructuredOutputsParams(**fields)))
        for name, kind in (
            ("guided_json", "json"),
            ("guided_regex", "regex"),
            ("guided_choice", "choice"),
            ("guided_grammar", "grammar"),
        ):
            value = getattr(self, name)
            if value is not None:
                found.append((name, StructuredOutputsParams(**{kind: value, "origin": name})))
        if len(found) > 1:
            names = [n for n, _ in found]
            raise ValueError(f"{names[1]}: give one output constraint, not {' and '.join(names)}")
        return found[0][1] if found else None

    def max_tokens_given(self) -> bool:
        """Whether the request named its length (else the model's default may apply)."""
        return any(
            getattr(self, name, None) is not None
            for name in ("max_tokens", "max_completion_tokens")
            if name in self.model_fields_set
        )

    def resolved_prompt_logprobs(self, logprobs: int | None) -> int | None:
        """``prompt_logprobs``, or for ``echo`` with ``logprobs`` (OpenAI's legacy way of
        scoring a prompt) the ``logprobs`` top-n; the larger when both are given."""
        asked = [self.prompt_logprobs]
        if getattr(self, "echo", False) and logprobs is not None:
            asked.append(logprobs)
        given = [n for n in asked if n is not None]
        if not given:
            return None
        return max(given) if all(isinstance(n, int) for n in given) else given[0]

    def sampling_params(
        self, max_tokens: int | None, logprobs: int | None, seed_offset: int = 0
    ) -> SamplingParams:
        """Raises ``ValueError`` naming the field for out-of-range values. The fields a model's
        generation config may default (``--generation-config``) are passed only when the
        request gives them, so ``SamplingParams.fields_set`` tells which it left unset."""
        optional = {
            name: getattr(self, name)
            for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
            if getattr(self, name) is not None
        }
        params = SamplingParams(
            max_tokens=max_tokens,
            prompt_logprobs=self.resolved_prompt_logprobs(logprobs),
            **optional,
            seed=None if self.seed is None else self.seed + seed_offset,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
            min_tokens=self.min_tokens,
            logprobs=logprobs,
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens,
            logit_bias=self.token_biases(),
            structured_outputs=self.structured(),
            kv_transfer_params=self.kv_transfer_params,
        )
        if not self.max_tokens_given():
            params.fields_set.discard("max_tokens")  # this endpoint's default, not the user's
        return params


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False

    def engine_max_tokens(self) -> tuple[int | None, bool]:
        """``(max_tokens for the engine, whether the reply drops what it generates)``:
        ``max_tokens: 0`` (scoring a prompt, with ``echo``) runs one token and drops it;
        without ``echo`` it is a 400 naming ``max_tokens``."""
        if self.max_tokens == 0:
            if not self.echo:
                raise ValueError("max_tokens: 0 generates nothing; it needs echo=true")
            return 1, True
        return self.max_tokens, False

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise ValueError("prompt: must not be empty")
        if all(isinstance(x, int) for x in p):
            return [list(p)]  # one prompt of token ids
        return list(p)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None

    def as_template_dict(self) -> dict[str, Any]:
        """Text parts joined; the template sees role, content (and name if given)."""
        content = self.content
        if isinstance(content, list):
            texts = []
            for i, part in enumerate(content):
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise ValueError(f"messages.content[{i}]: only text parts are supported")
                texts.append(part["text"])
            content = "".join(texts)
        out: dict[str, Any] = {"role": self.role, "content": content or ""}
        if self.name is not None:
            out["name"] = self.name
        if self.tool_calls:
            out["tool_calls"] = self.tool_calls
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    # Tool calling (see ``tools.py``); ``/v1/completions`` still refuses these fields.
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None

    def tool_spec(self) -> ToolSpec | None:
        """The checked tools and choice (None: no tool calling); ``ValueError`` naming the
        field otherwise."""
        return check_tools(self.tools, self.tool_choice, self.parallel_tool_calls)

    def structured(self) -> StructuredOutputsParams | None:
        """A forced tool choice's constraint, or the request's own (not both)."""
        own = super().structured()
        spec = self.tool_spec()
        if spec is None or not spec.forced:
            return own
        if own is not None:
            raise ValueError(f"tool_choice: a forced call cannot be combined with {own.origin}")
        return StructuredOutputsParams(grammar=spec.constraint(), origin="tools")

    def resolved_max_tokens(self) -> int | None:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens

    def resolved_logprobs(self) -> int | None:
        if not self.logprobs:
            if self.top_logprobs:
                raise ValueError("top_logprobs: needs logprobs=true")
            return None
        return self.top_logprobs or 0


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[Any] | None = None  # with messages: counted as a chat request's prompt
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    tokens: list[int]


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int | str | None = None


class ErrorResponse(BaseModel):
    """The OpenAI error body every 4xx/5xx carries."""

    error: ErrorDetail


def error_responses(*codes: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI ``responses`` for a route: its error statuses, all with ``ErrorResponse``."""
    text = {
        400: "invalid request (the error names the field)",
        401: "missing or wrong API key",
        404: "unknown model",
        413: "request body too large",
        500: "the request failed in the engine",
        503: "overloaded, shutting down, or the engine is dead",
        504: "the request ran past --request-timeout",
    }
    return {c: {"model": ErrorResponse, "description": text[c]} for c in codes}


def check_text(body: BaseModel) -> None:
    """``ValueError`` naming the first string in a request body that is not Unicode text
    (JSON lets ``"\\ud800"`` escape a lone UTF-16 surrogate; no tokenizer, template or
    encoder takes it): ``prompt``, ``stop``, ``messages[0].content``, ... A string in a list
    of strings names the list; a dict key names its dict."""
    _check_text(body.model_dump(), "")


def _check_text(value: Any, path: str) -> None:
    if isinstance(value, str):
        check_unicode(path or "body", value)
    elif isinstance(value, dict):
        for key, item in value.items():
            if isinstance(key, str):
                check_unicode(path or "body", key)
            _check_text(item, f"{path}.{key}" if path else str(key))
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            _check_text(item, f"{path}[{i}]" if isinstance(item, (dict, list)) else path)


def param_of(exc: ValueError) -> str | None:
    """The field a ``ValueError`` names (our messages start with ``field: ``)."""
    text = str(exc)
    head, sep, _ = text.partition(":")
    if sep and head and " " not in head.strip():
        return head.strip()
    return None


FinishReason = Literal["stop", "length", "abort", "error"]
