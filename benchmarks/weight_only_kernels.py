"""Weight-only int8 / int4 matmul paths on this CPU: torch's kernels
(``torch._weight_int8pack_mm``, ``torch._weight_int4pack_mm_for_cpu``) against dequantize +
``F.linear`` and the unquantized float matmul, over rows M (decode: 1..16, prefill: 256), in
fp32 and bf16, at ``--threads`` (1 by default). This is what set ``INT8_KERNEL_ROWS`` and
``INT4_KERNEL_ROWS`` in ``chunkserve/quant/weight_only.py``.

Each number is the best of ``--repeats`` timed calls (a shared machine's noise only adds).
Writes ``benchmarks/results/weight_only_kernels.json`` and ``.md``.

    PYTHONPATH=$PWD python benchmarks/weight_only_kernels.py --threads 1"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from chunkserve.bench.sweep import machine_description
from chunkserve.provenance import git_commit
from chunkserve.quant import weight_only
from chunkserve.quant.weight_only import Int4Weight, Int8Weight

RESULTS = Path(__file__).resolve().parent / "results"


def best_ms(fn, repeats: int) -> float:
    fn()  # warm-up (and the int4 kernel's one-time packing)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return round(1e3 * min(times), 3)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out-features", type=int, default=5632)
    ap.add_argument("--in-features", type=int, default=2048)
    ap.add_argument("--rows", default="1,4,8,16,32,256")
    ap.add_argument("--group-size", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--note", default="2 cores shared with other work during the run")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    n, k = args.out_features, args.in_features
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(0)) * 0.02
    q8 = Int8Weight.quantize(w)
    q4 = Int4Weight.quantize(w, args.group_size)
    rows = [int(m) for m in args.rows.split(",")]
    table = []
    for dtype in (torch.bfloat16, torch.float32):
        wf = w.to(dtype)
        scale8 = q8.scale.to(dtype)
        packed4, zeros4 = q4._kernel_args(dtype)
        for m in rows:
            x = torch.randn(m, k).to(dtype)
            r = {"dtype": str(dtype).removeprefix("torch."), "M": m}
            r["float_ms"] = best_ms(lambda x=x, wf=wf: F.linear(x, wf), args.repeats)
            r["int8_kernel_ms"] = best_ms(
                lambda x=x, s=scale8: torch._weight_int8pack_mm(x, q8.q, s), args.repeats
            )
            r["int8_dequant_ms"] = best_ms(lambda x=x: weight_only._tiled(q8, x), args.repeats)
            r["int4_kernel_ms"] = best_ms(
                lambda x=x, p=packed4, z=zeros4: torch._weight_int4pack_mm_for_cpu(
                    x, p, args.group_size, z
                ),
                args.repeats,
            )
            r["int4_dequant_ms"] = best_ms(lambda x=x: weight_only._tiled(q4, x), args.repeats)
            table.append(r)
            print(json.dumps(r), flush=True)
    doc = {
        "machine": machine_description(),
        "note": args.note,
        "commit": git_commit(),
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "threads": args.threads,
        "shape": [n, k],
        "group_size": args.group_size,
        "thresholds": {
            name: {str(k).removeprefix("torch."): v for k, v in rows.items()}
            for name, rows in (
                ("INT8_KERNEL_ROWS", weight_only.INT8_KERNEL_ROWS),
                ("INT4_KERNEL_ROWS", weight_only.INT4_KERNEL_ROWS),
            )
        },
        "results": table,
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "weight_only_kernels.json").write_text(json.dumps(doc, indent=2) + "\n")
    cols = ["float_ms", "int8_kernel_ms", "int8_dequant_ms", "int4_kernel_ms", "int4_dequant_ms"]
    lines = [
        f"# Weight-only int8/int4 matmul paths, [{n} x {k}] weight, int4 group {args.group_size}",
        "",
        f"{doc['machine']}, {args.threads} thread(s), torch {torch.__version__}, commit "
        f"{doc['commit']}, {doc['date']} ({args.note}). Best of {args.repeats}, ms per call.",
        "",
        "| dtype | M | " + " | ".join(cols) + " |",
        "|---|---|" + "---|" * len(cols),
    ]
    for r in table:
        lines.append(f"| {r['dtype']} | {r['M']} | " + " | ".join(str(r[c]) for c in cols) + " |")
    (RESULTS / "weight_only_kernels.md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
