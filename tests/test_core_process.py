"""The engine core in its own process (``MultiprocessEngine``): the same outputs as in
process, aborts that free blocks in the right core, a core that dies or hangs failing its
requests instead of hanging them, and data-parallel routing."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from chunkserve.config import EngineConfig
from chunkserve.engine.multiprocess_engine import CoreDeadError, MultiprocessEngine
from chunkserve.scheduling.sampling_params import SamplingParams
from tests.conftest import NATURAL_PROMPTS, random_prompt

# The shared in-process engine's configuration (tests/conftest.py), so outputs compare.
CONFIG = dict(dtype="float32", max_model_len=1024, kv_cache_memory=64 << 20)


def run(engine, requests, timeout: float = 600.0) -> dict[str, dict]:
    """Add ``(prompt, params)`` pairs, step until all finish; per request: the final output
    and the text and token ids its deltas add up to (what a stream sends)."""
    ids = [engine.add_request(p, sp) for p, sp in requests]
    got = {i: {"text": "", "tokens": [], "final": None} for i in ids}
    deadline = time.monotonic() + timeout
    while any(g["final"] is None for g in got.values()):
        assert time.monotonic() < deadline, "requests did not finish"
        for out in engine.step():
            g = got.get(out.request_id)
            if g is None:
                continue
            g["text"] += out.delta_text
            g["tokens"] += out.delta_token_ids
            if out.finished:
                g["final"] = out
    return {i: got[i] for i in ids}


def mixed_requests() -> list[tuple]:
    greedy = SamplingParams(max_tokens=12, temperature=0.0)
    return [
        *((p, greedy) for p in NATURAL_PROMPTS),
        (NATURAL_PROMPTS[0], SamplingParams(max_tokens=8, temperature=0.0, logprobs=3)),
        (NATURAL_PROMPTS[1], SamplingParams(max_tokens=20, temperature=0.0, stop=["\n"])),
        (NATURAL_PROMPTS[2], SamplingParams(max_tokens=10, temperature=0.8, seed=7)),
        (NATURAL_PROMPTS[2], SamplingParams(max_tokens=10, temperature=0.8, seed=8)),
        (random_prompt(__import__("random").Random(0), 300), greedy),
    ]


def assert_same(a: dict[str, dict], b: dict[str, dict]) -> None:
    for (ia, ga), (ib, gb) in zip(a.items(), b.items(), strict=True):
        fa, fb = ga["final"], gb["final"]
        assert fa.token_ids == fb.token_ids, (ia, ib)
        assert fa.text == fb.text
        assert fa.finish_reason == fb.finish_reason
        assert fa.stop_reason == fb.stop_reason
        assert ga["text"] == fa.text and ga["tokens"] == fa.token_ids  # deltas add up
        assert gb["text"] == fb.text and gb["tokens"] == fb.token_ids
        if fa.logprobs is not None or fb.logprobs is not None:
            assert [x.token_id for x in fa.logprobs] == [x.token_id for x in fb.logprobs]
            for x, y in zip(fa.logprobs, fb.logprobs, strict=True):
                assert x.logprob == pytest.approx(y.logprob, abs=1e-4)
                assert [t for t, _ in x.top] == [t for t, _ in y.top]
        assert fb.metrics is not None and fb.metrics.ttft is not None


@pytest.fixture(scope="module")
def remote():
    engine = MultiprocessEngine(EngineConfig.from_kwargs(**CONFIG))
    yield engine
    engine.shutdown()
    assert all(not c.process.is_alive() for c in engine._cores)


@pytest.fixture(scope="module")
def in_process(shared_engine) -> dict[str, dict]:
    """``mixed_requests`` run by the shared in-process engine, once for the module: the
    outputs a core process (or two) must give."""
    return run(shared_engine, mixed_requests())


def test_outputs_equal_in_process(remote, in_process) -> None:
    requests = mixed_requests()
    assert_same(in_process, run(remote, requests))
    assert remote.kv_blocks_used == 0 and not remote.has_unfinished()


def test_abort_frees_blocks_in_the_core(remote) -> None:
    rid = remote.add_request(
        random_prompt(__import__("random").Random(1), 200),
        SamplingParams(max_tokens=500, temperature=0.0, ignore_eos=True),
    )
    deadline = time.monotonic() + 600  # only against a hang (a loaded machine is slow)
    while not any(o.request_id == rid and o.token_ids for o in remote.step()):
        assert time.monotonic() < deadline
    assert remote.kv_blocks_used > 0
    assert remote.abort_request(rid)
    final = None
    while final is None:
        assert time.monotonic() < deadline
        final = next((o for o in remote.step() if o.request_id == rid and o.finished), None)
    assert final.finish_reason == "abort"
    assert remote.kv_blocks_used == 0 and remote.num_running == 0
    assert not remote.abort_request(rid)  # no longer in flight


def test_edge_errors_never_reach_the_core(remote) -> None:
    with pytest.raises(ValueError, match="max_tokens"):
        remote.add_request("hi", SamplingParams(max_tokens=5000))
    with pytest.raises(ValueError, match="prompt: token id"):
        remote.add_request([1, 10**9], SamplingParams(max_tokens=2))
    assert not remote.has_unfinished()


def test_bad_configuration_is_a_value_error_from_the_core() -> None:
    with pytest.raises(ValueError, match="kv_cache_memory"):
        MultiprocessEngine(EngineConfig.from_kwargs(**{**CONFIG, "kv_cache_memory": 1 << 20}))


# The watchdog of the tests that hang a core on purpose, once the core has stepped (the
# first, cold, step gets ``FIRST_STEP_ALLOWANCE_S``: two cold processes on a loaded 2-core CI
# machine took over 2 s for it, CI of 00634af).
HUNG_S = 2.0
# Until the engine under test has seen what it must (a live core reporting after the other
# hung), a watchdog no loaded machine trips.
STARTUP_S = 600.0


def wait_dead(engine, timeout: float = 60.0) -> CoreDeadError:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            engine.step()
        except CoreDeadError as exc:
            return exc
    raise AssertionError("the engine did not notice its core was gone")


def stopped(pid: int) -> bool:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] in ("T", "t")


def test_a_dead_core_is_an_error_not_a_hang(remote) -> None:
    """The module's core, killed: the last test of the module to use it (its start is
    seconds of a loaded machine's time; a test after this one asking for ``remote`` gets a
    dead engine, a ``CoreDeadError``)."""
    # The watchdog is out of the way: the exit itself is noticed (a core starved before the
    # kill must not be reported as hung instead).
    engine = remote
    engine.watchdog_s = STARTUP_S
    try:
        engine.add_request("Once upon a time", SamplingParams(max_tokens=400, ignore_eos=True))
        while not engine.step():
            pass
        os.kill(engine.core_infos[0].pid, signal.SIGKILL)
        exc = wait_dead(engine)
        assert "exited" in str(exc), exc
        with pytest.raises(CoreDeadError):
            engine.add_request("again", SamplingParams(max_tokens=2))
    finally:
        engine.shutdown(timeout=5)
    assert all(not c.process.is_alive() for c in engine._cores)


def test_a_hung_core_trips_the_watchdog_after_its_first_step_allowance() -> None:
    """A core hung before its first step is given ``FIRST_STEP_ALLOWANCE_S`` (a cold first
    step is slow), not the watchdog's timeout; hung after a step, the timeout: the engine
    fails instead of hanging."""
    from chunkserve.engine.frontend import FIRST_STEP_ALLOWANCE_S

    engine = MultiprocessEngine(EngineConfig.from_kwargs(**CONFIG), watchdog_s=0.5)
    try:
        pid = engine.core_infos[0].pid
        os.kill(pid, signal.SIGSTOP)
        engine.add_request("Once upon a time", SamplingParams(max_tokens=400, ignore_eos=True))
        # Six timeouts' worth of silence (well inside the allowance): not hung yet.
        assert FIRST_STEP_ALLOWANCE_S > 10
        t0 = time.monotonic()
        while time.monotonic() - t0 < 3.0:
            assert engine.step() == []
        os.kill(pid, signal.SIGCONT)
        while not engine.step():
            pass
        engine.watchdog_s = HUNG_S
        os.kill(pid, signal.SIGSTOP)
        exc = wait_dead(engine)
        assert "engine core 0" in str(exc) and "watchdog" in str(exc), exc
        with pytest.raises(CoreDeadError):
            engine.add_request("again", SamplingParams(max_tokens=2))
    finally:
        engine.shutdown(timeout=5)
    assert all(not c.process.is_alive() for c in engine._cores)


def test_watchdog_limit_allows_for_the_longest_step() -> None:
    from chunkserve.engine.frontend import (
        FIRST_STEP_ALLOWANCE_S,
        LONGEST_STEP_FACTOR,
        watchdog_limit,
    )

    assert watchdog_limit(120.0, True) == 120.0
    assert watchdog_limit(120.0, True, 10.0) == 120.0  # short steps: the timeout
    assert watchdog_limit(120.0, True, 30.0) == LONGEST_STEP_FACTOR * 30.0 > 120.0
    assert watchdog_limit(0.5, False) == FIRST_STEP_ALLOWANCE_S
    assert watchdog_limit(0.5, False, 100.0) == LONGEST_STEP_FACTOR * 100.0


def test_a_slow_core_is_not_hung_until_its_longest_steps_allowance(monkeypatch) -> None:
    """A core's longest step after its first is tracked from its reports; stopped after it,
    the watchdog (timeout 1 s on an injected clock) waits ``LONGEST_STEP_FACTOR`` x that
    longest step, not the timeout, then kills it."""
    import types

    import chunkserve.engine.multiprocess_engine as mp
    from chunkserve.engine.frontend import LONGEST_STEP_FACTOR

    engine = MultiprocessEngine(EngineConfig.from_kwargs(**CONFIG), watchdog_s=STARTUP_S)
    try:
        walls: list[float] = []
        engine.step_listeners.append(lambda stats: walls.append(stats.wall_time))
        engine.add_request("Once upon a time", SamplingParams(max_tokens=400, ignore_eos=True))
        while len(walls) < 4:
            engine.step()
        core = engine._cores[0]
        assert core.longest_step_s == max(walls[1:])  # the cold first step aside
        pid = engine.core_infos[0].pid
        os.kill(pid, signal.SIGSTOP)
        while not stopped(pid):
            time.sleep(0.01)
        while engine._reports.poll(0):  # reports sent before it stopped
            engine.step()
        now = [1000.0]
        monkeypatch.setattr(mp, "time", types.SimpleNamespace(monotonic=lambda: now[0]))
        engine.watchdog_s = 1.0
        core.longest_step_s = 10.0  # as if a step had taken 10 s
        core.quiet_since = now[0]
        now[0] += LONGEST_STEP_FACTOR * 10.0 - 1.0  # well past the timeout: not hung yet
        assert engine.step() == []
        now[0] += 2.0
        with pytest.raises(CoreDeadError, match="engine core 0.*watchdog"):
            engine.step()
    finally:
        monkeypatch.undo()
        engine.shutdown(timeout=5)
    assert all(not c.process.is_alive() for c in engine._cores)


@pytest.fixture(scope="module")
def two_cores():
    """Two data-parallel cores for the module (the watchdog out of the way until a test
    sets it): the routing test, then the hung-core test, which ends them."""
    engine = MultiprocessEngine(
        EngineConfig.from_kwargs(**CONFIG), data_parallel_size=2, watchdog_s=STARTUP_S
    )
    yield engine
    engine.shutdown(timeout=5)
    assert all(not c.process.is_alive() for c in engine._cores)


def test_data_parallel_routes_by_load_and_prefix(two_cores, in_process) -> None:
    engine = two_cores
    assert engine.data_parallel_size == 2
    assert len({i.pid for i in engine.core_infos}) == 2
    requests = mixed_requests()
    ids = [engine.add_request(p, sp) for p, sp in requests]
    cores = [engine.core_of(i) for i in ids]
    assert set(cores) == {0, 1}, cores  # both serve
    for i in ids:
        engine.abort_request(i)
    while engine.has_unfinished():
        engine.step()
    assert [load.kv_blocks_used for load in engine.core_loads()] == [0, 0]
    # The same outputs as one in-process core.
    assert_same(in_process, run(engine, requests))
    # A repeated long prefix goes where it went before, though that core is busier.
    rng = __import__("random").Random(2)
    doc = random_prompt(rng, 256)
    params = SamplingParams(max_tokens=4, temperature=0.0)
    first = engine.add_request(doc + random_prompt(rng, 5), params)
    home = engine.core_of(first)
    other = engine.add_request(random_prompt(rng, 64), params)
    assert engine.core_of(other) != home  # the least loaded
    again = engine.add_request(doc + random_prompt(rng, 7), params)
    assert engine.core_of(again) == home
    while engine.has_unfinished():
        engine.step()
    assert engine.kv_blocks_used == 0


def test_one_hung_core_trips_the_watchdog_while_the_other_reports(two_cores) -> None:
    """The module's two cores (after the routing test, idle: nothing in flight, no load),
    the last test to use them: core 0 is stopped and the watchdog ends them."""
    engine = two_cores
    assert not engine.has_unfinished() and engine.watchdog_s == STARTUP_S
    try:
        params = SamplingParams(max_tokens=400, ignore_eos=True)
        ids = [engine.add_request(p, params) for p in NATURAL_PROMPTS[:2]]
        assert {engine.core_of(i) for i in ids} == {0, 1}
        started: set[str] = set()
        while len(started) < 2:
            started |= {o.request_id for o in engine.step()}
        hung = engine.core_infos[0].pid
        os.kill(hung, signal.SIGSTOP)
        while not stopped(hung):
            time.sleep(0.01)
        # The live core reports after the hung one's last report (three times: reports
        # already on their way from core 0 come in between), so core 0 has been quiet longer
        # than core 1 from then on, however slowly a loaded machine runs core 1: the
        # watchdog, which looks at core 0 first, can only name core 0.
        live = next(i for i in ids if engine.core_of(i) == 1)
        reports = 0
        while reports < 3:
            reports += any(o.request_id == live for o in engine.step())
        engine.watchdog_s = HUNG_S
        exc = wait_dead(engine)
        assert "engine core 0" in str(exc) and "watchdog" in str(exc), exc
    finally:
        engine.shutdown(timeout=5)
    assert all(not c.process.is_alive() for c in engine._cores)


# The API server's process with its core in another: it starts the core, tokenises, serves
# a request and builds the app, and never imports torch (~200 MiB resident: 1.6x of
# llama.cpp's memory on Gemma 3 270M came mostly from torch in both processes).
NO_TORCH_FRONT_END = """
import sys
from chunkserve.config import EngineConfig
from chunkserve.engine.async_engine import AsyncEngine
from chunkserve.engine.multiprocess_engine import MultiprocessEngine
from chunkserve.entrypoints.openai.api_server import build_app
from chunkserve.entrypoints import serve
from chunkserve.scheduling.sampling_params import SamplingParams
engine = MultiprocessEngine(EngineConfig.from_kwargs(**CONFIG))
try:
    engine.add_request("Hello", SamplingParams(max_tokens=2, temperature=0.0))
    done = False
    while not done:
        done = any(out.finished for out in engine.step())
    build_app(AsyncEngine(engine), served_model_name="m")
finally:
    engine.shutdown()
print(sorted(m for m in sys.modules if m == "torch" or m.startswith("torch.")))
"""


def test_the_api_servers_process_never_imports_torch() -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    code = f"CONFIG = {CONFIG!r}\n{NO_TORCH_FRONT_END}"
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "[]"
