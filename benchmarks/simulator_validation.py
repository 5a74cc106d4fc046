"""Validate ``chunkserve simulate`` against real ``bench serve`` runs on this machine.

For each budget: start ``chunkserve serve`` (1 torch thread, the load generator on the other
core, the profile loaded so it predicts each step), run the seeded stall workload and read two
server metrics: the mean gap between steps (its serving-loop work,
``chunkserve:step_gap_seconds``) and the mean measured/predicted step time
(``chunkserve:step_time_over_predicted``: how much slower the served steps run than the
profiled shapes). Then simulate the same workload with the same scheduler configuration and
the profile, each step scaled and charged by what the *other* budgets' runs measured (out of
sample); also with the profile as it is (overhead only) and with neither (the engine alone).
Compare p50/p99 TTFT and ITL. Writes ``benchmarks/results/simulator_validation.{md,json}``.

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
VARIANTS = ("calibrated", "one_scale", "profile_only", "engine_only")


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
        if not all("rel_error_calibrated" in row for row in doc["rows"]):
            raise SystemExit(f"{args.name}.json predates the calibrated simulation: re-run it")
        (RESULTS / f"{args.name}.md").write_text(report(doc["meta"], doc["rows"]))
        return

    import httpx

    from chunkserve import provenance
    from chunkserve.bench.datasets import WorkloadSpec, build_workload
    from chunkserve.bench.loadgen import run, summarize
    from chunkserve.bench.sweep import ServerProcess, machine_description
    from chunkserve.config import EngineConfig
    from chunkserve.engine.tokenizer import Tokenizer
    from chunkserve.model.loader import load_model_config, resolve_model
    from chunkserve.scheduling.costmodel import CostModel
    from chunkserve.tuning.simulate import simulate

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
            "--cost-profile",
            args.cost_profile,
        ]
        print(f"== budget {budget}: real server", flush=True)
        server = ServerProcess(cmd, logs / f"budget-{budget}.log")
        try:
            server.wait_healthy()
            records, duration = run(server.base_url + "/v1", requests, progress=False)
            text = httpx.get(server.base_url + "/metrics", timeout=10).text
        finally:
            server.stop()
        gaps = histogram_totals(text, "chunkserve:step_gap_seconds")
        ratios = histogram_totals(text, "chunkserve:step_time_over_predicted", by="kind")
        real_runs[budget] = (summarize(records, duration), gaps, ratios)
        print(
            f"   mean serving-loop gap between steps: {1e3 * pooled_mean([gaps]):.1f} ms; "
            "steps over the profile's prediction: "
            + ", ".join(f"{k} {pooled_mean([ratios], k):.3f}" for k in sorted(ratios)),
            flush=True,
        )

    for budget in budgets:
        real, own_gaps, own_ratios = real_runs[budget]
        # The serving overhead and the step-time scales are measured in the *other* budgets'
        # runs (not this one), pooled over their steps, so the comparison stays out of sample.
        others = [v for b, v in real_runs.items() if b != budget] or [real_runs[budget]]
        overhead = pooled_mean([v[1] for v in others])
        other_ratios = [v[2] for v in others]
        kinds = sorted(set().union(*other_ratios))
        scale_by_kind = {k: pooled_mean(other_ratios, k) for k in kinds}
        scale = pooled_mean(other_ratios)
        config = EngineConfig(max_num_batched_tokens=budget).scheduler_config(
            mc.max_position_embeddings
        )
        print(f"== budget {budget}: simulation", flush=True)
        sims, steps = {}, {}
        variants = {
            "calibrated": (overhead, scale_by_kind),
            "one_scale": (overhead, scale),
            "profile_only": (overhead, 1.0),
            "engine_only": (0.0, 1.0),
        }
        for name, (step_overhead, cost_scale) in variants.items():
            sim_records, sim_duration, info = simulate(
                requests,
                config,
                num_blocks,
                model,
                seed=args.seed,
                step_overhead_s=step_overhead,
                cost_scale=cost_scale,
            )
            sims[name] = summarize(sim_records, sim_duration)
            steps[name] = info["steps"]
        row = {
            "budget": budget,
            "step_overhead_ms": 1e3 * overhead,
            "cost_scale": scale_by_kind,
            "one_scale": scale,
            "own_run_gap_ms": 1e3 * pooled_mean([own_gaps]),
            "own_run_ratio": {k: pooled_mean([own_ratios], k) for k in sorted(own_ratios)},
            "real": {m: real[m] for m in METRICS},
            "real_failed": real["failed"],
            "sim_steps": steps["calibrated"],
        }
        for name in variants:
            row[name] = {m: sims[name][m] for m in METRICS}
            row[f"rel_error_{name}"] = {m: (sims[name][m] - real[m]) / real[m] for m in METRICS}
        print(json.dumps(row, indent=1), flush=True)
        rows.append(row)
    meta = {
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": machine_description(),
        "commit": provenance.git_commit(),
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
        "Calibrated: each simulated step is the profile's prediction times the mean "
        "`chunkserve:step_time_over_predicted` of its kind (decode, mixed, prefill), plus the "
        "mean `chunkserve:step_gap_seconds` (the serving loop's work between steps), both "
        "measured in the *other* budgets' real runs (pooled over their steps), so each row is "
        "out of sample. One scale: one factor for every step kind. Profile only: the overhead "
        "but no scale. Engine only: neither.",
        "",
        "| budget | metric | real ms | "
        + " | ".join(f"{v.replace('_', '-')} sim ms | error" for v in VARIANTS)
        + " |",
        "|---|---|---|" + "---|---|" * len(VARIANTS),
    ]
    for row in rows:
        for m in METRICS:
            cells = [f"{row['budget']}", m.removesuffix("_ms"), f"{row['real'][m]:.0f}"]
            for name in VARIANTS:
                cells += [f"{row[name][m]:.0f}", f"{100 * row[f'rel_error_{name}'][m]:+.0f}%"]
            lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    for row in rows:
        worst = _worst(row, "calibrated")
        lines.append(
            f"- budget {row['budget']}: largest calibrated error {100 * worst:.0f}% "
            f"({'within' if worst <= TOLERANCE else 'NOT within'} {100 * TOLERANCE:.0f}%; "
            f"one scale: {100 * _worst(row, 'one_scale'):.0f}%, profile only: "
            f"{100 * _worst(row, 'profile_only'):.0f}%); scales used {_kinds(row['cost_scale'])} "
            f"(its own run measured {_kinds(row['own_run_ratio'])}), "
            f"overhead used {row['step_overhead_ms']:.1f} ms/step (its own run measured "
            f"{row['own_run_gap_ms']:.1f} ms)"
        )
    lines.append("")
    for name in VARIANTS:
        within = [row["budget"] for row in rows if _worst(row, name) <= TOLERANCE]
        lines.append(
            f"Budgets with all four metrics within {100 * TOLERANCE:.0f}%, "
            f"{name.replace('_', ' ')}: {', '.join(map(str, within)) or 'none'}"
            + (" (target: at least two)." if name == "calibrated" else ".")
        )
        lines.append("")
    return "\n".join(lines)


def _kinds(scales: dict[str, float]) -> str:
    return ", ".join(f"{k} {v:.3f}" for k, v in sorted(scales.items()))


def _worst(row: dict, variant: str) -> float:
    return max(abs(e) for e in row[f"rel_error_{variant}"].values())


def histogram_totals(
    text: str, name: str, by: str | None = None
) -> dict[str | None, tuple[float, float]]:
    """``(sum, count)`` of the histogram ``name`` in a Prometheus exposition, per value of the
    label ``by`` (or under ``None``, all series together)."""
    from prometheus_client.parser import text_string_to_metric_families

    totals: dict[str | None, list[float]] = {}
    for family in text_string_to_metric_families(text):
        if family.name != name:
            continue
        for sample in family.samples:
            key = sample.labels.get(by) if by else None
            slot = totals.setdefault(key, [0.0, 0.0])
            if sample.name.endswith("_sum"):
                slot[0] += sample.value
            elif sample.name.endswith("_count"):
                slot[1] += sample.value
    result = {k: (v[0], v[1]) for k, v in totals.items() if v[1]}
    if not result:
        raise RuntimeError(f"server reported no samples of {name}")
    return result


def pooled_mean(runs: list[dict], key: str | None = "*") -> float:
    """Mean over the steps of several runs' ``histogram_totals``: of one key, or ("*") all."""
    pairs = [t for run in runs for k, t in run.items() if key == "*" or k == key]
    count = sum(c for _, c in pairs)
    if not count:
        raise RuntimeError(f"no samples of {key!r} in the runs")
    return sum(s for s, _ in pairs) / count


if __name__ == "__main__":
    main()
