"""``chunkserve router``: the picking logic alone, then the router end to end over loopback
sockets in front of fake instances (small FastAPI apps on uvicorn threads; no model)."""

from __future__ import annotations

import argparse
import asyncio
import collections
import concurrent.futures
import json
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import httpx
import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client.parser import text_string_to_metric_families

from chunkserve.entrypoints.cli import build_parser
from chunkserve.entrypoints.router import (
    RouterState,
    _router,
    affinity_key,
    build_router_app,
    normalize_url,
)

CLIENT_TIMEOUT_S = 60.0
# The most to wait for something that should happen "within a few seconds": only a hang
# takes it (generous for a loaded machine); the tests wait on events and states.
WAIT_S = 30.0


# ---- servers on threads ---------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerThread:
    """``app`` served by uvicorn on a thread, on a loopback port bound before it starts."""

    def __init__(self, app: FastAPI) -> None:
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        config = uvicorn.Config(
            app, log_level="critical", timeout_graceful_shutdown=1, lifespan="on"
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True
        )
        self.thread.start()
        deadline = time.monotonic() + WAIT_S
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                self.stop()
                raise RuntimeError("server did not start")
            time.sleep(0.01)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(WAIT_S)
        self.sock.close()
        assert not self.thread.is_alive(), "server thread did not stop"


