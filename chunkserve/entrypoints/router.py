"""``chunkserve router``: an OpenAI-compatible HTTP front before chunkserve server instances.

Two modes:

* **Disaggregated** (``--prefill URL ... --decode URL ...``): each completion picks one prefill
  instance and one decode instance and goes to the decode instance only, with
  ``"kv_transfer_params": {"prefill_url": <the prefill instance>}`` added to its body. The
  decode instance asks that prefill instance for the prompt's KV cache itself, then decodes
  and answers; the router relays the answer (SSE bytes as they arrive, or the body as is).

  Why the decode instance pulls rather than the router sending the prompt to both: the
  decode instance is the one that must hold the KV blocks, so it can reserve them before it
  asks, fetch exactly the blocks its own prefix cache misses, and tie the transfer to the
  request's lifetime (an abort frees everything in one place). The router stays a plain
  one-upstream proxy: no second request to coordinate, no KV bytes through it, nothing to
  undo on the prefill side when the decode side fails or the client leaves.

  The prefill instance is chosen by prefix affinity: rendezvous hashing of the prompt's
  start over the prefill URLs, so requests sharing a prefix land where that prefix is
  already cached (and, while the set of instances stays the same, always on the same one;
  removing an instance moves only the prefixes that preferred it). Affinity yields to load
  when the preferred instance has more than ``AFFINITY_IMBALANCE_BOUND`` requests in flight
  beyond the least loaded one. The decode instance is the least loaded, ties round-robin.

* **Data parallel** (``--data-parallel URL ...``): each completion goes, body unchanged, to
  the least loaded instance.

Load is the number of requests in flight through this router to an instance (a request
holds its prefill instance too until it ends: the router cannot see the prefill finish).

Errors have OpenAI's body ``{"error": {"message", "type", "param", "code"}}``: an unreachable
instance is a 502, one that does not answer in time a 504; a failure in the middle of an SSE
stream is one ``data: {"error": ...}`` event, then ``data: [DONE]``. When the client goes away
the upstream response is closed, so the instance aborts the request and frees its KV cache.

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET /v1/models``
(from the first decode / data-parallel instance that answers), ``GET /health`` (probes the
instances), ``GET /metrics`` (the router's own, ``chunkserve_router:`` prefix).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from typing import Any, Literal, TypeVar
from urllib.parse import urlsplit

import anyio
import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Receive, Scope, Send

from chunkserve.entrypoints.openai.responses import SSE_DONE, error_body, error_response, sse_event

logger = logging.getLogger("chunkserve.router")

Role = Literal["prefill", "decode", "data_parallel"]
Mode = Literal["disaggregated", "data_parallel"]
T = TypeVar("T")

DEFAULT_PORT = 8080
DEFAULT_TIMEOUT_S = 600.0
CONNECT_TIMEOUT_S = 5.0
HEALTH_TIMEOUT_S = 2.0
MODELS_TIMEOUT_S = 10.0
# Bounds the time the router spends closing an upstream response; a close never blocks a
# cancelled request longer than this.
CLOSE_TIMEOUT_S = 2.0
AFFINITY_IMBALANCE_BOUND = 4
AFFINITY_PROMPT_CHARS = 256  # of a completion's prompt string (or tokens of a token list)
AFFINITY_MESSAGES_CHARS = 512  # of the JSON of a chat request's messages
# nginx's "client closed request": the status recorded for a request whose client left.
CLIENT_CLOSED_STATUS = 499
GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions")
KV_TRANSFER_FIELD = "kv_transfer_params"
_PASSTHROUGH_RESPONSE_HEADERS = ("content-type", "retry-after", "x-request-id")
_REQUEST_BUCKETS_S = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0)


def _sse(obj: dict[str, Any] | str) -> bytes:
    return sse_event(obj).encode()


def normalize_url(url: str) -> str:
    """``url`` without trailing slashes; ValueError unless it is an http(s) base URL."""
    url = url.strip().rstrip("/")
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(f"{url!r}: not an http:// or https:// URL with a host")
    if parts.query or parts.fragment:
        raise ValueError(f"{url!r}: a base URL has no query or fragment")
    return url


# ---- picking instances ----------------------------------------------------------------------
def affinity_key(path: str, body: dict[str, Any]) -> str:
    """The start of the prompt, the part shared by requests whose prefix cache could match:
    for chat the JSON of ``messages``, else the ``prompt`` (a batch's first prompt)."""
    if path.endswith("/chat/completions"):
        messages = json.dumps(body.get("messages"), sort_keys=True, separators=(",", ":"))
        return messages[:AFFINITY_MESSAGES_CHARS]
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return prompt[:AFFINITY_PROMPT_CHARS]
    if isinstance(prompt, list):
        return json.dumps(prompt[:AFFINITY_PROMPT_CHARS], separators=(",", ":"))
    return ""


def _rendezvous_score(url: str, key: str) -> int:
    digest = hashlib.blake2b(f"{url}\0{key}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


class RouterState:
    """The instances of each role and their load (requests in flight through this router).

    Not thread safe: used from the router's one event loop. Invariant: each ``acquire`` is
    matched by exactly one ``release``, so a load is never negative and returns to 0 when
    the router is idle."""

    def __init__(
        self,
        prefill: Sequence[str] = (),
        decode: Sequence[str] = (),
        data_parallel: Sequence[str] = (),
        imbalance_bound: int = AFFINITY_IMBALANCE_BOUND,
    ) -> None:
        if data_parallel and (prefill or decode):
            raise ValueError("data_parallel: not allowed with prefill/decode instances")
        if not data_parallel and not (prefill and decode):
            raise ValueError(
                "instances: give both prefill and decode instances, or data-parallel ones"
            )
        if imbalance_bound < 0:
            raise ValueError("imbalance_bound: must be >= 0")
        self.mode: Mode = "data_parallel" if data_parallel else "disaggregated"
        self.instances: dict[Role, list[str]] = {}
        for role, urls in (
            ("prefill", prefill),
            ("decode", decode),
            ("data_parallel", data_parallel),
        ):
            if not urls:
                continue
            normalized = [normalize_url(u) for u in urls]
            if len(set(normalized)) != len(normalized):
                raise ValueError(f"{role}: an instance is listed twice: {normalized}")
            self.instances[role] = normalized
        self.imbalance_bound = imbalance_bound
        self._in_flight: dict[tuple[Role, str], int] = {
            (role, url): 0 for role, urls in self.instances.items() for url in urls
        }
        self._next_rr: dict[Role, int] = dict.fromkeys(self.instances, 0)

    @property
    def target_role(self) -> Role:
        """The role of the instances that answer completions."""
        return "data_parallel" if self.mode == "data_parallel" else "decode"

    def load(self, role: Role, url: str) -> int:
        return self._in_flight[(role, url)]

    def acquire(self, role: Role, url: str) -> None:
        self._in_flight[(role, url)] += 1

    def release(self, role: Role, url: str) -> None:
        assert self._in_flight[(role, url)] > 0, (role, url)
        self._in_flight[(role, url)] -= 1

    def least_loaded(self, role: Role) -> str:
        """The instance with the fewest requests in flight; ties go round-robin."""
        urls = self.instances[role]
        start = self._next_rr[role]
        self._next_rr[role] = (start + 1) % len(urls)
        rotated = urls[start:] + urls[:start]
        return min(rotated, key=lambda url: self.load(role, url))

    def preferred_prefill(self, key: str) -> str:
        """The prefill instance ``key`` hashes to (highest random weight): the same while the
        set of prefill instances is the same."""
        return max(self.instances["prefill"], key=lambda url: (_rendezvous_score(url, key), url))

    def pick_prefill(self, key: str) -> str:
        preferred = self.preferred_prefill(key)
        lightest = self.least_loaded("prefill")
        if self.load("prefill", preferred) - self.load("prefill", lightest) > self.imbalance_bound:
            return lightest
        return preferred


# ---- metrics --------------------------------------------------------------------------------
class RouterMetrics:
    """The router's own Prometheus metrics, in a registry of its own (several routers may
    live in one process)."""

    def __init__(self, state: RouterState) -> None:
        self.registry = CollectorRegistry()
        reg = self.registry
        self.requests = Counter(
            "chunkserve_router:requests",
            "Requests through the router per instance and final HTTP status (499: client "
            "left; a failure mid-stream counts as its error event's code).",
            ["role", "instance", "status"],
            registry=reg,
        )
        self.in_flight = Gauge(
            "chunkserve_router:requests_in_flight",
            "Requests in flight through the router per instance.",
            ["role", "instance"],
            registry=reg,
        )
        for role, urls in state.instances.items():
            for url in urls:
                self.in_flight.labels(role, url).set_function(
                    lambda role=role, url=url: state.load(role, url)
                )
        self.request_seconds = Histogram(
            "chunkserve_router:request_seconds",
            "End-to-end time of a completion request through the router.",
            ["mode"],
            buckets=_REQUEST_BUCKETS_S,
            registry=reg,
        )
        self.upstream_errors = Counter(
            "chunkserve_router:upstream_errors",
            "Failed upstream calls: connect (unreachable), timeout, read (broken answer).",
            ["instance", "kind"],
            registry=reg,
        )


# ---- upstream errors ------------------------------------------------------------------------
class UpstreamError(Exception):
    """An instance could not be reached or did not answer: ``status`` 502 or 504."""

    def __init__(self, url: str, role: Role, exc: Exception, timeout_s: float) -> None:
        detail = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        if isinstance(exc, (httpx.ConnectError, httpx.ConnectTimeout)):
            self.kind = "connect"
        elif isinstance(exc, httpx.TimeoutException):
            self.kind = "timeout"
        else:
            self.kind = "read"
        if isinstance(exc, httpx.TimeoutException):
            self.status, self.err_type = 504, "gateway_timeout"
            limit_s = CONNECT_TIMEOUT_S if self.kind == "connect" else timeout_s
            message = f"{role} instance {url} did not answer within {limit_s:g} s ({detail})"
        else:
            self.status, self.err_type = 502, "bad_gateway"
            what = "is unreachable" if self.kind == "connect" else "failed"
            message = f"{role} instance {url} {what} ({detail})"
        super().__init__(message)
        self.url, self.message = url, message

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.err_type, None, self.status)


class _ClientGone(Exception):
    """The client disconnected before the upstream answer started."""


async def _client_disconnected(request: Request) -> None:
    """Returns when the client disconnects (its body already read)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _unless_disconnected(
    request: Request,
    work: Awaitable[T],
    discard: Callable[[T], Awaitable[None]] | None = None,
) -> T:
    """``work``'s result, or ``_ClientGone`` (``work`` cancelled, a result it still made
    passed to ``discard``) if the client disconnects first."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_client_disconnected(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:  # also on our own cancellation: neither task outlives this call
        watcher.cancel()
        task.cancel()  # a no-op once done
    if task in done:  # the answer wins a tie with the disconnect
        return task.result()
    await asyncio.wait({task})
    if not task.cancelled() and task.exception() is None and discard is not None:
        await discard(task.result())  # made before the cancel reached it
    raise _ClientGone


