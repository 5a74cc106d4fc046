"""The stall scenario replayed inside one process, no HTTP: the same seeded workload as
``chunkserve bench sweep --dataset stall`` (short chats at a Poisson rate, long documents at a
fixed interval, token ids, EOS ignored), fed to an ``Engine`` at the requests' arrival times;
each output with new text is timed when ``step()`` returns it (``chunkserve.bench.replay``).
This isolates what the scheduler and the model do from the serving path (HTTP, SSE).

    python benchmarks/gpu/stall_offline.py --model .gpu/models/llama3-8b --load-format dummy \
        --budgets off,256,512,1024 --num-prompts 200 --request-rate 10 --long-interval 2
"""

from __future__ import annotations

import argparse
import gc
import json
import time

import numpy as np
import torch

from chunkserve.bench.datasets import WorkloadSpec, build_workload
from chunkserve.bench.loadgen import summarize
from chunkserve.bench.replay import replay
from chunkserve.engine.engine import Engine
from chunkserve.provenance import git_commit


def replay_stall(engine: Engine, workload, max_duration: float) -> dict:
    records, duration = replay(engine, workload, max_duration=max_duration)
    s = summarize(records, duration)
    short = [r for r in records if r.kind == "short" and r.ttft is not None]
    return {
        "duration_s": duration,
        "completed": s["completed"],
        "output_tokens": s["total_output_tokens"],
        "output_throughput": s["output_throughput"],
        "p50_itl_ms": s["median_itl_ms"],
        "p99_itl_ms": s["p99_itl_ms"],
        "max_itl_ms": s["max_itl_ms"],
        "median_ttft_short_ms": 1e3 * float(np.median([r.ttft for r in short])),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--load-format", default="auto")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--budgets", default="off,512")
    ap.add_argument("--num-prompts", type=int, default=200)
    ap.add_argument("--request-rate", type=float, default=10.0)
    ap.add_argument("--long-interval", type=float, default=2.0)
    ap.add_argument("--max-duration", type=float, default=120.0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    engine = None
    rows = []
    for budget in args.budgets.split(","):
        kwargs = {"enable_chunked_prefill": False} if budget == "off" else {}
        if budget != "off":
            kwargs["max_num_batched_tokens"] = int(budget)
        engine = Engine(
            model=args.model,
            load_format=args.load_format,
            device=args.device,
            max_model_len=8192,
            log_stats_interval=10**9,
            **kwargs,
        )
        spec = WorkloadSpec(
            dataset="stall",
            num_prompts=args.num_prompts,
            request_rate=args.request_rate,
            long_interval=args.long_interval,
        )
        workload = build_workload(spec, engine.tokenizer)
        row = {"config": budget, **replay_stall(engine, workload, args.max_duration)}
        rows.append(row)
        print(
            f"{budget:>6}: p50 ITL {row['p50_itl_ms']:.1f} ms, p99 {row['p99_itl_ms']:.1f}, max "
            f"{row['max_itl_ms']:.1f}, {row['output_throughput']:.0f} out tok/s, short TTFT "
            f"{row['median_ttft_short_ms']:.0f} ms, {row['completed']} done",
            flush=True,
        )
        del engine
        gc.collect()
        torch.cuda.empty_cache() if torch.cuda.is_available() else None
    if args.out:
        doc = {
            "benchmark": "stall scenario replayed in-process (no HTTP)",
            "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
            "date": time.strftime("%Y-%m-%d"),
            "commit": git_commit(),
            "args": vars(args),
            "rows": rows,
        }
        with open(args.out, "w") as f:
            json.dump(doc, f, indent=1)


if __name__ == "__main__":
    main()
