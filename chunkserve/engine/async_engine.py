"""AsyncEngine: the engine loop on its own thread, streams to asyncio.

The event loop never runs model code. Requests, aborts and their results cross between the
loop and the engine thread through a command queue (loop -> engine) and per-request asyncio
queues fed with ``call_soon_threadsafe`` (engine -> loop). Every engine call happens on the
engine thread, so ``Engine`` itself needs no locks.

Failure model: a request whose sampling, output processing or admission raises fails alone;
a step whose forward raises fails its requests (``finish_reason="error"``, a 500 or an SSE
error event) and the loop goes on. A device error no step recovers from
(``engine.DeviceError``), or the loop itself breaking, fails every request in flight and
turns ``healthy`` False (``/health`` and new requests answer 503).

Streams are bounded: the outputs a consumer has not taken are merged into one
(``merge_outputs``).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

from chunkserve.engine.frontend import WATCHDOG_S, FrontEnd, watchdog_limit
from chunkserve.engine.input_processor import CheckedRequest
from chunkserve.engine.output_processor import RequestOutput
from chunkserve.scheduling.sampling_params import SamplingParams
from chunkserve.worker.errors import DeviceError

logger = logging.getLogger("chunkserve.async")

# Seconds ``drain`` gives the streams it ended to hand their error event to the client.
DELIVERY_GRACE_S = 2.0
# With work to do, an engine that has not finished a step for this long is stuck:
# ``healthy`` turns False.
STUCK_AFTER_S = WATCHDOG_S


class EngineDeadError(RuntimeError):
    """The engine loop stopped; no request can be served."""


class RequestFailedError(RuntimeError):
    """A request's step raised inside the engine (the engine keeps serving others)."""


class RequestTimeoutError(RuntimeError):
    """A request ran past its time limit and was aborted."""


@dataclass
class _Add:
    request_id: str
    request: CheckedRequest
    arrival_time: float


@dataclass
class _Abort:
    request_id: str


@dataclass
class _ResetPrefixCache:
    pass


@dataclass
class _FailAll:
    error: BaseException


def merge_outputs(old: RequestOutput, new: RequestOutput) -> RequestOutput:
    """One output standing for ``old`` then ``new`` (two steps of the same request): the
    newer cumulative fields, the deltas concatenated."""
    delta_logprobs = old.delta_logprobs
    if new.delta_logprobs:
        delta_logprobs = [*(delta_logprobs or []), *new.delta_logprobs]
    return dataclasses.replace(
        new,
        delta_text=old.delta_text + new.delta_text,
        delta_token_ids=old.delta_token_ids + new.delta_token_ids,
        delta_logprobs=delta_logprobs,
    )


def output_bytes(out: RequestOutput) -> int:
    """About what an output holds in memory: its texts, token ids and logprob entries."""
    n = len(out.text) + len(out.delta_text) + 8 * (len(out.token_ids) + len(out.delta_token_ids))
    return n + 64 * len(out.delta_logprobs or ())