async def _close_upstream(resp: httpx.Response) -> None:
    # Shielded: the close runs to the end even in a cancelled request (closing the
    # connection is what tells the instance to abort), but never longer than the bound.
    with anyio.move_on_after(CLOSE_TIMEOUT_S, shield=True):
        await resp.aclose()


# ---- one request's hold on its instances ----------------------------------------------------
class _Flight:
    """A request in flight: it holds its instances (``RouterState`` load) from creation to
    ``finish``, which counts it once whatever path ends it (answer, error, client gone)."""

    def __init__(
        self,
        state: RouterState,
        metrics: RouterMetrics,
        holds: list[tuple[Role, str]],
        start_s: float,
    ) -> None:
        self.state, self.metrics, self.holds, self.start_s = state, metrics, holds, start_s
        self.finished = False
        for role, url in holds:
            state.acquire(role, url)

    def finish(self, status: int) -> None:
        if self.finished:
            return
        self.finished = True
        for role, url in self.holds:
            self.state.release(role, url)
            self.metrics.requests.labels(role, url, str(status)).inc()
        elapsed_s = time.perf_counter() - self.start_s
        self.metrics.request_seconds.labels(self.state.mode).observe(elapsed_s)


class _RelayResponse(StreamingResponse):
    """Streams ``relay`` (an upstream SSE answer). However the response ends, even when it is
    cancelled before the relay starts, the upstream response is closed and the flight
    finished."""

    def __init__(
        self,
        relay: AsyncGenerator[bytes, None],
        upstream: httpx.Response,
        flight: _Flight,
        headers: dict[str, str],
    ) -> None:
        super().__init__(relay, status_code=upstream.status_code, headers=headers)
        self.relay, self.upstream, self.flight = relay, upstream, flight

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                await self.relay.aclose()
                await _close_upstream(self.upstream)
            self.flight.finish(CLIENT_CLOSED_STATUS)  # no-op when the relay finished it


