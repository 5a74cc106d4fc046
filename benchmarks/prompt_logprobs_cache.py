"""What asking for prompt logprobs costs when the prompt's prefix is cached (issue 44): a
request with ``prompt_logprobs`` skips the prefix cache (a cached block has no logits to
give), so it prefills its whole prompt, where the same request without them prefills only
what follows the cached prefix. In one engine (the embedded model, default dtype), a
``--prefix-len``-token prose prefix is cached first; then requests of that prefix plus a
fresh ``--suffix-len``-token tail, one output token each, alternate with and without
``prompt_logprobs=1``: the seconds each took, its cached tokens and the ratio of medians.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/prompt_logprobs_cache.py --threads 1

Writes ``prompt_logprobs_cache.json`` and ``.md`` under ``--out-dir``, naming the CPU and the
load average at each request.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from datetime import datetime, timezone
from pathlib import Path

from chunkserve.bench.prose import prose_tokens
from chunkserve.engine.engine import Engine
from chunkserve.provenance import cpu_description, git_commit
from chunkserve.scheduling.sampling_params import SamplingParams


def timed(engine: Engine, prompt: list[int], prompt_logprobs: int | None) -> tuple[float, int]:
    """Seconds from adding the request to its end, and the prompt tokens it took cached."""
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=prompt_logprobs)
    start = time.perf_counter()
    rid = engine.add_request(prompt, params)
    cached = 0
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id == rid and out.finished:
                cached = out.num_cached_tokens
    return time.perf_counter() - start, cached


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--prefix-len", type=int, default=1024)
    p.add_argument("--suffix-len", type=int, default=32)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out-dir", type=Path, default=Path("benchmarks/results"))
    args = p.parse_args(argv)
    engine = Engine(num_threads=args.threads, max_model_len=args.prefix_len + 256)
    tokens = prose_tokens(engine.tokenizer)
    prefix = tokens[: args.prefix_len]

    def tail(i: int) -> list[int]:
        first = args.prefix_len + i * args.suffix_len
        return tokens[first : first + args.suffix_len]

    timed(engine, prefix + tail(0), None)  # caches the prefix (and warms up)
    runs: dict[str, list[dict]] = {"cache_hit": [], "prompt_logprobs": []}
    for r in range(args.repeats):
        for j, (name, lp) in enumerate((("cache_hit", None), ("prompt_logprobs", 1))):
            seconds, cached = timed(engine, prefix + tail(1 + 2 * r + j), lp)
            load = os.getloadavg()[0]
            runs[name].append({"seconds": seconds, "cached_tokens": cached, "load": load})
            print(f"{name}: {seconds:.3f} s, {cached} cached tokens, load {load:.2f}")
    medians = {k: statistics.median(x["seconds"] for x in v) for k, v in runs.items()}
    doc = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": cpu_description(),
        "commit": git_commit(),
        "threads": args.threads,
        "dtype": str(engine.core.worker.dtype).removeprefix("torch."),
        "prefix_len": args.prefix_len,
        "suffix_len": args.suffix_len,
        "runs": runs,
        "median_seconds": medians,
        "ratio": medians["prompt_logprobs"] / medians["cache_hit"],
    }
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "prompt_logprobs_cache.json").write_text(json.dumps(doc, indent=2) + "\n")
    md = [
        f"# Prompt logprobs skip the prefix cache: their cost ({doc['date']})",
        "",
        f"- machine: {doc['machine']}; {args.threads} thread(s); dtype {doc['dtype']}",
        f"- command: `benchmarks/prompt_logprobs_cache.py --threads {args.threads}"
        f" --prefix-len {args.prefix_len} --suffix-len {args.suffix_len}"
        f" --repeats {args.repeats}` at commit {doc['commit']}",
        "- 1-minute load average at each request: "
        + ", ".join(f"{x['load']:.2f}" for v in runs.values() for x in v),
        "",
        "| request | median s | cached prompt tokens |",
        "|---|---|---|",
    ]
    for name, v in runs.items():
        md.append(f"| {name} | {medians[name]:.3f} | {v[0]['cached_tokens']} |")
    md += [
        "",
        f"A {args.prefix_len}-token cached prefix plus a {args.suffix_len}-token tail, one "
        f"output token: with prompt logprobs the request prefills its whole prompt, "
        f"{doc['ratio']:.1f}x the time of the same request served from the cache.",
    ]
    (args.out_dir / "prompt_logprobs_cache.md").write_text("\n".join(md) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
