"""The budget policies' trade-off between token gaps and TTFT, in the simulator.

The real scheduler and budget controller (``chunkserve.tuning.simulate``) against a cost profile
measured on this machine (``chunkserve profile``), with the machine's step-time noise
(log-normal, correlated from step to step as this VM's is), over the two serving workloads
of the stall-free issue: ``stall`` (short requests, 1,500-4,000-token documents every 15 s)
and ``mix`` (a realistic spread of lengths). For each request rate it runs chunking off,
static budgets, and the adaptive budget over a grid of its two knobs
(``--max-decode-slowdown``, ``--long-step-share``), each over several noise seeds (the
median of each metric is reported), and judges every configuration against chunking off
by the issue's targets: on ``stall``, max ITL >= 5x lower, p99 ITL lower, p99.9 ITL >= 3x
lower, output throughput >= 0.95x, short prompts' median TTFT <= 1.1x; on ``mix``, no
reported latency percentile worse than chunking off's (within 5%).

    .venv/bin/chunkserve profile --num-threads 1 --output benchmarks/results/profile_cpu_t1.json
    .venv/bin/python benchmarks/policy_frontier.py --cost-profile \\
        benchmarks/results/profile_cpu_t1.json --name policy_frontier_t1

Writes ``benchmarks/results/<name>/report.md`` and ``results.json``. Simulated, not served:
compare with the served sweeps (``stall_free_*``, ``mix3_t1``) for how far to trust it.
"""

from __future__ import annotations

import argparse
import json
import statistics
from datetime import datetime, timezone
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
STALL_RATES = (0.25, 0.4)
MIX_RATES = (0.15, 0.25, 0.35)
SLOWDOWNS = (1.5, 2.0, 3.0, 5.0, 10.0)
LONG_SHARES = (0.0, 0.005, 0.02)
STATIC_BUDGETS = (32, 64, 256, 1024)
# The mix workload's percentiles judged against chunking off (all that the sweeps report).
MIX_KEYS = (
    "median_ttft_ms",
    "p90_ttft_ms",
    "p99_ttft_ms",
    "median_itl_ms",
    "p90_itl_ms",
    "p99_itl_ms",
    "p99.9_itl_ms",
    "max_itl_ms",
    "short_ttft_ms",
    "medium_ttft_ms",
    "long_ttft_ms",
)
ROW_KEYS = (
    "median_itl_ms",
    "p90_itl_ms",
    "p99_itl_ms",
    "p99.9_itl_ms",
    "max_itl_ms",
    "median_ttft_ms",
    "p90_ttft_ms",
    "p99_ttft_ms",
    "short_ttft_ms",
    "medium_ttft_ms",
    "long_ttft_ms",
    "output_throughput",
)


def configs() -> list[tuple[str, dict]]:
    """(name, EngineConfig keyword arguments) of every configuration simulated."""
    out: list[tuple[str, dict]] = [("off", {"enable_chunked_prefill": False})]
    out += [(f"budget-{b}", {"max_num_batched_tokens": b}) for b in STATIC_BUDGETS]
    for s in SLOWDOWNS:
        for share in LONG_SHARES:
            name = f"slowdown {s:g}, long {100 * share:g}%"
            if (s, share) == (2.0, 0.005):
                name += " (defaults)"
            out.append((name, {"max_decode_slowdown": s, "long_step_share": share}))
    return out


def run_one(requests, kwargs: dict, model, args, seed: int) -> dict:
    from chunkserve.bench.loadgen import percentile, summarize
    from chunkserve.config import EngineConfig
    from chunkserve.tuning.simulate import simulate

    config = EngineConfig(**kwargs)
    records, duration, _ = simulate(
        requests,
        config.scheduler_config(8192),
        args.num_blocks,
        model,
        policy=config.budget_policy(8192),
        noise=args.noise,
        noise_correlation=args.noise_correlation,
        step_overhead_s=args.step_overhead_ms / 1e3,
        seed=seed,
    )
    result = summarize(records, duration)
    for kind in ("short", "medium", "long"):
        ttfts = [1e3 * r.ttft for r in records if r.success and r.kind == kind]
        result[f"{kind}_ttft_ms"] = percentile(ttfts, 50) if ttfts else None
    return result


def median_of(results: list[dict]) -> dict:
    return {
        k: statistics.median(r[k] for r in results) if results[0].get(k) is not None else None
        for k in ROW_KEYS
    }


def stall_verdict(off: dict, run: dict) -> dict[str, bool]:
    return {
        "max ITL >= 5x lower": run["max_itl_ms"] * 5 <= off["max_itl_ms"],
        "p99 ITL lower": run["p99_itl_ms"] < off["p99_itl_ms"],
        "p99.9 ITL >= 3x lower": run["p99.9_itl_ms"] * 3 <= off["p99.9_itl_ms"],
        "throughput >= 0.95x": run["output_throughput"] >= 0.95 * off["output_throughput"],
        "short TTFT <= 1.1x": run["short_ttft_ms"] <= 1.1 * off["short_ttft_ms"],
    }


