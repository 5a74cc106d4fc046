"""The OpenAI-compatible HTTP server (FastAPI) over an ``AsyncEngine``.

Endpoints: ``/v1/completions``, ``/v1/chat/completions`` (both streamed as SSE or not),
``/v1/models``, ``/health``, ``/version``, ``/tokenize``, ``/detokenize``, ``/metrics``.
Errors have OpenAI's body ``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from chunkserve.engine.async_engine import (
    AsyncEngine,
    EngineDeadError,
    OverloadedError,
    RequestFailedError,
    RequestHandle,
    RequestTimeoutError,
)
from chunkserve.engine.input_processor import CheckedRequest
from chunkserve.engine.output_processor import PromptTokenLogprob, RequestOutput, TokenLogprob
from chunkserve.entrypoints.openai.metrics import Metrics
from chunkserve.entrypoints.openai.protocol import (
    MAX_SEQUENCES_PER_REQUEST,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    check_text,
    error_responses,
    param_of,
)
from chunkserve.entrypoints.openai.reasoning_parsers import (
    detect_reasoning_parser,
    get_reasoning_parser,
)
from chunkserve.entrypoints.openai.responses import (
    SSE_DONE,
    error_body,
    error_response,
    sse_event,
)
from chunkserve.entrypoints.openai.tool_parsers import (
    Event,
    HarmonyParser,
    Reasoning,
    ReplyParser,
    collect,
    detect_tool_parser,
    get_tool_parser,
)
from chunkserve.entrypoints.openai.tools import (
    ToolSpec,
    check_tools,
    encode_chat_with_tools,
)
from chunkserve.version import __version__

logger = logging.getLogger("chunkserve.server")

DEFAULT_MAX_BODY_BYTES = 32 << 20
DISCONNECT_POLL_S = 0.2


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        err_type: str = "invalid_request_error",
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.err_type, self.param = status, message, err_type, param
        self.headers = headers


class _BodyTooLarge(Exception):
    pass


class BodyLimitMiddleware:
    """Rejects request bodies over ``max_bytes`` with a 413 (declared or streamed size)."""

    def __init__(self, app: Any, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        declared = headers.get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await self._reject(scope, receive, send)
            return
        seen = 0

        async def limited() -> dict:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise _BodyTooLarge
            return message

        try:
            await self.app(scope, limited, send)
        except _BodyTooLarge:
            await self._reject(scope, receive, send)

    async def _reject(self, scope: dict, receive: Callable, send: Callable) -> None:
        response = error_response(
            413, f"request body is larger than {self.max_bytes} bytes", "invalid_request_error"
        )
        await response(scope, receive, send)


class APIKeyMiddleware:
    """``Authorization: Bearer KEY`` on /v1 and the tokenizer routes, compared in constant
    time. A plain ASGI middleware: Starlette's BaseHTTPMiddleware would hide client
    disconnects from the endpoints."""

    def __init__(self, app: Any, api_key: str) -> None:
        self.app = app
        self.key = api_key.encode()

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] == "http" and _needs_auth(scope.get("path", "")):
            headers = dict(scope.get("headers") or [])
            value = headers.get(b"authorization", b"")
            token = value[7:] if value[:7].lower() == b"bearer " else b""
            if not hmac.compare_digest(token, self.key):
                response = error_response(401, "invalid or missing API key", "authentication_error")
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


@dataclass
class ServerState:
    engine: AsyncEngine
    model_name: str
    api_key: str | None
    metrics: Metrics
    created: int
    request_timeout: float | None = None
    tool_call_parser: str = "hermes"
    reasoning_parser: str | None = None


def resolve_parsers(
    chat_template: str | None, tool_call_parser: str, reasoning_parser: str | None
) -> tuple[str, str | None, list[str]]:
    """``(tool-call parser, reasoning parser or None, lines saying why)``: ``auto`` picks
    from the chat template (``detect_tool_parser`` / ``detect_reasoning_parser``), ``none``
    turns reasoning parsing off; an unknown name is a ``ValueError`` naming the flag."""
    why = []
    if tool_call_parser == "auto":
        tool_call_parser, reason = detect_tool_parser(chat_template)
        why.append(f"tool-call parser {tool_call_parser} ({reason})")
    get_tool_parser(tool_call_parser)
    if reasoning_parser == "auto":
        reasoning_parser, reason = detect_reasoning_parser(chat_template)
        why.append(f"reasoning parser {reasoning_parser or 'none'} ({reason})")
    elif reasoning_parser == "none":
        reasoning_parser = None
    if reasoning_parser is not None:
        get_reasoning_parser(reasoning_parser)
    return tool_call_parser, reasoning_parser, why


def build_app(
    async_engine: AsyncEngine,
    *,
    served_model_name: str,
    api_key: str | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    request_timeout: float | None = None,
    tool_call_parser: str = "hermes",
    reasoning_parser: str | None = None,
) -> FastAPI:
    engine = async_engine.engine
    # An unknown name fails here, not at the first call; ``auto`` is decided and said here.
    tool_call_parser, reasoning_parser, why = resolve_parsers(
        engine.tokenizer.chat_template, tool_call_parser, reasoning_parser
    )
    for line in why:
        logger.info("chat replies: %s", line)
    metrics = Metrics(engine, served_model_name)
    metrics.track_streams(lambda: async_engine.queued_bytes)
    engine.step_listeners.append(metrics.on_step)
    engine.finish_listeners.append(metrics.on_finish)
    state = ServerState(
        async_engine,
        served_model_name,
        api_key,
        metrics,
        int(time.time()),
        request_timeout,
        tool_call_parser,
        reasoning_parser,
    )

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async_engine.start()
        try:
            yield
        finally:
            async_engine.stop()

    app = FastAPI(title="chunkserve", version=__version__, lifespan=lifespan)
    app.state.chunkserve = state
    _install_error_handlers(app)

    if api_key is not None:
        app.add_middleware(APIKeyMiddleware, api_key=api_key)
    app.add_middleware(BodyLimitMiddleware, max_bytes=max_body_bytes)
    _add_routes(app, state)
    return app


def _needs_auth(path: str) -> bool:
    return path.startswith("/v1") or path in ("/tokenize", "/detokenize")


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def on_validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        first = errors[0] if errors else {}
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        if first.get("type") == "json_invalid":
            message = f"malformed JSON body: {first.get('msg', '')}"
            loc = []
        else:
            where = ".".join(loc) or "body"
            message = f"{where}: {first.get('msg', 'invalid value')}"
        return error_response(400, message, "invalid_request_error", ".".join(loc) or None)

    @app.exception_handler(APIError)
    async def on_api_error(request: Request, exc: APIError) -> JSONResponse:
        return error_response(exc.status, exc.message, exc.err_type, exc.param, exc.headers)

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        # The framework's own errors (a body it cannot parse, an unknown route, a wrong
        # method) in the same OpenAI body as ours.
        kind = {401: "authentication_error", 404: "not_found_error"}.get(
            exc.status_code, "invalid_request_error" if exc.status_code < 500 else "server_error"
        )
        message = exc.detail if isinstance(exc.detail, str) else json.dumps(exc.detail)
        return error_response(exc.status_code, message, kind, headers=exc.headers)

    @app.exception_handler(ValueError)
    async def on_value_error(request: Request, exc: ValueError) -> JSONResponse:
        return error_response(400, str(exc), "invalid_request_error", param_of(exc))

    @app.exception_handler(OverloadedError)
    async def on_overload(request: Request, exc: OverloadedError) -> JSONResponse:
        return error_response(
            503, str(exc), "service_unavailable_error", headers={"Retry-After": "1"}
        )

    @app.exception_handler(RequestFailedError)
    async def on_failed(request: Request, exc: RequestFailedError) -> JSONResponse:
        return error_response(500, f"request failed in the engine: {exc}", "server_error")

    @app.exception_handler(RequestTimeoutError)
    async def on_timeout(request: Request, exc: RequestTimeoutError) -> JSONResponse:
        return error_response(504, str(exc), "timeout_error")

    @app.exception_handler(EngineDeadError)
    async def on_dead(request: Request, exc: EngineDeadError) -> JSONResponse:
        return error_response(503, str(exc), "service_unavailable_error")


# ---- generation helpers ------------------------------------------------------------------------
@dataclass
class _Choice:
    index: int
    prompt_index: int
    request: CheckedRequest  # checked here, at the edge: the engine queues it as it is


_Submitted = tuple[int, RequestHandle]  # a choice's index and its queued request


async def _merge(submitted: list[_Submitted]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleave several requests' outputs as they arrive. Closing this iterator cancels
    the readers, which aborts the unfinished requests."""
    q: asyncio.Queue[tuple[int, RequestOutput | Exception | None]] = asyncio.Queue()

    async def pump(index: int, handle: RequestHandle) -> None:
        outputs = handle.outputs()
        try:
            async for item in outputs:
                q.put_nowait((index, item))
            q.put_nowait((index, None))
        except Exception as exc:
            q.put_nowait((index, exc))
        finally:
            await outputs.aclose()  # a cancelled reader aborts its request now

    tasks = [asyncio.create_task(pump(i, handle)) for i, handle in submitted]
    try:
        remaining = len(tasks)
        while remaining:
            index, item = await q.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield index, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _until_disconnect(request: Request, coro: Awaitable[Any]) -> Any:
    """Run ``coro``; if the client goes away first, cancel it (its requests are aborted)."""
    task = asyncio.ensure_future(coro)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                return task.result()
            if await request.is_disconnected():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                raise APIError(499, "client disconnected", "invalid_request_error")
    finally:
        if not task.done():
            task.cancel()


