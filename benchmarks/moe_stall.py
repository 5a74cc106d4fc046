"""Issue 41's stall target on the MoE model, measured so that one pair of runs cannot decide
it: defaults vs chunking off, max ITL >= 5x lower at >= 0.95x output throughput.

Why (benchmarks/results/moe_stall.json, three single pairs on the shared 2-core machine:
15.5x, 1.2x, and a failed run): the stall workload's worst gap is one event, the step that
holds every decode while a long document prefills (its five largest gaps are the same
event seen by five requests), so a run's max ITL is the duration of its single slowest
step. The same seeded workload's off runs gave 3.96 s, 13.3 s and 4.91 s for that step:
3.4x apart with nothing changed but the machine's load (two CPU hogs and other jobs, load
average 7-11 on 2 cores, where a 1-thread server's share of a core varies that much). A
ratio of two such maxima measured minutes apart is a ratio of two load samples. (The 15.5x
and 1.2x pairs also differed in configuration: with and without a cost profile.)

So: ``--rounds`` rounds of (off, defaults) back to back, the order alternating (off first,
then defaults first: ABBA, so a drift in load does not favour one side), each round's ratios
taken within the round, and the verdict from the median over rounds, with every round's
ratios, the p99.9 ITL ratio (less a single-event statistic) and the 1-minute load average
before each run recorded beside it.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/moe_stall.py --rounds 3 --threads 1

Each run is ``chunkserve bench sweep`` with one configuration (its folder under
``--results-dir``/round<i>/); writes ``summary.json`` and ``report.md`` there.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from datetime import datetime, timezone
from pathlib import Path

TARGET_MAX_ITL_RATIO = 5.0
TARGET_THROUGHPUT_RATIO = 0.95


def write_model(out: Path) -> Path:
    """The tiny random Mixtral of moe_stall.json (hidden 512, 4 layers, 8 experts of 1024
    columns, top 2), written as benchmarks/moe_decode.py writes it."""
    sys.path.insert(0, str(Path(__file__).parent))
    from moe_decode import write_model_dir

    shape = argparse.Namespace(hidden=512, layers=4, experts=8, top_k=2, expert_inter=1024)
    return write_model_dir(out, shape, dense=False)


def run_one(config: str, out_dir: Path, model: Path, a: argparse.Namespace) -> dict:
    server_args = f"--model {model} --load-format dummy --dtype float32 {a.server_args}".strip()
    cmd = [
        sys.executable, "-m", "chunkserve", "bench", "sweep",
        "--results-dir", str(out_dir), "--name", config, "--budgets", "",
        "--no-defaults" if config == "off" else "--no-baseline",
        "--dataset", "stall", "--num-prompts", str(a.num_prompts),
        "--request-rates", str(a.request_rate), "--long-interval", str(a.long_interval),
        "--threads", str(a.threads), "--max-duration", str(a.max_duration),
        "--server-args", server_args,
    ]  # fmt: skip
    load = os.getloadavg()[0]
    subprocess.run(cmd, check=True, env={**os.environ, "OMP_NUM_THREADS": str(a.threads)})
    run = json.loads((out_dir / config / "results.json").read_text())["runs"][0]
    keys = ("max_itl_ms", "p99.9_itl_ms", "p99_itl_ms", "median_itl_ms", "output_throughput")
    return {"load_avg_1m_before": round(load, 2), **{k: run[k] for k in keys},
            "completed": run["completed"], "failed": run["failed"]}  # fmt: skip


def summarize(rounds: list[dict]) -> dict:
    def ratios(key: str, invert: bool = False) -> list[float]:
        out = []
        for r in rounds:
            off, on = r["off"][key], r["defaults"][key]
            out.append(on / off if invert else off / on)
        return out

    table = {
        "max_itl_ratio": ratios("max_itl_ms"),
        "p99.9_itl_ratio": ratios("p99.9_itl_ms"),
        "throughput_ratio": ratios("output_throughput", invert=True),
    }
    summary = {
        k: {"median": statistics.median(v), "min": min(v), "max": max(v), "rounds": v}
        for k, v in table.items()
    }
    failed = sum(r[c]["failed"] for r in rounds for c in ("off", "defaults"))
    met = (
        summary["max_itl_ratio"]["median"] >= TARGET_MAX_ITL_RATIO
        and summary["throughput_ratio"]["median"] >= TARGET_THROUGHPUT_RATIO
        and failed == 0
    )
    summary["failed_requests"] = failed
    summary["verdict"] = (
        f"{'met' if met else 'NOT met'} by the medians over {len(rounds)} interleaved rounds "
        f"(max ITL {summary['max_itl_ratio']['median']:.2f}x lower, target >= "
        f"{TARGET_MAX_ITL_RATIO}x; throughput {summary['throughput_ratio']['median']:.3f}x, "
        f"target >= {TARGET_THROUGHPUT_RATIO}x; {failed} failed requests)"
    )
    return summary


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--num-prompts", type=int, default=40)
    p.add_argument("--request-rate", type=float, default=0.25)
    p.add_argument("--long-interval", type=float, default=15.0)
    p.add_argument("--max-duration", type=float, default=900.0)
    p.add_argument("--server-args", default="", help="more flags for both servers")
    p.add_argument("--results-dir", default="benchmarks/results/moe_stall_rounds")
    a = p.parse_args()
    out = Path(a.results_dir)
    out.mkdir(parents=True, exist_ok=True)
    model = write_model(Path(tempfile.mkdtemp(prefix="moe-stall-")) / "moe-tiny")
    rounds: list[dict] = []
    for i in range(a.rounds):
        order = ("off", "defaults") if i % 2 == 0 else ("defaults", "off")
        rnd: dict = {"order": list(order)}
        for config in order:
            rnd[config] = run_one(config, out / f"round{i}", model, a)
        rounds.append(rnd)
        doc = {
            "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "command": " ".join(sys.argv),
            "machine": f"{os.cpu_count()} cores, load averages per run below (~1 or less: quiet)",
            "rounds": rounds,
            "summary": summarize(rounds),
        }
        (out / "summary.json").write_text(json.dumps(doc, indent=1) + "\n")
        print(json.dumps(doc["summary"], indent=1), flush=True)
    s = doc["summary"]
    lines = [
        "# MoE stall target, interleaved rounds (defaults vs chunking off)",
        "",
        f"{doc['date']}, {doc['machine']}; `{doc['command']}`",
        "",
        "| round | order | load before off / defaults | off max ITL ms | defaults max ITL ms "
        "| max ITL ratio | p99.9 ratio | throughput ratio | failed |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for i, r in enumerate(rounds):
        lines.append(
            f"| {i} | {' then '.join(r['order'])} | {r['off']['load_avg_1m_before']} / "
            f"{r['defaults']['load_avg_1m_before']} | {r['off']['max_itl_ms']:.0f} | "
            f"{r['defaults']['max_itl_ms']:.0f} | {s['max_itl_ratio']['rounds'][i]:.2f} | "
            f"{s['p99.9_itl_ratio']['rounds'][i]:.2f} | {s['throughput_ratio']['rounds'][i]:.3f} "
            f"| {r['off']['failed'] + r['defaults']['failed']} |"
        )
    lines += ["", f"Verdict: {s['verdict']}."]
    (out / "report.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
