"""``chunkserve bench serve`` (load generator) and ``chunkserve bench sweep`` (one server per
configuration, same seeded workload, report and plots)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from chunkserve.bench.args import add_workload_args, workload_from_args
from chunkserve.bench.sweep import add_sweep_args, run_sweep
from chunkserve.provenance import git_commit


def _serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    p.add_argument("--endpoint", default="completions", choices=["completions", "chat"])
    p.add_argument("--model", default=None, help="model name to send (default: none)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument(
        "--max-duration", type=float, default=1800.0, help="stop waiting after this many seconds"
    )
    p.add_argument(
        "--goodput",
        nargs="*",
        default=None,
        metavar="KEY:MS",
        help="SLOs for goodput: ttft:MS tpot:MS itl:MS (worst gap) e2el:MS",
    )
    p.add_argument("--result-json", default=None, help="write the full result here")
    p.add_argument("--no-progress", action="store_true")
    add_workload_args(p)


def _bench_args(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="bench_command", required=True)
    serve = sub.add_parser("serve", help="run a streaming workload against a server")
    _serve_args(serve)
    sweep = sub.add_parser("sweep", help="one server per configuration, same workload")
    add_sweep_args(sweep)


def _bench(args: argparse.Namespace) -> int:
    if args.bench_command == "sweep":
        return run_sweep(args)
    return bench_serve(args)


def bench_serve(args: argparse.Namespace) -> int:
    from chunkserve.bench.loadgen import GoodputSLO, format_summary, result_document, run

    slo = GoodputSLO.parse(args.goodput)
    requests, spec = workload_from_args(args)
    records, duration = run(
        args.base_url,
        requests,
        endpoint=args.endpoint,
        model=args.model,
        max_concurrency=args.max_concurrency,
        max_duration=args.max_duration,
        progress=not args.no_progress,
        api_key=args.api_key,
    )
    result = result_document(records, duration, slo)
    print(format_summary(result))
    for kind, r in result["by_kind"].items():
        print(format_summary(r, f"{kind} requests"))
    errors = [r.error for r in records if r.error]
    if errors:
        print(f"{len(errors)} failed; first error: {errors[0]}")
    if args.result_json:
        out = {
            "base_url": args.base_url,
            "endpoint": args.endpoint,
            "commit": git_commit(),
            "workload": vars(spec),
            **result,
        }
        Path(args.result_json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.result_json).write_text(json.dumps(out, indent=1, default=str))
    return 0 if not errors else 1
