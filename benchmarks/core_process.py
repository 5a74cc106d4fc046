"""The engine core in its own process: what serving costs against the engine alone, what data
parallelism buys, and what the process boundary costs per step.

1. **Served vs in process.** The same seeded workload, fed to an in-process ``Engine`` at the
   requests' arrival times (``chunkserve.bench.replay``) and sent to ``chunkserve serve`` over
   HTTP (the load generator): the core in its own process (the default) and on a thread of
   the server's process (``--no-core-process``, as before). Two workloads: the stall
   workload (short chats at a Poisson rate, long documents every ``--long-interval`` s) and
   32 concurrent streams. p50 and p99 ITL, served over in-process.
2. **Data parallel.** A decode-heavy load of 64 concurrent requests against two cores of one
   thread each (``--data-parallel-size 2 --num-threads 1``) and against one core of two
   threads: output tokens per second.
3. **The boundary's cost.** A step's report for 64 running requests (token ids, statistics),
   encoded, sent over the same ZeroMQ IPC socket pair and decoded, timed over many rounds,
   against the mean decode step with 64 requests running in process.

    python benchmarks/core_process.py --out-dir benchmarks/results/core_process

Writes ``results.json`` and ``report.md`` there, with the machine, date and commit.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import zmq

from chunkserve.bench.datasets import WorkloadSpec, build_workload
from chunkserve.bench.loadgen import run as run_load
from chunkserve.bench.loadgen import summarize
from chunkserve.bench.replay import replay
from chunkserve.bench.sweep import ServerProcess, machine_description
from chunkserve.engine.core import CoreLoad, CoreOutput
from chunkserve.engine.core_process import StepReport, encoder, report_decoder
from chunkserve.engine.engine import Engine
from chunkserve.engine.step_log import StepStats
from chunkserve.engine.tokenizer import Tokenizer
from chunkserve.model.loader import load_model_config, resolve_model
from chunkserve.provenance import git_commit
from chunkserve.scheduling.sampling_params import SamplingParams

KEYS = ("median_itl_ms", "p99_itl_ms", "max_itl_ms", "median_ttft_ms", "output_throughput")


def summary(records, duration) -> dict:
    s = summarize(records, duration)
    return {k: s[k] for k in (*KEYS, "completed", "failed")}


def served(args, workload, log: Path, extra: list[str], max_concurrency=None) -> dict:
    cmd = [sys.executable, "-m", "chunkserve", "serve", "--log-level", "warning", *extra]
    server = ServerProcess(cmd, log)
    try:
        server.wait_healthy()
        records, duration = run_load(
            server.base_url + "/v1",
            workload,
            max_concurrency=max_concurrency,
            max_duration=args.max_duration,
            progress=False,
        )
    finally:
        server.stop()
    return summary(records, duration)


def in_process(args, workload, threads: int, max_concurrency=None) -> dict:
    engine = Engine(num_threads=threads, log_stats_interval=10**9)
    try:
        records, duration = replay(
            engine, workload, max_concurrency=max_concurrency, max_duration=args.max_duration
        )
    finally:
        del engine
        gc.collect()
    return summary(records, duration)


def compare(args, name: str, workload, out_dir: Path, max_concurrency=None) -> dict:
    t = str(args.threads)
    rows = {
        "in process": in_process(args, workload, args.threads, max_concurrency),
        "served, core process": served(
            args, workload, out_dir / f"{name}_process.log", ["--num-threads", t], max_concurrency
        ),
        "served, core thread": served(
            args,
            workload,
            out_dir / f"{name}_thread.log",
            ["--num-threads", t, "--no-core-process"],
            max_concurrency,
        ),
    }
    for label, row in rows.items():
        print(f"  {name} / {label}: " + ", ".join(f"{k} {row[k]:.1f}" for k in KEYS), flush=True)
    return rows


def boundary_cost(rounds: int = 2000, batch: int = 64) -> dict:
    """Seconds to encode, send, receive and decode one step's report of ``batch`` decodes
    (the core's work and the front end's, one after the other on this thread)."""
    stats = StepStats(
        1, "decode", 0, 0, 0, batch, 0, 0, batch, 0, 0.5, batch, 1e-4, 0.05, 1e-3, 0.05
    )
    outputs = [
        CoreOutput(f"cmpl-{i:08x}-0", [1000 + i], None, None, None, 0, None) for i in range(batch)
    ]
    report = StepReport(0, outputs, stats, CoreLoad(batch, 0, 500))
    enc, dec = encoder(), report_decoder()
    ctx = zmq.Context()
    with tempfile.TemporaryDirectory() as tmp:
        pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
        pull.bind(f"ipc://{tmp}/b")
        push.connect(f"ipc://{tmp}/b")
        for _ in range(50):
            push.send(enc.encode(report))
            dec.decode(pull.recv())
        t0 = time.perf_counter()
        for _ in range(rounds):
            push.send(enc.encode(report))
            got = dec.decode(pull.recv())
        per_round = (time.perf_counter() - t0) / rounds
        push.close(linger=0)
        pull.close(linger=0)
    ctx.term()
    assert len(got.outputs) == batch
    return {"seconds": per_round, "bytes": len(enc.encode(report))}


def decode_step_time(threads: int, batch: int = 64, steps: int = 30) -> float:
    """Mean in-process decode step with ``batch`` requests running (all prefilled first)."""
    engine = Engine(num_threads=threads, log_stats_interval=10**9)
    times: list[float] = []

    def record(s) -> None:
        if s.kind == "decode" and s.num_decode_tokens == batch:
            times.append(s.wall_time)

    engine.step_listeners.append(record)
    params = SamplingParams(max_tokens=1000, temperature=0.0, ignore_eos=True)
    ids = [
        engine.add_request(prompt_token_ids=[100 + i] * 32, sampling_params=params)
        for i in range(batch)
    ]
    while len(times) < steps:
        engine.step()
    for rid in ids:
        engine.abort_request(rid)
    return statistics.fmean(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=1, help="torch threads of the engine")
    ap.add_argument("--num-prompts", type=int, default=50, help="stall workload: short ones")
    ap.add_argument("--request-rate", type=float, default=0.4)
    ap.add_argument("--long-interval", type=float, default=15.0)
    ap.add_argument("--streams", type=int, default=32)
    ap.add_argument("--dp-requests", type=int, default=64, help="concurrent decode requests")
    ap.add_argument("--max-duration", type=float, default=900.0)
    ap.add_argument("--out-dir", default="benchmarks/results/core_process")
    ap.add_argument("--skip", default="", help="comma list of: stall,streams,dp,boundary")
    args = ap.parse_args()
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    skip = set(filter(None, args.skip.split(",")))
    source = resolve_model(None)
    tok = Tokenizer.from_source(source, load_model_config(source)[1], None)
    doc: dict = {
        "benchmark": "engine core in its own process",
        "machine": machine_description(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "commit": git_commit(),
        "args": vars(args),
    }
    if "stall" not in skip:
        spec = WorkloadSpec(
            dataset="stall",
            num_prompts=args.num_prompts,
            request_rate=args.request_rate,
            long_interval=args.long_interval,
        )
        print("stall workload", flush=True)
        doc["stall"] = compare(args, "stall", build_workload(spec, tok), out_dir)
    if "streams" not in skip:
        spec = WorkloadSpec(
            dataset="random", num_prompts=2 * args.streams, input_len=128, output_len=128
        )
        print(f"{args.streams} concurrent streams", flush=True)
        doc["streams"] = compare(
            args, "streams", build_workload(spec, tok), out_dir, max_concurrency=args.streams
        )
    if "dp" not in skip:
        n = args.dp_requests
        spec = WorkloadSpec(dataset="random", num_prompts=2 * n, input_len=32, output_len=256)
        workload = build_workload(spec, tok)
        print(f"data parallel: {n} concurrent decode-heavy requests", flush=True)
        doc["dp"] = {
            "2 cores x 1 thread": served(
                args,
                workload,
                out_dir / "dp2.log",
                ["--data-parallel-size", "2", "--num-threads", "1"],
                n,
            ),
            "1 core x 2 threads": served(
                args, workload, out_dir / "dp1.log", ["--num-threads", "2"], n
            ),
        }
        for label, row in doc["dp"].items():
            print(f"  {label}: {row['output_throughput']:.1f} output tok/s", flush=True)
    if "boundary" not in skip:
        cost = boundary_cost()
        step = decode_step_time(args.threads)
        doc["boundary"] = {**cost, "decode_step_s": step, "share": cost["seconds"] / step}
        print(
            f"boundary: {1e6 * cost['seconds']:.0f} us per 64-request report "
            f"({cost['bytes']} bytes) vs a {1e3 * step:.1f} ms decode step: "
            f"{100 * cost['seconds'] / step:.2f}%",
            flush=True,
        )
    (out_dir / "results.json").write_text(json.dumps(doc, indent=1))
    (out_dir / "report.md").write_text(report(doc))
    print(f"wrote {out_dir}/results.json and report.md")


def report(doc: dict) -> str:
    a = doc["args"]
    lines = [
        "# The engine core in its own process",
        "",
        f"Measured {doc['date']} on {doc['machine']}; commit {doc['commit']}. Engine: "
        f"{a['threads']} torch thread(s), defaults otherwise; the load generator on the same "
        "machine.",
        "",
        "Reproduce: `python benchmarks/core_process.py` (see its docstring).",
    ]
    for name, title in (
        (
            "stall",
            f"Stall workload ({a['num_prompts']} short at {a['request_rate']} req/s, "
            f"long documents every {a['long_interval']} s)",
        ),
        ("streams", f"{a['streams']} concurrent streams (128 in, 128 out)"),
    ):
        rows = doc.get(name)
        if not rows:
            continue
        base = rows["in process"]
        lines += [
            "",
            f"## {title}",
            "",
            "| config | p50 ITL ms | p99 ITL ms | max ITL ms | median TTFT ms | output tok/s "
            "| p50 / in process | p99 / in process |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for label, r in rows.items():
            lines.append(
                f"| {label} | {r['median_itl_ms']:.1f} | {r['p99_itl_ms']:.1f} | "
                f"{r['max_itl_ms']:.1f} | {r['median_ttft_ms']:.0f} | "
                f"{r['output_throughput']:.1f} | "
                f"{r['median_itl_ms'] / base['median_itl_ms']:.2f} | "
                f"{r['p99_itl_ms'] / base['p99_itl_ms']:.2f} |"
            )
    if doc.get("dp"):
        lines += [
            "",
            f"## Data parallel ({a['dp_requests']} concurrent requests, 32 in, 256 out)",
            "",
            "| config | output tok/s | p50 ITL ms | p99 ITL ms |",
            "|---|---|---|---|",
        ]
        for label, r in doc["dp"].items():
            lines.append(
                f"| {label} | {r['output_throughput']:.1f} | {r['median_itl_ms']:.1f} | "
                f"{r['p99_itl_ms']:.1f} |"
            )
    if doc.get("boundary"):
        b = doc["boundary"]
        lines += [
            "",
            "## The boundary's cost per step",
            "",
            f"One step's report for 64 running requests ({b['bytes']} bytes): encode, send, "
            f"receive, decode {1e6 * b['seconds']:.0f} us, against a "
            f"{1e3 * b['decode_step_s']:.1f} ms decode step at 64 requests in process: "
            f"**{100 * b['share']:.2f}%** of the step (target: under 2%).",
        ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
