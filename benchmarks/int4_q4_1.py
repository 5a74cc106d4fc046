"""``--quantization int4`` before / after issue 43's Q4_1 change, on a float checkpoint (the
embedded model's fp32 HF copy, SmolLM2-135M, as ``quant_quality.py`` makes it), bf16, in one
process, the two engines taking turns run after run (a busy machine slows both alike):

- ``int4_before``: the previous path, ``Int4Weight`` in groups of 32 (fp32 scale / low, torch's
  ``_weight_int4pack_mm_for_cpu`` up to 64 rows, dequantized tiles beyond), forced here by
  making ``weight_only.quantize_blocks`` decline every weight;
- ``int4_after``: GGML Q4_1 ``GGUFWeight`` blocks (``weight_only.quantize_blocks``) on the
  block kernels of ``quant.kernels``.

Per engine: bits a weight resident in the linear layers (their bytes after the first steps,
torch's packed copy included, over their parameters), batch-1 decode (output tokens / s after
the first token, one short prompt), the time of one ``--prefill``-token prompt to its first
token, and perplexity on ``--windows`` windows of the shipped prose (``quant_quality.py``'s
teacher forcing) with the unquantized model's as reference.

``--int8``: also ``--quantization int8`` before (``Int8Weight``, one fp32 scale a row, torch's
``_weight_int8pack_mm``; forced the same way) and after (GGML Q8_0 blocks).

    OMP_NUM_THREADS=1 PYTHONPATH=$PWD .venv/bin/python benchmarks/int4_q4_1.py --threads 1 --int8
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

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from quant_embedded import decode_rate
from quant_quality import row_log_probs

from chunkserve import LLM, SamplingParams
from chunkserve.bench.embedded_hf import embedded_hf_copy
from chunkserve.bench.prose import prose_prompts, prose_tokens
from chunkserve.model.layers import ColumnParallelLinear, RowParallelLinear
from chunkserve.provenance import cpu_description, git_commit
from chunkserve.quant import kernels, weight_only

ROOT = Path(__file__).resolve().parent.parent


def linear_bits(model) -> tuple[float, str]:
    linears = [
        m for m in model.modules() if isinstance(m, (ColumnParallelLinear, RowParallelLinear))
    ]
    qs = [m.qweight for m in linears if m.qweight is not None]
    params = sum(q.shape[0] * q.shape[1] for q in qs)
    kinds = sorted({f"{type(q).__name__}:{q.qtype}" for q in qs})
    return 8 * sum(q.nbytes for q in qs) / params, "+".join(kinds)


def prefill_s(llm: LLM, prompt: list[int]) -> float:
    params = SamplingParams(max_tokens=1, temperature=0.0)
    t0 = time.perf_counter()
    llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    return time.perf_counter() - t0


def perplexity(llm: LLM, windows: int, window: int, reference: list | None) -> dict:
    engine = llm.engine
    tokens = prose_tokens(engine.tokenizer)
    step = (len(tokens) - window) // windows
    nll, n, agree, rows = 0.0, 0, 0, []
    for w in range(windows):
        ids = tokens[w * step : w * step + window]
        lp = row_log_probs(engine, ids, 256)[:-1]
        nll -= float(lp.gather(1, torch.tensor(ids[1:])[:, None]).sum())
        n += len(ids) - 1
        rows.append(lp)
        if reference is not None:
            agree += int((lp.argmax(-1) == reference[w].argmax(-1)).sum())
    return {
        "perplexity": round(float(torch.exp(torch.tensor(nll / n))), 4),
        "top1_agreement": None if reference is None else round(agree / n, 4),
        "rows": rows,
    }


def best_ms(f, calls: int, rounds: int = 5) -> float:
    f()
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(calls):
            f()
        times.append((time.perf_counter() - t0) / calls * 1e3)
    return min(times)


def kernel_table(shapes: list[tuple[int, int]], rows: list[int]) -> list[dict]:
    """Best-of-5 ms of one bf16 ``matmul`` per weight kind, the kinds interleaved per shape."""
    from chunkserve.quant.weight_only import Int4Weight, Int8Weight

    table = []
    for out, inn in shapes:
        w = torch.randn(out, inn, generator=torch.Generator().manual_seed(0)) * 0.02
        kinds = {
            "int4_before (Int4Weight g32)": Int4Weight.quantize(w, 32),
            "int4_after (Q4_1)": weight_only.quantize_blocks(w, "Q4_1"),
            "int8 (Int8Weight)": Int8Weight.quantize(w),
            "int8 as Q8_0": weight_only.quantize_blocks(w, "Q8_0"),
        }
        for m in rows:
            x = torch.randn(m, inn).to(torch.bfloat16)
            calls = max(3, int(2e5 // (out * inn // 1000 * m)))
            row = {"shape": f"{out}x{inn}", "M": m, "load": os.getloadavg()[0]}
            for name, q in kinds.items():
                row[name] = round(best_ms(lambda q=q, x=x: q.matmul(x), calls), 4)
            print(row, flush=True)
            table.append(row)
    return table


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hf-dir", default=str(ROOT / ".cache" / "tests" / "smollm2-hf"))
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--decode-len", type=int, default=32)
    ap.add_argument("--prefill", type=int, default=256)
    ap.add_argument("--windows", type=int, default=2)
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--int8", action="store_true", help="also int8 per channel against Q8_0")
    ap.add_argument("--out-dir", default="benchmarks/results")
    ap.add_argument("--kernels-only", action="store_true", help="only the per-call table")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.kernels_only:
        shapes = [(960, 576), (3072, 576), (576, 1536), (2048, 2048), (5632, 2048)]
        table = kernel_table(shapes, [1, 4, 16, 64, 256])
        out = Path(args.out_dir) / "int4_q4_1_kernels.json"
        doc = {"machine": cpu_description(), "threads": args.threads, "commit": git_commit()}
        out.write_text(json.dumps({**doc, "rows": table}, indent=2) + "\n")
        return
    hf_dir = embedded_hf_copy(Path(args.hf_dir))
    common = dict(
        model=str(hf_dir),
        dtype="bfloat16",
        num_threads=args.threads,
        max_model_len=1024,
        kv_cache_memory=64 << 20,
    )
    real = weight_only.quantize_blocks
    weight_only.quantize_blocks = lambda *a, **k: None  # the previous paths
    engines = {"int4_before": LLM(**common, quantization="int4")}
    if args.int8:
        engines["int8_before"] = LLM(**common, quantization="int8")
    weight_only.quantize_blocks = real
    engines["int4_after"] = LLM(**common, quantization="int4")
    if args.int8:
        engines["int8_after"] = LLM(**common, quantization="int8")
    tok = engines["int4_after"].tokenizer
    short = prose_prompts(tok, [24], random.Random(1))[0]
    long = prose_prompts(tok, [args.prefill], random.Random(2))[0]
    for llm in engines.values():  # warm-up (torch's int4 packed copy is made here)
        decode_rate(llm, short, 4)
        prefill_s(llm, long)
    runs = {n: {"decode_tok_s": [], "prefill_s": [], "load": []} for n in engines}
    for r in range(args.repeats):
        order = list(engines.items())
        for name, llm in order if r % 2 == 0 else order[::-1]:  # neither always first
            runs[name]["load"].append(os.getloadavg()[0])
            runs[name]["decode_tok_s"].append(decode_rate(llm, short, args.decode_len))
            runs[name]["prefill_s"].append(prefill_s(llm, long))
            print(f"run {r} {name}: { ({k: v[-1] for k, v in runs[name].items()}) }", flush=True)
    results = {}
    plain = LLM(**common)
    ref = perplexity(plain, args.windows, args.window, None)
    results["none"] = {"perplexity": ref["perplexity"]}
    del plain
    for name, llm in engines.items():
        bits, kinds = linear_bits(llm.engine.core.worker.model)
        ppl = perplexity(llm, args.windows, args.window, ref["rows"])
        results[name] = {
            "linear_weights": kinds,
            "linear_bits_per_weight": round(bits, 3),
            "model_weight_mib": round(llm.engine.core.worker.model.weight_bytes() / 2**20, 1),
            "median_decode_tok_s": round(statistics.median(runs[name]["decode_tok_s"]), 2),
            "median_prefill_s": round(statistics.median(runs[name]["prefill_s"]), 3),
            "perplexity": ppl["perplexity"],
            "top1_agreement_vs_unquantized": ppl["top1_agreement"],
            "runs": runs[name],
        }
        print(name, {k: v for k, v in results[name].items() if k != "runs"}, flush=True)
    k = kernels.load()
    doc = {
        "benchmark": "int4_q4_1",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": cpu_description(),
        "kernel": None if k is None else {"simd": k.simd, "amx": k.amx},
        "threads": args.threads,
        "args": vars(args),
        "note": "2 cores shared with other helpers' jobs (load average per run in runs.load)",
        "command": " ".join(["benchmarks/int4_q4_1.py", *sys.argv[1:]]),
        "commit": git_commit(),
        "results": results,
    }
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "int4_q4_1.json").write_text(json.dumps(doc, indent=2) + "\n")


if __name__ == "__main__":
    main()
