"""Tensor parallel on this machine: two ranks of one thread against one process of two
threads, and against two data-parallel cores of one thread each.

Every configuration runs the engine core in its own process (``MultiprocessEngine``, as
``chunkserve serve`` does), the model at its defaults (``dtype auto``, the adaptive budget)
and measures, in one run:

- **prefill**: 4 prompts of ``--prompt-len`` tokens sent together, 1 output token each:
  prompt tokens per second from the first add to the last finish (best of ``--repeats``);
- **decode at batch 1**: one request (64-token prompt, ``--decode-tokens`` outputs, EOS
  ignored): median and p99 inter-token latency as the front end sees the tokens;
- **decode at batch 32**: 32 such requests together: median and p99 inter-token latency over
  the steps after every prompt is in, and output tokens per second;
- **communication share** (tensor parallel only): the seconds rank 0 spends in collectives
  (the step broadcast, the all-reduces, the logits gather; waiting for the other rank
  included) over the step's time, median over the phase's steps.

    python benchmarks/tensor_parallel.py --out-dir benchmarks/results/tensor_parallel

Writes ``results.json`` and ``report.md`` there, with the machine, date and commit.
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import statistics
import time
from pathlib import Path

from chunkserve.config import EngineConfig
from chunkserve.engine.multiprocess_engine import MultiprocessEngine
from chunkserve.provenance import cpu_description, git_commit
from chunkserve.scheduling.sampling_params import SamplingParams

CONFIGS = {
    "tp1 x 2 threads": (dict(num_threads=2), 1),
    "tp2 x 1 thread": (dict(num_threads=1, tensor_parallel_size=2), 1),
    "tp2 x 1 thread (gloo sums)": (
        dict(num_threads=1, tensor_parallel_size=2, tensor_parallel_shm=False),
        1,
    ),
    "dp2 x 1 thread": (dict(num_threads=1), 2),
}


def prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(100, 49_000) for _ in range(n)]


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def drive(engine, prompts, params) -> tuple[dict[str, list[float]], float]:
    """Add every prompt, step until all finish; per request the times its tokens arrived,
    and the seconds from the first add to the last finish."""
    t0 = time.perf_counter()
    ids = [engine.add_request(p, params) for p in prompts]
    times: dict[str, list[float]] = {i: [] for i in ids}
    left = set(ids)
    while left:
        for out in engine.step():
            if out.request_id in times and out.delta_token_ids:
                times[out.request_id].append(time.perf_counter())
            if out.finished:
                left.discard(out.request_id)
    return times, time.perf_counter() - t0


def measure(name: str, args) -> dict:
    extra, dp = CONFIGS[name]
    config = EngineConfig.from_kwargs(max_model_len=args.max_model_len, dtype=args.dtype, **extra)
    engine = MultiprocessEngine(config, dp)
    steps: list = []
    engine.step_listeners.append(steps.append)
    rng = random.Random(0)
    result: dict = {"config": name, "info": str(engine.core_infos[0])}
    try:
        warm = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
        drive(engine, [prompt(rng, 200) for _ in range(4)], warm)  # warm caches and cost model
        # Prefill.
        best = None
        for _ in range(args.repeats):
            steps.clear()
            prompts = [prompt(rng, args.prompt_len) for _ in range(4)]
            _, secs = drive(engine, prompts, SamplingParams(max_tokens=1, temperature=0.0))
            rate = 4 * args.prompt_len / secs
            if best is None or rate > best[0]:
                best = (rate, [s for s in steps if s.num_prefill_tokens])
        rate, prefill_steps = best
        result["prefill_tok_s"] = rate
        result["prefill_comm_share"] = share(prefill_steps)
        # Decode, batch 1 and 32.
        params = SamplingParams(max_tokens=args.decode_tokens, temperature=0.0, ignore_eos=True)
        for batch in (1, 32):
            steps.clear()
            times, secs = drive(engine, [prompt(rng, 64) for _ in range(batch)], params)
            start = max(ts[0] for ts in times.values())  # every prompt is in
            gaps = [b - a for ts in times.values() for a, b in itertools.pairwise(ts) if a >= start]
            decode_steps = [s for s in steps if s.kind == "decode"]
            result[f"b{batch}_itl_p50_ms"] = 1e3 * statistics.median(gaps)
            result[f"b{batch}_itl_p99_ms"] = 1e3 * percentile(gaps, 0.99)
            result[f"b{batch}_out_tok_s"] = batch * args.decode_tokens / secs
            result[f"b{batch}_comm_share"] = share(decode_steps)
            result[f"b{batch}_step_ms"] = 1e3 * statistics.median(s.wall_time for s in decode_steps)
    finally:
        engine.shutdown()
    print(json.dumps(result), flush=True)
    return result


def share(steps) -> float | None:
    shares = [s.comm_time / s.wall_time for s in steps if s.wall_time > 0 and s.comm_time]
    return statistics.median(shares) if shares else None


def report(results: list[dict], meta: dict) -> str:
    def fmt(x, spec=".1f"):
        return "-" if x is None else format(x, spec)

    lines = [
        "# Tensor parallel vs one process vs data parallel",
        "",
        f"Machine: {meta['machine']}; date {meta['date']}; commit {meta['commit']}; "
        f"command: `{meta['command']}`.",
        "",
        "| config | prefill tok/s | b1 ITL p50 / p99 ms | b32 ITL p50 / p99 ms | "
        "b32 out tok/s | comm share prefill / b1 / b32 |",
        "|---|---|---|---|---|---|",
    ]
    for r in results:
        comm = " / ".join(
            fmt(r[k] and 100 * r[k], ".0f") + ("%" if r[k] else "")
            for k in ("prefill_comm_share", "b1_comm_share", "b32_comm_share")
        )
        lines.append(
            f"| {r['config']} | {fmt(r['prefill_tok_s'], '.0f')} | "
            f"{fmt(r['b1_itl_p50_ms'])} / {fmt(r['b1_itl_p99_ms'])} | "
            f"{fmt(r['b32_itl_p50_ms'])} / {fmt(r['b32_itl_p99_ms'])} | "
            f"{fmt(r['b32_out_tok_s'])} | {comm} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out-dir", type=Path, default=Path("benchmarks/results/tensor_parallel"))
    p.add_argument("--prompt-len", type=int, default=1024)
    p.add_argument("--decode-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--configs", default=",".join(CONFIGS))
    p.add_argument("--dtype", default="auto", help="auto: bf16 where the CPU has it, else fp32")
    args = p.parse_args()
    meta = {
        "machine": cpu_description(),
        "date": time.strftime("%Y-%m-%d"),
        "commit": git_commit(),
        "command": "python benchmarks/tensor_parallel.py "
        + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items()),
    }
    results = [measure(name, args) for name in args.configs.split(",")]
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "results.json").write_text(
        json.dumps({"meta": meta, "results": results}, indent=2) + "\n"
    )
    (args.out_dir / "report.md").write_text(report(results, meta))
    print(report(results, meta))


if __name__ == "__main__":
    main()
