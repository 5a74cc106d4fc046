"""The stall scenario replayed inside one process, no HTTP: the same seeded workload as
``chunkserve bench sweep --dataset stall`` (short chats at a Poisson rate, long documents at a
fixed interval, token ids, EOS ignored), fed to an ``Engine`` at the requests' arrival times;
each token's time is taken when ``step()`` returns it. This isolates what the scheduler and
the model do from the serving path (HTTP, SSE, the engine thread sharing the GIL).

    python benchmarks/gpu/stall_offline.py --model .gpu/models/llama3-8b --load-format dummy \
        --budgets off,256,512,1024 --num-prompts 200 --request-rate 10 --long-interval 2
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import time

import numpy as np
import torch

from chunkserve.bench.datasets import WorkloadSpec, build_workload
from chunkserve.engine import Engine
from chunkserve.provenance import git_commit
from chunkserve.request import SamplingParams


def replay(engine: Engine, workload, max_duration: float) -> dict:
    pending = sorted(workload, key=lambda r: r.arrival)
    kinds, times, starts = {}, {}, {}
    t0 = time.perf_counter()
    i = 0
    while (i < len(pending) or engine.has_unfinished()) and time.perf_counter() - t0 < max_duration:
        now = time.perf_counter() - t0
        while i < len(pending) and pending[i].arrival <= now:
            r = pending[i]
            params = SamplingParams(max_tokens=r.output_len, temperature=0.0, ignore_eos=True)
            rid = engine.add_request(prompt_token_ids=r.prompt, sampling_params=params)
            kinds[rid], times[rid], starts[rid] = r.kind, [], t0 + r.arrival
            i += 1
        if not engine.has_unfinished():
            time.sleep(min(0.001, max(0.0, pending[i].arrival - now)))
            continue
        outs = engine.step()
        t = time.perf_counter()
        for o in outs:
            times[o.request_id].extend([t] * len(o.delta_token_ids))
    duration = time.perf_counter() - t0
    itl = np.array([b - a for ts in times.values() for a, b in itertools.pairwise(ts)]) * 1e3
    ttft_short = [
        (ts[0] - starts[r]) * 1e3 for r, ts in times.items() if ts and kinds[r] == "short"
    ]
    out_tokens = sum(len(ts) for ts in times.values())
    return {
        "duration_s": duration,
        "completed": sum(1 for ts in times.values() if ts),
        "output_tokens": out_tokens,
        "output_throughput": out_tokens / duration,
        "p50_itl_ms": float(np.percentile(itl, 50)),
        "p99_itl_ms": float(np.percentile(itl, 99)),
        "max_itl_ms": float(itl.max()),
        "median_ttft_short_ms": float(np.median(ttft_short)),
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
        row = {"config": budget, **replay(engine, workload, args.max_duration)}
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
