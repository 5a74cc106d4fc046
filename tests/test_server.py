"""The OpenAI-compatible server: a real server in a subprocess on a free loopback port, driven
by the real ``openai`` client and by raw HTTP for the error paths."""

from __future__ import annotations

import collections
import concurrent.futures
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import NATURAL_PROMPTS

MODEL = "SmolLM2-135M-Instruct"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ChunkserveProcess:
    """``python -m chunkserve <command> --port P ...`` on a free loopback port, ready once
    ``health`` answers 200; ``stop`` ends it by its PID (SIGTERM, then SIGKILL). Its output
    is read as it comes (its last lines kept in ``output``): an unread pipe fills and
    blocks a server that logs."""

    def __init__(
        self,
        command: str,
        *args: str,
        health: str,
        timeout_s: float,
        env: dict[str, str] | None = None,
    ) -> None:
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "chunkserve", command, "--port", str(self.port), *args]
        env = dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}))
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
        )
        self.output: collections.deque[str] = collections.deque(maxlen=500)
        reader = threading.Thread(target=self.output.extend, args=(self.proc.stdout,))
        reader.daemon = True
        reader.start()
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            if self.proc.poll() is not None:
                reader.join(10)
                raise RuntimeError(f"{command} exited:\n" + "".join(self.output))
            try:
                if httpx.get(self.base + health, timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        self.stop()
        raise RuntimeError(f"{command} did not become healthy")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)


class Server(ChunkserveProcess):
    def __init__(self, *extra: str, env: dict[str, str] | None = None) -> None:
        super().__init__(
            "serve",
            "--dtype",
            "float32",
            "--max-model-len",
            "512",
            "--kv-cache-memory",
            "64MiB",
            "--max-num-batched-tokens",
            "64",
            "--log-level",
            "warning",
            *extra,
            health="/health",
            timeout_s=600,  # only against a hang: a loaded machine starts slowly
            env=env,
        )

    def client(self, api_key: str = "none") -> openai.OpenAI:
        return openai.OpenAI(base_url=self.base + "/v1", api_key=api_key, max_retries=0)

    def metrics(self) -> dict[str, float]:
        text = httpx.get(self.base + "/metrics", timeout=10).text
        out: dict[str, float] = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                key = sample.name
                reason = sample.labels.get("finished_reason")
                if reason:
                    key += f"{{{reason}}}"
                out[key] = out.get(key, 0.0) + sample.value
        return out

    def wait_idle(self, timeout: float = 120.0) -> dict[str, float]:
        deadline = time.time() + timeout
        while True:
            m = self.metrics()
            idle = (
                m["chunkserve:num_requests_running"] == 0
                and m["chunkserve:num_requests_waiting"] == 0
            )
            if idle and m["chunkserve:kv_cache_blocks_used"] == 0:
                return m
            if time.time() > deadline:
                raise AssertionError(f"server not idle after {timeout:.0f} s: {m}")
            time.sleep(0.2)


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    s = Server()
    yield s
    s.stop()


def greedy(**kw):
    return dict(temperature=0.0, max_tokens=kw.pop("max_tokens", 16), **kw)


def assert_alive(server: Server) -> None:
    assert httpx.get(server.base + "/health", timeout=10).status_code == 200
    r = server.client().completions.create(model=MODEL, prompt="Hi", **greedy(max_tokens=2))
    assert r.choices[0].finish_reason in ("length", "stop")


# ---- happy paths ---------------------------------------------------------------------------
def test_completion_stream_equals_non_stream(server: Server) -> None:
    client = server.client()
    full = client.completions.create(model=MODEL, prompt=NATURAL_PROMPTS[0], **greedy())
    assert full.choices[0].finish_reason in ("length", "stop")
    stream = client.completions.create(
        model=MODEL,
        prompt=NATURAL_PROMPTS[0],
        stream=True,
        stream_options={"include_usage": True},
        **greedy(),
    )
    parts, usage, finish = [], None, None
    for chunk in stream:
        if chunk.choices:
            parts.append(chunk.choices[0].text)
            finish = chunk.choices[0].finish_reason or finish
        if chunk.usage:
            usage = chunk.usage
    assert "".join(parts) == full.choices[0].text
    assert finish == full.choices[0].finish_reason
    assert usage.completion_tokens == full.usage.completion_tokens
    assert usage.prompt_tokens == full.usage.prompt_tokens > 0


def test_chat_stream_equals_non_stream(server: Server) -> None:
    client = server.client()
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    full = client.chat.completions.create(model=MODEL, messages=messages, **greedy())
    assert full.choices[0].message.role == "assistant"
    stream = client.chat.completions.create(model=MODEL, messages=messages, stream=True, **greedy())
    parts = []
    roles = []
    for chunk in stream:
        delta = chunk.choices[0].delta
        roles.append(delta.role)
        parts.append(delta.content or "")
    assert roles[0] == "assistant"
    assert "".join(parts) == full.choices[0].message.content


def test_concurrent_streams_match_solo(server: Server) -> None:
    prompts = [f"{NATURAL_PROMPTS[i % len(NATURAL_PROMPTS)]} ({i})" for i in range(16)]
    client = server.client()
    solo = [
        client.completions.create(model=MODEL, prompt=p, **greedy(max_tokens=12)).choices[0].text
        for p in prompts
    ]

    def stream_one(p: str) -> str:
        c = server.client()
        chunks = c.completions.create(model=MODEL, prompt=p, stream=True, **greedy(max_tokens=12))
        return "".join(ch.choices[0].text for ch in chunks if ch.choices)

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        together = list(pool.map(stream_one, prompts))
    assert together == solo
    m = server.wait_idle()
    assert m["chunkserve:kv_cache_blocks_used"] == 0


