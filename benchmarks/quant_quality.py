"""Quality of ``--quantization int8|int4`` (weight-only, at load): perplexity of the embedded
model's HF copy (SmolLM2-135M-Instruct, fp32 safetensors made from its GGUF, as the test
suite's ``hf_dir`` fixture does) on the prose shipped with the package
(``chunkserve/bench/data/shakespeare.txt.gz``), unquantized against int8 and int4.

``--windows`` windows of ``--window`` tokens from fixed offsets of the tokenized prose are
teacher-forced through the engine's model (in chunks of ``--chunk`` tokens, each attending
to the cached earlier ones); perplexity = exp(mean negative log-likelihood of each next
token). Also reported: how often the quantized model's top-1 prediction equals the
unquantized one's, the mean KL divergence from the unquantized next-token distribution, and
the linear layers' resident bytes. ``int4-g64`` (in ``--methods``): int4 preferring groups
of 64 (plain ``int4``: ``weight_only.LOAD_GROUP_SIZE``, 32; the embedded model's values are
Q4_1, groups of 32 already, so group 32 reproduces them exactly).

Writes ``benchmarks/results/quant_quality.json`` and ``.md`` (machine, commit, numbers).

    PYTHONPATH=$PWD python benchmarks/quant_quality.py --threads 1"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from chunkserve.bench.embedded_hf import embedded_hf_copy

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"


def row_log_probs(engine, token_ids: list[int], chunk: int) -> torch.Tensor:
    """Log-softmax of the logits of every row of ``token_ids`` [len, vocab] (fp32)."""
    from chunkserve.scheduling.request import Request
    from chunkserve.scheduling.sampling_params import SamplingParams
    from chunkserve.scheduling.scheduler import ScheduledChunk, SchedulerOutput

    worker = engine.core.worker
    req = Request("ppl", token_ids, SamplingParams(max_tokens=1), max_tokens=1)
    rows = []
    try:
        for start in range(0, len(token_ids), chunk):
            n = min(chunk, len(token_ids) - start)
            if not engine.core.kv.allocate_slots(req, n):
                raise RuntimeError("KV cache too small for a window")
            out = SchedulerOutput(prefills=[ScheduledChunk(req, start, n)])
            with torch.inference_mode():
                layout, _ = worker.runner.build_layout(out)
                meta = worker.runner.prepare(layout)
                hidden = worker.model(layout, worker.runner.kv_caches, worker.runner.attn, meta)
                logits = worker.model.compute_logits(hidden[:n]).float()
                rows.append(torch.log_softmax(logits, dim=-1))
            req.num_computed_tokens += n
    finally:
        engine.core.kv.free(req)
    return torch.cat(rows)


def linear_bytes(model) -> int:
    from chunkserve.model.layers import ColumnParallelLinear, RowParallelLinear, weight_nbytes

    return sum(
        weight_nbytes(m.qweight if m.qweight is not None else m.weight)
        for m in model.modules()
        if isinstance(m, (ColumnParallelLinear, RowParallelLinear))
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hf-dir", default=str(ROOT / ".cache" / "tests" / "smollm2-hf"))
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument(
        "--methods", default="none,int8,int4", help="none first; int4-g32/-g64: int4's group"
    )
    ap.add_argument("--windows", type=int, default=4)
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out-name", default="quant_quality", help="results/<name>.json and .md")
    ap.add_argument("--note", default="2 cores shared with other work during the run")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from chunkserve.bench.prose import prose_tokens
    from chunkserve.bench.sweep import machine_description
    from chunkserve.engine.engine import Engine
    from chunkserve.provenance import git_commit
    from chunkserve.quant import weight_only

    hf_dir = embedded_hf_copy(Path(args.hf_dir))
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    if methods[0] != "none":
        sys.exit("--methods: the first must be none (the reference)")
    results = []
    default_group = weight_only.LOAD_GROUP_SIZE
    for dtype in [d.strip() for d in args.dtypes.split(",") if d.strip()]:
        reference: list[torch.Tensor] = []
        for method in methods:
            t0 = time.perf_counter()
            # "int4-g32": int4 preferring groups of 32 (the load's group, set in-process).
            base, _, group = method.partition("-g")
            weight_only.LOAD_GROUP_SIZE = int(group) if group else default_group
            engine = Engine(
                model=str(hf_dir),
                dtype=dtype,
                quantization=None if base == "none" else base,
                num_threads=args.threads,
                max_model_len=args.window,
                kv_cache_memory=64 << 20,
            )
            load_s = time.perf_counter() - t0
            tokens = prose_tokens(engine.tokenizer)
            step = (len(tokens) - args.window) // args.windows
            nll, n, agree, kl = 0.0, 0, 0, 0.0
            t0 = time.perf_counter()
            for w in range(args.windows):
                ids = tokens[w * step : w * step + args.window]
                lp = row_log_probs(engine, ids, args.chunk)[:-1]
                target = torch.tensor(ids[1:])
                nll -= float(lp.gather(1, target[:, None]).sum())
                n += len(target)
                if method == "none":
                    reference.append(lp)
                else:
                    ref = reference[w]
                    agree += int((lp.argmax(-1) == ref.argmax(-1)).sum())
                    kl += float((ref.exp() * (ref - lp)).sum())
            row = {
                "dtype": dtype,
                "quantization": method,
                "perplexity": round(float(torch.exp(torch.tensor(nll / n))), 4),
                "tokens": n,
                "top1_agreement": None if method == "none" else round(agree / n, 4),
                "mean_kl": None if method == "none" else round(kl / n, 5),
                "linear_weight_mib": round(linear_bytes(engine.core.worker.model) / 2**20, 2),
                "load_s": round(load_s, 1),
                "eval_s": round(time.perf_counter() - t0, 1),
            }
            results.append(row)
            print(json.dumps(row), flush=True)
            engine.shutdown()
    doc = {
        "machine": machine_description(),
        "note": args.note,
        "commit": git_commit(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "threads": args.threads,
        "model": "SmolLM2-135M-Instruct, HF fp32 copy of the embedded GGUF (Q4_1/Q8_0 values)",
        "text": f"chunkserve/bench/data/shakespeare.txt.gz, {args.windows} windows of "
        f"{args.window} tokens, chunks of {args.chunk}",
        "results": results,
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{args.out_name}.json").write_text(json.dumps(doc, indent=2) + "\n")
    lines = [
        "# Weight-only int8 / int4 quality (perplexity on the shipped prose)",
        "",
        f"{doc['model']}; {doc['text']}. {doc['machine']}, {args.threads} thread(s), commit "
        f"{doc['commit']}, {doc['date']} ({args.note}).",
        "",
        "| dtype | quantization | perplexity | top-1 agreement | mean KL | linear weights MiB |",
        "|---|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(
            f"| {r['dtype']} | {r['quantization']} | {r['perplexity']} | "
            f"{r['top1_agreement'] if r['top1_agreement'] is not None else '-'} | "
            f"{r['mean_kl'] if r['mean_kl'] is not None else '-'} | {r['linear_weight_mib']} |"
        )
    (RESULTS / f"{args.out_name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
