"""The embedded model (SmolLM2-135M, Q4_1 layers and a Q8_0 tied embedding) kept in its bits
against the same file dequantized to bf16 at load (``LLM(gguf_dequantize=True)``), both in
bf16 at ``--threads`` threads, in one process, the two engines taking turns run after run (a
busy machine slows both alike):

- **batch-1 decode**: one short prompt, ``--decode-len`` output tokens: output tokens / time
  after the first token (the median over ``--repeats``);
- **offline throughput**: ``--num-prompts`` prose prompts of 50..400 tokens,
  ``--output-len`` output tokens each (EOS ignored): prompt + output tokens / wall time and
  output tokens / wall time (the median over ``--repeats``);
- the weights' resident bytes.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/quant_embedded.py --threads 1

Writes ``quant_embedded_t<threads>.json`` and ``.md`` under ``--out-dir`` naming the CPU, the
kernel options and the load average at each run.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

from chunkserve import LLM, SamplingParams
from chunkserve.bench.prose import prose_prompts
from chunkserve.provenance import cpu_description, git_commit
from chunkserve.quant import kernels


def decode_rate(llm: LLM, prompt: list[int], n: int) -> float:
    """Output tokens per second after the first token, one request."""
    params = SamplingParams(max_tokens=n, min_tokens=n, temperature=0.0, ignore_eos=True)
    engine = llm.engine
    engine.add_request(prompt, params)
    first = None
    while engine.has_unfinished():
        engine.step()
        if first is None:
            first = time.perf_counter()
    return (n - 1) / (time.perf_counter() - first)


def throughput(llm: LLM, prompts: list[list[int]], n: int) -> tuple[float, float]:
    params = SamplingParams(max_tokens=n, min_tokens=n, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    dt = time.perf_counter() - t0
    out_tokens = sum(len(o.token_ids) for o in outs)
    return (sum(map(len, prompts)) + out_tokens) / dt, out_tokens / dt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--decode-len", type=int, default=64)
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--out-dir", default="benchmarks/results")
    args = ap.parse_args()
    common = dict(dtype="bfloat16", num_threads=args.threads, max_model_len=1024)
    engines = {
        "kept_in_bits": LLM(**common),
        "dequantized_bf16": LLM(**common, gguf_dequantize=True),
    }
    tok = engines["kept_in_bits"].tokenizer
    rng = random.Random(0)
    prompts = prose_prompts(tok, [rng.randint(50, 400) for _ in range(args.num_prompts)], rng)
    short = prose_prompts(tok, [24], random.Random(1))[0]
    runs: dict[str, dict[str, list[float]]] = {
        name: {"decode_tok_s": [], "total_tok_s": [], "output_tok_s": [], "load": []}
        for name in engines
    }
    for llm in engines.values():  # warm-up
        throughput(llm, prompts[:2], 4)
        decode_rate(llm, short, 4)
    for r in range(args.repeats):
        for name, llm in engines.items():
            runs[name]["load"].append(os.getloadavg()[0])
            runs[name]["decode_tok_s"].append(decode_rate(llm, short, args.decode_len))
            total, out = throughput(llm, prompts, args.output_len)
            runs[name]["total_tok_s"].append(total)
            runs[name]["output_tok_s"].append(out)
            print(
                f"run {r} {name}: decode {runs[name]['decode_tok_s'][-1]:.1f} tok/s, "
                f"offline {total:.1f} tok/s ({out:.1f} output tok/s), "
                f"load {runs[name]['load'][-1]:.2f}",
                flush=True,
            )
    k = kernels.load()
    summary = {
        name: {
            **{f"median_{key}": statistics.median(v) for key, v in r.items() if key != "load"},
            "runs": r,
            "weight_bytes": engines[name].engine.core.worker.model.weight_bytes(),
        }
        for name, r in runs.items()
    }
    result = {
        "benchmark": "quant_embedded",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": cpu_description(),
        "kernel": None if k is None else {"simd": k.simd, "amx": k.amx},
        "float_kernel_opt_in": kernels.float_kernel(),
        "threads": args.threads,
        "args": vars(args),
        "note": "the engines take turns (a busy machine slows both alike); the load averages "
        "say how busy",
        "command": " ".join(["benchmarks/quant_embedded.py", *sys.argv[1:]]),
        "commit": git_commit(),
        "results": summary,
    }
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"quant_embedded_t{args.threads}"
    stem.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    q, d = summary["kept_in_bits"], summary["dequantized_bf16"]
    lines = [
        f"# The embedded model kept in its bits vs dequantized to bf16 ({result['date']})",
        "",
        f"- machine: {result['machine']}; kernel: {result['kernel']}; "
        f"float opt-in: {result['float_kernel_opt_in']}; {args.threads} thread(s)",
        f"- {result['note']}; 1-minute load average at each run: "
        + ", ".join(f"{v:.2f}" for n in runs for v in runs[n]["load"]),
        f"- command: `{result['command']}` at commit {result['commit']}",
        "",
        "| engine | batch-1 decode tok/s | offline tok/s (in+out) | offline output tok/s "
        "| weight MiB |",
        "|---|---|---|---|---|",
    ]
    for name, s in summary.items():
        lines.append(
            f"| {name} | {s['median_decode_tok_s']:.1f} | {s['median_total_tok_s']:.1f} | "
            f"{s['median_output_tok_s']:.1f} | {s['weight_bytes'] / 2**20:.0f} |"
        )
    lines += [
        "",
        f"Kept in bits / dequantized: decode "
        f"{q['median_decode_tok_s'] / d['median_decode_tok_s']:.2f}x, offline "
        f"{q['median_total_tok_s'] / d['median_total_tok_s']:.2f}x (medians).",
    ]
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
