"""``--quantization int4``'s group size (``weight_only.LOAD_GROUP_SIZE``): what each of
``INT4_GROUP_SIZES`` costs in speed and memory, and what it saves in weight error, on this
CPU.

Per group size and weight shape: the time of ``Int4Weight.matmul`` on bf16 rows (torch's
``_weight_int4pack_mm_for_cpu`` up to ``INT4_KERNEL_ROWS`` rows, dequantized tiles beyond),
the median of ``--repeats`` rounds in which the group sizes take turns (a busy machine slows
all alike; ``--clock cpu``, the process's CPU time, is steadier there with one thread); the
weight's bytes in memory after a call (the nibbles, fp32 scale and low, and the kernel's packed
copy with its bf16 scales and zeros); and the error of the quantized weight, relative to its
norm, on random weights: normal values, and Student-t values with 4 degrees of freedom (heavy
tails, as trained weights have: a group's range, so its step, grows with its largest value).
The perplexity of a model quantized with each group is ``benchmarks/quant_quality.py``'s
(``benchmarks/results/quant_quality_int4_groups.md``).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/int4_group_sizes.py --threads 1 --clock cpu

Writes ``int4_group_sizes.json`` and ``.md`` under ``--out-dir`` (``benchmarks/results``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

from chunkserve.provenance import cpu_description, git_commit
from chunkserve.quant import weight_only
from chunkserve.quant.weight_only import INT4_GROUP_SIZES, Int4Weight

SHAPES = [(2048, 2048), (5632, 2048)]  # (out, in)


def weights(out_features: int, in_features: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    normal = torch.randn(out_features, in_features, generator=gen) * 0.02
    # Student-t(4) = normal / sqrt(chi2(4) / 4), chi2(4) the sum of 4 squared normals
    chi2 = torch.randn(4, out_features, in_features, generator=gen).square().sum(0)
    heavy = torch.randn(out_features, in_features, generator=gen) / (chi2 / 4).sqrt() * 0.02
    return {"normal": normal, "student_t4": heavy}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 64, 256])
    ap.add_argument(
        "--shapes", nargs="+", default=[f"{o}x{i}" for o, i in SHAPES], help="OUTxIN ..."
    )
    ap.add_argument("--clock", choices=["wall", "cpu"], default="wall")
    ap.add_argument("--out-dir", default="benchmarks/results")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    rows: list[dict] = []
    for shape in args.shapes:
        out_features, in_features = (int(v) for v in shape.split("x"))
        ws = weights(out_features, in_features)
        qs = {g: Int4Weight.quantize(ws["normal"], g) for g in INT4_GROUP_SIZES}
        errors = {
            g: {
                kind: float((Int4Weight.quantize(w, g).dequantize() - w).norm() / w.norm())
                for kind, w in ws.items()
            }
            for g in INT4_GROUP_SIZES
        }
        for m in args.rows:
            x = torch.randn(m, in_features).bfloat16()
            load = os.getloadavg()[0]
            times: dict[int, list[float]] = {g: [] for g in INT4_GROUP_SIZES}
            with torch.inference_mode():
                for q in qs.values():
                    q.matmul(x)  # warm-up (and the kernel's packing)
                for _ in range(args.repeats):
                    for g, q in qs.items():
                        t0 = clock()
                        q.matmul(x)
                        times[g].append(clock() - t0)
            for g, q in qs.items():
                row = {
                    "shape": [out_features, in_features],
                    "group_size": g,
                    "rows": m,
                    "path": "torch int4 kernel"
                    if m <= weight_only.INT4_KERNEL_ROWS[torch.bfloat16]
                    else "dequantized tiles",
                    "median_ms": statistics.median(times[g]) * 1e3,
                    "min_ms": min(times[g]) * 1e3,
                    "weight_bytes": q.nbytes,
                    "bits_per_weight": 8 * q.nbytes / (out_features * in_features),
                    "rel_error": errors[g],
                    "load_average_1min": load,
                }
                rows.append(row)
                print(json.dumps(row), flush=True)
    result = {
        "benchmark": "int4_group_sizes",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": cpu_description(),
        "torch": torch.__version__,
        "threads": args.threads,
        "clock": args.clock,
        "load_average_at_end": os.getloadavg(),
        "note": "machine shared with other jobs (2 cores); the group sizes take turns",
        "command": " ".join(["benchmarks/int4_group_sizes.py", *sys.argv[1:]]),
        "commit": git_commit(),
        "load_group_size": weight_only.LOAD_GROUP_SIZE,
        "results": rows,
    }
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "int4_group_sizes.json").write_text(json.dumps(result, indent=2) + "\n")
    lines = [
        f"# int4 weight-only group sizes ({result['date']})",
        "",
        f"- machine: {result['machine']}; torch {result['torch']}; {args.threads} thread(s); "
        f"{args.clock} time",
        f"- {result['note']}; load average at the end: "
        + ", ".join(f"{v:.2f}" for v in result["load_average_at_end"]),
        f"- command: `{result['command']}` at commit {result['commit']}",
        "",
        "Median (min) ms of one bf16 `Int4Weight.matmul`; bits per weight in memory after a "
        "call (with the kernel's packed copy); the quantized weight's error relative to its "
        "norm, normal and Student-t(4) random values; load: the 1-minute load average when "
        "the row started.",
        "",
        "| out x in | M | path | group | ms | bits/weight | error (normal) | error (t4) | load |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['shape'][0]}x{r['shape'][1]} | {r['rows']} | {r['path']} | "
            f"{r['group_size']} | {r['median_ms']:.3f} ({r['min_ms']:.3f}) | "
            f"{r['bits_per_weight']:.2f} | {r['rel_error']['normal']:.4f} | "
            f"{r['rel_error']['student_t4']:.4f} | {r['load_average_1min']:.2f} |"
        )
    (out / "int4_group_sizes.md").write_text("\n".join(lines) + "\n")
    print(f"wrote {out}/int4_group_sizes.json and .md")


if __name__ == "__main__":
    main()
