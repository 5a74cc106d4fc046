"""An engine core in its own process, and the messages it exchanges with the front end.

The API server's interpreter does HTTP, tokenisation, detokenisation and SSE; the core's
does nothing but schedule and step, so neither waits for the other's GIL. They talk over
ZeroMQ sockets with msgpack-encoded messages (msgspec): commands in on a PULL socket
(``AddRequest``, ``AbortRequests``, ``FinishRequests``, ``FailRequest``, ``Shutdown``),
reports out on a PUSH socket. Start-up is a handshake: the core reads the model's config
and reports it (``CoreConfig``: the front end never imports torch, which reading it needs),
the front end answers ``StartCore`` with the EOS ids (its tokenizer's and the model's), the
core loads and reports ``CoreReady`` (or ``CoreFailed`` at any point). Then one
``StepReport`` per step with work: token-id deltas (``core_types.CoreOutput``) and the
step's statistics. This module imports no torch (the core's modules load in ``run_core``).

The core steps back to back while it has work, taking new commands between steps, and
blocks on its command socket when idle. It exits on ``Shutdown``, when its parent process
is gone, or after reporting an error no step recovers from (``CoreDead``).
"""

from __future__ import annotations

import logging
import os
import pickle
import signal
from typing import TYPE_CHECKING, Union

import msgspec
import zmq

from chunkserve.config import EngineConfig
from chunkserve.engine.core_types import CoreInfo, CoreLoad, CoreOutput, CoreRequest
from chunkserve.engine.step_log import StepStats
from chunkserve.memory import freeze_startup_heap
from chunkserve.scheduling.request import RequestStatus

if TYPE_CHECKING:
    from chunkserve.engine.core import EngineCore

logger = logging.getLogger("chunkserve.core")

# Milliseconds an idle core waits for a command before it checks that its parent lives.
IDLE_POLL_MS = 500


class AddRequest(msgspec.Struct, tag="add"):
    request: CoreRequest


class AbortRequests(msgspec.Struct, tag="abort"):
    request_ids: list[str]


class FinishRequests(msgspec.Struct, tag="finish"):
    """Requests the front end finished (a stop string in their text)."""

    request_ids: list[str]


class FailRequest(msgspec.Struct, tag="fail"):
    """A request whose output processing raised in the front end."""

    request_id: str
    error: str


class ResetPrefixCache(msgspec.Struct, tag="reset_prefix_cache"):
    pass


class StartCore(msgspec.Struct, tag="start"):
    """The front end's answer to ``CoreConfig``: load the model and serve with these EOS ids
    (the tokenizer's, which only the front end reads, with the model's)."""

    eos_token_ids: list[int]


class Shutdown(msgspec.Struct, tag="shutdown"):
    pass


Command = Union[  # noqa: UP007
    AddRequest, AbortRequests, FinishRequests, FailRequest, ResetPrefixCache, StartCore, Shutdown
]


class CoreConfig(msgspec.Struct, tag="config"):
    """The model's ``ModelConfig`` (pickled), read by the core before its weights: the front
    end takes it from here, as reading it needs the model registry, and so torch."""

    core: int
    model_config: bytes


class CoreReady(msgspec.Struct, tag="ready"):
    core: int
    info: CoreInfo


class CoreFailed(msgspec.Struct, tag="failed"):
    """The core could not start: ``error_type`` is ``ValueError`` for a bad configuration
    (the front end raises one with the same message)."""

    core: int
    error_type: str
    message: str


class CoreDead(msgspec.Struct, tag="dead"):
    """The core stopped serving (the device failed, or a bug in the core's loop)."""

    core: int
    message: str


class StepReport(msgspec.Struct, tag="step"):
    core: int
    outputs: list[CoreOutput]
    stats: StepStats | None
    load: CoreLoad  # after the step


Report = Union[CoreConfig, CoreReady, CoreFailed, CoreDead, StepReport]  # noqa: UP007


def encoder() -> msgspec.msgpack.Encoder:
    return msgspec.msgpack.Encoder()


def command_decoder() -> msgspec.msgpack.Decoder:
    return msgspec.msgpack.Decoder(Command)


def report_decoder() -> msgspec.msgpack.Decoder:
    return msgspec.msgpack.Decoder(Report)


