"""``chunkserve serve``: the OpenAI-compatible server on the engine."""

from __future__ import annotations

import argparse
import gc
import logging
import time

from chunkserve.cli import add_engine_args, command, engine_config_from_args, parse_bytes

logger = logging.getLogger("chunkserve.server")


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
        default=None,
        help="require 'Authorization: Bearer KEY' on /v1 and tokenizer routes",
    )
    p.add_argument(
        "--max-waiting-requests",
        type=int,
        default=None,
        help="answer 503 with Retry-After when this many requests wait",
    )
    p.add_argument("--max-request-body-bytes", type=parse_bytes, default=32 << 20)
    add_engine_args(p)


@command("serve", "serve the model over an OpenAI-compatible HTTP API", _serve_args)
def _serve(args: argparse.Namespace) -> int:
    import uvicorn

    from chunkserve.async_engine import AsyncEngine
    from chunkserve.engine import Engine
    from chunkserve.server.api import build_app

    if args.max_waiting_requests is not None and args.max_waiting_requests < 1:
        raise ValueError("max_waiting_requests: must be >= 1")
    config = engine_config_from_args(args)
    engine = Engine(config)
    name = args.served_model_name or engine.model_name
    sc = engine.scheduler_config
    print(
        f"chunkserve {name}: http://{args.host}:{args.port}/v1 | device={engine.device} "
        f"dtype={str(engine.dtype).removeprefix('torch.')} threads={_threads()} | "
        f"KV cache {engine.num_blocks} blocks x {engine.block_size} tokens = "
        f"{engine.num_blocks * engine.block_size} tokens "
        f"({engine.kv_cache_memory / 2**20:.0f} MiB) | max_model_len={engine.max_model_len} "
        f"max_num_seqs={sc.max_num_seqs} chunked_prefill={sc.enable_chunked_prefill} "
        f"scheduling_policy={sc.policy} | budget {engine.budget_policy.describe()} | "
        f"api_key={'set' if args.api_key else 'none'} "
        f"max_waiting_requests={args.max_waiting_requests}",
        flush=True,
    )
    app = build_app(
        AsyncEngine(engine, args.max_waiting_requests),
        served_model_name=name,
        api_key=args.api_key,
        max_body_bytes=args.max_request_body_bytes,
    )
    freeze_startup_heap()
    uvicorn.run(
        app, host=args.host, port=args.port, log_level=args.log_level, timeout_graceful_shutdown=5
    )
    return 0


def freeze_startup_heap() -> None:
    """Move every object alive after start-up (the model's modules, the tokenizer's
    vocabulary, the app) out of the garbage collector's reach, as vLLM does. Otherwise each
    full collection walks ~200k of them: ~100 ms with the GIL held, a stall of every stream
    (measured on the 2-core CPU: it put single gaps of 300-390 ms into runs held to 250 ms).
    Only for a process that keeps its engine until it exits: frozen objects are never
    collected."""
    t0 = time.perf_counter()
    gc.collect()
    gc.freeze()
    logger.info(
        "froze %d start-up objects out of the GC (%.0f ms)",
        gc.get_freeze_count(),
        1e3 * (time.perf_counter() - t0),
    )


def _threads() -> int:
    import torch

    return torch.get_num_threads()
