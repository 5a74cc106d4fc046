"""Offline throughput: chunkserve (``LLM()``'s defaults, a server's adaptive default, a static
chunked budget, unchunked) against HF transformers `generate`.

64 prompts of real prose with lengths drawn uniformly from 20..1,500 tokens, 128 output tokens
each (EOS ignored so every engine produces the same count). Each engine runs in its own
subprocess, so peak RSS is its own. Prints a table and writes
``benchmarks/results/offline_throughput.{json,md}``.

    python benchmarks/offline_throughput.py                 # all five, ~20 min on 2 cores
    python benchmarks/offline_throughput.py --modes chunked --num-prompts 16

Prefill and decode tok/s split each step's time between its prefill and decode tokens in
proportion to their counts (a mixed step does both); HF's prefill time is the time to the
first token of each batch.
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def make_prompts(tokenizer, num: int, min_len: int, max_len: int, seed: int) -> list[list[int]]:
    from chunkserve.bench.prose import prose_prompts

    rng = random.Random(seed)
    lengths = [rng.randint(min_len, max_len) for _ in range(num)]
    return prose_prompts(tokenizer, lengths, rng)


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run_chunkserve(args: argparse.Namespace, mode: str) -> dict:
    """``mode``: defaults (``LLM()`` as an offline user gets it: no budget flag, so the
    offline budget), adaptive (``Engine()``: a server's default, the adaptive budget that
    protects the gaps between tokens), torch-attention (the defaults on the torch attention
    backend instead of the CPU kernel), chunked (static budget ``--budget``) or unchunked."""
    from chunkserve import LLM, SamplingParams
    from chunkserve.engine.engine import Engine

    if mode in ("defaults", "torch-attention"):
        backend = "torch" if mode == "torch-attention" else "auto"
        llm = LLM(num_threads=args.threads, dtype=args.dtype, attention_backend=backend)
        engine = llm.engine
        budget = None
    elif mode == "adaptive":
        engine = Engine(num_threads=args.threads, dtype=args.dtype)
        budget = None
    else:
        chunked = mode == "chunked"
        budget = args.budget if chunked else args.unchunked_budget
        engine = Engine(
            max_num_batched_tokens=budget,
            max_num_seqs=args.num_prompts,
            enable_chunked_prefill=chunked,
            num_threads=args.threads,
            dtype=args.dtype,
        )
    prompts = make_prompts(
        engine.tokenizer, args.num_prompts, args.min_len, args.max_len, args.seed
    )
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    engine.add_request(prompts[0][:32], SamplingParams(max_tokens=4))  # warm-up
    while engine.has_unfinished():
        engine.step()
    stats = []
    engine.step_listeners.append(stats.append)
    t0 = time.perf_counter()
    for p in prompts:
        engine.add_request(p, params)
    num_out = 0
    while engine.has_unfinished():
        for o in engine.step():
            num_out += len(o.delta_token_ids)
    total = time.perf_counter() - t0

    prefill_time = sum(s.wall_time * s.num_prefill_tokens / s.num_batched_tokens for s in stats)
    decode_time = sum(s.wall_time * s.num_decode_tokens / s.num_batched_tokens for s in stats)
    split = overhead_split(engine, prompts, args)
    num_prompt = sum(len(p) for p in prompts)
    return {
        "engine": f"chunkserve {mode}",
        "max_num_batched_tokens": budget,
        "budget_policy": engine.core.budget_policy.describe(),
        "attention_backend": engine.core.worker.attention.name,
        "dtype": str(engine.core.worker.dtype).removeprefix("torch."),
        "num_prompt_tokens": num_prompt,
        "num_output_tokens": num_out,
        "total_time_s": total,
        "total_tok_s": (num_prompt + num_out) / total,
        "output_tok_s": num_out / total,
        "prefill_tok_s": num_prompt / prefill_time,
        "decode_tok_s": num_out / decode_time,
        "peak_rss_mib": peak_rss_mib(),
        "num_steps": len(stats),
        "num_preemptions": engine.core.scheduler.num_preemptions,
        **split,
    }


def overhead_split(engine, prompts: list[list[int]], args: argparse.Namespace) -> dict:
    """Scheduler and batch-building time against step time with 64 requests running: 64
    short prompts (the first 64 tokens of each) decoding together."""
    from chunkserve import SamplingParams

    stats = []
    engine.step_listeners.append(stats.append)
    n = min(64, len(prompts))
    for p in prompts[:n]:
        engine.add_request(p[:64], SamplingParams(max_tokens=64, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    engine.step_listeners.remove(stats.append)
    full = [s for s in stats if s.num_running == n]
    schedule = sum(s.schedule_time for s in full)
    layout = sum(s.layout_time for s in full)
    wall = sum(s.wall_time for s in full)
    return {
        "split_running": n,
        "split_steps": len(full),
        "schedule_ms_per_step": 1e3 * schedule / len(full),
        "layout_ms_per_step": 1e3 * layout / len(full),
        "step_ms": 1e3 * wall / len(full),
        "overhead_fraction": (schedule + layout) / wall,
    }


def run_hf(args: argparse.Namespace) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, LogitsProcessor, LogitsProcessorList

    from chunkserve.engine.tokenizer import Tokenizer
    from chunkserve.model.loader import embedded_model_path
    from chunkserve.platform import resolve_dtype

    torch.set_num_threads(args.threads)
    path = embedded_model_path()
    from chunkserve.model.loader import open_gguf

    tokenizer = Tokenizer.from_gguf(path, open_gguf(path))
    dtype = resolve_dtype(args.dtype, torch.device("cpu"))
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype)
    model.eval()
    prompts = make_prompts(tokenizer, args.num_prompts, args.min_len, args.max_len, args.seed)
    order = list(range(len(prompts)))
    if args.hf_sort:
        order.sort(key=lambda i: len(prompts[i]))
    pad = 2

    class FirstCall(LogitsProcessor):
        def __init__(self) -> None:
            self.t = None

        def __call__(self, input_ids, scores):
            if self.t is None:
                self.t = time.perf_counter()
            return scores

    def batch_tensors(batch):
        width = max(len(p) for p in batch)
        ids = torch.full((len(batch), width), pad, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for j, p in enumerate(batch):
            ids[j, width - len(p) :] = torch.tensor(p)
            mask[j, width - len(p) :] = 1
        return ids, mask

    with torch.inference_mode():  # warm-up
        ids, mask = batch_tensors([prompts[0][:32]])
        model.generate(
            ids, attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=pad
        )
    prefill_time = 0.0
    num_out = 0
    t0 = time.perf_counter()
    for b in range(0, len(order), args.hf_batch_size):
        batch = [prompts[i] for i in order[b : b + args.hf_batch_size]]
        ids, mask = batch_tensors(batch)
        first = FirstCall()
        tb = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=args.output_len,
                min_new_tokens=args.output_len,
                do_sample=False,
                pad_token_id=pad,
                logits_processor=LogitsProcessorList([first]),
            )
        prefill_time += first.t - tb
        num_out += (out.shape[1] - ids.shape[1]) * len(batch)
    total = time.perf_counter() - t0
    num_prompt = sum(len(p) for p in prompts)
    return {
        "engine": f"HF transformers generate (batch {args.hf_batch_size}"
        + (", length-sorted)" if args.hf_sort else ")"),
        "max_num_batched_tokens": None,
        "dtype": str(dtype).removeprefix("torch."),
        "num_prompt_tokens": num_prompt,
        "num_output_tokens": num_out,
        "total_time_s": total,
        "total_tok_s": (num_prompt + num_out) / total,
        "output_tok_s": num_out / total,
        "prefill_tok_s": num_prompt / prefill_time,
        "decode_tok_s": num_out / (total - prefill_time),
        "peak_rss_mib": peak_rss_mib(),
    }


def child(args: argparse.Namespace) -> None:
    if args.child == "hf":
        result = run_hf(args)
    else:
        result = run_chunkserve(args, args.child)
    print("RESULT " + json.dumps(result), flush=True)


def render(results: list[dict], args: argparse.Namespace, meta: dict) -> str:
    lines = [
        "# Offline throughput",
        "",
        f"{meta['date']}, {meta['machine']}, commit {meta.get('commit')}. "
        f"{args.num_prompts} prompts of prose, "
        f"{args.min_len}..{args.max_len} tokens (uniform, seed {args.seed}), "
        f"{args.output_len} output tokens each, {args.threads} torch threads.",
        "",
        f"Command: `{meta['command']}`",
        "",
        "| engine | total tok/s | output tok/s | prefill tok/s | decode tok/s | total s "
        "| peak RSS MiB |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        name = r["engine"]
        if r.get("attention_backend"):
            name += f" ({r['attention_backend']} attention)"
        lines.append(
            f"| {name} | {r['total_tok_s']:.0f} | {r['output_tok_s']:.1f} | "
            f"{r['prefill_tok_s']:.0f} | {r['decode_tok_s']:.1f} | {r['total_time_s']:.1f} | "
            f"{r['peak_rss_mib']:.0f} |"
        )
    hf = next((r for r in results if r["engine"].startswith("HF")), None)
    lines.append("")
    for r in results:
        if hf is not None and r is not hf:
            lines.append(
                f"- {r['engine']}: {r['total_tok_s'] / hf['total_tok_s']:.2f}x HF's "
                f"total throughput."
            )
        if "overhead_fraction" in r:
            lines.append(
                f"- {r['engine']} split over {r['split_steps']} steps with "
                f"{r['split_running']} running: scheduler {r['schedule_ms_per_step']:.2f} ms + "
                f"batch building {r['layout_ms_per_step']:.2f} ms of {r['step_ms']:.1f} ms per "
                f"step = {100 * r['overhead_fraction']:.1f}%."
            )
    return "\n".join(lines) + "\n"


def main() -> None:
    from chunkserve.provenance import cpu_description, git_commit

    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--modes", default="defaults,adaptive,chunked,unchunked,hf")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--min-len", type=int, default=20)
    p.add_argument("--max-len", type=int, default=1500)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--budget", type=int, default=512, help="chunked max_num_batched_tokens")
    p.add_argument("--unchunked-budget", type=int, default=2048)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument(
        "--dtype", default="auto", help="both engines: auto (bf16 where the CPU has it), float32"
    )
    p.add_argument("--hf-batch-size", type=int, default=16)
    p.add_argument(
        "--hf-sort",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="sort prompts by length into HF batches (less padding: HF's best case)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--name", default="offline_throughput")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(args)
        return
    results = []
    for mode in args.modes.split(","):
        cmd = [sys.executable, __file__, "--child", mode, *sys.argv[1:]]
        print(f"== {mode}: running in a subprocess", flush=True)
        proc = subprocess.run(cmd, capture_output=True, text=True)
        line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
        if proc.returncode != 0 or line is None:
            sys.stderr.write(proc.stdout[-3000:] + proc.stderr[-3000:])
            raise SystemExit(f"{mode} failed")
        result = json.loads(line.removeprefix("RESULT "))
        print(json.dumps(result, indent=1), flush=True)
        results.append(result)
    meta = {
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": cpu_description() + ", CPU only",
        "commit": git_commit(),
        "command": "python benchmarks/offline_throughput.py " + " ".join(sys.argv[1:]),
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{args.name}.json").write_text(
        json.dumps({"meta": meta, "args": vars(args), "results": results}, indent=2)
    )
    report = render(results, args, meta)
    (RESULTS / f"{args.name}.md").write_text(report)
    print(report)


if __name__ == "__main__":
    main()
