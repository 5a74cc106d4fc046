"""The step-time cost model on mixture-of-experts models (issue 41, item 4): ``chunkserve
profile``'s measurement and fit (``tuning.profiler.run_profile``) on tiny random MoE models,
with the routers as a random model's are (uniform) and Zipf-skewed (``moe.RoutingTap``: each
router's logits biased by ``-s * log(rank)`` times their own spread, as trained routers
favour some experts), reporting the held-out error with the experts feature and without it
(the dense model's features alone), as ``benchmarks/results/profile_cpu_t1.json`` reports the
dense profile's.

Models (random weights, fp32, the embedded model's 49,152-token vocabulary, hidden 512, 4
layers): ``moe8`` (8 experts of 1024 columns, top 2: the stall benchmark's model) and
``moe64`` (64 experts of 128 columns, top 4: fine-grained experts as in Qwen3-MoE / OLMoE,
where a step's count of touched experts matters most).

    OMP_NUM_THREADS=1 PYTHONPATH=$PWD .venv/bin/python benchmarks/moe_profile.py --threads 1

Writes ``benchmarks/results/moe_profile.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from moe_decode import write_model_dir

from chunkserve.engine.engine import Engine
from chunkserve.provenance import cpu_description, git_commit
from chunkserve.tuning.profiler import QUICK_GRID, profile_summary, run_profile

MODELS = {
    "moe8": dict(hidden=512, layers=4, experts=8, top_k=2, expert_inter=1024),
    "moe64": dict(hidden=512, layers=4, experts=64, top_k=4, expert_inter=128),
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--models", default="moe8,moe64")
    p.add_argument("--skews", default="0,1", help="Zipf exponents of the router bias")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default="benchmarks/results/moe_profile.json")
    args = p.parse_args()
    torch.manual_seed(0)
    doc: dict[str, Any] = dict(
        machine=cpu_description(),
        shared="the machine was shared: two CPU hogs and other helpers' jobs on its 2 cores",
        commit=git_commit(),
        date=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        command=" ".join(sys.argv),
        grid="QUICK_GRID plus the MoE decode batches (1, 2, 8)",
        runs=[],
    )
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models.split(","):
            path = write_model_dir(
                Path(tmp) / name, argparse.Namespace(**MODELS[name]), dense=False
            )
            engine = Engine(
                model=str(path),
                load_format="dummy",
                dtype="float32",
                num_threads=args.threads,
                max_model_len=2048,
                kv_cache_memory=64 << 20,
            )
            for skew in (float(s) for s in args.skews.split(",")):
                prof = run_profile(engine, QUICK_GRID, repeats=args.repeats, route_skew=skew)
                print(f"{name} skew {skew}: {profile_summary(prof)}", flush=True)
                moe = prof["moe"]
                doc["runs"].append(
                    dict(
                        model=name,
                        shape=MODELS[name],
                        route_skew=skew,
                        fit=prof["fit"],
                        weights=prof["weights"],
                        expert_share=[round(s, 4) for s in moe["expert_share"]],
                        touched_mean_rel_error=moe["touched_mean_rel_error"],
                        touched_max_rel_error=moe["touched_max_rel_error"],
                        touched=moe["touched"],
                        step_time_s_median=statistics.median(s["time_s"] for s in prof["samples"]),
                    )
                )
                Path(args.out).write_text(json.dumps(doc, indent=1))
            engine.shutdown()
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
