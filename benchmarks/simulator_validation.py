"""Validate ``chunkserve simulate`` against real ``bench serve`` runs on this machine.

For each budget: start ``chunkserve serve`` (1 torch thread, the load generator on the other
core), run the seeded stall workload and read the server's mean gap between steps (its
serving-loop work, ``chunkserve:step_gap_seconds``); then simulate the same workload with the
same scheduler configuration and the cost-model profile of this machine, each step charged
the gap measured in the *other* budgets' runs (and once more with no overhead, the engine
alone); compare p50/p99 TTFT and ITL. Writes ``benchmarks/results/simulator_validation.{md,json}``.

    chunkserve profile --num-threads 1 --output benchmarks/results/profile_cpu_t1.json
    python benchmarks/simulator_validation.py --cost-profile benchmarks/results/profile_cpu_t1.json
"""

from __future__ import annotations

import argparse
import json
import sys
from datetime import datetime, timezone
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
METRICS = ("median_ttft_ms", "p99_ttft_ms", "median_itl_ms", "p99_itl_ms")
TOLERANCE = 0.20


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--cost-profile", required=True)
    p.add_argument("--budgets", default="64,256")
    p.add_argument("--num-prompts", type=int, default=50)
    p.add_argument("--request-rate", type=float, default=0.7)
    p.add_argument("--long-interval", type=float, default=5.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--name", default="simulator_validation")
    p.add_argument(
        "--render", action="store_true", help="only rewrite NAME.md from NAME.json (no runs)"
    )
    args = p.parse_args()
    if args.render:
        doc = json.loads((RESULTS / f"{args.name}.json").read_text())
        (RESULTS / f"{args.name}.md").write_text(report(doc["meta"], doc["rows"]))
        return

    from chunkserve.bench.datasets import WorkloadSpec, build_workload
    from chunkserve.bench.loadgen import run, summarize
    from chunkserve.bench.sweep import ServerProcess, machine_description
    from chunkserve.config import EngineConfig
    from chunkserve.costmodel import CostModel
    from chunkserve.model.loader import load_model_config, resolve_model
    from chunkserve.simulate import simulate
    from chunkserve.tokenizer import Tokenizer

    model = CostModel.load(args.cost_profile)
    source = resolve_model(None)
    mc, reader = load_model_config(source)
    tokenizer = Tokenizer.from_source(source, reader)
    spec = WorkloadSpec(
        dataset="stall",
        num_prompts=args.num_prompts,
        request_rate=args.request_rate,
        long_interval=args.long_interval,
        seed=args.seed,
    )
    requests = build_workload(spec, tokenizer)
    per_block = mc.kv_bytes_per_token(2) * 16  # bf16, block 16: the server's defaults
    num_blocks = (1 << 30) // per_block - 1
    rows = []
    logs = RESULTS / args.name
    logs.mkdir(parents=True, exist_ok=True)
    budgets = [int(b) for b in args.budgets.split(",")]
    real_runs = {}
    for budget in budgets:
        cmd = [
            sys.executable,
            "-m",
            "chunkserve",
            "serve",
            "--num-threads",
            str(args.threads),
            "--max-num-batched-tokens",
            str(budget),
            "--log-level",
            "warning",
        ]
        print(f"== budget {budget}: real server", flush=True)
        server = ServerProcess(cmd, logs / f"budget-{budget}.log")
        try:
            server.wait_healthy()
            records, duration = run(server.base_url + "/v1", requests, progress=False)
            gap = mean_step_gap(server.base_url + "/metrics")
        finally:
            server.stop()
        real_runs[budget] = (summarize(records, duration), gap)
        print(f"   mean serving-loop gap between steps: {1e3 * gap:.1f} ms", flush=True)

    for budget in budgets:
        real, _ = real_runs[budget]
        # The serving overhead is measured in the *other* budgets' runs (not this one), so
        # the comparison stays out of sample.
        others = [g for b, (_, g) in real_runs.items() if b != budget] or [real_runs[budget][1]]
        overhead = sum(others) / len(others)
        config = EngineConfig(max_num_batched_tokens=budget).scheduler_config(
            mc.max_position_embeddings
        )
        print(f"== budget {budget}: simulation", flush=True)
        sims = {}
        for name, step_overhead in (("engine_only", 0.0), ("with_overhead", overhead)):
            sim_records, sim_duration, info = simulate(
                requests, config, num_blocks, model, seed=args.seed, step_overhead_s=step_overhead
            )
            sims[name] = summarize(sim_records, sim_duration)
        sim = sims["with_overhead"]
        row = {
            "budget": budget,
            "step_overhead_ms": 1e3 * overhead,
            "own_run_gap_ms": 1e3 * real_runs[budget][1],
            "real": {m: real[m] for m in METRICS},
            "simulated": {m: sim[m] for m in METRICS},
            "rel_error": {m: (sim[m] - real[m]) / real[m] for m in METRICS},
            "simulated_engine_only": {m: sims["engine_only"][m] for m in METRICS},
            "rel_error_engine_only": {
                m: (sims["engine_only"][m] - real[m]) / real[m] for m in METRICS
            },
            "real_failed": real["failed"],
            "sim_steps": info["steps"],
        }
        print(json.dumps(row, indent=1), flush=True)
        rows.append(row)
    meta = {
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": machine_description(),
        "threads": args.threads,
        "profile": args.cost_profile,
        "profile_meta": model.meta.get("fit"),
        "workload": vars(spec),
        "command": "python benchmarks/simulator_validation.py " + " ".join(sys.argv[1:]),
    }
    (RESULTS / f"{args.name}.json").write_text(
        json.dumps({"meta": meta, "rows": rows}, indent=1, default=str)
    )
    text = report(meta, rows)
    (RESULTS / f"{args.name}.md").write_text(text)
    print(text)


def report(meta: dict, rows: list[dict]) -> str:
    """The markdown report of one validation run (``--render NAME`` redoes it from the JSON)."""
    w = meta["workload"]
    lines = [
        "# Simulator against the real server",
        "",
        f"{meta['date']}, {meta['machine']}; server with {meta['threads']} torch thread(s), "
        f"load generator on the same machine. Workload: {w['dataset']}, {w['num_prompts']} "
        f"short requests at {w['request_rate']} req/s, long documents every "
        f"{w['long_interval']} s, seed {w['seed']}. Cost model: `{meta['profile']}`.",
        "",
        f"Reproduce: `{meta['command']}`",
        "",
        "Simulated with the serving loop's per-step overhead (the mean "
        "`chunkserve:step_gap_seconds` measured in the other budgets' real runs, so each row "
        "is out of sample), and without it (the engine alone).",
        "",
        "| budget | metric | real ms | simulated ms | error | engine-only sim ms | error |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        for m in METRICS:
            lines.append(
                f"| {row['budget']} | {m.removesuffix('_ms')} | {row['real'][m]:.0f} | "
                f"{row['simulated'][m]:.0f} | {100 * row['rel_error'][m]:+.0f}% | "
                f"{row['simulated_engine_only'][m]:.0f} | "
                f"{100 * row['rel_error_engine_only'][m]:+.0f}% |"
            )
    lines.append("")
    for row in rows:
        worst = max(abs(e) for e in row["rel_error"].values())
        lines.append(
            f"- budget {row['budget']}: largest error {100 * worst:.0f}% "
            f"({'within' if worst <= TOLERANCE else 'NOT within'} {100 * TOLERANCE:.0f}%); "
            f"overhead used {row['step_overhead_ms']:.1f} ms/step (its own run measured "
            f"{row['own_run_gap_ms']:.1f} ms)"
        )
    within = [
        row["budget"] for row in rows if max(abs(e) for e in row["rel_error"].values()) <= TOLERANCE
    ]
    lines += [
        "",
        f"Budgets with all four metrics within {100 * TOLERANCE:.0f}%: "
        f"{', '.join(map(str, within)) or 'none'} (target: at least two).",
    ]
    return "\n".join(lines) + "\n"


def mean_step_gap(metrics_url: str) -> float:
    """Mean of the server's ``chunkserve:step_gap_seconds`` histogram (seconds)."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(metrics_url, timeout=10).text
    total = count = 0.0
    for family in text_string_to_metric_families(text):
        if family.name != "chunkserve:step_gap_seconds":
            continue
        for sample in family.samples:
            if sample.name.endswith("_sum"):
                total += sample.value
            elif sample.name.endswith("_count"):
                count += sample.value
    if not count:
        raise RuntimeError("server reported no step gaps")
    return total / count


if __name__ == "__main__":
    main()