class _Handler:
    """Shared plumbing of the two generation endpoints."""

    def __init__(self, state: ServerState) -> None:
        self.state = state
        self.engine = state.engine.engine
        self.tokenizer = self.engine.tokenizer

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.state.model_name:
            raise APIError(
                404,
                f"model {model!r} does not exist; this server serves {self.state.model_name!r}",
                "not_found_error",
                "model",
            )

    def prepare(
        self,
        prompts: list[tuple[str | None, list[int]]],
        body: Any,
        max_tokens: int | None,
        logprobs: int | None,
        keep_special: list[int] | None = None,
        reasoning: str | None = None,
    ) -> list[_Choice]:
        """Check every (prompt, n) pair against the engine before anything is queued (the
        engine queues the checked requests without checking them again). ``reasoning``:
        what may precede a structured output (``StructuredOutputsParams.reasoning``)."""
        field = body.unsupported()
        if field is not None:
            raise APIError(400, f"{field}: not supported by this server", param=field)
        if len(prompts) * body.n > MAX_SEQUENCES_PER_REQUEST:
            raise APIError(
                400,
                f"n: {len(prompts)} prompts x n={body.n} asks for more than "
                f"{MAX_SEQUENCES_PER_REQUEST} sequences in one request",
                param="n",
            )
        choices = []
        for p_index, (text, ids) in enumerate(prompts):
            for j in range(body.n):
                params = body.sampling_params(max_tokens, logprobs, seed_offset=j)
                if keep_special:
                    params.keep_special_token_ids = list(keep_special)
                if reasoning is not None and params.structured_outputs is not None:
                    params.structured_outputs.reasoning = reasoning
                checked = self.engine.inputs.check(text, ids, params, body.priority)
                choices.append(_Choice(len(choices), p_index, checked))
        self.state.engine.check_capacity(len(choices))
        return choices

    def chat_prompt(
        self, messages: list[dict[str, Any]], body: ChatCompletionRequest, spec: ToolSpec | None
    ) -> list[int]:
        tools = spec.tools if spec is not None else None
        return encode_chat_with_tools(self.tokenizer, messages, tools, body.add_generation_prompt)

    def reply_parser(self, spec: ToolSpec | None) -> ReplyParser | None:
        """A fresh parser for one chat reply (None: the reply is all content). Tool calls:
        Hermes for forced calls (their grammar writes that format), else
        ``--tool-call-parser``; reasoning: ``--reasoning-parser`` (a forced call's grammar
        admits its reasoning first: ``constrained_reasoning``), but for a parser whose
        reasoning the grammar would not admit (none so far): then the call alone."""
        tools = None if spec is None else "hermes" if spec.forced else self.state.tool_call_parser
        reasoning = self.state.reasoning_parser
        if spec is not None and spec.forced and self.constrained_reasoning() is None:
            reasoning = None
        if tools is None and reasoning is None:
            return None
        if "harmony" in (tools, reasoning):  # one parser reads harmony's channels and calls
            rest = None if tools in (None, "harmony") else get_tool_parser(tools)()
            return ReplyParser(HarmonyParser(calls=tools == "harmony"), rest)
        return ReplyParser(
            get_reasoning_parser(reasoning)() if reasoning else None,
            get_tool_parser(tools)() if tools else None,
        )

    def constrained_reasoning(self) -> str | None:
        """What a chat reply's structured output lets come before it: the reasoning of
        ``--reasoning-parser`` (``StructuredOutputsParams.reasoning``), or None."""
        name = self.state.reasoning_parser
        return None if name is None else get_reasoning_parser(name).constrained_reasoning

    def kept_special_tokens(self, parser: ReplyParser | None) -> list[int] | None:
        """The special tokens of the parsers' formats (kept in the reply's text)."""
        if parser is None:
            return None
        markers = [m for p in (parser.reasoning, parser.tools) if p for m in p.markers]
        ids = {self.tokenizer.special_token_id(m) for m in markers}
        return sorted(i for i in ids if i is not None) or None

    def submit(self, choices: list[_Choice], base_id: str) -> list[_Submitted]:
        """Queue every choice now, right after ``prepare`` admitted them (no await in
        between): they count against ``--max-waiting-requests`` from here, streaming or
        not. A response that never starts drops the handles, which aborts them."""
        eng = self.state.engine
        return [
            (
                c.index,
                eng.submit(
                    c.request,
                    request_id=f"{base_id}-{c.index}",
                    timeout_s=self.state.request_timeout,
                ),
            )
            for c in choices
        ]

    async def collect(self, submitted: list[_Submitted]) -> dict[int, RequestOutput]:
        finals: dict[int, RequestOutput] = {}
        scored: dict[int, Any] = {}  # prompt logprobs come with a request's first output
        async for index, out in _merge(submitted):
            if out.prompt_logprobs is not None:
                scored[index] = out.prompt_logprobs
            if out.finished:
                finals[index] = out
        for index, prompt_logprobs in scored.items():
            if index in finals:
                finals[index].prompt_logprobs = prompt_logprobs
        return finals

    def usage(
        self,
        prompts: list[tuple[str | None, list[int]]],
        finals: dict[int, RequestOutput] | list[int],
    ) -> dict[str, int]:
        prompt_tokens = sum(len(ids) for _, ids in prompts)
        if isinstance(finals, dict):
            completion = sum(len(o.token_ids) for o in finals.values())
        else:
            completion = sum(finals)
        return {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": prompt_tokens + completion,
        }

    def token_str(self, token_id: int) -> str:
        return self.tokenizer.token_text(token_id)

    def completion_logprobs(
        self,
        entries: list[TokenLogprob] | None,
        text_start: int,
        texts: list[str],
        prompt: list[PromptTokenLogprob | None] | None = None,
        prompt_ids: list[int] | None = None,
        prompt_start: int = 0,
    ) -> dict[str, Any] | None:
        """OpenAI's legacy logprobs object; with ``prompt`` (``echo`` with ``logprobs``) the
        prompt's tokens first, the very first one's logprob and top null."""
        if entries is None and prompt is None:
            return None
        entries = entries or []
        head: list[tuple[str, float | None, dict[str, float] | None]] = []
        if prompt is not None and prompt_ids is not None:
            for token, e in zip(prompt_ids, prompt):
                top = None if e is None else {self.token_str(t): lp for t, lp in e.top}
                head.append((self.token_str(token), None if e is None else e.logprob, top))
        offsets, pos = [], prompt_start  # the echoed prompt's tokens, then the generated ones
        for t, _, _ in head:
            offsets.append(pos)
            pos += len(t)
        pos = text_start
        for t in texts:
            offsets.append(pos)
            pos += len(t)
        return {
            "tokens": [t for t, _, _ in head] + list(texts),
            "token_logprobs": [lp for _, lp, _ in head] + [e.logprob for e in entries],
            "top_logprobs": [top for _, _, top in head]
            + [{self.token_str(t): lp for t, lp in e.top} for e in entries],
            "text_offset": offsets,
        }

    def prompt_logprobs(
        self, entries: list[PromptTokenLogprob | None] | None
    ) -> list[dict[str, Any] | None] | None:
        """vLLM's ``prompt_logprobs``: per prompt token (None for the first) its id and the
        top-n ids, each with ``logprob``, ``rank`` and ``decoded_token``."""
        if entries is None:
            return None
        out: list[dict[str, Any] | None] = []
        for e in entries:
            if e is None:
                out.append(None)
                continue
            item = {str(e.token_id): self._scored(e.token_id, e.logprob, e.rank)}
            for rank, (t, lp) in enumerate(e.top, 1):
                item.setdefault(str(t), self._scored(t, lp, rank))
            out.append(item)
        return out

    def _scored(self, token_id: int, logprob: float, rank: int) -> dict[str, Any]:
        return {"logprob": logprob, "rank": rank, "decoded_token": self.token_str(token_id)}

    def chat_logprobs(self, entries: list[TokenLogprob] | None) -> dict[str, Any] | None:
        if entries is None:
            return None

        def item(token_id: int, logprob: float) -> dict[str, Any]:
            s = self.token_str(token_id)
            return {"token": s, "logprob": logprob, "bytes": list(s.encode("utf-8"))}

        return {
            "content": [
                {**item(e.token_id, e.logprob), "top_logprobs": [item(t, lp) for t, lp in e.top]}
                for e in entries
            ]
        }


