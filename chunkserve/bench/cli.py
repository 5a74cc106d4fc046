"""``chunkserve bench serve`` (load generator) and ``chunkserve bench sweep`` (one server per
configuration, same seeded workload, report and plots)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from chunkserve.cli import command
from chunkserve.provenance import git_commit


def add_workload_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("workload")
    g.add_argument(
        "--dataset", default="stall", choices=["random", "sharegpt", "stall", "fairness", "mix"]
    )
    g.add_argument("--dataset-path", default=None, help="ShareGPT JSON file (sharegpt)")
    g.add_argument(
        "--num-prompts",
        type=int,
        default=100,
        help="requests (stall/fairness: short requests; long ones are added)",
    )
    g.add_argument(
        "--request-rate",
        type=float,
        default=float("inf"),
        help="requests/s of the (short) stream; inf sends all at once",
    )
    g.add_argument(
        "--burstiness",
        type=float,
        default=1.0,
        help="1: Poisson arrivals; other values: gamma gaps of this shape",
    )
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--input-len", type=int, default=256, help="random: prompt tokens")
    g.add_argument("--output-len", type=int, default=128, help="random: output tokens")
    g.add_argument(
        "--range-ratio", type=float, default=0.0, help="random: lengths uniform in [(1-r)L, (1+r)L]"
    )
    g.add_argument(
        "--long-interval", type=float, default=10.0, help="stall: seconds between long documents"
    )
    g.add_argument(
        "--num-long",
        type=int,
        default=0,
        help="stall: long documents (default: enough to span the short arrivals; set it with "
        "--max-concurrency, where the shorts all arrive at once)",
    )
    g.add_argument(
        "--tokenizer-model",
        default=None,
        help="model file whose tokenizer builds prompts (default: embedded)",
    )


def workload_from_args(args: argparse.Namespace) -> tuple[list, Any]:
    from chunkserve.bench.datasets import WorkloadSpec, build_workload
    from chunkserve.model.loader import load_model_config, resolve_model
    from chunkserve.tokenizer import Tokenizer

    source = resolve_model(args.tokenizer_model, weights=False)
    _, reader = load_model_config(source)
    tokenizer = Tokenizer.from_source(source, reader)
    spec = WorkloadSpec(
        dataset=args.dataset,
        num_prompts=args.num_prompts,
        request_rate=args.request_rate,
        burstiness=args.burstiness,
        seed=args.seed,
        input_len=args.input_len,
        output_len=args.output_len,
        range_ratio=args.range_ratio,
        dataset_path=args.dataset_path,
        long_interval=args.long_interval,
        stall_num_long=args.num_long,
    )
    return build_workload(spec, tokenizer), spec


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
    from chunkserve.bench.sweep import add_sweep_args

    sweep = sub.add_parser("sweep", help="one server per configuration, same workload")
    add_sweep_args(sweep)


@command("bench", "benchmarks: load generator (serve) and budget sweeps (sweep)", _bench_args)
def _bench(args: argparse.Namespace) -> int:
    if args.bench_command == "sweep":
        from chunkserve.bench.sweep import run_sweep

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
