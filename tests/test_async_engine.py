"""AsyncEngine and the app in-process: a step that raises fails only its requests (HTTP 500)
and the engine goes on serving; aborts free blocks."""

from __future__ import annotations

import asyncio
import threading

import pytest
from fastapi.testclient import TestClient

from chunkserve.engine.async_engine import AsyncEngine, RequestFailedError
from chunkserve.engine.engine import Engine
from chunkserve.entrypoints.openai.api_server import build_app
from chunkserve.scheduling.request import RequestStatus
from chunkserve.scheduling.sampling_params import SamplingParams
from tests.conftest import assert_no_blocks_in_use

POISON = 7777  # a token id that makes the fake fault fire
FATAL = 6666  # a token id that makes the fake device fail for good
SAMPLE_POISON = 5555  # a request with this prompt token fails in the sampler
OUTPUT_POISON = 4444  # ... in output processing (detokenising)


@pytest.fixture(scope="module")
def engine() -> Engine:
    eng = Engine(
        dtype="float32", max_model_len=256, kv_cache_memory=16 << 20, max_num_batched_tokens=64
    )
    real = eng.core.worker.runner.execute

    def faulty(out):
        if any(FATAL in c.request.prompt_token_ids for c in out.chunks):
            raise RuntimeError("CUDA error: device-side assert triggered")
        if any(POISON in c.request.prompt_token_ids for c in out.chunks):
            raise RuntimeError("injected fault")
        return real(out)

    eng.core.worker.runner.execute = faulty
    sampler = eng.core.worker.runner.sampler

    class FaultySampler:
        def __call__(self, logits, requests):
            if any(SAMPLE_POISON in r.prompt_token_ids for r in requests):
                raise IndexError("injected sampling fault")
            return sampler(logits, requests)

        def __getattr__(self, name):
            return getattr(sampler, name)

    eng.core.worker.runner.sampler = FaultySampler()
    make_output = eng.outputs._make_output

    def faulty_output(state, core_output):
        if OUTPUT_POISON in state.prompt_token_ids:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected output fault")
        return make_output(state, core_output)

    eng.outputs._make_output = faulty_output
    return eng


def block_steps(engine: Engine, monkeypatch) -> threading.Event:
    """Make the engine's steps wait for the returned event (a step that does not return)."""
    release = threading.Event()
    real_step = engine.step

    def blocked_step(*args, **kwargs):
        release.wait(30)
        return real_step(*args, **kwargs)

    monkeypatch.setattr(engine, "step", blocked_step)
    return release


async def collect(agen):
    return [o async for o in agen]


