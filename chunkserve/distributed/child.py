"""Starting the engine's child processes, one way for all: engine-core processes
(``engine.multiprocess_engine``) and tensor-parallel ranks (``launch.LocalRanks``).

A child is a fresh interpreter, ``python -m chunkserve.distributed.child MODULE:FUNCTION``,
that reads the function's arguments pickled on its stdin, calls it, and exits with its
return value (0 for None; 1 with a traceback if it raises). The command line names what the
child runs, so a PID can be checked to still be one (``runs``). No torch here: the module is
the lowest level, importable from every package.

One liveness check: ``check_alive`` raises ``ProcessExited`` naming the first child that has
exited and its exit code.
"""

from __future__ import annotations

import atexit
import importlib
import logging
import pickle
import subprocess
import sys
import time
import weakref
from collections.abc import Iterable

logger = logging.getLogger("chunkserve")

CHILD_MODULE = "chunkserve.distributed.child"
# Seconds a daemon child gets to stop after SIGTERM when its parent exits.
DAEMON_STOP_S = 5.0


class ProcessExited(RuntimeError):
    """A child process (an engine core, a tensor-parallel rank) or its parent exited."""


class ChildProcess:
    """One child process running ``target`` (``"module:function"``); see the module doc."""

    def __init__(self, name: str, target: str, popen: subprocess.Popen) -> None:
        self.name = name
        self.target = target
        self.popen = popen

    @classmethod
    def start(cls, name: str, target: str, args: tuple = (), daemon: bool = False) -> ChildProcess:
        """Start ``target(*args)`` in a new interpreter. ``daemon``: terminated (SIGTERM,
        then killed) if still running when this interpreter exits."""
        module, _, function = target.partition(":")
        if not module or not function:
            raise ValueError(f"target: expected 'module:function', got {target!r}")
        popen = subprocess.Popen(
            [sys.executable, "-m", CHILD_MODULE, target], stdin=subprocess.PIPE
        )
        try:
            assert popen.stdin is not None
            popen.stdin.write(pickle.dumps(args))
            popen.stdin.close()
        except BaseException:
            popen.kill()
            popen.wait()
            raise
        child = cls(name, target, popen)
        if daemon:
            _daemons.add(child)
        return child

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def exitcode(self) -> int | None:
        """The exit code once it exited (negative: the signal that ended it), else None."""
        return self.popen.poll()

    def is_alive(self) -> bool:
        return self.exitcode is None

    def check(self) -> None:
        """Raise ``ProcessExited`` if it has exited."""
        code = self.exitcode
        if code is not None:
            raise ProcessExited(f"{self.name} (pid {self.pid}) exited with code {code}")

    def join(self, timeout: float | None = None) -> int | None:
        """Wait up to ``timeout`` seconds for it to exit; its exit code, or None."""
        try:
            return self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def kill(self) -> None:
        if self.is_alive():
            self.popen.kill()

    def terminate(self) -> None:
        if self.is_alive():
            self.popen.terminate()

    def __repr__(self) -> str:
        return f"ChildProcess({self.name!r}, pid={self.pid}, exitcode={self.exitcode})"


def check_alive(children: Iterable[ChildProcess]) -> None:
    """The liveness check: raise ``ProcessExited`` for the first child that has exited."""
    for child in children:
        child.check()


def wait_any(children: Iterable[ChildProcess], poll_s: float = 0.2) -> ChildProcess:
    """Block until one of the children exits; that child."""
    children = list(children)
    while True:
        for child in children:
            if not child.is_alive():
                return child
        time.sleep(poll_s)


def stop(children: Iterable[ChildProcess], timeout: float, warn: bool = False) -> None:
    """Wait up to ``timeout`` seconds (for all together) for the children to exit, then kill
    the rest (``warn``: saying so)."""
    deadline = time.monotonic() + timeout
    for child in children:
        if child.join(max(0.0, deadline - time.monotonic())) is None:
            if warn:
                logger.warning("%s did not stop; killing it", child.name)
            child.kill()
            child.join(5.0)


def runs(pid: int, target: str) -> bool:
    """Whether process ``pid`` is alive and a child running ``target`` (or the module part
    of it) — a PID checked before it is signalled, never one reused by another program."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read().split(b"\0")
    except OSError:
        return False
    return CHILD_MODULE.encode() in argv and any(a.startswith(target.encode()) for a in argv)


_daemons: weakref.WeakSet[ChildProcess] = weakref.WeakSet()


@atexit.register
def _stop_daemons() -> None:
    alive = [c for c in _daemons if c.is_alive()]
    for child in alive:
        child.terminate()
    stop(alive, DAEMON_STOP_S)


def _main() -> None:
    target = sys.argv[1]
    module, _, function = target.partition(":")
    fn = getattr(importlib.import_module(module), function)
    args = pickle.loads(sys.stdin.buffer.read())
    result = fn(*args)
    sys.exit(result if isinstance(result, int) else 0)


if __name__ == "__main__":
    _main()
