"""Prefill rate per chunk size: tokens/s and achieved TFLOP/s against the measured matmul rate.

For each model (dummy bf16 weights) and each size: one request whose prompt is exactly that
many random tokens, ``max_tokens=1``, prefix caching off, with a token budget that takes the
whole prompt in one step (long-prompt limits off). 2 warm-ups, then the median
``StepStats.forward_time`` of 8 prefill steps. Sizes: chunks of 256..8192, and sizes just past
multiples of 128 (1025, 2049, 2064, 2112, 2176, 2177) that show tile and padding effects as time
per token against the chunk size below them.

FLOPs of one prefill of n tokens:

- 2 * n * (per-layer qkv + o + gate_up + down weights) * num_layers;
- attention: 4 * num_layers * num_heads * head_dim * sum_{i<n}(i + 1) (QK^T and PV, causal);
- lm_head for the one sampled row: 2 * hidden * vocab.

Target: at least 50% of the matmul rate at 2048-token chunks for llama3-8b. One engine serves
every size of a model (budget = the largest size; a step's tokens are checked to be the whole
prompt). It runs with ``enforce_eager=True``: CUDA graphs are for decode-only steps, so a
prefill step is eager either way and capture would only cost start-up time. Writes
``prefill.json`` (after every model) and ``prefill.png``:

    python benchmarks/gpu/prefill.py --ceilings benchmarks/results/gpu/ceilings.json
    python benchmarks/gpu/prefill.py --device cpu --model-root /tmp/gm --models smollm2-135m \\
        --quick --out /tmp/gpu_smoke
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
import traceback
from pathlib import Path

import torch
from ceilings import DEFAULT_OUT, load_or_measure, run_meta, write_json

TOKEN_ID_LIMIT = 49152
TARGET_MODEL, TARGET_TOKENS, TARGET_FRACTION = "llama3-8b", 2048, 0.5
QUICK_SIZES, QUICK_TILES = "32,64,128,256", "129,144,257"


def describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"[:300]


def matmul_params_per_layer(cfg) -> int:
    """qkv + o + gate_up + down weight elements of one decoder layer."""
    q = cfg.num_heads * cfg.head_dim
    kv = cfg.num_kv_heads * cfg.head_dim
    h, inter = cfg.hidden_size, cfg.intermediate_size
    return h * (q + 2 * kv) + q * h + 2 * inter * h + inter * h


def prefill_flops(cfg, n: int) -> dict:
    linear = 2 * n * matmul_params_per_layer(cfg) * cfg.num_layers
    attention = 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim * (n * (n + 1) // 2)
    lm_head = 2 * cfg.hidden_size * cfg.vocab_size
    return {
        "linear_flops": linear,
        "attention_flops": attention,
        "lm_head_flops": lm_head,
        "flops": linear + attention + lm_head,
    }


def engine_padding(eng, n: int) -> int:
    """Tokens the runner actually computes for an n-token step, where it pads batches."""
    if not getattr(eng.core.worker.runner, "pad_batches", False):
        return n
    try:
        from chunkserve.worker.model_runner import padded_num_tokens
    except ImportError:
        return n
    return padded_num_tokens(n)


def time_size(eng, n: int, reps: int, warmup: int, seed: int) -> list[float]:
    from chunkserve.scheduling.sampling_params import SamplingParams

    limit = min(TOKEN_ID_LIMIT, eng.model_config.vocab_size)
    gen = torch.Generator().manual_seed(seed)
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    stats: list = []
    eng.step_listeners.append(stats.append)
    times = []
    try:
        for i in range(warmup + reps):
            ids = torch.randint(0, limit, (n,), generator=gen).tolist()
            eng.add_request(prompt_token_ids=ids, sampling_params=params)
            first = len(stats)
            while eng.has_unfinished():
                eng.step()
            prefill = [s for s in stats[first:] if s.num_prefill_tokens > 0]
            if len(prefill) != 1 or prefill[0].num_prefill_tokens != n:
                got = [s.num_prefill_tokens for s in prefill]
                raise RuntimeError(f"{n} tokens: prefill took steps of {got}, not one of {n}")
            if i >= warmup:
                times.append(prefill[0].forward_time)
    finally:
        eng.step_listeners.remove(stats.append)
    return times


def run_model(model: str, args: argparse.Namespace, device: torch.device, matmul_tflops: float):
    from chunkserve.engine.engine import Engine

    sizes = [int(x) for x in args.sizes.split(",")]
    tiles = [int(x) for x in args.tile_sizes.split(",")] if args.tile_sizes else []
    every = sorted(set(sizes + tiles))
    top = max(every)
    max_len = -(-(top + 16) // 16) * 16
    model_dir = args.model_root / model
    cfg_json = json.loads((model_dir / "config.json").read_text())
    elsize = 2 if device.type == "cuda" else 4
    head_dim = cfg_json.get("head_dim") or (
        cfg_json["hidden_size"] // cfg_json["num_attention_heads"]
    )
    kv_token = 2 * cfg_json["num_hidden_layers"] * cfg_json["num_key_value_heads"] * head_dim
    t0 = time.perf_counter()
    eng = Engine(
        model=str(model_dir),
        load_format="dummy",
        device=device.type,
        dtype="bfloat16" if device.type == "cuda" else "float32",
        max_model_len=max_len,
        max_num_batched_tokens=top,
        max_num_seqs=4,
        enable_prefix_caching=False,
        long_prefill_token_threshold=0,
        kv_cache_memory=2 * max_len * kv_token * elsize + (16 << 20),
        enforce_eager=True,
        attention_backend=args.backend if device.type == "cuda" else "torch",
        log_stats_interval=10**6,
    )
    build_s = time.perf_counter() - t0
    backend_name = getattr(
        eng.core.worker.runner.attn, "name", type(eng.core.worker.runner.attn).__name__
    )
    print(f"   engine built in {build_s:.1f} s, attention {backend_name}", flush=True)
    cfg = eng.model_config
    rows = []
    try:
        for n in every:
            row = {
                "model": model,
                "tokens": n,
                "kind": "chunk" if n in sizes else "tile",
                "backend": backend_name,
                "engine_build_s": build_s,
                "computed_tokens": engine_padding(eng, n),
            }
            try:
                times = time_size(eng, n, args.reps, args.warmup, seed=args.seed + n)
                fwd = statistics.median(times)
                fl = prefill_flops(cfg, n)
                row.update(fl)
                row.update(
                    {
                        "forward_s": fwd,
                        "forward_min_s": min(times),
                        "forward_all_s": times,
                        "tokens_per_s": n / fwd,
                        "us_per_token": 1e6 * fwd / n,
                        "tflops": fl["flops"] / fwd / 1e12,
                        "matmul_fraction": fl["flops"] / fwd / 1e12 / matmul_tflops,
                    }
                )
                print(
                    f"   {model} {n}: {1e3 * fwd:.2f} ms, {row['tflops']:.3f} TFLOP/s "
                    f"({100 * row['matmul_fraction']:.1f}% of matmul)",
                    flush=True,
                )
            except Exception as exc:
                traceback.print_exc()
                row["error"] = describe(exc)
            rows.append(row)
    finally:
        del eng
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    base_sizes = sorted(sizes)
    for r in rows:
        below = [s for s in base_sizes if s <= r["tokens"] and s != r["tokens"]]
        base = next(
            (b for b in rows if below and b["tokens"] == below[-1] and "us_per_token" in b), None
        )
        if r["kind"] == "tile" and base is not None and "us_per_token" in r:
            r["base_tokens"] = base["tokens"]
            r["per_token_vs_base"] = r["us_per_token"] / base["us_per_token"]
    return rows


def print_table(rows: list[dict]) -> None:
    head = (
        f"{'model':<13} {'tokens':>6} {'kind':<5} {'computed':>8} {'fwd ms':>9} {'tok/s':>9} "
        f"{'TFLOP/s':>8} {'% matmul':>8} {'us/tok':>8} {'vs base':>12}"
    )
    print(head)
    print("-" * len(head))
    for r in rows:
        if "error" in r:
            print(f"{r['model']:<13} {r['tokens']:>6} {r['kind']:<5}  {r['error']}")
            continue
        vs = ""
        if "per_token_vs_base" in r:
            vs = f"{r['per_token_vs_base']:.3f}x {r['base_tokens']}"
        print(
            f"{r['model']:<13} {r['tokens']:>6} {r['kind']:<5} {r['computed_tokens']:>8} "
            f"{1e3 * r['forward_s']:>9.2f} {r['tokens_per_s']:>9.0f} {r['tflops']:>8.3f} "
            f"{100 * r['matmul_fraction']:>7.1f}% {r['us_per_token']:>8.2f} {vs:>12}"
        )


def target_line(rows: list[dict]) -> str:
    goal = f"at least {TARGET_FRACTION:.0%} of the matmul rate at {TARGET_TOKENS}-token chunks "
    goal += f"for {TARGET_MODEL}"
    hit = next(
        (
            r
            for r in rows
            if r["model"] == TARGET_MODEL and r["tokens"] == TARGET_TOKENS and "tflops" in r
        ),
        None,
    )
    if hit is None:
        return f"target {goal}: not measured"
    verdict = "met" if hit["matmul_fraction"] >= TARGET_FRACTION else "not met"
    return f"target {goal}: {verdict} ({100 * hit['matmul_fraction']:.1f}%)"


def plot(rows: list[dict], matmul_tflops: float, title: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for i, model in enumerate(dict.fromkeys(r["model"] for r in rows)):
        color = f"C{i}"
        ok = [r for r in rows if r["model"] == model and "tflops" in r]
        chunks = [r for r in ok if r["kind"] == "chunk"]
        tiles = [r for r in ok if r["kind"] == "tile"]
        ax.plot(
            [r["tokens"] for r in chunks],
            [r["tflops"] for r in chunks],
            "o-",
            color=color,
            label=model,
        )
        if tiles:
            ax.plot(
                [r["tokens"] for r in tiles],
                [r["tflops"] for r in tiles],
                "x",
                color=color,
                markersize=8,
                label=f"{model}, just past multiples of 128",
            )
    ax.axhline(matmul_tflops, color="k", ls="--", lw=1, label=f"matmul {matmul_tflops:.3g}")
    ax.axhline(matmul_tflops * TARGET_FRACTION, color="grey", ls=":", lw=1, label="50% of it")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("prompt tokens in the step")
    ax.set_ylabel("achieved TFLOP/s")
    ax.set_title(title, fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--models", default="smollm2-135m,llama3-8b")
    ap.add_argument("--model-root", type=Path, default=Path(".gpu/models"))
    ap.add_argument("--sizes", default="256,512,1024,2048,4096,8192")
    ap.add_argument("--tile-sizes", default="1025,2049,2064,2112,2176,2177")
    ap.add_argument("--reps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--backend", default="auto", help="attention backend (CUDA)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--quick", action="store_true", help=f"sizes {QUICK_SIZES} + {QUICK_TILES}")
    ap.add_argument("--ceilings", type=Path, default=None, help="ceilings.json to use")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if args.quick:
        args.sizes, args.tile_sizes, args.reps, args.warmup = QUICK_SIZES, QUICK_TILES, 3, 1

    device = torch.device(args.device)
    ceilings = load_or_measure(args.ceilings, device, args.quick)
    matmul_tflops = ceilings["matmul_tflops"]
    meta = run_meta(device, "prefill.py")
    rows: list[dict] = []
    out_path = args.out / "prefill.json"

    def save() -> None:
        payload = {"meta": meta, "args": vars(args), "ceilings": ceilings, "rows": rows}
        write_json(out_path, json.loads(json.dumps(payload, default=str)))

    for model in args.models.split(","):
        print(f"== {model}", flush=True)
        try:
            rows.extend(run_model(model, args, device, matmul_tflops))
        except Exception as exc:
            traceback.print_exc()
            rows.append({"model": model, "tokens": 0, "kind": "-", "error": describe(exc)})
        save()

    print()
    print(
        f"{meta['machine']}; torch {meta['torch']}, triton {meta['triton']}; matmul ceiling "
        f"{matmul_tflops:.3f} TFLOP/s ({ceilings['source']})"
    )
    print_table(rows)
    line = target_line(rows)
    print(line)
    meta["target"] = line
    save()
    png = args.out / "prefill.png"
    try:
        plot(rows, matmul_tflops, f"Prefill, one request per step: {meta['machine']}", png)
        print(f"wrote {out_path}, {png}")
    except Exception:
        traceback.print_exc()
        print(f"wrote {out_path} (no plot)")


if __name__ == "__main__":
    main()