def _last_event_end(buffer: bytes) -> int:
    """The end of the last complete SSE event in ``buffer`` (0: none)."""
    lf, crlf = buffer.rfind(b"\n\n"), buffer.rfind(b"\r\n\r\n")
    return max(lf + 2 if lf >= 0 else 0, crlf + 4 if crlf >= 0 else 0)


def _passthrough_headers(resp: httpx.Response) -> dict[str, str]:
    return {k: resp.headers[k] for k in _PASSTHROUGH_RESPONSE_HEADERS if k in resp.headers}


# ---- the proxy ------------------------------------------------------------------------------
class _Proxy:
    def __init__(
        self,
        state: RouterState,
        timeout_s: float,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.state = state
        self.metrics = RouterMetrics(state)
        self.timeout_s = timeout_s
        self._transport = transport
        self._client: httpx.AsyncClient | None = None

    @property
    def client(self) -> httpx.AsyncClient:
        # Made on first use, in the event loop that serves the app.
        if self._client is None:
            self._client = httpx.AsyncClient(
                transport=self._transport,
                timeout=httpx.Timeout(self.timeout_s, connect=CONNECT_TIMEOUT_S),
                # Streams last minutes: a pool limit would queue requests behind them.
                limits=httpx.Limits(max_connections=None, max_keepalive_connections=64),
                follow_redirects=False,
            )
        return self._client

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    def _upstream_failed(self, exc: UpstreamError) -> None:
        self.metrics.upstream_errors.labels(exc.url, exc.kind).inc()
        logger.warning("%s", exc.message)

    async def generate(self, request: Request) -> Response:
        start_s = time.perf_counter()
        raw = await request.body()
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            return error_response(400, f"malformed JSON body: {exc}", "invalid_request_error")
        if not isinstance(body, dict):
            return error_response(
                400, "the request body must be a JSON object", "invalid_request_error"
            )
        if KV_TRANSFER_FIELD in body:
            return error_response(
                400,
                f"{KV_TRANSFER_FIELD}: set by the router, not by clients",
                "invalid_request_error",
                KV_TRANSFER_FIELD,
            )
        state = self.state
        path = request.url.path
        target_role = state.target_role
        target = state.least_loaded(target_role)
        holds: list[tuple[Role, str]] = [(target_role, target)]
        if state.mode == "disaggregated":
            prefill = state.pick_prefill(affinity_key(path, body))
            holds.insert(0, ("prefill", prefill))
            content = json.dumps({**body, KV_TRANSFER_FIELD: {"prefill_url": prefill}}).encode()
        else:
            content = raw  # data parallel: the body as the client sent it
        flight = _Flight(state, self.metrics, holds, start_s)
        try:
            return await self._forward(request, flight, target_role, target, path, content)
        except _ClientGone:
            flight.finish(CLIENT_CLOSED_STATUS)
            return Response(status_code=CLIENT_CLOSED_STATUS)
        except UpstreamError as exc:
            self._upstream_failed(exc)
            flight.finish(exc.status)
            return JSONResponse(exc.body(), status_code=exc.status)
        except BaseException:
            flight.finish(500)
            raise

    async def _forward(
        self,
        request: Request,
        flight: _Flight,
        role: Role,
        url: str,
        path: str,
        content: bytes,
    ) -> Response:
        """Sends ``content`` to ``url``; the flight is finished here unless the answer is a
        stream, whose response finishes it."""
        headers = {"content-type": "application/json", "accept-encoding": "identity"}
        if "authorization" in request.headers:
            headers["authorization"] = request.headers["authorization"]
        target = url + path + (f"?{request.url.query}" if request.url.query else "")
        upstream_request = self.client.build_request(
            "POST", target, content=content, headers=headers
        )

        async def send() -> httpx.Response:
            try:
                return await self.client.send(upstream_request, stream=True)
            except httpx.RequestError as exc:
                raise UpstreamError(url, role, exc, self.timeout_s) from exc

        resp = await _unless_disconnected(request, send(), _close_upstream)
        passthrough = _passthrough_headers(resp)
        if resp.headers.get("content-type", "").startswith("text/event-stream"):
            relay = self._relay(resp, flight, role, url)
            return _RelayResponse(relay, resp, flight, passthrough)
        try:

            async def read() -> bytes:
                try:
                    return await resp.aread()
                except httpx.RequestError as exc:
                    raise UpstreamError(url, role, exc, self.timeout_s) from exc

            answer = await _unless_disconnected(request, read())
        finally:
            await _close_upstream(resp)
        flight.finish(resp.status_code)
        return Response(answer, status_code=resp.status_code, headers=passthrough)

    async def _relay(
        self, resp: httpx.Response, flight: _Flight, role: Role, url: str
    ) -> AsyncGenerator[bytes, None]:
        """The upstream SSE bytes, passed on in whole events (an error event can follow
        them without breaking one in two)."""
        status = resp.status_code
        pending = b""
        try:
            async for chunk in resp.aiter_bytes():
                pending += chunk
                cut = _last_event_end(pending)
                if cut:
                    yield pending[:cut]
                    pending = pending[cut:]
            if pending:
                yield pending
        except httpx.RequestError as exc:
            # The incomplete event in `pending` is dropped: the client sees whole events only.
            error = UpstreamError(url, role, exc, self.timeout_s)
            self._upstream_failed(error)
            status = error.status
            yield _sse(error.body())
            yield _sse(SSE_DONE)
        except BaseException:
            status = CLIENT_CLOSED_STATUS
            raise
        finally:
            await _close_upstream(resp)
            flight.finish(status)

    async def models(self, request: Request) -> Response:
        role = self.state.target_role
        headers = {"accept-encoding": "identity"}
        if "authorization" in request.headers:
            headers["authorization"] = request.headers["authorization"]
        failures: list[str] = []
        for url in self.state.instances[role]:
            try:
                resp = await self.client.get(
                    url + "/v1/models",
                    headers=headers,
                    timeout=httpx.Timeout(MODELS_TIMEOUT_S, connect=CONNECT_TIMEOUT_S),
                )
            except httpx.RequestError as exc:
                error = UpstreamError(url, role, exc, MODELS_TIMEOUT_S)
                self._upstream_failed(error)
                failures.append(error.message)
                continue
            return Response(
                resp.content, status_code=resp.status_code, headers=_passthrough_headers(resp)
            )
        return error_response(
            502, f"no {role} instance answered /v1/models: " + "; ".join(failures), "bad_gateway"
        )

    async def _healthy(self, url: str) -> bool:
        try:
            resp = await self.client.get(url + "/health", timeout=HEALTH_TIMEOUT_S)
        except httpx.RequestError:
            return False
        return resp.status_code == 200

    async def health(self) -> JSONResponse:
        roles = list(self.state.instances)
        probes = [(role, url) for role in roles for url in self.state.instances[role]]
        results = await asyncio.gather(*(self._healthy(url) for _, url in probes))
        status: dict[str, dict[str, list[str]]] = {r: {"up": [], "down": []} for r in roles}
        for (role, url), up in zip(probes, results):
            status[role]["up" if up else "down"].append(url)
        missing = [role for role in roles if not status[role]["up"]]
        if missing:
            down = ", ".join(f"{role} {url}" for role in roles for url in status[role]["down"])
            return error_response(
                503,
                f"no healthy {' or '.join(missing)} instance (down: {down})",
                "service_unavailable_error",
            )
        return JSONResponse({"status": "ok", "mode": self.state.mode, "instances": status})


def build_router_app(
    prefill: list[str],
    decode: list[str],
    data_parallel: list[str],
    timeout_s: float,
    *,
    transport: httpx.AsyncBaseTransport | None = None,
) -> FastAPI:
    """The router's app: disaggregated with ``prefill`` and ``decode`` instances, or data
    parallel over ``data_parallel`` ones (exactly one of the two; ValueError otherwise).
    ``timeout_s`` bounds each wait for an upstream read; ``transport`` replaces the network
    (tests)."""
    if not timeout_s > 0:
        raise ValueError("timeout_s: must be > 0 seconds")
    proxy = _Proxy(RouterState(prefill, decode, data_parallel), timeout_s, transport)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        await proxy.aclose()

    app = FastAPI(title="chunkserve router", lifespan=lifespan)
    app.state.proxy = proxy

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await proxy.generate(request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await proxy.generate(request)

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        return await proxy.models(request)

    @app.get("/health")
    async def health() -> JSONResponse:
        return await proxy.health()

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(proxy.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        message = exc.detail if isinstance(exc.detail, str) else json.dumps(exc.detail)
        return error_response(exc.status_code, f"{request.url.path}: {message}", kind)

    @app.exception_handler(Exception)
    async def on_error(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("%s %s failed", request.method, request.url.path)
        return error_response(500, f"router error: {type(exc).__name__}", "server_error")

    return app


# ---- the command ----------------------------------------------------------------------------
# The mode each instance option belongs to; options of two modes do not mix.
_MODE_OF_DEST: dict[str, Mode] = {
    "prefill": "disaggregated",
    "decode": "disaggregated",
    "data_parallel": "data_parallel",
}


class _InstanceURLs(argparse.Action):
    """Appends a normalized URL; an argparse error for a bad URL, a duplicate, or a mix of
    --data-parallel with --prefill/--decode."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: str | Sequence[Any] | None,
        option_string: str | None = None,
    ) -> None:
        try:
            url = normalize_url(str(values))
        except ValueError as exc:
            raise argparse.ArgumentError(self, str(exc)) from None
        mode = _MODE_OF_DEST[self.dest]
        for dest, other_mode in _MODE_OF_DEST.items():
            if other_mode != mode and getattr(namespace, dest, None):
                raise argparse.ArgumentError(
                    self,
                    "not allowed with --prefill/--decode"
                    if mode == "data_parallel"
                    else "not allowed with --data-parallel",
                )
        urls = list(getattr(namespace, self.dest, None) or [])
        if url in urls:
            raise argparse.ArgumentError(self, f"{url} given twice")
        setattr(namespace, self.dest, [*urls, url])


def _router_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group(
        "instances", "either --prefill and --decode (disaggregated), or --data-parallel"
    )
    g.add_argument(
        "--prefill",
        action=_InstanceURLs,
        default=[],
        metavar="URL",
        help="a prefill instance (repeat for more); chosen by prompt-prefix affinity",
    )
    g.add_argument(
        "--decode",
        action=_InstanceURLs,
        default=[],
        metavar="URL",
        help="a decode instance (repeat for more); it pulls the prompt's KV cache from the "
        "prefill instance; the least loaded is chosen",
    )
    g.add_argument(
        "--data-parallel",
        action=_InstanceURLs,
        default=[],
        metavar="URL",
        help="an instance that does whole requests (repeat for more); the least loaded is chosen",
    )
    p.add_argument("--host", default="127.0.0.1", help="bind address (default: loopback)")
    p.add_argument("--port", type=int, default=DEFAULT_PORT)
    p.add_argument(
        "--timeout",
        type=float,
        default=DEFAULT_TIMEOUT_S,
        help="seconds to wait for each read from an instance (an answer, or the next bytes "
        f"of a stream) before a 504 (connect: {CONNECT_TIMEOUT_S:g} s)",
    )
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])


def _router(args: argparse.Namespace) -> int:
    if args.data_parallel and (args.prefill or args.decode):  # programmatic namespaces
        raise ValueError("--data-parallel: not allowed with --prefill/--decode")
    if not args.data_parallel and not (args.prefill and args.decode):
        raise ValueError(
            "give --prefill URL and --decode URL (each at least once), or --data-parallel URL"
        )
    app = build_router_app(args.prefill, args.decode, args.data_parallel, args.timeout)
    state: RouterState = app.state.proxy.state
    listed = " | ".join(f"{role}: {' '.join(urls)}" for role, urls in state.instances.items())
    print(
        f"chunkserve router ({state.mode}): http://{args.host}:{args.port}/v1 | {listed} | "
        f"timeout {args.timeout:g} s",
        flush=True,
    )
    import uvicorn

    config = uvicorn.Config(
        app, host=args.host, port=args.port, log_level=args.log_level, timeout_graceful_shutdown=5
    )
    uvicorn.Server(config).run()
    return 0
