"""Decode step time against the memory-bandwidth floor, per model and batch size.

For each model (dummy bf16 weights) and batch size: ``batch`` requests of ``--context-len``
random token ids (ids < 49152, different per request) are added, steps run until every request
is decoding, then 5 decode-only steps warm up and 30 are timed. The step time is the median of
``StepStats.forward_time`` (layout + forward + sampling, ending in the host sync that reads the
sampled tokens back); the whole step (``wall_time``, scheduler included) is shown beside it.

The floor is the time to stream, at the measured copy bandwidth (``ceilings.py``), the bytes a
decode step must read at least once:

- weights: every parameter once (lm_head, all layers, final norm; a tied embedding counted
  once, as the lm_head), but an untied embedding table only as the ``batch`` rows gathered;
- KV cache: for every sequence, K and V of all its tokens in every layer
  (``sum(context) * 2 * num_layers * num_kv_heads * head_dim * elsize``).

Target: within 1.5x of the floor at batch 64 for llama3-8b, judged on forward_time of the
default configuration (``--backend auto``; CUDA graphs unless the backend cannot be captured).
With ``--compare`` (default on, CUDA only) the batch-64 row is also run with
``enforce_eager=True`` (no CUDA graphs) and with ``attention_backend="torch"`` (which the engine
cannot capture, so it runs eagerly too). Writes ``decode_floor.json`` after every row, so a run
cut short keeps what it measured.

    python benchmarks/gpu/model_dirs.py .gpu/models        # once, where the GGUF is
    python benchmarks/gpu/decode_floor.py --ceilings benchmarks/results/gpu/ceilings.json
    python benchmarks/gpu/decode_floor.py --device cpu --model-root /tmp/gm \\
        --models smollm2-135m --batch-sizes 1,2 --context-len 64 --quick --out /tmp/gpu_smoke
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import statistics
import time
import traceback
from pathlib import Path

import torch
from ceilings import DEFAULT_OUT, load_or_measure, run_meta, write_json

TOKEN_ID_LIMIT = 49152  # the SmolLM2 tokenizer's vocabulary: valid ids for both models
TARGET_MODEL, TARGET_BATCH, TARGET_RATIO = "llama3-8b", 64, 1.5


def describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"[:300]


def kv_bytes_per_token(cfg: dict, elsize: int) -> int:
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * head_dim * elsize


def weight_read_bytes(model: torch.nn.Module, tied: bool) -> tuple[int, int]:
    """(bytes a decode step reads whole, bytes of the embedding table). ``named_parameters``
    lists a tied lm_head once, as the embedding: then the table is read whole as the lm_head
    and counted; untied, only its gathered rows are read (added per step by the caller)."""
    total = embed = 0
    for name, p in model.named_parameters():
        nbytes = p.numel() * p.element_size()
        if name == "embed" or "embed_tokens" in name:
            embed = nbytes
            if not tied:
                continue
        total += nbytes
    return total, embed


def engine_kwargs(args: argparse.Namespace, device: torch.device) -> dict:
    return {
        "load_format": "dummy",
        "device": device.type,
        "dtype": "bfloat16" if device.type == "cuda" else "float32",
        "enable_prefix_caching": False,
        "long_prefill_token_threshold": 0,  # whole budget to one prompt: shortest fill
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "block_size": 16,
        "log_stats_interval": 10**6,
    }


def decode_budget(batch: int, args: argparse.Namespace) -> int:
    """Output tokens a request needs: decodes during the others' prefill, warm-up, timed."""
    fill_steps = math.ceil(batch * args.context_len / args.max_num_batched_tokens) + 2
    return fill_steps + args.warmup + args.steps + 8


def random_prompts(batch: int, length: int, limit: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, limit, (batch, length), generator=gen).tolist()