class _Stream:
    """The loop-side end of one request's output stream: at most one output waits, the
    steps the consumer has not taken yet merged into it (``merge_outputs``), so a client
    that stops reading holds one output's worth of memory, not one per step."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._pending: RequestOutput | None = None
        self._error: BaseException | None = None
        self._ready = asyncio.Event()

    def put(self, item: RequestOutput | BaseException) -> None:
        """Called on the engine thread."""
        # A closed event loop raises: its consumer is gone, nobody reads this stream.
        with contextlib.suppress(RuntimeError):
            self.loop.call_soon_threadsafe(self._put, item)

    def _put(self, item: RequestOutput | BaseException) -> None:
        if isinstance(item, BaseException):
            self._error = item
        elif self._pending is None:
            self._pending = item
        else:
            self._pending = merge_outputs(self._pending, item)
        self._ready.set()

    async def get(self) -> RequestOutput | BaseException:
        """The merged outputs not taken yet, then an error if one came."""
        await self._ready.wait()
        if self._pending is not None:
            item: RequestOutput | BaseException = self._pending
            self._pending = None
        else:
            assert self._error is not None
            item, self._error = self._error, None
        if self._pending is None and self._error is None:
            self._ready.clear()
        return item

    @property
    def queued_bytes(self) -> int:
        return 0 if self._pending is None else output_bytes(self._pending)


class AsyncEngine:
    """Drives a ``FrontEnd`` (an in-process ``Engine``, or a ``MultiprocessEngine`` whose
    cores run in their own processes) from a background thread; ``generate`` streams
    outputs."""

    def __init__(
        self,
        engine: FrontEnd,
        max_waiting_requests: int | None = None,
        stuck_after_s: float | None = None,
    ) -> None:
        self.engine = engine
        self.stuck_after_s = stuck_after_s  # None: ``STUCK_AFTER_S``
        self.max_waiting_requests = max_waiting_requests
        self._commands: queue.SimpleQueue[_Add | _Abort | _FailAll | None] = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self._streams: dict[str, _Stream] = {}  # touched on the engine thread only
        self._live: set[_Stream] = set()  # the same streams, touched on the event loop only
        self._lock = threading.Lock()  # guards the counters below
        self._num_pending = 0  # added, not yet seen by the engine thread
        self._num_waiting = 0
        self._num_running = 0
        self._ids = itertools.count()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.dead_error: BaseException | None = None
        self.draining = False  # shutting down: no new requests, the running ones finish
        self._busy = False  # whether the loop's last round had work
        self._busy_since = time.monotonic()  # since when

    # ---- lifecycle -------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name="chunkserve-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stopping = True
        self._commands.put(None)
        self._wakeup.set()
        if self._thread is not None:
            self._thread.join(timeout)
        self.engine.shutdown()

    @property
    def healthy(self) -> bool:
        alive = self.dead_error is None and self._thread is not None and self._thread.is_alive()
        return alive and not self.stuck

    @property
    def stuck(self) -> bool:
        """Work is waiting and no step has finished for ``STUCK_AFTER_S`` (the in-process
        engine's step hangs, or a core process stopped reporting); for ``LONGEST_STEP_FACTOR``
        x the longest step it has taken at least, and before its first step for
        ``FIRST_STEP_ALLOWANCE_S`` (``watchdog_limit``)."""
        last = max(self._busy_since, self.engine.last_progress)
        limit = watchdog_limit(
            STUCK_AFTER_S if self.stuck_after_s is None else self.stuck_after_s,
            self.engine.num_steps_seen > 0,
            self.engine.longest_step_s,
        )
        return self._busy and time.monotonic() - last > limit

    @property
    def num_waiting(self) -> int:
        """Requests queued for the engine (accepted but not running yet)."""
        with self._lock:
            return self._num_waiting + self._num_pending

    @property
    def num_running(self) -> int:
        with self._lock:
            return self._num_running

    # ---- requests --------------------------------------------------------------------------
    def new_request_id(self, prefix: str = "req") -> str:
        return f"{prefix}-{next(self._ids)}"

    def check_capacity(self, num_new: int = 1) -> None:
        """Raise ``OverloadedError`` when ``num_new`` more requests (a request's prompts x n)
        would overfill the waiting queue, or when the server is draining."""
        if self.draining:
            raise OverloadedError("server is shutting down; not accepting new requests")
        limit = self.max_waiting_requests
        if limit is not None and num_new > limit:
            raise ValueError(
                f"n: this request asks for {num_new} sequences (prompts x n), more than the "
                f"server ever queues (max_waiting_requests={limit})"
            )
        if limit is not None and self.num_waiting + num_new > limit:
            raise OverloadedError(
                f"server overloaded: {self.num_waiting} requests are waiting and this one "
                f"adds {num_new} (max_waiting_requests={limit})"
            )

    def submit(
        self,
        request: CheckedRequest | Sequence[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        *,
        prompt: str | None = None,
        priority: int = 0,
        timeout_s: float | None = None,
    ) -> RequestHandle:
        """Queue a request now (on the event loop's thread) and return its handle: a
        ``CheckedRequest`` (the server checks at its edge), or prompt token ids, ``params``
        and ``priority``, checked here (``ValueError`` naming the field). Called right after
        ``check_capacity``, with no await between, so the request counts against
        ``max_waiting_requests`` from admission on, streaming or not. The engine thread
        only queues it."""
        if not isinstance(request, CheckedRequest):
            request = self.engine.inputs.process(prompt, params, priority, prompt_token_ids=request)
        if not self.healthy:
            raise EngineDeadError(f"engine is not running: {self.dead_error!r}")
        request_id = request_id or self.new_request_id()
        stream = _Stream(asyncio.get_running_loop())
        with self._lock:
            self._num_pending += 1
        self._streams_register(request_id, stream)
        self._live.add(stream)
        self._commands.put(_Add(request_id, request, time.monotonic()))
        self._wakeup.set()
        return RequestHandle(self, request_id, stream, timeout_s)

    async def generate(self, *args: Any, **kwargs: Any) -> AsyncIterator[RequestOutput]:
        """``submit`` (same arguments), then yield the request's outputs until it finishes.

        Closing the iterator early (client gone, cancellation) aborts the request, which
        frees its KV blocks within one step; so does running past ``timeout_s`` seconds
        (``RequestTimeoutError``)."""
        outputs = self.submit(*args, **kwargs).outputs()
        try:
            async for item in outputs:
                yield item
        finally:
            await outputs.aclose()  # now, not when the collector finds it (aborts it)

    @property
    def queued_bytes(self) -> int:
        """Output waiting for the streams' consumers (read on the event loop's thread)."""
        return sum(s.queued_bytes for s in self._live)

    @property
    def num_streams(self) -> int:
        """Requests whose consumer is still reading (on the event loop's thread)."""
        return len(self._live)

    async def drain(self, timeout: float, poll_s: float = 0.05) -> int:
        """Stop admitting requests, wait up to ``timeout`` seconds for the running ones to
        finish, then end the rest with an ``EngineDeadError`` (their clients get an error
        body or SSE error event). Returns how many were ended that way."""
        self.draining = True
        deadline = time.monotonic() + timeout
        while self._live and time.monotonic() < deadline:
            await asyncio.sleep(poll_s)
        left = len(self._live)
        if left:
            logger.warning("shutdown timeout (%.1f s): ending %d request(s)", timeout, left)
            self._commands.put(_FailAll(EngineDeadError("server shutting down")))
            self._wakeup.set()
            deadline = time.monotonic() + DELIVERY_GRACE_S
            while self._live and self.healthy and time.monotonic() < deadline:
                await asyncio.sleep(poll_s)  # their consumers take the error events
        return left

    def abort(self, request_id: str) -> None:
        self._commands.put(_Abort(request_id))
        self._wakeup.set()

    def reset_prefix_cache(self) -> None:
        """``FrontEnd.reset_prefix_cache`` on the engine thread, before any request submitted
        after this call reaches the engine."""
        self._commands.put(_ResetPrefixCache())
        self._wakeup.set()

    def _streams_register(self, request_id: str, stream: _Stream) -> None:
        # The dict is read on the engine thread; registering happens before the _Add
        # command is queued, and the queue is a happens-before edge.
        self._streams[request_id] = stream

    # ---- the engine thread -----------------------------------------------------------------
    def _run(self) -> None:
        engine = self.engine
        try:
            while not self._stopping:
                if not self._drain_commands():
                    break
                busy = engine.has_unfinished()
                if busy and not self._busy:
                    self._busy_since = time.monotonic()
                self._busy = busy
                if not self._busy:
                    self._update_counts()
                    self._wakeup.wait(timeout=0.5)
                    self._wakeup.clear()
                    continue
                try:
                    outputs = engine.step()
                except DeviceError:
                    raise  # the device cannot be trusted: the engine is dead
                except Exception as exc:  # a bug outside the model runner: fail in-flight work
                    logger.exception("engine step raised; failing all in-flight requests")
                    self._fail_all(exc)
                    continue
                self._update_counts()
                for out in outputs:
                    self._deliver(out)
        except BaseException as exc:  # the loop itself broke: nothing can be served
            logger.exception("engine loop died")
            self.dead_error = exc
            self._fail_all(EngineDeadError(f"engine loop died: {exc!r}"))

    def _drain_commands(self) -> bool:
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return True
            if cmd is None:
                return False
            if isinstance(cmd, _FailAll):
                self._fail_all(cmd.error)
                continue
            if isinstance(cmd, _ResetPrefixCache):
                try:
                    self.engine.reset_prefix_cache()
                except Exception:
                    logger.exception("resetting the prefix cache failed")
                continue
            if isinstance(cmd, _Abort):
                self._streams.pop(cmd.request_id, None)
                try:
                    self.engine.abort_request(cmd.request_id)
                except Exception:  # the request is gone from the streams either way
                    logger.exception("abort of %s failed", cmd.request_id)
                continue
            stream = self._streams.get(cmd.request_id)
            if stream is None:
                with self._lock:
                    self._num_pending -= 1
                continue  # aborted before it reached the engine
            with self._lock:  # pending -> waiting in one move: admission never sees a gap
                self._num_pending -= 1
                self._num_waiting += 1
            try:
                self.engine.add_checked(cmd.request, cmd.request_id, cmd.arrival_time)
            except Exception as exc:  # fails this request, not the loop
                with self._lock:
                    self._num_waiting -= 1
                self._streams.pop(cmd.request_id, None)
                if isinstance(exc, ValueError):  # a request id in use: a 400
                    stream.put(exc)
                else:
                    logger.exception("adding %s failed", cmd.request_id)
                    stream.put(RequestFailedError(f"{type(exc).__name__}: {exc}"))

    def _deliver(self, out: RequestOutput) -> None:
        stream = self._streams.get(out.request_id)
        if out.finished:
            self._streams.pop(out.request_id, None)
        if stream is not None:
            stream.put(out)

    def _fail_all(self, exc: BaseException) -> None:
        for request_id in list(self._streams):
            try:
                self.engine.abort_request(request_id)
            except Exception:
                logger.exception("abort of %s failed", request_id)
            stream = self._streams.pop(request_id, None)
            if stream is not None:
                stream.put(
                    RequestFailedError(str(exc)) if not isinstance(exc, EngineDeadError) else exc
                )
        self._update_counts()

    def _update_counts(self) -> None:
        engine = self.engine
        with self._lock:
            self._num_waiting = engine.num_waiting
            self._num_running = engine.num_running


class RequestHandle:
    """A request queued by ``AsyncEngine.submit``: ``outputs()`` yields its outputs until it
    finishes. Closing that iterator early, or dropping a handle whose outputs were never
    read (a client gone before its response started), aborts the request."""

    def __init__(
        self, engine: AsyncEngine, request_id: str, stream: _Stream, timeout_s: float | None
    ) -> None:
        self._engine = engine
        self.request_id = request_id
        self._stream = stream
        self._timeout_s = timeout_s
        self._done = False  # finished, or aborted by us

    async def outputs(self) -> AsyncIterator[RequestOutput]:
        stream, timeout_s = self._stream, self._timeout_s
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        finished = False
        try:
            while True:
                if deadline is None:
                    item = await stream.get()
                else:
                    try:
                        item = await asyncio.wait_for(
                            stream.get(), max(0.0, deadline - time.monotonic())
                        )
                    except TimeoutError:
                        raise RequestTimeoutError(
                            f"request timed out after {timeout_s:g} s (--request-timeout)"
                        ) from None
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                if item.finished:
                    finished = True
                    if item.finish_reason == "error":
                        raise RequestFailedError(item.error or "request failed in the engine")
                yield item
                if finished:
                    return
        finally:
            self._close(aborted=not finished)

    def _close(self, aborted: bool) -> None:
        if self._done:
            return
        self._done = True
        self._engine._live.discard(self._stream)
        if aborted:
            self._engine.abort(self.request_id)

    def __del__(self) -> None:
        self._close(aborted=True)


class OverloadedError(RuntimeError):
    """Too many requests waiting; the client should retry later (HTTP 503)."""