# A generation answers JSON, or an SSE stream with "stream": true.
GENERATE_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {"content": {"application/json": {}, "text/event-stream": {}}},
    **error_responses(400, 401, 404, 413, 500, 503, 504),
}


def _add_routes(app: FastAPI, state: ServerState) -> None:
    h = _Handler(state)
    engine = h.engine

    @app.get("/health", responses=error_responses(503))
    async def health() -> Response:
        if not state.engine.healthy:
            why = "stuck: no step finished lately" if state.engine.stuck else "not running"
            return error_response(503, f"engine is {why}", "service_unavailable_error")
        if state.engine.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.post("/reset_prefix_cache", responses=error_responses(401))
    async def reset_prefix_cache() -> dict[str, str]:
        """Empty the prefix cache: no request sent after this reply hits a block cached
        before it; requests in flight run on unaffected."""
        state.engine.reset_prefix_cache()
        return {"status": "ok"}

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": __version__}

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models", responses=error_responses(401))
    async def models() -> dict[str, Any]:
        return {
            "object": "list",
            "data": [
                {
                    "id": state.model_name,
                    "object": "model",
                    "created": state.created,
                    "owned_by": "chunkserve",
                    "root": engine.model_path,
                    "max_model_len": engine.max_model_len,
                }
            ],
        }

    @app.post("/tokenize", responses=error_responses(400, 401, 404, 413))
    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        check_text(body)
        h.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "give exactly one of prompt or messages", param="prompt")
        if body.messages is not None:
            messages = [m.as_template_dict() for m in body.messages]
            spec = check_tools(body.tools, None, None)  # the prompt a chat request would get
            tools = spec.tools if spec is not None else None
            ids = encode_chat_with_tools(h.tokenizer, messages, tools, body.add_generation_prompt)
        else:
            ids = h.tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
        return {"tokens": ids, "count": len(ids), "max_model_len": engine.max_model_len}

    @app.post("/detokenize", responses=error_responses(400, 401, 404, 413))
    async def detokenize(body: DetokenizeRequest) -> dict[str, Any]:
        check_text(body)
        h.check_model(body.model)
        vocab = engine.model_config.vocab_size
        bad = next((t for t in body.tokens if not 0 <= t < vocab), None)
        if bad is not None:
            raise APIError(
                400,
                f"tokens: token id {bad} is outside the vocabulary [0, {vocab})",
                param="tokens",
            )
        return {"prompt": h.tokenizer.decode(body.tokens, skip_special_tokens=False)}

    @app.post("/v1/completions", responses=GENERATE_RESPONSES)
    async def completions(body: CompletionRequest, request: Request) -> Response:
        check_text(body)
        h.check_model(body.model)
        prompts = [engine.inputs.tokenize_prompt(p) for p in body.prompts()]
        prompts = [
            (text if text is not None else h.tokenizer.decode(ids), ids) for text, ids in prompts
        ]
        max_tokens, scoring_only = body.engine_max_tokens()
        choices = h.prepare(prompts, body, max_tokens, body.logprobs)
        base_id = f"cmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        submitted = h.submit(choices, base_id)
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(
                _stream_completion(
                    h,
                    body,
                    prompts,
                    choices,
                    submitted,
                    base_id,
                    created,
                    include_usage,
                    scoring_only,
                ),
                media_type="text/event-stream",
            )
        finals = await _until_disconnect(request, h.collect(submitted))
        out_choices = []
        for c in choices:
            o = finals[c.index]
            if scoring_only:  # max_tokens 0: the one token run is not part of the reply
                o.text, o.token_ids, o.logprobs = "", [], [] if o.logprobs is not None else None
            prefix = c.request.prompt if body.echo else ""
            texts = [h.token_str(t) for t in o.token_ids] if o.logprobs is not None else []
            echoed = o.prompt_logprobs if body.echo and body.logprobs is not None else None
            choice = {
                "index": c.index,
                "text": (prefix or "") + o.text,
                "logprobs": h.completion_logprobs(
                    o.logprobs, len(prefix or ""), texts, echoed, c.request.prompt_token_ids
                ),
                "finish_reason": o.finish_reason,
                "stop_reason": o.stop_reason,
            }
            if body.prompt_logprobs is not None:
                choice["prompt_logprobs"] = h.prompt_logprobs(o.prompt_logprobs)
            out_choices.append(choice)
        return JSONResponse(
            {
                "id": base_id,
                "object": "text_completion",
                "created": created,
                "model": state.model_name,
                "choices": out_choices,
                "usage": h.usage(prompts, finals),
            }
        )

    @app.post("/v1/chat/completions", responses=GENERATE_RESPONSES)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        check_text(body)
        h.check_model(body.model)
        spec = body.tool_spec()
        ids = h.chat_prompt([m.as_template_dict() for m in body.messages], body, spec)
        prompts: list[tuple[str | None, list[int]]] = [(None, ids)]
        keep = h.kept_special_tokens(h.reply_parser(spec))
        choices = h.prepare(
            prompts,
            body,
            body.resolved_max_tokens(),
            body.resolved_logprobs(),
            keep,
            h.constrained_reasoning(),
        )
        base_id = f"chatcmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        submitted = h.submit(choices, base_id)
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(
                _stream_chat(
                    h, body, prompts, choices, submitted, base_id, created, include_usage, spec
                ),
                media_type="text/event-stream",
            )
        finals = await _until_disconnect(request, h.collect(submitted))
        out_choices = []
        for c in choices:
            final = finals[c.index]
            message: dict[str, Any] = {"role": "assistant", "content": final.text}
            finish_reason = final.finish_reason
            parser = h.reply_parser(spec)
            if parser is not None:
                result = collect(parser.feed(final.text) + parser.finish())
                message["content"] = result.content
                if h.state.reasoning_parser is not None or result.reasoning is not None:
                    message["reasoning_content"] = result.reasoning
                parallel = spec is None or spec.parallel
                calls = result.tool_calls if parallel else result.tool_calls[:1]
                if calls:
                    message["content"] = result.content if result.content.strip() else None
                    message["tool_calls"] = [
                        {
                            "id": call.id,
                            "type": "function",
                            "function": {"name": call.name, "arguments": call.arguments},
                        }
                        for call in calls
                    ]
                    if finish_reason == "stop":
                        finish_reason = "tool_calls"
            out_choices.append(
                {
                    "index": c.index,
                    "message": message,
                    "logprobs": h.chat_logprobs(final.logprobs),
                    "finish_reason": finish_reason,
                    "stop_reason": final.stop_reason,
                }
            )
            if body.prompt_logprobs is not None:
                out_choices[-1]["prompt_logprobs"] = h.prompt_logprobs(final.prompt_logprobs)
        return JSONResponse(
            {
                "id": base_id,
                "object": "chat.completion",
                "created": created,
                "model": state.model_name,
                "choices": out_choices,
                "usage": h.usage(prompts, finals),
            }
        )