def mix_verdict(off: dict, run: dict) -> dict[str, bool]:
    return {k: run[k] <= 1.05 * off[k] for k in MIX_KEYS if off.get(k) is not None}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cost-profile", required=True, help="from `chunkserve profile`")
    p.add_argument("--name", default="policy_frontier")
    p.add_argument("--seeds", type=int, default=3, help="noise seeds per configuration")
    p.add_argument("--noise", type=float, default=0.18, help="sd of the log step-time noise")
    p.add_argument("--noise-correlation", type=float, default=0.8)
    p.add_argument("--step-overhead-ms", type=float, default=2.0)
    p.add_argument("--num-blocks", type=int, default=20000)
    p.add_argument("--num-prompts", type=int, default=50)
    args = p.parse_args()

    from chunkserve.bench.datasets import WorkloadSpec, build_workload
    from chunkserve.engine.tokenizer import Tokenizer
    from chunkserve.model.loader import load_model_config, resolve_model
    from chunkserve.provenance import cpu_description, git_commit
    from chunkserve.scheduling.costmodel import CostModel

    model = CostModel.load(args.cost_profile)
    profile = json.loads(Path(args.cost_profile).read_text())
    source = resolve_model(None, weights=False)
    _, reader = load_model_config(source)
    tokenizer = Tokenizer.from_source(source, reader)
    workloads = [
        ("stall", rate, WorkloadSpec("stall", args.num_prompts, rate, long_interval=15.0))
        for rate in STALL_RATES
    ] + [("mix", rate, WorkloadSpec("mix", args.num_prompts, rate)) for rate in MIX_RATES]

    groups = []
    for workload, rate, spec in workloads:
        requests = build_workload(spec, tokenizer)
        rows = {}
        for name, kwargs in configs():
            runs = [run_one(requests, kwargs, model, args, seed) for seed in range(args.seeds)]
            rows[name] = median_of(runs)
        off = rows["off"]
        judge = stall_verdict if workload == "stall" else mix_verdict
        verdicts = {name: judge(off, row) for name, row in rows.items() if name != "off"}
        groups.append({"workload": workload, "rate": rate, "rows": rows, "verdicts": verdicts})
        print(f"{workload} {rate} req/s: done", flush=True)

    doc = {
        "machine": cpu_description(),
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "commit": git_commit(),
        "simulated": True,
        "cost_profile": {
            k: profile.get(k) for k in ("hardware", "dtype", "threads", "date", "commit")
        },
        "args": vars(args),
        "groups": groups,
    }
    out = RESULTS / args.name
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(doc, indent=1) + "\n")
    (out / "report.md").write_text(report(doc))
    print(report(doc))


def report(doc: dict) -> str:
    a, prof = doc["args"], doc["cost_profile"]
    lines = [
        "# The budget policies' frontier (simulated)",
        "",
        f"Simulated {doc['date']} on {doc['machine']}, commit {doc['commit']}, against the "
        f"cost profile `{a['cost_profile']}` ({prof['hardware']}, {prof['dtype']}, "
        f"{prof['threads']} thread(s), profiled {prof['date']}), step noise log-normal sd "
        f"{a['noise']}, step-to-step correlation {a['noise_correlation']}, "
        f"{a['step_overhead_ms']} ms serving overhead a step; each cell the median of "
        f"{a['seeds']} noise seeds. Workloads as in the served sweeps ({a['num_prompts']} "
        "requests; stall: documents every 15 s).",
        "",
        "Reproduce: `python benchmarks/policy_frontier.py --cost-profile "
        f"{a['cost_profile']} --name {a['name']}`",
        "",
        "## Targets met against chunking off",
        "",
        "Stall: the five targets of the stall-free issue at each rate; mix: the reported "
        "percentiles no worse than chunking off's (within 5%).",
        "",
    ]
    names = list(doc["groups"][0]["verdicts"])
    head = [f"{g['workload']} {g['rate']:g}" for g in doc["groups"]]
    lines += ["| config | " + " | ".join(head) + " |", "|---" * (len(head) + 1) + "|"]
    for name in names:
        cells = []
        for g in doc["groups"]:
            v = g["verdicts"][name]
            cells.append(f"{sum(v.values())}/{len(v)}")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines.append("")
    for g in doc["groups"]:
        lines += [
            f"## {g['workload']} at {g['rate']:g} req/s",
            "",
            "| config | ITL p50 | p90 | p99 | p99.9 | max | TTFT p50 | p90 | p99 | short | "
            "medium | long | out tok/s | misses |",
            "|---" * 14 + "|",
        ]
        for name, row in g["rows"].items():
            missed = [k for k, ok in g["verdicts"].get(name, {}).items() if not ok]
            cells = ["-" if row[k] is None else f"{row[k]:.0f}" for k in ROW_KEYS[:-1]] + [
                f"{row['output_throughput']:.1f}",
                ", ".join(missed) or "-",
            ]
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