def run_batch(eng, batch: int, args: argparse.Namespace, seed: int) -> dict:
    from chunkserve.scheduling.sampling_params import SamplingParams

    limit = min(TOKEN_ID_LIMIT, eng.model_config.vocab_size)
    params = SamplingParams(max_tokens=decode_budget(batch, args), temperature=0.0, ignore_eos=True)
    stats: list = []
    eng.step_listeners.append(stats.append)
    rids = []
    try:
        t0 = time.perf_counter()
        for ids in random_prompts(batch, args.context_len, limit, seed):
            rids.append(eng.add_request(prompt_token_ids=ids, sampling_params=params))
        fill_steps = 0
        while not (stats and stats[-1].kind == "decode" and stats[-1].num_decode_tokens == batch):
            if fill_steps > 10 * decode_budget(batch, args):
                raise RuntimeError(f"batch {batch}: not all requests decoding after prefill")
            eng.step()
            fill_steps += 1
        fill_s = time.perf_counter() - t0
        for _ in range(args.warmup):
            eng.step()
        timed, contexts = [], []
        for _ in range(args.steps):
            # keys each decode attends over: its computed tokens plus the one it adds
            contexts.append(sum(r.num_computed_tokens + 1 for r in eng.core.scheduler.running))
            eng.step()
            s = stats[-1]
            if s.kind != "decode" or s.num_decode_tokens != batch:
                raise RuntimeError(f"batch {batch}: a timed step was {s.kind}, not {batch} decodes")
            timed.append(s)
    finally:
        eng.step_listeners.remove(stats.append)
        for rid in rids:
            eng.abort_request(rid)
        while eng.has_unfinished():
            eng.step()
    return {
        "fill_steps": fill_steps,
        "fill_s": fill_s,
        "forward_s": statistics.median(s.forward_time for s in timed),
        "wall_s": statistics.median(s.wall_time for s in timed),
        "forward_min_s": min(s.forward_time for s in timed),
        "mean_context": statistics.fmean(contexts) / batch,
        "sum_context": statistics.fmean(contexts),
    }


def floor_row(eng, batch: int, meas: dict, copy_gbs: float) -> dict:
    cfg = eng.model_config
    elsize = torch.tensor([], dtype=eng.core.worker.dtype).element_size()
    weights, embed = weight_read_bytes(eng.core.worker.model, cfg.tie_word_embeddings)
    gather = 0 if cfg.tie_word_embeddings else batch * cfg.hidden_size * elsize
    kv = meas["sum_context"] * cfg.kv_bytes_per_token(elsize)
    total = weights + gather + kv
    floor_s = total / (copy_gbs * 1e9)
    return {
        **meas,
        "weight_bytes": weights,
        "embed_table_bytes": embed,
        "embed_gather_bytes": gather,
        "kv_read_bytes": kv,
        "floor_bytes": total,
        "floor_s": floor_s,
        "ratio_forward": meas["forward_s"] / floor_s,
        "ratio_wall": meas["wall_s"] / floor_s,
        "achieved_gbs": total / meas["forward_s"] / 1e9,
        "tokens_per_s": batch / meas["forward_s"],
    }


def configs(args: argparse.Namespace, device: torch.device, batches: list[int]) -> list[dict]:
    """(label, engine options, batch sizes) per engine built for one model."""
    if device.type != "cuda":
        return [{"label": "cpu", "eager": True, "backend": "torch", "batches": batches}]
    out = [{"label": "default", "eager": False, "backend": args.backend, "batches": batches}]
    if args.compare:
        cb = [args.compare_batch]
        out.append({"label": "eager", "eager": True, "backend": args.backend, "batches": cb})
        out.append({"label": "torch attn", "eager": False, "backend": "torch", "batches": cb})
    return out