def test_n_logprobs_echo_and_token_prompts(server: Server) -> None:
    client = server.client()
    r = client.completions.create(
        model=MODEL,
        prompt=["Once upon", "The sky"],
        n=2,
        seed=3,
        temperature=1.0,
        max_tokens=5,
        logprobs=2,
        echo=True,
    )
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert r.choices[0].text.startswith("Once upon") and r.choices[2].text.startswith("The sky")
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs)
    # echo with logprobs: the prompt's tokens first, the very first one unscored.
    prompt_ids = httpx.post(server.base + "/tokenize", json={"prompt": "Once upon"}).json()
    assert len(lp.tokens) == prompt_ids["count"] + 5
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(t is None or len(t) <= 2 for t in lp.top_logprobs)
    assert all(x is not None for x in lp.token_logprobs[1:])
    ids = httpx.post(server.base + "/tokenize", json={"prompt": "The sky"}).json()["tokens"]
    by_ids = client.completions.create(model=MODEL, prompt=ids, **greedy(max_tokens=4))
    by_text = client.completions.create(model=MODEL, prompt="The sky", **greedy(max_tokens=4))
    assert by_ids.choices[0].text == by_text.choices[0].text
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Hi"}],
        logprobs=True,
        top_logprobs=2,
        **greedy(max_tokens=3),
    )
    entries = chat.choices[0].logprobs.content
    assert len(entries) == chat.usage.completion_tokens
    assert all(len(e.top_logprobs) == 2 for e in entries)


def test_streamed_n_choices_equal_the_non_streamed_ones(server: Server) -> None:
    """n > 1 streamed: every choice index's deltas add up to that choice's non-streamed
    text and finish reason (seeded sampling: the choices differ, so a mixed-up index
    shows), for completions over two prompts and for chat."""
    client = server.client()
    kw = dict(n=3, seed=11, temperature=1.0, max_tokens=12)
    full = client.completions.create(model=MODEL, prompt=["Once upon", "The sky"], **kw)
    expected = {c.index: (c.text, c.finish_reason) for c in full.choices}
    assert sorted(expected) == list(range(6))
    assert len({text for text, _ in expected.values()}) > 1
    texts: dict[int, str] = {}
    finish: dict[int, str] = {}
    for chunk in client.completions.create(
        model=MODEL, prompt=["Once upon", "The sky"], stream=True, **kw
    ):
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
            if c.finish_reason:
                finish[c.index] = c.finish_reason
    assert {i: (texts[i], finish[i]) for i in texts} == expected

    messages = [{"role": "user", "content": "Name a colour."}]
    full = client.chat.completions.create(model=MODEL, messages=messages, **kw)
    expected = {c.index: (c.message.content, c.finish_reason) for c in full.choices}
    assert sorted(expected) == [0, 1, 2] and len({t for t, _ in expected.values()}) > 1
    texts, finish = {}, {}
    for chunk in client.chat.completions.create(model=MODEL, messages=messages, stream=True, **kw):
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
            if c.finish_reason:
                finish[c.index] = c.finish_reason
    assert {i: (texts[i], finish[i]) for i in texts} == expected


def test_stop_strings_over_http(server: Server) -> None:
    client = server.client()
    full = (
        client.completions.create(model=MODEL, prompt=NATURAL_PROMPTS[1], **greedy(max_tokens=20))
        .choices[0]
        .text
    )
    stop = full[6:9]
    r = client.completions.create(
        model=MODEL, prompt=NATURAL_PROMPTS[1], stop=[stop], **greedy(max_tokens=20)
    )
    assert r.choices[0].text == full[: full.index(stop)]
    assert r.choices[0].finish_reason == "stop"


def test_models_tokenize_detokenize_version(server: Server) -> None:
    models = server.client().models.list()
    assert [m.id for m in models.data] == [MODEL]
    tok = httpx.post(server.base + "/tokenize", json={"prompt": "Hello world"}).json()
    assert tok["count"] == len(tok["tokens"]) and tok["max_model_len"] == 512
    text = httpx.post(server.base + "/detokenize", json={"tokens": tok["tokens"]}).json()
    assert text["prompt"] == "Hello world"
    chat = httpx.post(
        server.base + "/tokenize", json={"messages": [{"role": "user", "content": "Hi"}]}
    ).json()
    assert chat["tokens"][0] == 1
    assert httpx.get(server.base + "/version").json()["version"]


def test_metrics_parse_and_move(server: Server) -> None:
    before = server.wait_idle()
    server.client().completions.create(
        model=MODEL,
        prompt="Count: 1, 2, 3,",
        **greedy(max_tokens=6, extra_body={"ignore_eos": True}),
    )
    after = server.wait_idle()
    assert after["chunkserve:generation_tokens_total"] >= (
        before["chunkserve:generation_tokens_total"] + 6
    )
    assert after["chunkserve:prompt_tokens_total"] > before["chunkserve:prompt_tokens_total"]
    # 6 tokens: the steps after the first follow one another, each gap observed.
    assert after["chunkserve:step_gap_seconds_count"] >= (
        before.get("chunkserve:step_gap_seconds_count", 0) + 4
    )
    assert after["chunkserve:request_success_total{length}"] == (
        before.get("chunkserve:request_success_total{length}", 0) + 1
    )
    assert (
        after["chunkserve:time_to_first_token_seconds_count"]
        > (before["chunkserve:time_to_first_token_seconds_count"])
    )
    assert after["chunkserve:inter_token_latency_seconds_count"] >= (
        before["chunkserve:inter_token_latency_seconds_count"] + 5
    )
    assert after["chunkserve:kv_cache_blocks_total"] > 0


