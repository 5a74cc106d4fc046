"""The machine's own step-time noise: identical decode steps, one engine, nothing else running.

One request decodes at batch 1 (1 torch thread, the engine's defaults, the start-up heap
frozen out of the GC as a server does), restarted every ``--tokens-per-request`` tokens so
the context stays within a narrow band: every step does the same work. Whatever spread the
step times show is the machine's (hypervisor, caches, frequency), not the scheduler's: the
floor under any "max gap within X times the median" target measured on this machine.

    .venv/bin/python benchmarks/step_noise.py

Writes ``benchmarks/results/step_noise.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from datetime import datetime, timezone
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=2500)
    p.add_argument("--prompt-len", type=int, default=100)
    p.add_argument("--tokens-per-request", type=int, default=200)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--window", type=int, default=500, help="steps per window in the report")
    p.add_argument("--name", default="step_noise")
    args = p.parse_args()

    from chunkserve import SamplingParams
    from chunkserve.engine.engine import Engine
    from chunkserve.platform import freeze_startup_heap
    from chunkserve.provenance import cpu_description, git_commit

    engine = Engine(num_threads=args.threads, max_model_len=2048, kv_cache_memory=128 << 20)
    freeze_startup_heap()
    params = SamplingParams(max_tokens=args.tokens_per_request, temperature=0.0, ignore_eos=True)
    prompt = list(range(1000, 1000 + args.prompt_len))
    times: list[float] = []
    while len(times) < args.steps:
        engine.add_request(prompt, params)
        engine.step()  # its prefill: not timed
        while engine.has_unfinished() and len(times) < args.steps:
            t0 = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - t0)
        while engine.has_unfinished():
            engine.step()
    ms = [1e3 * t for t in times]
    median = statistics.median(ms)
    windows = [
        {"first": i, "median_ms": statistics.median(w), "max_ms": max(w)}
        for i in range(0, len(ms) - args.window + 1, args.window)
        for w in [ms[i : i + args.window]]
    ]
    doc = {
        "machine": cpu_description(),
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "commit": git_commit(),
        "command": "python benchmarks/step_noise.py",
        "args": vars(args),
        "dtype": str(engine.core.worker.dtype).removeprefix("torch."),
        "steps": len(ms),
        "p50_ms": median,
        "p90_ms": percentile(ms, 0.9),
        "p99_ms": percentile(ms, 0.99),
        "max_ms": max(ms),
        "max_over_median": max(ms) / median,
        "p99_over_median": percentile(ms, 0.99) / median,
        "windows": windows,
        "step_ms": ms,
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{args.name}.json").write_text(json.dumps(doc, indent=1) + "\n")
    lines = [
        "# Step-time noise of this machine",
        "",
        f"Measured {doc['date']} on {doc['machine']}; commit {doc['commit']}; {doc['dtype']}, "
        f"{args.threads} thread(s).",
        "",
        f"{len(ms)} identical decode steps: batch 1, context {args.prompt_len}-"
        f"{args.prompt_len + args.tokens_per_request} (one request restarted every "
        f"{args.tokens_per_request} tokens), one engine in one process, nothing else running, "
        "start-up heap frozen out of the GC.",
        "",
        f"Reproduce: `{doc['command']}`",
        "",
        "| p50 ms | p90 ms | p99 ms | max ms | p99 / p50 | max / p50 |",
        "|---|---|---|---|---|---|",
        f"| {median:.1f} | {doc['p90_ms']:.1f} | {doc['p99_ms']:.1f} | {doc['max_ms']:.1f} | "
        f"{doc['p99_over_median']:.2f} | {doc['max_over_median']:.2f} |",
        "",
        f"Per window of {args.window} steps:",
        "",
        "| steps | median ms | max ms | max / median |",
        "|---|---|---|---|",
        *(
            f"| {w['first']}-{w['first'] + args.window} | {w['median_ms']:.1f} | "
            f"{w['max_ms']:.1f} | {w['max_ms'] / w['median_ms']:.2f} |"
            for w in windows
        ),
        "",
    ]
    (RESULTS / f"{args.name}.md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