def free_engine(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def print_table(rows: list[dict]) -> None:
    head = (
        f"{'model':<13} {'config':<11} {'attn':<7} {'graphs':<6} {'batch':>5} {'ctx':>6} "
        f"{'fwd ms':>8} {'wall ms':>8} {'floor ms':>8} {'fwd/floor':>9} {'wall/floor':>10} "
        f"{'GB/s':>7} {'tok/s':>9}"
    )
    print(head)
    print("-" * len(head))
    for r in rows:
        if "error" in r:
            print(f"{r['model']:<13} {r['config']:<11} {'':<14} {r['batch']:>6}  {r['error']}")
            continue
        print(
            f"{r['model']:<13} {r['config']:<11} {r['backend_name']:<7} "
            f"{'yes' if r['cuda_graphs'] else 'no':<6} {r['batch']:>5} "
            f"{r['mean_context']:>6.0f} {1e3 * r['forward_s']:>8.3f} {1e3 * r['wall_s']:>8.3f} "
            f"{1e3 * r['floor_s']:>8.3f} {r['ratio_forward']:>8.2f}x {r['ratio_wall']:>9.2f}x "
            f"{r['achieved_gbs']:>7.0f} {r['tokens_per_s']:>9.0f}"
        )


def target_line(rows: list[dict]) -> str:
    hit = next(
        (
            r
            for r in rows
            if r["model"] == TARGET_MODEL
            and r["batch"] == TARGET_BATCH
            and r["config"] == "default"
            and "ratio_forward" in r
        ),
        None,
    )
    goal = f"within {TARGET_RATIO}x of the floor at batch {TARGET_BATCH} for {TARGET_MODEL}"
    if hit is None:
        return f"target {goal}: not measured"
    verdict = "met" if hit["ratio_forward"] <= TARGET_RATIO else "not met"
    return f"target {goal}: {verdict} ({hit['ratio_forward']:.2f}x on forward_time)"


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--models", default="smollm2-135m,llama3-8b")
    ap.add_argument("--model-root", type=Path, default=Path(".gpu/models"))
    ap.add_argument("--batch-sizes", default="1,16,64,256")
    ap.add_argument("--context-len", type=int, default=1024)
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--warmup", type=int, default=5, help="decode steps before timing")
    ap.add_argument("--steps", type=int, default=30, help="timed decode steps")
    ap.add_argument("--backend", default="auto", help="attention backend of the main rows")
    ap.add_argument(
        "--compare",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also run --compare-batch eager (no CUDA graphs) and with torch attention",
    )
    ap.add_argument("--compare-batch", type=int, default=TARGET_BATCH)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--quick", action="store_true", help="2 warm-up and 5 timed steps")
    ap.add_argument("--ceilings", type=Path, default=None, help="ceilings.json to use")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if args.quick:
        args.warmup, args.steps = 2, 5
    from chunkserve.engine.engine import Engine

    device = torch.device(args.device)
    batches = [int(b) for b in args.batch_sizes.split(",")]
    ceilings = load_or_measure(args.ceilings, device, args.quick)
    copy_gbs = ceilings["copy_bandwidth_gbs"]
    meta = run_meta(device, "decode_floor.py")
    elsize = 2 if device.type == "cuda" else 4
    rows: list[dict] = []
    out_path = args.out / "decode_floor.json"

    def save() -> None:
        payload = {"meta": meta, "args": vars(args), "ceilings": ceilings, "rows": rows}
        write_json(out_path, json.loads(json.dumps(payload, default=str)))

    for model in args.models.split(","):
        model_dir = args.model_root / model
        try:
            cfg = json.loads((model_dir / "config.json").read_text())
        except OSError as exc:
            print(f"== {model}: {exc}", flush=True)
            rows.append({"model": model, "config": "-", "batch": 0, "error": describe(exc)})
            save()
            continue
        for conf in configs(args, device, batches):
            top = max(conf["batches"])
            max_len = args.context_len + decode_budget(top, args) + 16
            max_len = -(-max_len // 16) * 16
            kv_memory = int(top * max_len * kv_bytes_per_token(cfg, elsize) * 1.2) + (64 << 20)
            base = {"model": model, "config": conf["label"], "enforce_eager": conf["eager"]}
            print(f"== {model} {conf['label']}: batches {conf['batches']}", flush=True)
            try:
                t0 = time.perf_counter()
                eng = Engine(
                    model=str(model_dir),
                    max_model_len=max_len,
                    max_num_seqs=max(top, 1),
                    kv_cache_memory=kv_memory,
                    enforce_eager=conf["eager"],
                    attention_backend=conf["backend"],
                    **engine_kwargs(args, device),
                )
                build_s = time.perf_counter() - t0
                backend_name = getattr(
                    eng.core.worker.runner.attn, "name", type(eng.core.worker.runner.attn).__name__
                )
                graphs = bool(eng.core.worker.cuda_graphs)
                print(
                    f"   engine built in {build_s:.1f} s: attention {backend_name}, "
                    f"CUDA graphs {'on' if graphs else 'off'}",
                    flush=True,
                )
            except Exception as exc:
                traceback.print_exc()
                for b in conf["batches"]:
                    rows.append({**base, "batch": b, "error": f"engine: {exc!r}"[:300]})
                save()
                free_engine(device)
                continue
            for i, b in enumerate(conf["batches"]):
                row = {
                    **base,
                    "batch": b,
                    "backend": conf["backend"],
                    "backend_name": backend_name,
                    "cuda_graphs": graphs,
                    "context_len": args.context_len,
                    "engine_build_s": build_s,
                    "kv_cache_memory": eng.core.worker.kv_cache_memory,
                }
                try:
                    meas = run_batch(eng, b, args, seed=args.seed + 1000 * i)
                    row.update(floor_row(eng, b, meas, copy_gbs))
                    print(
                        f"   batch {b}: forward {1e3 * row['forward_s']:.3f} ms, floor "
                        f"{1e3 * row['floor_s']:.3f} ms ({row['ratio_forward']:.2f}x)",
                        flush=True,
                    )
                except Exception as exc:
                    traceback.print_exc()
                    row["error"] = describe(exc)
                rows.append(row)
                save()
            del eng
            free_engine(device)

    print()
    print(
        f"{meta['machine']}; torch {meta['torch']}, triton {meta['triton']}; copy ceiling "
        f"{copy_gbs:.0f} GB/s ({ceilings['source']})"
    )
    print_table(rows)
    line = target_line(rows)
    print(line)
    meta["target"] = line
    save()
    print(f"wrote {out_path}")


if __name__ == "__main__":
    main()