async def _sse_stream(
    h: _Handler,
    body: CompletionRequest | ChatCompletionRequest,
    prompts: list[tuple[str | None, list[int]]],
    submitted: list[_Submitted],
    envelope: dict[str, Any],
    include_usage: bool,
    render: Callable[[int, RequestOutput], list[dict[str, Any]] | dict[str, Any] | None],
    prelude: list[dict[str, Any]] | None = None,
) -> AsyncIterator[str]:
    """SSE plumbing shared by both endpoints: the ``prelude`` choices, then one chunk per
    output that ``render`` makes a choice of (None: nothing to send yet), with the usage so
    far if ``stream_options.continuous_usage_stats``, the usage chunk if asked, an error
    event if the engine failed the request, and ``[DONE]``."""
    counts = dict.fromkeys(range(len(submitted)), 0)
    options = body.stream_options
    continuous = bool(options and options.continuous_usage_stats)
    try:
        for choice in prelude or []:
            yield sse_event({**envelope, "choices": [choice]})
        async for index, out in _merge(submitted):
            rendered = render(index, out)
            counts[index] = len(out.token_ids)  # (after render: max_tokens 0 drops its token)
            for choice in rendered if isinstance(rendered, list) else [rendered]:
                if choice is None:
                    continue
                chunk = {**envelope, "choices": [choice]}
                if continuous:
                    chunk["usage"] = h.usage(prompts, list(counts.values()))
                yield sse_event(chunk)
        if include_usage:
            usage = h.usage(prompts, list(counts.values()))
            yield sse_event({**envelope, "choices": [], "usage": usage})
    except EngineDeadError as exc:
        event = error_body(f"request failed: {exc}", "service_unavailable_error", None, 503)
        yield sse_event(event)
    except RequestTimeoutError as exc:
        yield sse_event(error_body(f"request failed: {exc}", "timeout_error", None, 504))
    except (RequestFailedError, ValueError) as exc:
        yield sse_event(error_body(f"request failed: {exc}", "server_error", None, 500))
    yield sse_event(SSE_DONE)


