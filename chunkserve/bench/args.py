"""The workload flags shared by ``chunkserve bench serve``, ``chunkserve bench sweep`` and
``chunkserve simulate``, and the workload they describe."""

from __future__ import annotations

import argparse

from chunkserve.bench.datasets import DATASETS, BenchRequest, WorkloadSpec, build_workload


def add_workload_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("workload")
    g.add_argument("--dataset", default="stall", choices=list(DATASETS))
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


def workload_from_args(args: argparse.Namespace) -> tuple[list[BenchRequest], WorkloadSpec]:
    from chunkserve.engine.tokenizer import Tokenizer
    from chunkserve.model.loader import load_model_config, resolve_model

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