def test_reset_prefix_cache_endpoint(server: Server) -> None:
    """POST /reset_prefix_cache empties the core's prefix cache: the same prompt sent after
    it hits nothing, and the one after that hits again."""
    prompt = " ".join(NATURAL_PROMPTS) + " (reset)"

    def hits_of_one_request() -> float:
        before = server.wait_idle()["chunkserve:prefix_cache_hits_total"]
        server.client().completions.create(model=MODEL, prompt=prompt, **greedy(max_tokens=2))
        return server.wait_idle()["chunkserve:prefix_cache_hits_total"] - before

    hits_of_one_request()
    assert hits_of_one_request() >= 48  # the prompt's full blocks (~70 tokens)
    r = httpx.post(server.base + "/reset_prefix_cache", timeout=30)
    assert r.status_code == 200 and r.json() == {"status": "ok"}
    assert hits_of_one_request() == 0
    assert hits_of_one_request() >= 48


# ---- tool calling ---------------------------------------------------------------------------
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
TIME_TOOL = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"utc_offset": {"type": "integer", "minimum": -12, "maximum": 14}},
            "required": ["utc_offset"],
            "additionalProperties": False,
        },
    },
}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def streamed_calls(stream) -> tuple[str, list[tuple[str, str, str]], str | None]:
    """A chat stream's content, calls (id, name, arguments: fragments added up, the name
    first) and finish reason."""
    content, calls, finish = "", {}, None
    for chunk in stream:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for tc in choice.delta.tool_calls or []:
            if tc.index not in calls:
                assert tc.id and tc.function.name, "the first delta of a call names it"
                calls[tc.index] = [tc.id, tc.function.name, ""]
            else:
                assert tc.id is None and tc.function.name is None
            calls[tc.index][2] += tc.function.arguments or ""
        finish = choice.finish_reason or finish
    return content, [tuple(calls[i]) for i in sorted(calls)], finish


def test_forced_tool_calls_round_trip(server: Server) -> None:
    """A named function and ``required``, greedy and sampled: arguments valid against the
    schema, the streamed call equal to the non-streamed one; then the tool's result sent back
    (the call's id in a ``tool`` message) gets an answer."""
    import jsonschema

    client = server.client()
    tools = [WEATHER_TOOL, TIME_TOOL]
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    named = {"type": "function", "function": {"name": "get_weather"}}
    for choice, sampling in (
        (named, greedy(max_tokens=48)),
        ("required", greedy(max_tokens=48)),
        ("required", dict(temperature=1.0, seed=7, max_tokens=64)),
    ):
        kw = dict(model=MODEL, messages=ASK, tools=tools, tool_choice=choice, **sampling)
        r = client.chat.completions.create(**kw)
        msg = r.choices[0].message
        assert r.choices[0].finish_reason == "tool_calls", msg
        assert msg.tool_calls and msg.content is None
        for call in msg.tool_calls:
            assert call.type == "function" and call.id.startswith("call_")
            jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
        if choice is named:
            assert [c.function.name for c in msg.tool_calls] == ["get_weather"]
        content, calls, finish = streamed_calls(client.chat.completions.create(**kw, stream=True))
        assert finish == "tool_calls" and content == ""
        assert [(n, a) for _, n, a in calls] == [
            (c.function.name, c.function.arguments) for c in msg.tool_calls
        ]
    call = msg.tool_calls[0]
    history = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 21 C"},
    ]
    answer = client.chat.completions.create(
        model=MODEL, messages=history, tools=tools, tool_choice="none", **greedy()
    )
    assert answer.choices[0].message.tool_calls is None
    assert answer.choices[0].message.content


def test_auto_tool_choice_content_and_calls_add_up(server: Server) -> None:
    """``auto`` on a real reply: whatever the model wrote, the streamed content and calls
    equal the non-streamed ones (a reply without a complete call is content)."""
    client = server.client()
    kw = dict(model=MODEL, messages=ASK, tools=[WEATHER_TOOL], **greedy(max_tokens=40))
    r = client.chat.completions.create(**kw)
    msg = r.choices[0].message
    content, calls, finish = streamed_calls(client.chat.completions.create(**kw, stream=True))
    assert content == (msg.content or "") or (msg.tool_calls and not (msg.content or "").strip())
    assert [(n, a) for _, n, a in calls] == [
        (c.function.name, c.function.arguments) for c in msg.tool_calls or []
    ]
    assert finish == r.choices[0].finish_reason
    # /tokenize with tools counts the prompt the chat request got (the tools in it).
    counted = post(server, "/tokenize", json={"messages": ASK, "tools": [WEATHER_TOOL]}).json()
    plain = post(server, "/tokenize", json={"messages": ASK}).json()
    assert counted["count"] == r.usage.prompt_tokens > plain["count"]


BAD_TOOL_REQUESTS = [
    (
        {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 7}}}]},
        "tools[0].function.parameters",
    ),
    (
        {"tools": [WEATHER_TOOL], "tool_choice": {"type": "function", "function": {"name": "x"}}},
        "tool_choice.function.name",
    ),
    ({"tool_choice": "required"}, "tool_choice"),
    (
        {"messages": [*ASK, {"role": "tool", "tool_call_id": "call_0", "content": "hi"}]},
        "messages[1].tool_call_id",
    ),
]


@pytest.mark.parametrize(("fields", "param"), BAD_TOOL_REQUESTS)
def test_bad_tool_requests_are_400(server: Server, fields: dict, param: str) -> None:
    body = {"model": MODEL, "messages": ASK, "max_tokens": 2, **fields}
    assert_error(post(server, "/v1/chat/completions", json=body), 400, param)


# ---- disconnects ---------------------------------------------------------------------------
def test_client_disconnect_mid_stream_frees_blocks(server: Server) -> None:
    body = {
        "model": MODEL,
        "prompt": NATURAL_PROMPTS[5],
        "max_tokens": 400,
        "stream": True,
        "temperature": 0.0,
        "ignore_eos": True,
    }
    before = server.metrics()
    with (
        httpx.Client(timeout=30) as client,
        client.stream("POST", server.base + "/v1/completions", json=body) as resp,
    ):
        assert resp.status_code == 200
        lines = 0
        for line in resp.iter_lines():
            if line.startswith("data:"):
                lines += 1
            if lines >= 3:
                break  # leave: closing the response drops the connection
    m = server.wait_idle()
    assert m["chunkserve:kv_cache_blocks_used"] == 0
    assert m["chunkserve:num_requests_running"] == 0
    key = "chunkserve:request_success_total{%s}"
    assert m.get(key % "abort", 0) == before.get(key % "abort", 0) + 1  # this one
    assert m.get(key % "length", 0) == before.get(key % "length", 0)
    assert_alive(server)