async def until(condition, timeout: float = 600.0) -> None:
    """Wait for ``condition()`` (a state the engine thread reaches), polling; the timeout is
    only against a hang."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not condition():
        assert loop.time() < deadline, "the state was not reached"
        await asyncio.sleep(0.01)


def test_failing_step_fails_only_its_requests(engine: Engine) -> None:
    async def main() -> None:
        ae = AsyncEngine(engine)
        ae.start()
        try:
            params = SamplingParams(max_tokens=8, temperature=0.0)
            # The step that raises fails the requests in it (here: the poisoned one alone)...
            with pytest.raises(RequestFailedError, match="injected fault"):
                await collect(ae.generate([POISON, 5, 6], params))
            # ...and the engine goes on serving.
            outs = await asyncio.gather(
                *(collect(ae.generate([10 + i, 11, 12], params)) for i in range(3))
            )
            assert all(o[-1].finished and o[-1].finish_reason == "length" for o in outs)
            assert ae.healthy
        finally:
            ae.stop()

    asyncio.run(main())
    assert_no_blocks_in_use(engine)


def test_abort_by_closing_the_stream(engine: Engine) -> None:
    async def main() -> None:
        ae = AsyncEngine(engine)
        ae.start()
        try:
            # To the end of max_model_len (256).
            params = SamplingParams(max_tokens=253, temperature=0.0, ignore_eos=True)
            ended = threading.Event()
            engine.finish_listeners.append(lambda o: o.request_id == "closing" and ended.set())
            agen = ae.generate([20, 21, 22], params, "closing")
            async for out in agen:
                if len(out.token_ids) >= 3:
                    break
            request = engine.get_request("closing")
            assert request is not None and not request.is_finished
            made = request.num_output_tokens  # the engine thread may be ahead of the stream
            await agen.aclose()
            assert await asyncio.get_running_loop().run_in_executor(None, ended.wait, 600)
            engine.finish_listeners.pop()
            assert request.status == RequestStatus.FINISHED_ABORTED
            # The abort is applied before the engine's next step: at most the step in flight
            # as the stream closed adds a token (by length it would have made 253).
            assert request.num_output_tokens <= made + 1 < 253
        finally:
            ae.stop()

    asyncio.run(main())
    assert_no_blocks_in_use(engine)


def test_http_500_for_failed_step_then_serves(engine: Engine) -> None:
    app = build_app(AsyncEngine(engine), served_model_name="m")
    with TestClient(app) as client:
        r = client.post("/v1/completions", json={"prompt": [POISON, 1, 2], "max_tokens": 3})
        assert r.status_code == 500
        assert r.json()["error"]["type"] == "server_error"
        r = client.post(
            "/v1/completions", json={"prompt": [3, 4, 5], "max_tokens": 3, "temperature": 0}
        )
        assert r.status_code == 200 and r.json()["choices"][0]["text"] is not None
        r = client.post(
            "/v1/completions", json={"prompt": [POISON, 1, 2], "max_tokens": 3, "stream": True}
        )
        assert r.status_code == 200 and '"server_error"' in r.text and "[DONE]" in r.text
        assert client.get("/health").status_code == 200
    assert_no_blocks_in_use(engine)


@pytest.mark.parametrize(
    ("poison", "error"), [(SAMPLE_POISON, "sampling fault"), (OUTPUT_POISON, "output fault")]
)
def test_a_request_failing_in_sampling_or_output_fails_alone(
    engine: Engine, poison: int, error: str
) -> None:
    """A good and a bad request in the same step: the bad one fails, the good one's tokens
    are those of a run without it."""
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    good = [30, 31, 32, 33]

    async def run(with_bad: bool) -> list[int]:
        ae = AsyncEngine(engine)
        ae.start()
        try:
            tasks = [collect(ae.generate(good, params))]
            if with_bad:
                tasks.append(collect(ae.generate([poison, 31, 32, 33], params, "bad")))
            results = await asyncio.gather(*tasks, return_exceptions=True)
            if with_bad:
                assert isinstance(results[1], RequestFailedError), results[1]
                assert error in str(results[1])
                # The failed request left the engine (it does not run on, holding blocks).
                assert engine.get_request("bad") is None
            assert ae.healthy
            return results[0][-1].token_ids
        finally:
            ae.stop()

    alone = asyncio.run(run(False))
    assert asyncio.run(run(True)) == alone and len(alone) == 12
    assert_no_blocks_in_use(engine)


def test_a_fatal_device_error_marks_the_engine_dead(engine: Engine) -> None:
    app = build_app(AsyncEngine(engine), served_model_name="m")
    with TestClient(app) as client:
        assert client.get("/health").status_code == 200
        r = client.post("/v1/completions", json={"prompt": [FATAL, 1, 2], "max_tokens": 3})
        assert r.status_code == 503, r.text
        # Dead, and it says so: health and every new request answer 503.
        assert client.get("/health").status_code == 503
        r = client.post("/v1/completions", json={"prompt": [3, 4, 5], "max_tokens": 3})
        assert r.status_code == 503 and r.json()["error"]["type"] == "service_unavailable_error"
    assert_no_blocks_in_use(engine)  # the in-flight request was aborted as the loop died


def test_a_stream_nobody_reads_holds_one_merged_output(engine: Engine) -> None:
    """The engine produces 64 steps of output for a consumer that does not read: what
    waits is one output (all deltas merged), about the size of the final text, not 64
    cumulative copies."""
    n = 64
    params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, logprobs=1)

    async def main() -> None:
        ae = AsyncEngine(engine)
        ae.start()
        try:
            agen = ae.generate([40, 41, 42], params)
            first = await agen.__anext__()  # started; now the client stops reading
            # The engine finishes the request and the stream holds its final output.
            await until(lambda: any(s._pending and s._pending.finished for s in ae._live))
            assert not engine.has_unfinished()
            queued = ae.queued_bytes
            rest = [o async for o in agen]
            assert len(rest) == 1 and rest[0].finished  # everything left, merged into one
            final = rest[0]
            assert first.delta_token_ids + final.delta_token_ids == final.token_ids
            assert len(first.delta_logprobs) + len(final.delta_logprobs) == n
            assert first.delta_text + final.delta_text == final.text
            # One final output's worth (texts, ids, logprob entries), with slack: the old
            # queue held n outputs of growing cumulative text, ~n/2 times this.
            one = len(final.text) * 2 + 8 * 2 * len(final.token_ids) + 64 * n
            assert 0 < queued <= one, (queued, one)
            assert ae.queued_bytes == 0
        finally:
            ae.stop()

    asyncio.run(main())
    assert_no_blocks_in_use(engine)


def test_the_engine_tracks_its_longest_step(engine: Engine) -> None:
    """``longest_step_s``: the longest wall time of the steps after the first (cold) one."""
    walls: list[float] = []
    engine.step_listeners.append(lambda stats: walls.append(stats.wall_time))
    try:
        before, cold = engine.longest_step_s, engine.num_steps_seen == 0
        engine.add_request([50, 51, 52], SamplingParams(max_tokens=4, temperature=0.0))
        while engine.has_unfinished():
            engine.step()
    finally:
        engine.step_listeners.pop()
    assert len(walls) >= 4
    assert engine.longest_step_s == max([before, *walls[1 if cold else 0 :]])


def test_stuck_allows_for_the_longest_step(monkeypatch) -> None:
    """On an injected clock: with work waiting and a timeout of 1 s, an engine whose longest
    step took 10 s is stuck after ``LONGEST_STEP_FACTOR`` x 10 s without a step, not 1 s."""
    import types

    import chunkserve.engine.async_engine as ae_mod
    from chunkserve.engine.frontend import LONGEST_STEP_FACTOR

    now = [100.0]
    monkeypatch.setattr(ae_mod, "time", types.SimpleNamespace(monotonic=lambda: now[0]))
    fake = types.SimpleNamespace(last_progress=100.0, num_steps_seen=5, longest_step_s=10.0)
    ae = AsyncEngine(fake, stuck_after_s=1.0)  # type: ignore[arg-type]
    ae._busy = True
    now[0] += 1.5  # past the timeout
    assert not ae.stuck
    fake.longest_step_s = 0.1  # short steps: the timeout
    assert ae.stuck
    fake.longest_step_s = 10.0
    now[0] = 100.0 + LONGEST_STEP_FACTOR * 10.0 - 1.0
    assert not ae.stuck
    now[0] += 2.0
    assert ae.stuck


def test_a_stuck_loop_is_unhealthy(engine: Engine, monkeypatch) -> None:
    """A step that does not return while work waits: after STUCK_AFTER_S health says so,
    and it recovers when the step does."""
    import chunkserve.engine.async_engine as ae_mod

    release = block_steps(engine, monkeypatch)
    monkeypatch.setattr(ae_mod, "STUCK_AFTER_S", 0.3)

    async def main() -> None:
        ae = AsyncEngine(engine)
        ae.start()
        try:
            assert ae.healthy
            task = asyncio.ensure_future(
                collect(ae.generate([50, 51], SamplingParams(max_tokens=2, temperature=0.0)))
            )
            # The step blocks for as long as the test holds it: stuck once 0.3 s pass.
            await until(lambda: ae.stuck)
            assert not ae.healthy and not task.done()
            release.set()
            outs = await task
            assert outs[-1].finished
            await until(lambda: not ae.stuck)  # the loop goes idle
            assert ae.healthy
        finally:
            release.set()
            ae.stop()

    asyncio.run(main())
    assert_no_blocks_in_use(engine)


def test_admission_counts_a_request_from_submit_on(engine: Engine, monkeypatch) -> None:
    """A streaming response starts reading later than its request was admitted; the
    request counts against max_waiting_requests from ``submit`` on, and while the engine
    holds it waiting: a third one is refused."""
    from chunkserve.engine.async_engine import OverloadedError

    release = block_steps(engine, monkeypatch)

    async def main() -> None:
        ae = AsyncEngine(engine, max_waiting_requests=2)
        ae.start()
        try:
            params = SamplingParams(max_tokens=2, temperature=0.0)
            ae.check_capacity(2)
            handles = [ae.submit([60 + i, 61], params, f"w{i}") for i in range(2)]  # not read
            with pytest.raises(OverloadedError):
                ae.check_capacity(1)
            # The engine took them (and is stuck in its step): they still count.
            await until(lambda: all(engine.get_request(f"w{i}") for i in range(2)))
            with pytest.raises(OverloadedError):
                ae.check_capacity(1)
            release.set()
            for h in handles:
                outs = [o async for o in h.outputs()]
                assert outs[-1].finished
            await until(lambda: ae.num_waiting == 0)
            ae.check_capacity(2)
            # A handle dropped unread (a client gone before its response started) aborts.
            ended: list[tuple[str, str | None]] = []
            engine.finish_listeners.append(lambda o: ended.append((o.request_id, o.finish_reason)))
            ae.submit([70, 71], SamplingParams(max_tokens=250, ignore_eos=True), "dropped")
            await until(lambda: bool(ended))
            assert ended == [("dropped", "abort")]
            engine.finish_listeners.pop()
        finally:
            release.set()
            ae.stop()

    asyncio.run(main())
    assert_no_blocks_in_use(engine)


def test_server_checks_each_request_once_at_its_edge(engine: Engine, monkeypatch) -> None:
    """The server checks and tokenises a request once: its sampling parameters validate
    when built from the body, the edge (``InputProcessor.check``) trusts them unchanged, and
    the engine thread queues the checked request without checking it again."""
    calls = {"validate": 0, "check": 0, "tokenize": 0}

    def counting(owner, name: str, key: str) -> None:
        real = getattr(owner, name)

        def counted(*args, **kwargs):
            calls[key] += 1
            return real(*args, **kwargs)

        monkeypatch.setattr(owner, name, counted)

    counting(SamplingParams, "validate", "validate")
    counting(engine.inputs, "check", "check")
    counting(engine.tokenizer, "encode", "tokenize")
    app = build_app(AsyncEngine(engine), served_model_name="m")
    with TestClient(app) as client:
        body = {"prompt": "Hello there", "max_tokens": 2, "n": 3, "temperature": 0}
        r = client.post("/v1/completions", json=body)
        assert r.status_code == 200 and len(r.json()["choices"]) == 3
        assert calls == {"validate": 3, "check": 3, "tokenize": 1}  # one per choice, one text
        r = client.post("/v1/completions", json={**body, "temperature": -1})
        assert r.status_code == 400 and r.json()["error"]["param"] == "temperature"
    assert_no_blocks_in_use(engine)