def _stream_completion(
    h: _Handler,
    body: CompletionRequest,
    prompts: list[tuple[str | None, list[int]]],
    choices: list[_Choice],
    submitted: list[_Submitted],
    base_id: str,
    created: int,
    include_usage: bool,
    scoring_only: bool = False,
) -> AsyncIterator[str]:
    echoed: set[int] = set()
    sent_chars = dict.fromkeys(range(len(choices)), 0)

    def render(index: int, out: RequestOutput) -> dict[str, Any] | None:
        text, delta_logprobs = out.delta_text, out.delta_logprobs
        if scoring_only:  # max_tokens 0: the one token run is not part of the reply
            text, out.token_ids = "", []
            delta_logprobs = [] if delta_logprobs is not None else None
        prompt, prompt_start = None, sent_chars[index]
        if body.echo and index not in echoed:
            echoed.add(index)
            echo = choices[index].request.prompt or ""
            text = echo + text
            sent_chars[index] += len(echo)
            if body.logprobs is not None:
                prompt = out.prompt_logprobs
        if not (text or out.finished or delta_logprobs or out.prompt_logprobs is not None):
            return None  # (a step whose text is held back still sends its logprobs)
        logprobs = None
        if delta_logprobs is not None or prompt is not None:
            texts = [h.token_str(e.token_id) for e in delta_logprobs or []]
            logprobs = h.completion_logprobs(
                delta_logprobs,
                sent_chars[index],
                texts,
                prompt,
                choices[index].request.prompt_token_ids,
                prompt_start,
            )
        sent_chars[index] += len(text) - (sent_chars[index] - prompt_start)
        chunk = {
            "index": index,
            "text": text,
            "logprobs": logprobs,
            "finish_reason": out.finish_reason if out.finished else None,
            "stop_reason": out.stop_reason if out.finished else None,
        }
        if body.prompt_logprobs is not None and out.prompt_logprobs is not None:
            chunk["prompt_logprobs"] = h.prompt_logprobs(out.prompt_logprobs)
        return chunk

    envelope = {
        "id": base_id,
        "object": "text_completion",
        "created": created,
        "model": h.state.model_name,
    }
    return _sse_stream(h, body, prompts, submitted, envelope, include_usage, render)