def wait_for(condition, what: str, timeout: float = 120.0) -> None:
    """Poll ``condition()`` (a state of the server) until it holds; the timeout only guards
    against a hang."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"never: {what}"
        time.sleep(0.05)


def process_stopped(pid: int) -> bool:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] in ("T", "t")


class PausedCores:
    """SIGSTOP a server's engine-core processes (and SIGCONT them on leaving): while paused,
    no request of the server can make progress, so a test can hold a request in flight for
    as long as it needs, however fast the machine generates."""

    def __init__(self, server: Server) -> None:
        self.pids = core_pids(server.proc.pid)
        assert self.pids, "no engine-core process"

    def __enter__(self) -> PausedCores:
        for pid in self.pids:
            os.kill(pid, signal.SIGSTOP)
        wait_for(lambda: all(process_stopped(p) for p in self.pids), "cores stopped")
        return self

    def __exit__(self, *exc) -> None:
        for pid in self.pids:
            os.kill(pid, signal.SIGCONT)


def generating(server: Server, before: dict[str, float]) -> bool:
    """Tokens were generated since the ``before`` metrics were read."""
    key = "chunkserve:generation_tokens_total"
    return server.metrics()[key] > before[key]


def test_client_disconnect_non_stream_frees_blocks(server: Server) -> None:
    """A client that gives up on a non-streamed request: the request is aborted (counted
    as such), not run to its end. The engine core is paused while the client leaves and
    the server notices, so the request cannot finish first on a fast machine."""
    before = server.metrics()
    prompt = NATURAL_PROMPTS[4]
    body = json.dumps(
        {
            "model": MODEL,
            "prompt": prompt,
            "max_tokens": 400,
            "temperature": 0.0,
            "ignore_eos": True,
        }
    ).encode()
    conn = socket.create_connection(("127.0.0.1", server.port), timeout=30)
    conn.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
    )
    wait_for(lambda: generating(server, before), "the request generates")
    with PausedCores(server):
        conn.close()  # the client is gone
        # The server polls for a gone client every DISCONNECT_POLL_S (0.2 s) and sends the
        # core an abort, which the core applies before its next step: ten polls' time while
        # nothing can finish (and were it later, 400 tokens are far from done).
        time.sleep(2.0)
    m = server.wait_idle()
    key = "chunkserve:request_success_total{%s}"
    assert m[key % "abort"] == before[key % "abort"] + 1
    assert m[key % "length"] == before[key % "length"]  # it did not run to the end
    assert m["chunkserve:kv_cache_blocks_used"] == 0
    assert_alive(server)


# ---- bad input -----------------------------------------------------------------------------
def post(server: Server, path: str, **kw) -> httpx.Response:
    return httpx.post(server.base + path, timeout=30, **kw)


def assert_error(r: httpx.Response, status: int, param: str | None = None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param is not None:
        assert err["param"] == param
    return err


# Distinct bad inputs: each must be a 400 naming its field.
BAD_COMPLETIONS = [
    ({"model": MODEL, "prompt": "x", "max_tokens": "many"}, "max_tokens"),
    ({"model": MODEL, "prompt": "x", "temperature": -1}, "temperature"),
    ({"model": MODEL, "prompt": "x", "top_p": 0}, "top_p"),
    ({"model": MODEL, "prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"model": MODEL, "prompt": ""}, "prompt"),
    ({"model": MODEL, "prompt": [1, 2, 10**7]}, "prompt"),
    ({"model": MODEL}, "prompt"),
    ({"model": MODEL, "prompt": "x", "n": 0}, "n"),
    ({"model": MODEL, "prompt": "x", "logprobs": 99}, "logprobs"),
    # Validated against the model and 64-bit ranges at the edge (they were 500s that
    # failed the requests sharing the step).
    (
        {"model": MODEL, "prompt": "x", "min_tokens": 1, "stop_token_ids": [999999999]},
        "stop_token_ids",
    ),
    ({"model": MODEL, "prompt": "x", "seed": 18446744073709551616}, "seed"),
    ({"model": MODEL, "prompt": "x", "top_k": 9223372036854775808}, "top_k"),
    ({"model": MODEL, "prompt": "x", "priority": 2**63}, "priority"),
    ({"model": MODEL, "prompt": "x", "min_tokens": 2**40}, "min_tokens"),
    ({"model": MODEL, "prompt": "x", "logit_bias": {"49152": 5}}, "logit_bias"),
    ({"model": MODEL, "prompt": "x", "logit_bias": {"12": 101}}, "logit_bias"),
    ({"model": MODEL, "prompt": "x", "logit_bias": {"cat": 1}}, "logit_bias"),
    ({"model": MODEL, "prompt": "x", "stop": ["s"] * 33}, "stop"),
    ({"model": MODEL, "prompt": "x", "stop": ["x" * 513]}, "stop"),
    ({"model": MODEL, "prompt": "x", "stop_token_ids": list(range(257))}, "stop_token_ids"),
    # Refused by name instead of silently ignored.
    (
        {"model": MODEL, "prompt": "x", "response_format": {"type": "json_schema"}},
        "response_format.json_schema",
    ),
    ({"model": MODEL, "prompt": "x", "suffix": "!"}, "suffix"),
    ({"model": MODEL, "prompt": "x", "best_of": 3}, "best_of"),
    ({"model": MODEL, "prompt": "x", "tools": [{"type": "function"}]}, "tools"),
    ({"model": MODEL, "prompt": "x", "guided_json": {"type": "array", "items": 3}}, "guided_json"),
    ({"model": MODEL, "prompt": ["a"] * 16, "n": 16}, "n"),  # 256 sequences in one
    ({"model": MODEL, "prompt": "x", "n": 17}, "n"),
    ({"model": MODEL, "prompt": "x", "presence_penalty": 3}, "presence_penalty"),
    ({"model": MODEL, "prompt": "x", "frequency_penalty": -2.5}, "frequency_penalty"),
    ({"model": MODEL, "prompt": "x", "repetition_penalty": 0}, "repetition_penalty"),
    ({"model": MODEL, "prompt": "x", "min_p": 2}, "min_p"),
    ({"model": MODEL, "prompt": "x", "top_k": -5}, "top_k"),
    ({"model": MODEL, "prompt": "x", "temperature": "hot"}, "temperature"),
]


@pytest.mark.parametrize(("body", "param"), BAD_COMPLETIONS)
def test_bad_completion_fields_are_400(server: Server, body: dict, param: str) -> None:
    assert_error(post(server, "/v1/completions", json=body), 400, param)


JSON = {"content-type": "application/json"}
# Bodies written as raw JSON: "\\ud800" escapes a lone UTF-16 surrogate, which no Unicode
# text holds (a client library would refuse to encode it). Each is a 400 naming the field.
LONE_SURROGATES = [
    ("/v1/completions", '{"prompt": "\\ud800 hi", "max_tokens": 2}', "prompt"),
    ("/v1/completions", '{"prompt": ["ok", "\\udc00"], "max_tokens": 2}', "prompt"),
    ("/v1/completions", '{"prompt": "hi", "stop": ["\\ud800"], "max_tokens": 2}', "stop"),
    ("/v1/completions", '{"prompt": "hi", "stop": "x\\ud800", "max_tokens": 2}', "stop"),
    ("/v1/completions", '{"prompt": "hi", "user": "\\ud800", "max_tokens": 2}', "user"),
    ("/v1/completions", '{"prompt": "hi", "model": "\\ud800"}', "model"),
    (
        "/v1/chat/completions",
        '{"messages": [{"role": "user", "content": "a\\ud800"}], "max_tokens": 2}',
        "messages[0].content",
    ),
    (
        "/v1/chat/completions",
        '{"messages": [{"role": "user", "content": "ok"}, {"role": "user", "content": '
        '[{"type": "text", "text": "\\udfff"}]}], "max_tokens": 2}',
        "messages[1].content[0].text",
    ),
    (
        "/v1/chat/completions",
        '{"messages": [{"role": "\\ud800", "content": "x"}], "max_tokens": 2}',
        "messages[0].role",
    ),
    ("/tokenize", '{"prompt": "\\ud800"}', "prompt"),
]


@pytest.mark.parametrize(("path", "raw", "param"), LONE_SURROGATES)
def test_lone_surrogate_is_400_naming_the_field(server: Server, path, raw, param) -> None:
    r = post(server, path, content=raw.encode(), headers=JSON)
    err = assert_error(r, 400, param)
    assert err["message"].startswith(f"{param}: not valid Unicode text")


def test_a_surrogate_pair_is_one_character(server: Server) -> None:
    raw = '{"prompt": "\\ud83d\\ude00 ok", "max_tokens": 1, "temperature": 0}'
    r = post(server, "/v1/completions", content=raw.encode(), headers=JSON)
    assert r.status_code == 200, r.text


def test_there_are_thirty_distinct_bad_inputs() -> None:
    assert len({json.dumps(b, sort_keys=True) for b, _ in BAD_COMPLETIONS}) >= 30


def test_bad_request_beside_good_ones_changes_nothing(server: Server) -> None:
    """Bad requests sent while good ones stream are refused at the edge: the good ones'
    tokens are those of a run alone, and the server goes on serving."""
    client = server.client()
    prompt = NATURAL_PROMPTS[5]
    alone = client.completions.create(model=MODEL, prompt=prompt, **greedy(max_tokens=24))

    def good(_: int) -> str:
        return client.completions.create(model=MODEL, prompt=prompt, **greedy(max_tokens=24))

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        goods = [pool.submit(good, i) for i in range(2)]
        bads = [
            (pool.submit(post, server, "/v1/completions", json=body), param)
            for body, param in BAD_COMPLETIONS  # every kind, while the good ones run
        ]
        for f, param in bads:
            assert_error(f.result(), 400, param)
        for f in goods:
            assert f.result().choices[0].text == alone.choices[0].text
    assert_alive(server)


def test_max_completion_tokens_bounds_a_chat_completion(server: Server) -> None:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Count from one to fifty."}],
        "max_completion_tokens": 3,
        "temperature": 0.0,
        "ignore_eos": True,
    }
    r = post(server, "/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["usage"]["completion_tokens"] == 3
    assert out["choices"][0]["finish_reason"] == "length"


def test_tiny_temperature_is_greedy_and_logit_bias_works(server: Server) -> None:
    client = server.client()
    prompt = NATURAL_PROMPTS[0]
    greedy_text = client.completions.create(model=MODEL, prompt=prompt, **greedy()).choices[0]
    tiny = client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=1e-40)
    assert tiny.choices[0].text == greedy_text.text and tiny.choices[0].text
    ids = httpx.post(server.base + "/tokenize", json={"prompt": " banana"}).json()["tokens"]
    forced = client.completions.create(
        model=MODEL, prompt=prompt, logit_bias={str(ids[-1]): 100}, **greedy(max_tokens=3)
    )
    assert forced.choices[0].text == " banana" * 3
    first = httpx.post(
        server.base + "/tokenize", json={"prompt": greedy_text.text, "add_special_tokens": False}
    ).json()["tokens"][0]
    banned = client.completions.create(
        model=MODEL, prompt=prompt, logit_bias={str(first): -100}, **greedy(max_tokens=4)
    )
    assert banned.choices[0].text != greedy_text.text[: len(banned.choices[0].text)]


def test_streamed_logprobs_cover_every_token(server: Server) -> None:
    """A stop string that holds text back (a possible match in progress) does not hold back
    the logprobs: one entry per completion token, in order, and continuous usage stats."""
    client = server.client()
    prompt = NATURAL_PROMPTS[3]
    full = client.completions.create(model=MODEL, prompt=prompt, logprobs=2, **greedy())
    tokens = full.choices[0].logprobs.tokens
    stop = "".join(tokens[5:9])  # four tokens long: held back while it could match
    ref = client.completions.create(model=MODEL, prompt=prompt, logprobs=2, stop=[stop], **greedy())
    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt=prompt,
            logprobs=2,
            stop=[stop],
            stream=True,
            stream_options={"include_usage": True, "continuous_usage_stats": True},
            **greedy(),
        )
    )
    streamed = [
        t
        for c in chunks
        if c.choices and c.choices[0].logprobs
        for t in c.choices[0].logprobs.tokens
    ]
    assert streamed == ref.choices[0].logprobs.tokens
    assert "".join(c.choices[0].text for c in chunks if c.choices) == ref.choices[0].text
    usage = [c.usage.completion_tokens for c in chunks if c.usage]
    assert usage == sorted(usage) and usage[-1] == ref.usage.completion_tokens


def test_malformed_json_and_wrong_shape(server: Server) -> None:
    assert_error(
        post(
            server,
            "/v1/completions",
            content=b'{"prompt": ',
            headers={"content-type": "application/json"},
        ),
        400,
    )
    assert_error(post(server, "/v1/completions", json=[1, 2]), 400)
    assert_error(
        post(server, "/v1/chat/completions", json={"model": MODEL, "messages": []}), 400, "messages"
    )
    assert_error(
        post(
            server,
            "/v1/chat/completions",
            json={"model": MODEL, "messages": [{"content": "no role"}]},
        ),
        400,
    )
    assert_alive(server)


def test_too_long_is_400_with_numbers(server: Server) -> None:
    err = assert_error(
        post(
            server,
            "/v1/completions",
            json={"model": MODEL, "prompt": "hello " * 100, "max_tokens": 450},
        ),
        400,
        "max_tokens",
    )
    assert "512" in err["message"] and "450" in err["message"]
    assert_error(
        post(server, "/v1/completions", json={"model": MODEL, "prompt": "hello " * 600}),
        400,
        "prompt",
    )
    assert_alive(server)


def test_unknown_model_is_404(server: Server) -> None:
    err = assert_error(
        post(server, "/v1/completions", json={"model": "gpt-9", "prompt": "x"}), 404, "model"
    )
    assert err["type"] == "not_found_error"
    with pytest.raises(openai.NotFoundError):
        server.client().chat.completions.create(
            model="gpt-9", messages=[{"role": "user", "content": "x"}]
        )


def test_body_size_is_bounded(server: Server) -> None:
    huge = b'{"prompt": "' + b"a" * (33 << 20) + b'"}'
    assert_error(
        post(server, "/v1/completions", content=huge, headers={"content-type": "application/json"}),
        413,
    )
    assert_alive(server)


# ---- auth and overload ---------------------------------------------------------------------
AUTH = {"Authorization": "Bearer sekret"}


@pytest.fixture(scope="module")
def guarded() -> Iterator[Server]:
    """One sequence at a time, two waiting at most, an API key, the priority policy; a
    context of 4096 so that one request can hold the only slot for thousands of tokens."""
    s = Server(
        "--max-model-len",
        "4096",
        "--kv-cache-memory",
        "256MiB",
        "--api-key",
        "sekret",
        "--max-waiting-requests",
        "2",
        "--max-num-seqs",
        "1",
        "--scheduling-policy",
        "priority",
    )
    yield s
    s.stop()


def test_api_key_required(guarded: Server) -> None:
    body = {"model": MODEL, "prompt": "x", "max_tokens": 2}
    assert_error(post(guarded, "/v1/completions", json=body), 401)
    assert_error(
        post(guarded, "/v1/completions", json=body, headers={"Authorization": "Bearer wrong"}), 401
    )
    with pytest.raises(openai.AuthenticationError):
        guarded.client("wrong").models.list()
    ok = guarded.client("sekret").completions.create(model=MODEL, prompt="x", max_tokens=2)
    assert ok.choices
    assert httpx.get(guarded.base + "/health").status_code == 200  # open


def test_overload_is_503_with_retry_after(guarded: Server) -> None:
    headers = {"Authorization": "Bearer sekret"}
    body = {
        "model": MODEL,
        "prompt": "Tell me a story.",
        "max_tokens": 60,
        "temperature": 0.0,
        "ignore_eos": True,
    }

    def send(_: int) -> httpx.Response:
        return httpx.post(guarded.base + "/v1/completions", json=body, headers=headers, timeout=120)

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        responses = list(pool.map(send, range(8)))
    codes = sorted(r.status_code for r in responses)
    assert 200 in codes and 503 in codes, codes
    rejected = next(r for r in responses if r.status_code == 503)
    assert rejected.headers["retry-after"]
    assert rejected.json()["error"]["type"] == "service_unavailable_error"
    m = guarded.wait_idle()
    assert m["chunkserve:kv_cache_blocks_used"] == 0
    ok = guarded.client("sekret").completions.create(model=MODEL, prompt="x", max_tokens=2)
    assert ok.choices


def test_priority_decides_who_runs_when_the_engine_is_full(guarded: Server) -> None:
    """One sequence at a time under the priority policy: while a request runs, a less
    urgent one then a more urgent one queue (seen in /metrics, no sleeps); when the slot
    frees, the more urgent one runs first, though it came second. The running request asks
    for the whole context (~4,000 tokens): it holds the slot until the test closes its
    stream, however fast the machine generates. Each queued request could only start after
    that, so the first to stream a token is the one admitted first. (Two waiting is within
    the server's bound.)"""
    server = guarded
    server.wait_idle()  # the counts below are this test's requests alone
    tails = {"running": "", "low": " Go.", "high": " Then list three more, with a reason."}
    first_token = {name: threading.Event() for name in ("running", "low", "high")}
    stop = {name: threading.Event() for name in first_token}

    def stream(name: str, priority: int) -> None:
        body = {
            "model": MODEL,
            # The more urgent one's prompt is the longest: by length or by arrival the
            # less urgent one would go first.
            "prompt": NATURAL_PROMPTS[3] + tails[name],
            # None: up to the context, so the running one cannot finish on its own first.
            "max_tokens": None if name == "running" else 400,
            "temperature": 0.0,
            "ignore_eos": True,
            "priority": priority,
            "stream": True,
        }
        with (
            httpx.Client(timeout=120, headers=AUTH) as c,
            c.stream("POST", server.base + "/v1/completions", json=body) as resp,
        ):
            for line in resp.iter_lines():
                if line.startswith("data: {"):
                    first_token[name].set()
                if stop[name].is_set():
                    return  # the connection closes: the server aborts the request

    def wait_for(condition, what: str) -> dict[str, float]:
        deadline = time.time() + 120  # a bound, not an ordering
        while time.time() < deadline:
            m = server.metrics()
            if condition(m):
                return m
            time.sleep(0.05)
        raise AssertionError(f"timed out waiting for {what}")

    threads = []
    try:
        for name, priority in (("running", 5), ("low", 10), ("high", 0)):
            t = threading.Thread(target=stream, args=(name, priority), daemon=True)
            t.start()
            threads.append(t)
            if name == "running":
                assert first_token["running"].wait(120)
            else:
                n = 1 if name == "low" else 2
                wait_for(lambda m, n=n: m["chunkserve:num_requests_waiting"] == n, f"{n} queued")
        m = server.metrics()
        assert m["chunkserve:num_requests_running"] == 1 and not first_token["low"].is_set()
        stop["running"].set()  # its stream closes: the slot frees
        deadline = time.time() + 120
        while not (first_token["low"].is_set() or first_token["high"].is_set()):
            assert time.time() < deadline, "neither queued request started"
            first_token["high"].wait(0.05)
        assert first_token["high"].is_set() and not first_token["low"].is_set()
    finally:
        for name in stop:
            stop[name].set()
        for t in threads:
            t.join(30)
    server.wait_idle()  # the aborted streams are gone: the next test finds it idle


def test_metrics_text_is_valid(guarded: Server) -> None:
    text = httpx.get(guarded.base + "/metrics").text
    names = {f.name for f in text_string_to_metric_families(text)}
    for name in (
        "chunkserve:time_to_first_token_seconds",
        "chunkserve:inter_token_latency_seconds",
        "chunkserve:time_per_output_token_seconds",
        "chunkserve:e2e_request_latency_seconds",
        "chunkserve:request_queue_time_seconds",
        "chunkserve:request_prefill_time_seconds",
        "chunkserve:iteration_tokens_total",
        "chunkserve:step_gap_seconds",
        "chunkserve:num_requests_running",
        "chunkserve:num_requests_waiting",
        "chunkserve:kv_cache_usage_perc",
        "chunkserve:prompt_tokens",
        "chunkserve:generation_tokens",
        "chunkserve:request_success",
        "chunkserve:num_preemptions",
    ):
        assert name in names, name
    assert json.loads(httpx.get(guarded.base + "/health").text)["status"] == "ok"


# ---- lifecycle: API key from the environment, request timeout, SIGTERM drain --------------
REQUEST_TIMEOUT_S = 8


@pytest.fixture(scope="module")
def lifecycle_server() -> Iterator[Server]:
    s = Server(
        # The timeout test holds its requests in flight by pausing the core (PausedCores),
        # so this needs only to exceed what runs before the pause: a 2-token request, and
        # the first 3 tokens of a stream (well under a second on an idle machine).
        "--request-timeout",
        str(REQUEST_TIMEOUT_S),
        "--shutdown-timeout",
        "1",
        env={"CHUNKSERVE_API_KEY": "sekret"},
    )
    yield s
    s.stop()


def test_empty_api_key_is_refused_before_loading() -> None:
    t0 = time.time()
    r = subprocess.run(
        [sys.executable, "-m", "chunkserve", "serve", "--port", str(free_port())],
        env=dict(os.environ, CHUNKSERVE_API_KEY=" "),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode != 0 and "api_key" in r.stdout + r.stderr
    assert time.time() - t0 < 60


def stream_events(
    base: str,
    body: dict,
    headers: dict,
    started: threading.Event | None = None,
    after: int = 1,
) -> list[dict | str]:
    """The SSE events of a streamed completion; ``started`` is set once ``after`` events
    came."""
    events: list[dict | str] = []
    url = base + "/v1/completions"
    with httpx.stream("POST", url, json=body, headers=headers, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: "):
                data = line[6:]
                events.append(data if data == "[DONE]" else json.loads(data))
                if started is not None and len(events) >= after:
                    started.set()
    return events


def test_api_key_from_the_environment_and_request_timeout(lifecycle_server: Server) -> None:
    base = lifecycle_server.base
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 2}
    assert httpx.post(base + "/v1/completions", json=body, timeout=30).status_code == 401
    auth = {"Authorization": "Bearer sekret"}
    assert httpx.post(base + "/v1/completions", json=body, headers=auth, timeout=30).is_success
    # Past --request-timeout (REQUEST_TIMEOUT_S): a 504 naming the timeout, or an SSE error
    # event; blocks freed. The core is paused once the request generates, so it cannot
    # finish first.
    long = {"model": MODEL, "prompt": "Hi", "max_tokens": 400, "ignore_eos": True}
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        before = lifecycle_server.metrics()
        f = pool.submit(httpx.post, base + "/v1/completions", json=long, headers=auth, timeout=60)
        wait_for(lambda: generating(lifecycle_server, before), "the request generates")
        with PausedCores(lifecycle_server):
            r = f.result(timeout=60)
    assert r.status_code == 504 and r.json()["error"]["type"] == "timeout_error", r.text
    started = threading.Event()
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        f = pool.submit(stream_events, base, {**long, "stream": True}, auth, started, 3)
        assert started.wait(60)
        with PausedCores(lifecycle_server):
            events = f.result(timeout=60)
    assert events[-1] == "[DONE]" and events[-2]["error"]["type"] == "timeout_error"
    assert len(events) > 3  # tokens came before the timeout
    m = lifecycle_server.wait_idle()
    assert m["chunkserve:kv_cache_blocks_used"] == 0


def test_sigterm_drains_then_ends_streams_with_an_error() -> None:
    """SIGTERM: admission stops (503, /health "draining"), a short stream in flight
    finishes, a long one is ended with an error event after --shutdown-timeout, and the
    process exits 0; nothing hangs. Its own server (it ends it). The core is paused while
    the server takes the signal, so both streams are in flight then whatever the machine's
    speed; the long one asks for 4000 tokens, far more than any CPU makes in the 10 s the
    drain waits (fp32: 400 tokens/s), and the short one has at most 2 left (2 steps took
    over 4 s on a 2-core machine with two test workers and other jobs busy)."""
    s = Server(
        "--shutdown-timeout",
        "10",
        "--max-model-len",
        "4096",
        "--kv-cache-memory",
        "256MiB",
    )
    try:
        base, auth = s.base, {}
        long = {"model": MODEL, "prompt": "Hi", "max_tokens": 4000, "ignore_eos": True}
        long["stream"] = True
        short = {**long, "max_tokens": 3}
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            long_started, short_started = threading.Event(), threading.Event()
            long_f = pool.submit(stream_events, base, long, auth, long_started)
            assert long_started.wait(60)
            short_f = pool.submit(stream_events, base, short, auth, short_started)
            assert short_started.wait(60)
            with PausedCores(s):
                s.proc.send_signal(signal.SIGTERM)
                wait_for(
                    lambda: httpx.get(base + "/health", timeout=10).status_code == 503,
                    "/health answers 503",
                )
                health = httpx.get(base + "/health", timeout=10)
                assert health.json() == {"status": "draining"}
                r = httpx.post(base + "/v1/completions", json={**short, "stream": False})
                assert r.status_code == 503, r.text
            short_events = short_f.result(timeout=60)
            long_events = long_f.result(timeout=60)
        assert short_events[-2]["choices"][0]["finish_reason"] == "length"  # finished in time
        assert long_events[-1] == "[DONE]"
        assert long_events[-2]["error"]["type"] == "service_unavailable_error", long_events[-2]
        assert "shutting down" in long_events[-2]["error"]["message"]
        assert s.proc.wait(60) == 0
    finally:
        s.stop()


def core_pids(server_pid: int) -> list[int]:
    """The server's engine-core processes (``distributed.child`` children running
    ``core_process.run_core``)."""
    pids = []
    for task in os.listdir(f"/proc/{server_pid}/task"):
        with open(f"/proc/{server_pid}/task/{task}/children") as f:
            pids += [int(p) for p in f.read().split()]
    cores = []
    for pid in pids:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            if b"chunkserve.engine.core_process:run_core" in f.read():
                cores.append(pid)
    return cores


def test_core_killed_mid_stream_errors_and_health_503() -> None:
    """``kill -9`` of the engine-core process: the streams in flight end with an error event
    and the non-streamed request with a 5xx body, ``/health`` answers 503 within seconds,
    new requests 503, ``/metrics`` still answers; the server itself does not hang."""
    s = Server("--data-parallel-size", "2", "--watchdog-timeout", "5")
    try:
        pids = core_pids(s.proc.pid)
        assert len(pids) == 2, pids
        long = {"model": MODEL, "prompt": "Hi", "max_tokens": 400, "ignore_eos": True}
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            streams = [
                pool.submit(stream_events, s.base, {**long, "stream": True}, {}) for _ in range(2)
            ]
            plain = pool.submit(httpx.post, s.base + "/v1/completions", json=long, timeout=60)
            wait_for(
                lambda: s.metrics()["chunkserve:num_requests_running"] == 3,
                "all three are running",
            )
            os.kill(pids[0], signal.SIGKILL)
            t0 = time.time()
            # Within seconds: the bound is generous for a loaded machine.
            wait_for(
                lambda: httpx.get(s.base + "/health", timeout=10).status_code != 200,
                "/health turns 503",
                timeout=60,
            )
            for f in streams:
                events = f.result(timeout=30)
                assert events[-1] == "[DONE]" and "error" in events[-2], events[-2:]
            r = plain.result(timeout=30)
            assert r.status_code >= 500 and "error" in r.json(), r.text
        assert time.time() - t0 < 90
        r = httpx.post(s.base + "/v1/completions", json={**long, "max_tokens": 2}, timeout=10)
        assert r.status_code == 503, r.text
        assert httpx.get(s.base + "/metrics", timeout=10).status_code == 200
    finally:
        s.stop()
    assert s.proc.wait(20) is not None
    # No core outlives its server (the server reaps them as it exits).
    wait_for(lambda: not any(alive(pid) for pid in pids), "the cores are gone", timeout=30)


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] not in ("Z", "X")  # a zombie has exited
    except FileNotFoundError:
        return False
