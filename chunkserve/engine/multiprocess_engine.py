"""``MultiprocessEngine``: a front end whose engine cores run in their own processes.

``chunkserve serve`` uses it: the API server's process does HTTP, tokenisation,
detokenisation and SSE; each core process (``core_process.run_core``) schedules and steps
its own KV cache. Commands go to a core over its own PUSH socket; every core reports to one
PULL socket (a step's token-id deltas and statistics), so ``step()`` here is "take the next
report and turn it into text".

Data parallel (``data_parallel_size`` > 1): each request goes to one core, the one whose
cache most likely holds the request's prompt prefix (the longest run of leading prompt
blocks routed to it before), unless that core has ``AFFINITY_SLACK`` more outstanding work
than the least loaded one; otherwise to the least loaded. Outstanding work is the tokens a
core still has to compute for its requests in flight (prompt, plus the outputs still due).

A core that dies (killed, the device failed), never starts, or reports no step for
``watchdog_s`` seconds while it has requests in flight (or ``frontend.LONGEST_STEP_FACTOR``
times its longest step, where that is longer: an overloaded core's steps are long, not
hung; hung: it is killed) is an error no
step recovers from: ``step()`` raises ``CoreDeadError`` (a ``DeviceError``), the async
engine fails every request in flight and ``/health`` answers 503.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import signal
import tempfile
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import zmq

from chunkserve.config import EngineConfig, ModelConfig
from chunkserve.distributed import child
from chunkserve.distributed.child import ChildProcess, ProcessExited
from chunkserve.distributed.launch import RANK_MAIN
from chunkserve.engine.core_process import (
    AbortRequests,
    AddRequest,
    CoreConfig,
    CoreDead,
    CoreFailed,
    CoreReady,
    FailRequest,
    FinishRequests,
    ResetPrefixCache,
    Shutdown,
    StartCore,
    StepReport,
    encoder,
    report_decoder,
)
from chunkserve.engine.core_types import CoreInfo, CoreLoad, CoreRequest
from chunkserve.engine.frontend import WATCHDOG_S, FrontEnd, watchdog_limit
from chunkserve.engine.output_processor import RequestOutput
from chunkserve.model.source import ModelSource, open_gguf
from chunkserve.scheduling.block_hash import block_hashes
from chunkserve.worker.errors import DeviceError

logger = logging.getLogger("chunkserve")

# An engine-core process's main (``child.ChildProcess`` target).
CORE_MAIN = "chunkserve.engine.core_process:run_core"
# Milliseconds ``step()`` waits for a report before it returns (so new requests and aborts
# queued meanwhile are sent within this long).
POLL_MS = 2
# Seconds a core may take to load its model before starting is given up.
STARTUP_TIMEOUT_S = 600.0
# Routing: a core holding the prefix is preferred while its outstanding tokens exceed the
# least loaded core's by at most this many.
AFFINITY_SLACK = 4096
# Prompt-block hashes remembered per core for routing (least recently routed dropped first).
MAX_ROUTED_BLOCKS = 1 << 16


class CoreDeadError(DeviceError):
    """An engine-core process died or stopped serving."""


@dataclass
class _Core:
    index: int
    process: ChildProcess
    socket: zmq.Socket
    info: CoreInfo | None = None
    load: CoreLoad = field(default_factory=CoreLoad)
    outstanding: int = 0  # tokens still to compute for its requests in flight
    # Its last report, or its first request after it had none: the watchdog counts from here.
    quiet_since: float = field(default_factory=time.monotonic)
    stepped: bool = False  # it has reported a step (its first, cold, one is slow)
    longest_step_s: float = 0.0  # its longest step after the first (``watchdog_limit``)


class MultiprocessEngine(FrontEnd):
    """A front end over ``data_parallel_size`` engine-core processes (see the module doc).
    Like ``Engine``, one thread drives ``step()``; ``add_request`` and ``abort_request`` on
    that same thread."""

    def __init__(
        self,
        config: EngineConfig,
        data_parallel_size: int = 1,
        watchdog_s: float = WATCHDOG_S,
    ) -> None:
        if not isinstance(data_parallel_size, int) or data_parallel_size < 1:
            raise ValueError(f"data_parallel_size: must be >= 1, got {data_parallel_size!r}")
        if not watchdog_s > 0:
            raise ValueError(f"watchdog_timeout: must be > 0 seconds, got {watchdog_s!r}")
        self.watchdog_s = watchdog_s
        self._tmp = tempfile.TemporaryDirectory(prefix="chunkserve-")
        self._ctx = zmq.Context()
        self._reports = self._ctx.socket(zmq.PULL)
        report_address = f"ipc://{self._tmp.name}/reports"
        self._reports.bind(report_address)
        self._enc, self._dec = encoder(), report_decoder()
        self._cores: list[_Core] = []
        self._owner: dict[str, tuple[_Core, int]] = {}  # request id -> (core, its work)
        self._routed: list[OrderedDict[bytes, None]] = []
        self._closed = False
        self._dead: str | None = None  # why the cores cannot serve, once they cannot
        try:
            for i in range(data_parallel_size):
                address = f"ipc://{self._tmp.name}/core{i}"
                sock = self._ctx.socket(zmq.PUSH)
                sock.setsockopt(zmq.SNDHWM, 0)  # never block on a busy core
                sock.bind(address)
                process = ChildProcess.start(
                    f"engine core {i}",
                    CORE_MAIN,
                    (
                        i,
                        config,
                        address,
                        report_address,
                        logging.getLogger("chunkserve").getEffectiveLevel(),
                        data_parallel_size,
                    ),
                    daemon=True,
                )
                self._cores.append(_Core(i, process, sock))
                self._routed.append(OrderedDict())
            # The front end's part (tokenizer, EOS ids, limits) on the config a core read
            # (``_load_model_config``); then each core loads its weights.
            super().__init__(config)
            self._source = self._reader = None  # each core loads its own
            for core in self._cores:
                self._send_starting(core, StartCore(list(self.eos_token_ids)))
            self._wait_ready()
        except BaseException:
            self.shutdown()
            raise

    # ---- what a server reads ---------------------------------------------------------------
    @property
    def data_parallel_size(self) -> int:
        return len(self._cores)

    @property
    def core_infos(self) -> list[CoreInfo]:
        return [c.info for c in self._cores if c.info is not None]

    def core_loads(self) -> list[CoreLoad]:
        return [c.load for c in self._cores]

    @property
    def num_running(self) -> int:
        return sum(c.load.num_running for c in self._cores)

    def has_unfinished(self) -> bool:
        """Requests in flight, or a core whose last report still shows work: a request the
        front end ended (a stop string, an abort) is gone here at once, and the core's
        next report, after it applied the finish, brings its load (running requests, KV
        blocks held: what /metrics shows) back to idle. Until then there is a report to
        wait for."""
        return super().has_unfinished() or any(
            c.load.num_running or c.load.num_waiting or c.load.kv_blocks_used for c in self._cores
        )

    @property
    def num_waiting(self) -> int:
        """Requests sent and not yet known to run (a core's report comes after its step)."""
        return max(0, len(self._owner) - self.num_running)

    @property
    def num_blocks(self) -> int:
        return sum(c.info.num_blocks for c in self._cores if c.info is not None)

    @property
    def kv_blocks_used(self) -> int:
        return sum(c.load.kv_blocks_used for c in self._cores)

    def core_of(self, request_id: str) -> int | None:
        """The index of the core serving a request in flight."""
        owner = self._owner.get(request_id)
        return None if owner is None else owner[0].index

    # ---- requests --------------------------------------------------------------------------
    def abort_request(self, request_id: str) -> bool:
        """Ask the request's core to stop it (its blocks free within a step there; its last
        output comes back in a report). False if it was not in flight."""
        owner = self._owner.get(request_id)
        if owner is None:
            return False
        self._send(owner[0], AbortRequests([request_id]))
        return True

    def step(self) -> list[RequestOutput]:
        """Take the next report (waiting up to ``POLL_MS``) and return its outputs."""
        if self._dead is not None:
            raise CoreDeadError(self._dead)
        if not self._reports.poll(POLL_MS):
            self._check_alive()
            now = time.monotonic()
            for core in self._cores:
                quiet = now - core.quiet_since
                limit = watchdog_limit(self.watchdog_s, core.stepped, core.longest_step_s)
                if core.outstanding and quiet > limit:
                    self._die(
                        f"engine core {core.index} reported no step for {quiet:.0f} s with "
                        f"requests in flight (watchdog)"
                    )
            return []
        report = self._dec.decode(self._reports.recv())
        if isinstance(report, CoreDead):
            self._die(f"engine core {report.core} died: {report.message}")
        if not isinstance(report, StepReport):
            self._die(f"unexpected report from a core: {report!r}")
        core = self._cores[report.core]
        core.load = report.load
        core.quiet_since = time.monotonic()
        if report.stats is not None:
            if core.stepped:
                core.longest_step_s = max(core.longest_step_s, report.stats.wall_time)
            core.stepped = True
        for out in report.outputs:
            if out.finished:
                self._release(out.request_id)
        return self._process(report.outputs, report.stats)

    def shutdown(self, timeout: float = 10.0) -> None:
        """Tell every core to stop, wait up to ``timeout`` seconds, then kill what is left."""
        if self._closed:
            return
        self._closed = True
        for core in self._cores:
            if core.process.is_alive():
                with contextlib.suppress(zmq.ZMQError):
                    core.socket.send(self._enc.encode(Shutdown()), zmq.NOBLOCK)
        child.stop([c.process for c in self._cores], timeout, warn=True)
        for core in self._cores:
            self._kill_ranks(core)
        for core in self._cores:
            core.socket.close(linger=0)
        self._reports.close(linger=0)
        self._ctx.term()
        self._tmp.cleanup()

    # ---- the core's side -------------------------------------------------------------------
    def _core_add(self, request: CoreRequest) -> None:
        core = self._route(request)
        if not core.outstanding:
            core.quiet_since = time.monotonic()  # the watchdog counts from here
        work = len(request.prompt_token_ids) + request.max_tokens
        self._owner[request.request_id] = (core, work)
        core.outstanding += work
        try:
            self._send(core, AddRequest(request))
        except BaseException:
            self._release(request.request_id)  # never reached the core: nothing to wait for
            raise

    def _core_finish(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            owner = self._release(request_id)
            if owner is not None:
                self._send(owner, FinishRequests([request_id]))

    def _core_fail(self, request_id: str, error: str) -> None:
        owner = self._release(request_id)
        if owner is not None:
            self._send(owner, FailRequest(request_id, error))

    def _core_reset_prefix_cache(self) -> None:
        # Each core applies its commands in order: a request added after this finds the
        # cache empty. The prefixes routed to a core are cached there no longer.
        for core, routed in zip(self._cores, self._routed, strict=True):
            self._send(core, ResetPrefixCache())
            routed.clear()

    def _release(self, request_id: str) -> _Core | None:
        owner = self._owner.pop(request_id, None)
        if owner is None:
            return None
        core, work = owner
        core.outstanding -= work
        return core

    def _die(self, why: str) -> None:
        """The cores cannot serve: stop them all (a hung one included) and raise."""
        self._dead = why
        for core in self._cores:
            if core.process.is_alive():
                core.process.kill()
            self._kill_ranks(core)
        raise CoreDeadError(why)

    @staticmethod
    def _kill_ranks(core: _Core) -> None:
        """A core's tensor-parallel rank processes, once the core is gone (a stopped or hung
        rank would outlive it). Each PID is checked to still be a rank process."""
        for pid in core.info.tp_pids if core.info else []:
            if child.runs(pid, RANK_MAIN):
                with contextlib.suppress(OSError):  # gone already
                    os.kill(pid, signal.SIGKILL)

    def _send(self, core: _Core, message) -> None:
        if self._closed or self._dead is not None:
            raise CoreDeadError(self._dead or "the engine is shut down")
        try:
            core.socket.send(self._enc.encode(message), zmq.NOBLOCK)
        except zmq.Again:  # no peer: the core's socket is gone
            raise CoreDeadError(f"engine core {core.index} is not reachable") from None

    def _route(self, request: CoreRequest) -> _Core:
        if len(self._cores) == 1:
            return self._cores[0]
        # The prefix cache's own keys (one chain for both: ``scheduling.block_hash``).
        hashes = block_hashes(request.prompt_token_ids, self.config.block_size)
        least = min(self._cores, key=lambda c: c.outstanding)
        best, best_len = least, 0
        for core, routed in zip(self._cores, self._routed):
            n = 0
            for h in hashes:
                if h not in routed:
                    break
                n += 1
            if n > best_len and core.outstanding - least.outstanding <= AFFINITY_SLACK:
                best, best_len = core, n
        routed = self._routed[best.index]
        for h in hashes:
            routed[h] = None
            routed.move_to_end(h)
        while len(routed) > MAX_ROUTED_BLOCKS:
            routed.popitem(last=False)
        return best

    # ---- start-up and liveness -------------------------------------------------------------
    def _load_model_config(self, source: ModelSource) -> tuple[ModelConfig, Any]:
        """The first core's ``CoreConfig`` (this process does not import torch, which
        reading the config needs: the registry's families), and the GGUF reader for the
        tokenizer, opened here."""
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while True:
            report = self._next_startup_report(deadline)
            if isinstance(report, CoreConfig):
                model_config = pickle.loads(report.model_config)
                return model_config, open_gguf(source.path) if source.kind == "gguf" else None

    def _next_startup_report(self, deadline: float):
        """The next report while the cores start; a core that failed raises (a
        ``ValueError`` for a bad configuration)."""
        while True:
            if time.monotonic() > deadline:
                raise CoreDeadError("engine cores did not start in time")
            if not self._reports.poll(200):
                self._check_alive()
                continue
            report = self._dec.decode(self._reports.recv())
            if isinstance(report, CoreFailed):
                if report.error_type == "ValueError":  # a bad configuration
                    raise ValueError(report.message)
                raise CoreDeadError(
                    f"engine core {report.core} failed to start: "
                    f"{report.error_type}: {report.message}"
                )
            return report

    def _send_starting(self, core: _Core, message) -> None:
        try:
            core.socket.send(self._enc.encode(message), zmq.NOBLOCK)
        except zmq.Again:
            raise CoreDeadError(f"engine core {core.index} is not reachable") from None

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        waiting = {c.index for c in self._cores}
        while waiting:
            if time.monotonic() > deadline:
                raise CoreDeadError(f"engine cores {sorted(waiting)} did not start in time")
            report = self._next_startup_report(deadline)
            if isinstance(report, CoreReady):
                self._cores[report.core].info = report.info
                waiting.discard(report.core)
        info = self._cores[0].info
        assert info is not None
        logger.info(
            "%d engine core process(es) ready (pids %s): device=%s dtype=%s threads=%d | "
            "KV cache %d blocks x %d tokens each | %s",
            len(self._cores),
            ", ".join(str(c.info.pid) for c in self._cores if c.info),
            info.device,
            info.dtype,
            info.num_threads,
            info.num_blocks,
            info.block_size,
            info.budget_policy,
        )

    def _check_alive(self) -> None:
        try:
            child.check_alive(c.process for c in self._cores)
        except ProcessExited as exc:
            self._die(str(exc))