def _stream_chat(
    h: _Handler,
    body: ChatCompletionRequest,
    prompts: list[tuple[str | None, list[int]]],
    choices: list[_Choice],
    submitted: list[_Submitted],
    base_id: str,
    created: int,
    include_usage: bool,
    spec: ToolSpec | None = None,
) -> AsyncIterator[str]:
    parsers = {c.index: h.reply_parser(spec) for c in choices}

    def render(index: int, out: RequestOutput) -> list[dict[str, Any]] | None:
        scored = out.prompt_logprobs if body.prompt_logprobs is not None else None
        if not (out.delta_text or out.finished or out.delta_logprobs or scored is not None):
            return None  # (a step whose text is held back still sends its logprobs)
        finish_reason = out.finish_reason if out.finished else None
        parser = parsers[index]
        if parser is None:
            delta: dict[str, Any] = {"content": out.delta_text} if out.delta_text else {}
            deltas = [delta]
        else:
            events = parser.feed(out.delta_text)
            if out.finished:
                events += parser.finish()
                if parser.count and finish_reason == "stop":
                    finish_reason = "tool_calls"
            elif not events and not out.delta_logprobs and scored is None:
                return None  # the parser holds the text back
            deltas = _chat_deltas(events, spec is None or spec.parallel)
        logprobs = h.chat_logprobs(out.delta_logprobs)
        rendered = [
            {"index": index, "delta": d, "logprobs": None, "finish_reason": None} for d in deltas
        ]
        # The step's logprobs and finish reason ride on its last chunk.
        rendered[-1].update(logprobs=logprobs, finish_reason=finish_reason)
        if scored is not None:  # the first output's: on its first chunk
            rendered[0]["prompt_logprobs"] = h.prompt_logprobs(scored)
        return rendered

    envelope = {
        "id": base_id,
        "object": "chat.completion.chunk",
        "created": created,
        "model": h.state.model_name,
    }
    prelude = [
        {
            "index": c.index,
            "delta": {"role": "assistant", "content": ""},
            "logprobs": None,
            "finish_reason": None,
        }
        for c in choices
    ]
    return _sse_stream(h, body, prompts, submitted, envelope, include_usage, render, prelude)


def _chat_deltas(events: list[Event], parallel: bool) -> list[dict[str, Any]]:
    """A step's parser events as chat deltas: content joined, then each tool-call delta in its
    own chunk (the call's id, type and name first, then its arguments), as OpenAI streams
    them; with ``parallel_tool_calls`` false, calls after the first are left out."""
    deltas: list[dict[str, Any]] = []
    # Runs of reasoning and of content each in one delta, in the order they came.
    for e in events:
        key = "reasoning_content" if isinstance(e, Reasoning) else "content"
        if isinstance(e, (str, Reasoning)):
            piece = e.text if isinstance(e, Reasoning) else e
            if deltas and list(deltas[-1]) == [key]:
                deltas[-1][key] += piece
            elif piece:
                deltas.append({key: piece})
            continue
        if e.index > 0 and not parallel:
            continue
        fn: dict[str, Any] = {"arguments": e.arguments}
        call: dict[str, Any] = {"index": e.index}
        if e.id is not None:
            call.update(id=e.id, type="function")
            fn = {"name": e.name, **fn}
        call["function"] = fn
        deltas.append({"tool_calls": [call]})
    return deltas or [{}]