def run_core(
    index: int,
    config: EngineConfig,
    command_address: str,
    report_address: str,
    log_level: int = logging.INFO,
    data_parallel_size: int = 1,
) -> None:
    """The core process's main: read the model's config and report it (``CoreConfig``),
    wait for the front end's ``StartCore``, build the core, report ready, serve commands
    until told to stop or orphaned. With several cores on CUDA, core ``index`` takes GPU
    ``index``."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the front end decides when to stop
    logging.basicConfig(
        level=log_level, format=f"%(asctime)s %(levelname)s core{index}: %(message)s"
    )
    parent = os.getppid()
    ctx = zmq.Context()
    commands = ctx.socket(zmq.PULL)
    commands.connect(command_address)
    reports = ctx.socket(zmq.PUSH)
    reports.setsockopt(zmq.LINGER, 2000)
    reports.connect(report_address)
    enc, dec = encoder(), command_decoder()
    try:
        # The core (and torch) are imported here, in the core's process: the API server's
        # imports this module for its messages only.
        from chunkserve.engine.core import EngineCore
        from chunkserve.model.loader import load_model_config
        from chunkserve.model.source import (
            config_source,
            release_gguf_readers,
            weights_only_reader,
        )

        if data_parallel_size > 1:
            _pick_gpu(config.device, index, data_parallel_size, config.tensor_parallel_size)
        source = config_source(config)
        model_config, reader = load_model_config(source)
        if reader is not None:  # the tokenizer is the front end's
            reader = weights_only_reader(reader)
        reports.send(enc.encode(CoreConfig(index, pickle.dumps(model_config))))
        start = _wait_start(commands, dec, parent)
        if start is None:
            return _close(commands, reports, ctx)
        core = EngineCore(
            config, tuple(start.eos_token_ids), source, model_config, reader, index=index
        )
        # The weights are in: the GGUF reader (the file's map, whose copied pages stay
        # resident, and its parsed header) can go, as ``EngineCore`` does with one it
        # opened itself. The first grammar's tokenizer parses the file again.
        del reader
        released = release_gguf_readers()
        logger.debug("released %.0f MiB with the GGUF reader", released / 2**20)
    except Exception as exc:
        logger.exception("engine core %d failed to start", index)
        reports.send(enc.encode(CoreFailed(index, type(exc).__name__, str(exc))))
        return _close(commands, reports, ctx)
    freeze_startup_heap()  # the model's objects: out of the collector's walks
    reports.send(enc.encode(CoreReady(index, core.info())))
    try:
        _serve(index, core, commands, reports, enc, dec, parent)
    except BaseException as exc:  # the device or the loop broke: tell the front end
        logger.exception("engine core %d died", index)
        reports.send(enc.encode(CoreDead(index, f"{type(exc).__name__}: {exc}")))
    finally:
        core.shutdown()
        commands.close(linger=0)
        reports.close()
        ctx.term()


def _wait_start(commands, dec, parent: int) -> StartCore | None:
    """The front end's ``StartCore``; None if it said ``Shutdown`` or is gone."""
    while True:
        if commands.poll(IDLE_POLL_MS):
            cmd = dec.decode(commands.recv())
            if isinstance(cmd, StartCore):
                return cmd
            if isinstance(cmd, Shutdown):
                return None
        elif os.getppid() != parent:
            return None


def _close(commands, reports, ctx) -> None:
    commands.close(linger=0)
    reports.close()
    ctx.term()


def _pick_gpu(device: str, index: int, data_parallel_size: int, tensor_parallel_size: int) -> None:
    import torch

    if device == "cpu" or (device == "auto" and not torch.cuda.is_available()):
        return  # CPU cores share the machine: each takes --num-threads of it
    if tensor_parallel_size > 1:
        raise ValueError(
            "data_parallel_size: several engine cores with tensor_parallel_size > 1 on CUDA "
            "(each core's ranks would take the same GPUs); run one core per node"
        )
    found = torch.cuda.device_count()
    if found < data_parallel_size:
        raise ValueError(
            f"data_parallel_size: {data_parallel_size} engine cores need as many GPUs, "
            f"found {found}"
        )
    torch.cuda.set_device(index)


def _serve(index, core: EngineCore, commands, reports, enc, dec, parent: int) -> None:
    finals: list[CoreOutput] = []  # of aborts, and of adds that failed
    changed = False  # a command changed the core's state: report it even when idle
    while True:
        timeout = 0 if core.has_unfinished() or changed else IDLE_POLL_MS
        while commands.poll(timeout):
            timeout = 0
            cmd = dec.decode(commands.recv())
            if isinstance(cmd, Shutdown):
                return
            _apply(core, cmd, finals)
            changed = True
        if os.getppid() != parent:
            logger.warning("engine core %d: the front end is gone; exiting", index)
            return
        if not core.has_unfinished() and not changed:
            core.keepalive()  # tensor parallel: the ranks live and hear from rank 0
            continue
        step = core.step()
        outputs = finals + step.outputs
        if outputs or step.stats is not None or changed:  # not while only KV arrives
            reports.send(enc.encode(StepReport(index, outputs, step.stats, core.load())))
        finals, changed = [], False


def _apply(core: EngineCore, cmd: Command, finals: list[CoreOutput]) -> None:
    if isinstance(cmd, AddRequest):
        try:
            core.add_request(cmd.request)
        except Exception as exc:  # fails this request only
            logger.exception("adding %s failed", cmd.request.request_id)
            finals.append(
                CoreOutput(cmd.request.request_id, [], finish_reason="error", error=str(exc))
            )
    elif isinstance(cmd, AbortRequests):
        for request_id in cmd.request_ids:
            final = core.abort_request(request_id)
            if final is not None:
                finals.append(final)
    elif isinstance(cmd, FinishRequests):
        core.finish_requests(cmd.request_ids, RequestStatus.FINISHED_STOPPED)
    elif isinstance(cmd, FailRequest):
        core.fail_request(cmd.request_id, cmd.error)
    elif isinstance(cmd, ResetPrefixCache):
        core.reset_prefix_cache()