class FakeInstance:
    """A chunkserve server stand-in. What it does with a completion depends on its prompt
    (chat: the first message's content): ``"error400"``, ``"sleep:S"`` (answers after S
    seconds, or stops when its client leaves), ``"hold"`` (answers once the test calls
    ``release``), ``"stream"``, ``"stream_then_fail"``, ``"stream_forever"``; anything else:
    a JSON answer."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.healthy = True
        self.received: list[tuple[str, dict[str, str], bytes]] = []
        self.stream_closed = threading.Event()
        self.sleep_disconnected = threading.Event()
        self.released = threading.Event()
        self.server = ServerThread(self._app())
        self.url = self.server.url

    def reset(self) -> None:
        self.healthy = True
        self.received.clear()
        self.stream_closed.clear()
        self.sleep_disconnected.clear()
        self.released.clear()

    def release(self) -> None:
        self.released.set()

    def bodies(self) -> list[dict[str, Any]]:
        return [json.loads(raw) for _, _, raw in self.received]

    def _app(self) -> FastAPI:
        app = FastAPI()

        async def generate(request: Request) -> Response:
            raw = await request.body()
            self.received.append((request.url.path, dict(request.headers), raw))
            body = json.loads(raw)
            prompt = body.get("prompt") or body["messages"][0]["content"]
            if prompt == "error400":
                error = {"message": "max_tokens: must be >= 1", "type": "invalid_request_error"}
                return JSONResponse({"error": {**error, "param": "max_tokens"}}, 400)
            if prompt.startswith("sleep:"):
                deadline = time.monotonic() + float(prompt.split(":")[1])
                while time.monotonic() < deadline:
                    if await request.is_disconnected():
                        self.sleep_disconnected.set()
                        return Response(status_code=499)
                    await asyncio.sleep(0.02)
            elif prompt == "hold":
                while not self.released.is_set():
                    await asyncio.sleep(0.02)
            elif prompt.startswith("stream"):
                return StreamingResponse(self._stream(prompt), media_type="text/event-stream")
            return JSONResponse({"id": "cmpl-1", "instance": self.name, "choices": [{"text": "x"}]})

        app.post("/v1/completions")(generate)
        app.post("/v1/chat/completions")(generate)

        @app.get("/v1/models")
        async def models() -> dict[str, Any]:
            return {"object": "list", "data": [{"id": "fake", "owned_by": self.name}]}

        @app.get("/health")
        async def health() -> Response:
            return Response(status_code=200 if self.healthy else 503)

        return app

    async def _stream(self, mode: str) -> AsyncIterator[bytes]:
        try:
            for i in range(3):
                yield f'data: {{"n": {i}}}\n\n'.encode()
            if mode == "stream_then_fail":
                yield b'data: {"n": 3, "cut'  # an event the failure leaves incomplete
                await asyncio.sleep(0.05)
                raise RuntimeError("upstream died")  # uvicorn drops the connection
            if mode == "stream_forever":
                for i in range(200):  # 10 s at most
                    await asyncio.sleep(0.05)
                    yield f'data: {{"n": {3 + i}}}\n\n'.encode()
            yield b"data: [DONE]\n\n"
        finally:
            self.stream_closed.set()


@pytest.fixture(scope="module")
def fakes() -> Iterator[list[FakeInstance]]:
    instances: list[FakeInstance] = []
    try:
        for name in ("A", "B", "C"):
            instances.append(FakeInstance(name))
        yield instances
    finally:
        for fake in instances:
            fake.server.stop()


@pytest.fixture(autouse=True)
def _reset(request: pytest.FixtureRequest) -> None:
    if "fakes" in request.fixturenames:
        for fake in request.getfixturevalue("fakes"):
            fake.reset()


@pytest.fixture
def start_router() -> Iterator[Callable[..., str]]:
    """``start_router(prefill=..., decode=..., data_parallel=..., timeout_s=...)`` -> the
    base URL of a router on a thread, stopped at the end of the test."""
    started: list[ServerThread] = []

    def start(
        prefill: tuple[str, ...] = (),
        decode: tuple[str, ...] = (),
        data_parallel: tuple[str, ...] = (),
        timeout_s: float = 5.0,
    ) -> str:
        app = build_router_app(list(prefill), list(decode), list(data_parallel), timeout_s)
        started.append(ServerThread(app))
        return started[-1].url

    yield start
    for server in started:
        server.stop()


def client() -> httpx.Client:
    return httpx.Client(timeout=CLIENT_TIMEOUT_S)


def metric_samples(base: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = httpx.get(base + "/metrics", timeout=CLIENT_TIMEOUT_S).text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def sample(samples: dict, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def wait_for(predicate: Callable[[], bool], timeout_s: float = WAIT_S) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()


def sse_data(text: str) -> list[str]:
    return [line[len("data: ") :] for line in text.split("\n") if line.startswith("data: ")]


# ---- picking, alone -------------------------------------------------------------------------
PREFILLS = [f"http://10.0.0.{i}:8000" for i in range(1, 5)]
DECODES = ["http://d1:8000", "http://d2:8000", "http://d3:8000"]


def test_affinity_is_stable_and_spreads_prefixes() -> None:
    state = RouterState(PREFILLS, DECODES)
    keys = [f"system prompt #{i}: you are a helpful assistant" for i in range(400)]
    first = [state.pick_prefill(k) for k in keys]
    assert [state.pick_prefill(k) for k in keys] == first  # same prefix, same instance
    assert [RouterState(PREFILLS, DECODES).pick_prefill(k) for k in keys] == first
    counts = collections.Counter(first)
    assert set(counts) == set(PREFILLS) and min(counts.values()) > 400 / 4 / 2
    # Rendezvous hashing: dropping an instance moves only the prefixes it had.
    fewer = RouterState(PREFILLS[:3], DECODES)
    for key, url in zip(keys, first):
        if url != PREFILLS[3]:
            assert fewer.pick_prefill(key) == url


def test_affinity_yields_to_load_beyond_the_bound() -> None:
    state = RouterState(PREFILLS, DECODES, imbalance_bound=4)
    key = "a shared prefix"
    preferred = state.preferred_prefill(key)
    for _ in range(4):
        state.acquire("prefill", preferred)
    assert state.pick_prefill(key) == preferred  # 4 more than the lightest: within the bound
    state.acquire("prefill", preferred)
    other = state.pick_prefill(key)
    assert other != preferred and state.load("prefill", other) == 0
    for url in PREFILLS:
        if url != preferred:
            state.acquire("prefill", url)
    assert state.pick_prefill(key) == preferred  # 5 vs 1: within the bound again
    for _ in range(5):
        state.release("prefill", preferred)
    assert state.load("prefill", preferred) == 0


def test_least_loaded_and_round_robin_ties() -> None:
    state = RouterState(PREFILLS, DECODES)
    assert {state.least_loaded("decode") for _ in range(3)} == set(DECODES)  # all idle
    for url, n in zip(DECODES, (3, 1, 2)):
        for _ in range(n):
            state.acquire("decode", url)
    assert [state.least_loaded("decode") for _ in range(3)] == [DECODES[1]] * 3
    state.acquire("decode", DECODES[1])
    state.acquire("decode", DECODES[1])  # 3, 3, 2
    assert state.least_loaded("decode") == DECODES[2]


def test_state_and_urls_validation() -> None:
    assert normalize_url(" http://127.0.0.1:8001/ ") == "http://127.0.0.1:8001"
    assert normalize_url("https://h/prefix//") == "https://h/prefix"
    for bad in ("ftp://h:1", "127.0.0.1:8001", "http://", "http://h:1/?x=1"):
        with pytest.raises(ValueError):
            normalize_url(bad)
    with pytest.raises(ValueError, match="data_parallel"):
        RouterState(PREFILLS, DECODES, ["http://x:1"])
    with pytest.raises(ValueError, match="prefill and decode"):
        RouterState(PREFILLS, [])
    with pytest.raises(ValueError, match="twice"):
        RouterState(PREFILLS, ["http://d:1", "http://d:1/"])
    with pytest.raises(ValueError, match="timeout_s"):
        build_router_app([], [], ["http://x:1"], 0.0)


def test_affinity_key() -> None:
    long = "x" * 1000
    assert affinity_key("/v1/completions", {"prompt": long}) == "x" * 256
    assert affinity_key("/v1/completions", {"prompt": [long, "b"]}) == "x" * 256
    tokens = affinity_key("/v1/completions", {"prompt": list(range(1000))})
    assert tokens == json.dumps(list(range(256)), separators=(",", ":"))
    chat = affinity_key("/v1/chat/completions", {"messages": [{"role": "user", "content": long}]})
    assert len(chat) == 512 and chat.startswith('[{"content":"xxx')


def test_cli_arguments() -> None:
    def parse(*argv: str) -> argparse.Namespace:
        return build_parser("router").parse_args(["router", *argv])

    args = parse("--prefill", "http://p:1/", "--decode", "http://d:1", "--decode", "http://d:2")
    assert (args.prefill, args.decode, args.data_parallel) == (
        ["http://p:1"],
        ["http://d:1", "http://d:2"],
        [],
    )
    assert (args.port, args.timeout) == (8080, 600.0)
    assert parse("--data-parallel", "http://a:1", "--port", "9").data_parallel == ["http://a:1"]
    for argv in (
        ("--prefill", "http://p:1", "--data-parallel", "http://a:1"),
        ("--data-parallel", "http://a:1", "--decode", "http://d:1"),
        ("--decode", "ftp://d:1"),
        ("--decode", "http://d:1", "--decode", "http://d:1/"),
    ):
        with pytest.raises(SystemExit):
            parse(*argv)
    with pytest.raises(ValueError, match="--decode"):
        _router(parse("--prefill", "http://p:1"))


# ---- end to end -----------------------------------------------------------------------------
def test_decode_gets_body_with_prefill_url(
    fakes: list[FakeInstance], start_router: Callable[..., str]
) -> None:
    p1, p2, d = fakes
    base = start_router(prefill=(p1.url, p2.url), decode=(d.url,))
    sent = {"model": "m", "prompt": "The capital of France is", "max_tokens": 4}
    with client() as c:
        for _ in range(3):
            r = c.post(base + "/v1/completions", json=sent, headers={"Authorization": "Bearer k"})
            assert r.status_code == 200 and r.json()["instance"] == "C"
        chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
        assert c.post(base + "/v1/chat/completions", json=chat).status_code == 200
    assert not p1.received and not p2.received  # the router never calls a prefill instance
    preferred = RouterState([p1.url, p2.url], [d.url]).preferred_prefill(sent["prompt"])
    bodies = d.bodies()
    assert bodies[:3] == [{**sent, "kv_transfer_params": {"prefill_url": preferred}}] * 3
    assert bodies[3]["kv_transfer_params"]["prefill_url"] in (p1.url, p2.url)
    paths = [path for path, _, _ in d.received]
    assert paths == ["/v1/completions"] * 3 + ["/v1/chat/completions"]
    assert d.received[0][1]["authorization"] == "Bearer k"
    assert "authorization" not in d.received[3][1]


def test_streaming_passthrough(fakes: list[FakeInstance], start_router: Callable[..., str]) -> None:
    base = start_router(prefill=(fakes[0].url,), decode=(fakes[1].url,))
    with (
        client() as c,
        c.stream("POST", base + "/v1/completions", json={"prompt": "stream"}) as r,
    ):
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        text = r.read().decode()
    assert sse_data(text) == ['{"n": 0}', '{"n": 1}', '{"n": 2}', "[DONE]"]


def test_non_streaming_passthrough_and_upstream_error_verbatim(
    fakes: list[FakeInstance], start_router: Callable[..., str]
) -> None:
    base = start_router(prefill=(fakes[0].url,), decode=(fakes[1].url,))
    with client() as c:
        ok = c.post(base + "/v1/completions", json={"prompt": "hello"})
        bad = c.post(base + "/v1/completions", json={"prompt": "error400"})
    assert ok.status_code == 200 and ok.headers["content-type"] == "application/json"
    assert ok.json() == {"id": "cmpl-1", "instance": "B", "choices": [{"text": "x"}]}
    assert bad.status_code == 400
    assert bad.content == (
        b'{"error":{"message":"max_tokens: must be >= 1","type":"invalid_request_error",'
        b'"param":"max_tokens"}}'
    )


def test_bad_requests_are_answered_by_the_router(
    fakes: list[FakeInstance], start_router: Callable[..., str]
) -> None:
    base = start_router(prefill=(fakes[0].url,), decode=(fakes[1].url,))
    with client() as c:
        kv = c.post(
            base + "/v1/completions",
            json={"prompt": "hi", "kv_transfer_params": {"prefill_url": "http://evil:1"}},
        )
        broken = c.post(base + "/v1/completions", content=b"{not json")
        array = c.post(base + "/v1/chat/completions", json=[1, 2])
        unknown = c.get(base + "/v1/nothing")
    assert kv.status_code == 400
    assert kv.json()["error"]["param"] == "kv_transfer_params"
    assert "kv_transfer_params" in kv.json()["error"]["message"]
    assert broken.status_code == 400 and "JSON" in broken.json()["error"]["message"]
    assert array.status_code == 400 and array.json()["error"]["code"] == 400
    assert unknown.status_code == 404
    assert unknown.json()["error"]["type"] == "not_found_error"
    assert not fakes[1].received


def test_router_shares_the_servers_error_bodies_and_loads_no_engine() -> None:
    """The router answers with the server's OpenAI error body and SSE framing
    (``openai.responses``) and, importing them, loads neither the engine nor torch."""
    import subprocess
    import sys

    code = (
        "import sys, chunkserve.entrypoints.router as r, chunkserve.entrypoints.openai.responses"
        " as o\n"
        "assert r.error_response is o.error_response and r.error_body is o.error_body\n"
        "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('chunkserve.engine')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_dead_decode_instance_is_502(
    fakes: list[FakeInstance], start_router: Callable[..., str]
) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    base = start_router(prefill=(fakes[0].url,), decode=(dead,))
    with client() as c:
        r = c.post(base + "/v1/completions", json={"prompt": "hi", "stream": True})
        again = c.post(base + "/v1/completions", json={"prompt": "hi"})
    assert r.status_code == 502 and again.status_code == 502
    error = r.json()["error"]
    assert dead in error["message"]
    assert (error["type"], error["param"], error["code"]) == ("bad_gateway", None, 502)
    samples = metric_samples(base)
    name = "chunkserve_router:upstream_errors_total"
    assert sample(samples, name, instance=dead, kind="connect") == 2
    assert (
        sample(samples, "chunkserve_router:requests_in_flight", role="decode", instance=dead) == 0
    )


def test_slow_instance_is_504_and_the_upstream_is_closed(
    fakes: list[FakeInstance], start_router: Callable[..., str]
) -> None:
    d = fakes[1]
    base = start_router(prefill=(fakes[0].url,), decode=(d.url,), timeout_s=0.5)
    start_s = time.monotonic()
    with client() as c:
        r = c.post(base + "/v1/completions", json={"prompt": "sleep:600"})
    # The router's 0.5 s, not the instance's 600 s (room for a loaded machine).
    assert r.status_code == 504 and time.monotonic() - start_s < 60
    error = r.json()["error"]
    assert d.url in error["message"] and error["code"] == 504
    assert d.sleep_disconnected.wait(WAIT_S)
    samples = metric_samples(base)
    assert sample(
        samples, "chunkserve_router:upstream_errors_total", instance=d.url, kind="timeout"
    )


def test_mid_stream_failure_is_an_error_event_then_done(
    fakes: list[FakeInstance], start_router: Callable[..., str]
) -> None:
    d = fakes[1]
    base = start_router(prefill=(fakes[0].url,), decode=(d.url,))
    with (
        client() as c,
        c.stream("POST", base + "/v1/completions", json={"prompt": "stream_then_fail"}) as r,
    ):
        assert r.status_code == 200
        text = r.read().decode()
    events = sse_data(text)
    assert events[:3] == ['{"n": 0}', '{"n": 1}', '{"n": 2}']  # the cut event is dropped
    assert events[4:] == ["[DONE]"]
    error = json.loads(events[3])["error"]
    assert d.url in error["message"] and error["code"] == 502
    samples = metric_samples(base)
    status = sample(
        samples, "chunkserve_router:requests_total", role="decode", instance=d.url, status="502"
    )
    assert status == 1


def test_client_disconnect_closes_the_upstream_stream(
    fakes: list[FakeInstance], start_router: Callable[..., str]
) -> None:
    p, d = fakes[0], fakes[1]
    base = start_router(prefill=(p.url,), decode=(d.url,))
    with (
        client() as c,
        c.stream("POST", base + "/v1/completions", json={"prompt": "stream_forever"}) as r,
    ):
        chunks = r.iter_raw()  # held: a dropped iterator closes the response
        assert next(chunks).startswith(b"data: ")
        during = metric_samples(base)
        gauge = "chunkserve_router:requests_in_flight"
        assert sample(during, gauge, role="decode", instance=d.url) == 1
        assert sample(during, gauge, role="prefill", instance=p.url) == 1
    # The client has closed the stream.
    assert d.stream_closed.wait(WAIT_S)

    def idle() -> bool:
        samples = metric_samples(base)
        gauge = "chunkserve_router:requests_in_flight"
        return (
            sample(samples, gauge, role="decode", instance=d.url) == 0
            and sample(samples, gauge, role="prefill", instance=p.url) == 0
            and sample(
                samples,
                "chunkserve_router:requests_total",
                role="decode",
                instance=d.url,
                status="499",
            )
            == 1
        )

    assert wait_for(idle)


def test_client_disconnect_before_the_answer_closes_the_upstream(
    fakes: list[FakeInstance], start_router: Callable[..., str]
) -> None:
    d = fakes[1]
    base = start_router(prefill=(fakes[0].url,), decode=(d.url,))
    # The client leaves once the instance has the request (not after a fixed time, which a
    # loaded machine may spend before the router forwards it).
    body = b'{"prompt": "sleep:600"}'
    host, port = base.removeprefix("http://").split(":")
    conn = socket.create_connection((host, int(port)), timeout=CLIENT_TIMEOUT_S)
    conn.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
    )
    assert wait_for(lambda: bool(d.received))
    conn.close()
    assert d.sleep_disconnected.wait(WAIT_S)


def test_data_parallel_forwards_unchanged_and_spreads(
    fakes: list[FakeInstance], start_router: Callable[..., str]
) -> None:
    a, b = fakes[0], fakes[1]
    base = start_router(data_parallel=(a.url, b.url))
    # Held until all four arrived: each is routed while the others are in flight.
    raw = b'{"prompt":  "hold", "max_tokens" : 3}'
    with client() as c, concurrent.futures.ThreadPoolExecutor(4) as pool:
        post = lambda _: c.post(  # noqa: E731
            base + "/v1/completions", content=raw, headers={"content-type": "application/json"}
        )
        futures = [pool.submit(post, i) for i in range(4)]
        assert wait_for(lambda: len(a.received) + len(b.received) == 4)
        a.release()
        b.release()
        answers = [f.result() for f in futures]
    assert [r.status_code for r in answers] == [200] * 4
    assert len(a.received) == len(b.received) == 2  # the least loaded each time
    assert {body for _, _, body in a.received + b.received} == {raw}
    samples = metric_samples(base)
    for fake in (a, b):
        assert (
            sample(
                samples,
                "chunkserve_router:requests_total",
                role="data_parallel",
                instance=fake.url,
                status="200",
            )
            == 2
        )
    assert sample(samples, "chunkserve_router:request_seconds_count", mode="data_parallel") == 4


def test_models_from_the_first_instance_that_answers(
    fakes: list[FakeInstance], start_router: Callable[..., str]
) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    base = start_router(prefill=(fakes[0].url,), decode=(dead, fakes[2].url))
    r = httpx.get(base + "/v1/models", timeout=CLIENT_TIMEOUT_S)
    assert r.status_code == 200 and r.json()["data"][0]["owned_by"] == "C"


def test_health(fakes: list[FakeInstance], start_router: Callable[..., str]) -> None:
    p, d1, d2 = fakes
    dead = f"http://127.0.0.1:{free_port()}"
    base = start_router(prefill=(p.url, dead), decode=(d1.url, d2.url))
    ok = httpx.get(base + "/health", timeout=CLIENT_TIMEOUT_S)
    assert ok.status_code == 200 and ok.json()["status"] == "ok"
    assert ok.json()["instances"]["prefill"] == {"up": [p.url], "down": [dead]}
    d1.healthy = d2.healthy = False
    down = httpx.get(base + "/health", timeout=CLIENT_TIMEOUT_S)
    assert down.status_code == 503
    message = down.json()["error"]["message"]
    assert "decode" in message and d1.url in message and d2.url in message
    d1.healthy = True
    assert httpx.get(base + "/health", timeout=CLIENT_TIMEOUT_S).status_code == 200
    no_prefill = start_router(prefill=(dead,), decode=(d1.url,))
    r = httpx.get(no_prefill + "/health", timeout=CLIENT_TIMEOUT_S)
    assert r.status_code == 503 and dead in r.json()["error"]["message"]


def test_metrics_count_requests(
    fakes: list[FakeInstance], start_router: Callable[..., str]
) -> None:
    p, d = fakes[0], fakes[1]
    base = start_router(prefill=(p.url,), decode=(d.url,))
    before = metric_samples(base)
    assert (
        sample(before, "chunkserve_router:requests_in_flight", role="decode", instance=d.url) == 0
    )
    with client() as c:
        for prompt in ("a", "b", "error400"):
            c.post(base + "/v1/completions", json={"prompt": prompt})
    after = metric_samples(base)
    total = "chunkserve_router:requests_total"
    assert sample(after, total, role="decode", instance=d.url, status="200") == 2
    assert sample(after, total, role="prefill", instance=p.url, status="200") == 2
    assert sample(after, total, role="decode", instance=d.url, status="400") == 1
    assert sample(after, "chunkserve_router:request_seconds_count", mode="disaggregated") == 3
    assert (
        sample(after, "chunkserve_router:requests_in_flight", role="prefill", instance=p.url) == 0
    )
