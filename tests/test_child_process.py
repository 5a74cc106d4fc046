"""One way to start the engine's child processes (``distributed.child``): engine cores and
tensor-parallel ranks are both ``ChildProcess``es, watched by one liveness check."""

from __future__ import annotations

import subprocess
import sys

import pytest

from chunkserve.distributed import child
from chunkserve.distributed.child import ChildProcess, ProcessExited
from chunkserve.distributed.launch import RANK_MAIN, LocalRanks
from chunkserve.engine.multiprocess_engine import CORE_MAIN
from tests.test_server import alive


def test_a_child_runs_its_target_with_pickled_args_and_exits_with_its_code() -> None:
    c = ChildProcess.start("exiter", "os:_exit", (3,))
    assert c.join(120) == 3 and not c.is_alive()
    with pytest.raises(ProcessExited, match=r"exiter \(pid \d+\) exited with code 3"):
        child.check_alive([c])


def test_liveness_names_the_first_child_gone_and_runs_checks_the_command_line() -> None:
    sleeper = ChildProcess.start("engine core 0", "time:sleep", (600,))
    try:
        gone = ChildProcess.start("engine core 1", "os:_exit", (0,))
        assert gone.join(120) == 0
        child.check_alive([sleeper])  # alive: no error
        with pytest.raises(ProcessExited, match="engine core 1 .* code 0"):
            child.check_alive([sleeper, gone])
        assert child.runs(sleeper.pid, "time:sleep") and child.runs(sleeper.pid, "time")
        assert not child.runs(sleeper.pid, "os:_exit")
        assert not child.runs(gone.pid, "os:_exit")  # reaped: no such process
    finally:
        sleeper.kill()
    assert sleeper.join(60) == -9
    with pytest.raises(ProcessExited, match="code -9"):
        sleeper.check()


def test_ranks_are_watched_by_the_same_check() -> None:
    ranks = LocalRanks({1: ChildProcess.start("tensor-parallel rank 1", "os:_exit", (1,))})
    assert ranks.wait_any() == 1
    with pytest.raises(ProcessExited, match="tensor-parallel rank 1"):
        ranks.check()


def test_cores_and_ranks_start_named_mains() -> None:
    for target in (CORE_MAIN, RANK_MAIN):
        module, _, name = target.partition(":")
        assert callable(getattr(__import__(module, fromlist=[name]), name))
    with pytest.raises(ValueError, match="target"):
        ChildProcess.start("bad", "os")


def test_a_daemon_child_is_stopped_when_its_parent_exits() -> None:
    script = (
        "from chunkserve.distributed.child import ChildProcess\n"
        "c = ChildProcess.start('d', 'time:sleep', (600,), daemon=True)\n"
        "print(c.pid, flush=True)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert not alive(int(out.stdout))
