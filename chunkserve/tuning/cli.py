"""``chunkserve profile | tune | simulate``: the step-time cost model and what it is for."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from chunkserve.bench.args import add_workload_args, workload_from_args
from chunkserve.engine_args import add_engine_args, engine_config_from_args


def _profile_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--output",
        default=None,
        help="where to save the profile (default: beside the model, see README)",
    )
    p.add_argument("--quick", action="store_true", help="a small grid (for tests and smoke)")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per shape (median)")
    add_engine_args(p)
    p.set_defaults(log_level="warning")


def _profile(args: argparse.Namespace) -> int:
    from tqdm.auto import tqdm

    from chunkserve.engine.engine import Engine
    from chunkserve.scheduling.costmodel import default_profile_path
    from chunkserve.tuning.profiler import (
        FULL_GRID,
        QUICK_GRID,
        kv_blocks_needed,
        profile_summary,
        run_profile,
        save_profile,
    )

    grid = QUICK_GRID if args.quick else FULL_GRID
    config = engine_config_from_args(args)
    if config.kv_cache_memory is None:
        # Room for the largest shape of the grid (and the default max_model_len).
        from chunkserve.model.loader import load_model_config
        from chunkserve.model.source import config_source

        mc, _ = load_model_config(config_source(config))
        per_block = mc.kv_bytes_per_token(4) * config.block_size
        config = config.replace(
            kv_cache_memory=per_block
            * max(
                kv_blocks_needed(grid, config.block_size),
                -(-(config.max_model_len or mc.max_position_embeddings) // config.block_size) + 2,
            )
        )
    engine = Engine(config)
    bar = tqdm(total=1, desc="profiling step shapes", unit="shape", dynamic_ncols=True)

    def progress(done: int, total: int) -> None:
        bar.total = total
        bar.n = done
        bar.refresh()

    doc = run_profile(engine, grid, repeats=args.repeats, progress=progress)
    bar.close()
    path = (
        Path(args.output)
        if args.output
        else default_profile_path(
            engine.model_path,
            engine.core.worker.device.type,
            str(engine.core.worker.dtype).removeprefix("torch."),
            engine.core.worker.num_threads,
            engine.core.worker.weights_format,
        )
    )
    save_profile(doc, path)
    print(profile_summary(doc))
    print(f"saved {path}")
    return 0


def _load_model_for(args: argparse.Namespace):
    from chunkserve.scheduling.costmodel import CostModel

    if not args.cost_profile:
        raise ValueError("cost_profile: pass --cost-profile PATH (from `chunkserve profile`)")
    return CostModel.load(args.cost_profile)


def _tune_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--itl-slo-ms", type=float, required=True)
    p.add_argument("--cost-profile", required=True, help="profile JSON")
    p.add_argument("--num-decodes", type=int, default=16, help="decodes running beside")
    p.add_argument("--decode-context", type=int, default=1024, help="their context length")
    p.add_argument(
        "--prefill-start",
        type=int,
        default=2048,
        help="where in its prompt the prefill chunk starts (attention cost)",
    )


def _tune(args: argparse.Namespace) -> int:
    from chunkserve.tuning.profiler import tune_table

    model = _load_model_for(args)
    slo = args.itl_slo_ms / 1e3
    candidates = [
        c
        for c in (32, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048)
        if c > args.num_decodes
    ]
    exact = args.num_decodes + model.max_prefill_tokens(
        (args.decode_context,) * args.num_decodes, args.prefill_start, slo, 1 << 16
    )
    rows = tune_table(
        model,
        slo,
        args.num_decodes,
        args.decode_context,
        args.prefill_start,
        sorted({*candidates, exact}),
    )
    print(
        f"profile: {model.meta.get('hardware', '?')} {model.meta.get('dtype', '')} "
        f"{model.meta.get('threads', '?')} threads; {args.num_decodes} decodes at "
        f"{args.decode_context} tokens, prefill chunk at position {args.prefill_start}"
    )
    print(
        f"{'budget':>8} {'predicted ITL ms':>17} {'prefill tok/s':>14}  meets "
        f"{args.itl_slo_ms:.0f} ms"
    )
    for r in rows:
        mark = "yes" if r["meets"] else "no"
        star = "  <- recommended" if r["budget"] == exact else ""
        print(
            f"{r['budget']:>8} {r['predicted_itl_ms']:>17.1f} {r['prefill_tok_s']:>14.0f}  "
            f"{mark}{star}"
        )
    if exact <= args.num_decodes:
        print("the decodes alone exceed the target: no static budget meets it")
        return 1
    print(
        f"recommended: --max-num-batched-tokens {exact} (the largest predicted to meet "
        f"{args.itl_slo_ms:.0f} ms; with --itl-slo-ms the engine picks per step)"
    )
    return 0


def _simulate_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument(
        "--noise",
        type=float,
        default=0.0,
        help="relative standard deviation of simulated step times",
    )
    p.add_argument(
        "--noise-correlation",
        type=float,
        default=None,
        help="with --noise: log-normal step noise whose log is an AR(1) process of this "
        "step-to-step correlation (0.8 matches this VM's decode steps); default: "
        "independent normal noise",
    )
    p.add_argument(
        "--step-overhead-ms",
        type=float,
        default=0.0,
        help="serving-loop time added to every step (a server's mean "
        "chunkserve:step_gap_seconds; 0: the engine alone)",
    )
    p.add_argument(
        "--cost-scale",
        default="1",
        help="multiply predicted step times: one factor, or one per step kind "
        "(decode=1.17,mixed=1.08): a server's means of chunkserve:step_time_over_predicted, "
        "measured with --cost-profile (1: the profile as it is)",
    )
    p.add_argument("--goodput", nargs="*", default=None, metavar="KEY:MS")
    p.add_argument("--result-json", default=None)
    add_workload_args(p)
    add_engine_args(p, sampler_seed=False)  # --seed seeds the workload
    p.set_defaults(log_level="warning")


def _simulate(args: argparse.Namespace) -> int:
    from chunkserve.bench.loadgen import GoodputSLO, format_summary, result_document
    from chunkserve.model.loader import load_model_config
    from chunkserve.model.source import config_source
    from chunkserve.tuning.simulate import parse_cost_scale, simulate

    model = _load_model_for(args)
    config = engine_config_from_args(args)
    mc, _ = load_model_config(config_source(config))
    max_model_len = config.max_model_len or mc.max_position_embeddings
    sched_config = config.scheduler_config(max_model_len)
    dtype_size = 2 if model.meta.get("dtype", "bfloat16") in ("bfloat16", "float16") else 4
    per_block = mc.kv_bytes_per_token(dtype_size) * config.block_size
    memory = config.kv_cache_memory or (1 << 30)
    num_blocks = memory // per_block - 1
    requests, spec = workload_from_args(args)
    slo = GoodputSLO.parse(args.goodput)
    records, duration, info = simulate(
        requests,
        sched_config,
        num_blocks,
        model,
        enable_prefix_caching=config.enable_prefix_caching,
        policy=config.budget_policy(max_model_len),
        max_concurrency=args.max_concurrency,
        noise=args.noise,
        noise_correlation=args.noise_correlation,
        step_overhead_s=args.step_overhead_ms / 1e3,
        cost_scale=parse_cost_scale(args.cost_scale),
        seed=args.seed,
    )
    result = result_document(records, duration, slo)
    print(format_summary(result, "Simulated serving benchmark"))
    for kind, r in result["by_kind"].items():
        print(format_summary(r, f"{kind} requests (simulated)"))
    print(
        f"{info['steps']} steps, {info['preemptions']} preemptions, busy "
        f"{100 * info['busy_s'] / max(duration, 1e-9):.0f}% of {duration:.1f} s",
        file=sys.stderr,
    )
    if args.result_json:
        Path(args.result_json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.result_json).write_text(
            json.dumps(
                {
                    "simulated": True,
                    "workload": vars(spec),
                    **result,
                },
                indent=1,
                default=str,
            )
        )
    return 0
