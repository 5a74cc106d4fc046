"""``chunkserve serve``: the OpenAI-compatible server on the engine."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
from types import FrameType

from chunkserve.engine_args import add_engine_args, engine_config_from_args, parse_bytes
from chunkserve.entrypoints.openai.reasoning_parsers import REASONING_PARSERS
from chunkserve.entrypoints.openai.tool_parsers import TOOL_PARSERS

logger = logging.getLogger("chunkserve.server")

API_KEY_ENV = "CHUNKSERVE_API_KEY"
DEFAULT_SHUTDOWN_TIMEOUT_S = 30.0


def _serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1", help="bind address (default: loopback)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument(
        "--served-model-name",
        default=None,
        help="model name clients send (default: the model file's name)",
    )
    p.add_argument(
        "--api-key",
        default=os.environ.get(API_KEY_ENV),
        help=f"require 'Authorization: Bearer KEY' on /v1 and tokenizer routes (default: "
        f"${API_KEY_ENV}, which keeps the key out of the process list)",
    )
    p.add_argument(
        "--shutdown-timeout",
        type=float,
        default=DEFAULT_SHUTDOWN_TIMEOUT_S,
        help="on SIGTERM/SIGINT: stop admitting requests (503, /health says draining), let "
        "the running ones finish for up to this many seconds, then end them with an error",
    )
    p.add_argument(
        "--request-timeout",
        type=float,
        default=None,
        help="end a request that runs longer than this many seconds with a 504 / SSE error "
        "(default: no limit)",
    )
    p.add_argument(
        "--max-waiting-requests",
        type=int,
        default=None,
        help="answer 503 with Retry-After when this many requests wait",
    )
    p.add_argument(
        "--tool-call-parser",
        default="auto",
        choices=["auto", *sorted(TOOL_PARSERS)],
        help="the format tool calls are read from in a chat reply with tools (default: auto, "
        "the one the chat template writes: harmony, mistral, hermes or llama3_json; hermes, "
        "the fallback prompt's <tool_call> blocks, when it writes none); said at startup",
    )
    p.add_argument(
        "--reasoning-parser",
        default="auto",
        choices=["auto", "none", *sorted(REASONING_PARSERS)],
        help="split the reasoning off chat replies into reasoning_content (default: auto, "
        "harmony for a <|channel|> template, qwen3 or deepseek_r1 for a <think> one, else "
        "none); said at startup",
    )
    p.add_argument("--max-request-body-bytes", type=parse_bytes, default=32 << 20)
    p.add_argument(
        "--core-process",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="run the engine core in its own process, beside the API server's (default: "
        "on; --no-core-process steps it on a thread of the server's process)",
    )
    p.add_argument(
        "--data-parallel-size",
        "--dp",
        type=int,
        default=1,
        help="engine-core processes, each with its own KV cache and --num-threads; requests "
        "go to the least loaded, or the one holding their prompt's prefix",
    )
    p.add_argument(
        "--watchdog-timeout",
        type=float,
        default=None,
        help="with requests in flight and no engine step finished for this many seconds "
        "(default 120; or 5x the longest step the engine has taken, where that is longer), "
        "the engine is hung: /health answers 503; a hung core process is killed and its "
        "requests end with an error",
    )
    add_engine_args(p)


def _serve(args: argparse.Namespace) -> int:
    # No torch in this process when the core runs in its own (``engine.core_types``).
    from chunkserve.engine.async_engine import AsyncEngine
    from chunkserve.engine.multiprocess_engine import MultiprocessEngine
    from chunkserve.entrypoints.openai.api_server import build_app
    from chunkserve.model.source import release_gguf_readers

    if args.max_waiting_requests is not None and args.max_waiting_requests < 1:
        raise ValueError("max_waiting_requests: must be >= 1")
    if args.api_key is not None and not args.api_key.strip():
        raise ValueError(
            f"api_key: empty (from --api-key or ${API_KEY_ENV}); unset it or set a key"
        )
    if not args.shutdown_timeout >= 0:
        raise ValueError("shutdown_timeout: must be >= 0 seconds")
    if args.request_timeout is not None and not args.request_timeout > 0:
        raise ValueError("request_timeout: must be > 0 seconds")
    from chunkserve.engine.frontend import WATCHDOG_S

    watchdog = WATCHDOG_S if args.watchdog_timeout is None else args.watchdog_timeout
    if not watchdog > 0:
        raise ValueError("watchdog_timeout: must be > 0 seconds")
    if args.data_parallel_size < 1:
        raise ValueError("data_parallel_size: must be >= 1")
    if args.data_parallel_size > 1 and not args.core_process:
        raise ValueError("data_parallel_size: more than one core needs --core-process")
    config = engine_config_from_args(args)
    if config.tensor_parallel_size > 1:
        from chunkserve.distributed import launch

        if args.data_parallel_size > 1 and (config.nnodes > 1 or launch.launcher_env()):
            raise ValueError(
                "data_parallel_size: with tensor parallelism over several nodes or a "
                "launcher, use one engine core"
            )
        spec = launch.launcher_rank(config)
        if spec is not None and spec.rank != 0:  # a launcher's rank: compute, serve nothing
            from chunkserve.worker.tp_rank import run_rank_and_exit

            run_rank_and_exit(config, spec)
        if spec is None and config.node_rank > 0:  # a node other than 0: its ranks only
            return launch.run_headless(config)
    if args.core_process:
        engine = MultiprocessEngine(config, args.data_parallel_size, watchdog)
    else:
        from chunkserve.engine.engine import Engine

        engine = Engine(config)
    # A server is one model for its life: the front end's GGUF reader (the parsed header,
    # ~60 MiB for a 49k-token vocabulary) is not needed once the tokenizer is built.
    release_gguf_readers()
    name = args.served_model_name or engine.model_name
    sc, info = config.scheduler_config(engine.max_model_len), engine.core_infos[0]
    print(
        f"chunkserve {name}: http://{args.host}:{args.port}/v1 | device={info.device} "
        f"dtype={info.dtype} threads={info.num_threads} | "
        f"engine core: {'process' if args.core_process else 'thread'} "
        f"x{len(engine.core_infos)} | "
        f"KV cache {info.num_blocks} blocks x {info.block_size} tokens = "
        f"{info.num_blocks * info.block_size} tokens "
        f"({info.kv_cache_memory / 2**20:.0f} MiB) | max_model_len={engine.max_model_len} "
        f"max_num_seqs={sc.max_num_seqs} chunked_prefill={sc.enable_chunked_prefill} "
        f"scheduling_policy={sc.policy} | budget {info.budget_policy} | "
        f"tensor_parallel_size={config.tensor_parallel_size} | "
        f"disaggregation={config.disaggregation_mode or 'off'}"
        f"{f' kv_connector={config.kv_connector}' if config.disaggregation_mode else ''} | "
        f"api_key={'set' if args.api_key else 'none'} "
        f"max_waiting_requests={args.max_waiting_requests}",
        flush=True,
    )
    from chunkserve.entrypoints.openai.api_server import resolve_parsers

    tool_parser, reasoning_parser, _ = resolve_parsers(
        engine.tokenizer.chat_template, args.tool_call_parser, args.reasoning_parser
    )
    print(
        f"chat replies: tool-call parser {tool_parser}"
        f"{' (auto)' if args.tool_call_parser == 'auto' else ''}, reasoning parser "
        f"{reasoning_parser or 'none'}{' (auto)' if args.reasoning_parser == 'auto' else ''}",
        flush=True,
    )
    async_engine = AsyncEngine(engine, args.max_waiting_requests, watchdog)
    app = build_app(
        async_engine,
        served_model_name=name,
        api_key=args.api_key,
        max_body_bytes=args.max_request_body_bytes,
        request_timeout=args.request_timeout,
        tool_call_parser=tool_parser,
        reasoning_parser=reasoning_parser,
    )
    from chunkserve.memory import freeze_startup_heap

    freeze_startup_heap()
    import uvicorn

    config = uvicorn.Config(
        app, host=args.host, port=args.port, log_level=args.log_level, timeout_graceful_shutdown=5
    )
    _draining_server_class()(config, async_engine, args.shutdown_timeout).run()
    return 0


def _draining_server_class():
    import uvicorn

    class DrainingServer(uvicorn.Server):
        """uvicorn, with a drain before it stops: the first SIGTERM/SIGINT stops admission
        (new requests 503, ``/health`` 503 "draining"), waits for the running requests up to
        ``shutdown_timeout`` seconds and ends the rest with an error event; then the server
        exits (0). A second signal exits at once."""

        def __init__(self, config, async_engine, shutdown_timeout: float) -> None:
            super().__init__(config)
            self.async_engine = async_engine
            self.shutdown_timeout = shutdown_timeout
            self._loop: asyncio.AbstractEventLoop | None = None
            self._drain_task: asyncio.Task | None = None

        async def serve(self, sockets=None) -> None:
            self._loop = asyncio.get_running_loop()
            await super().serve(sockets)

        def handle_exit(self, sig: int, frame: FrameType | None) -> None:
            if self._loop is None or self._drain_task is not None or self.should_exit:
                super().handle_exit(sig, frame)  # not started, or asked twice: exit now
                return
            logger.warning(
                "%s: draining (up to %.0f s for %d running request(s))",
                signal.Signals(sig).name,
                self.shutdown_timeout,
                self.async_engine.num_streams,
            )
            self.async_engine.draining = True  # admission stops now, before the task runs
            self._loop.call_soon_threadsafe(self._start_drain)

        def _start_drain(self) -> None:
            self._drain_task = asyncio.ensure_future(self._drain())

        async def _drain(self) -> None:
            try:
                await self.async_engine.drain(self.shutdown_timeout)
            finally:
                self.should_exit = True

    return DrainingServer
