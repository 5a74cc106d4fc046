"""The quantized-weight kernels (``chunkserve.quant``) against bf16 ``F.linear`` on the same
weight dequantized: per GGML format and weight shape, the time of one product at M rows, the
time per row ("per token"), and the rate the quantized weight's bytes are read at.

The weights are random blocks (speed does not depend on the values): gguf-py's quantization of
normal floats for the formats it writes, random bytes with small f16 scales for K-quants. The
quantized paths run at each M (the int8-activation kernel, the default at every M; the float
decode kernel of the opt-in, up to ``kernels.DECODE_MAX_ROWS`` rows; the weight dequantized to
bf16 by the kernel, then torch, the opt-in's prefill path), and the default is compared with
bf16. Each figure is the median (and the min) of ``--repeats`` calls after a warm-up; the
calls take turns, so a busy machine slows all alike.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/quant_kernels.py --threads 1

Writes ``quant_kernels_t<threads>.json`` and ``.md`` under ``--out-dir``
(``benchmarks/results``), naming the CPU model, its bf16/VNNI/AMX flags and the load average.

``--cflags`` builds the kernels with extra compiler flags (``-mno-avx512f``: the AVX2 path on
an AVX512 machine; with ``-mno-avxvnni`` too, its vpmaddubsw dots, as on CPUs without
AVX-VNNI); ``--with-portable`` also times the int8 and float kernels' portable C in the same
rounds (the ratios say what the SIMD path gains over what the compiler makes of plain C);
``--stem`` names the result files:

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/quant_kernels.py --threads 1 --with-portable
        --cflags='-mno-avx512f -mno-avxvnni' --stem quant_kernels_avx2   (one command line)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as T
from gguf.quants import quantize as gguf_quantize

from chunkserve.provenance import cpu_description, git_commit
from chunkserve.quant import formats, kernels
from chunkserve.quant.weight import GGUFWeight

FORMATS = ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K"]
SHAPES = [(2048, 2048), (5632, 2048)]  # (out, in)


def random_weight(name: str, out_features: int, in_features: int) -> GGUFWeight:
    fmt = formats.get(name)
    rng = np.random.default_rng(0)
    if fmt.block_values == 32:
        w = rng.standard_normal((out_features, in_features)).astype(np.float32) * 0.02
        raw = gguf_quantize(w, T(fmt.code))
    else:
        raw = rng.integers(0, 256, (out_features, in_features // 256 * fmt.block_bytes), np.uint8)
        blocks = raw.reshape(-1, fmt.block_bytes)
        for off in (208,) if name == "Q6_K" else (0, 2):
            scale = (rng.random((blocks.shape[0], 1)) * 1e-3).astype(np.float16)
            blocks[:, off : off + 2] = scale.view(np.uint8)
    return GGUFWeight.from_gguf(raw, fmt.code, name)


def cpu_flags() -> list[str]:
    want = {"avx2", "avx512bw", "avx512_vnni", "avx_vnni", "avx512_bf16", "amx_bf16", "amx_int8"}
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            return sorted(want & set(line.split(":", 1)[1].split()))
    return []


@torch.inference_mode()
def time_turns(
    calls: dict[str, Callable[[], object]], repeats: int, clock: Callable[[], float]
) -> dict[str, list[float]]:
    """Seconds of each call over ``repeats`` rounds, the calls taking turns in each round."""
    for call in calls.values():
        call()
    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(repeats):
        for name, call in calls.items():
            t0 = clock()
            call()
            times[name].append(clock() - t0)
    return times


PATHS = ["int8_kernel", "int8_packed", "float_kernel", "dequant_tiles", "bf16_linear"]
PORTABLE = ["int8_portable", "float_portable"]


def paths(
    k: kernels.QuantKernels,
    w: GGUFWeight,
    dense_w: torch.Tensor,
    x: torch.Tensor,
    with_portable: bool = False,
):
    """The quantized paths and the bf16 baseline, as calls (the float kernel only where the
    float opt-in runs it, up to ``kernels.DECODE_MAX_ROWS`` rows: beyond, it is very slow);
    with ``with_portable``, the int8 and float kernels' portable C too."""
    code, k_in = w.format.code, w.in_features
    calls = {
        "int8_kernel": lambda: k.gemm(code, w.data, x),
        "float_kernel": lambda: k.gemm_float(code, w.data, x),
        "dequant_tiles": lambda: F.linear(x, k.dequantize(code, w.data, k_in, x.dtype)),
        "bf16_linear": lambda: F.linear(x, dense_w),
    }
    if k.packable(code, w.out_features):  # the layout a bf16 engine's weights take at load
        packed = k.pack(code, w.data, k_in)
        calls["int8_packed"] = lambda: k.gemm_packed(code, packed, x)
    if with_portable:
        calls["int8_portable"] = lambda: k.gemm(code, w.data, x, portable=True)
        calls["float_portable"] = lambda: k.gemm_float(code, w.data, x, portable=True)
    if x.shape[0] > kernels.DECODE_MAX_ROWS:
        calls.pop("float_kernel")
        calls.pop("float_portable", None)
    return calls


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 64, 512])
    ap.add_argument("--formats", nargs="+", default=FORMATS)
    ap.add_argument(
        "--shapes", nargs="+", default=[f"{o}x{i}" for o, i in SHAPES], help="OUTxIN ..."
    )
    ap.add_argument(
        "--clock",
        choices=["wall", "cpu"],
        default="wall",
        help="cpu: the process's CPU time (time.process_time), steadier than wall time on a "
        "machine shared with other work; meaningful with --threads 1",
    )
    ap.add_argument("--out-dir", default="benchmarks/results")
    ap.add_argument(
        "--cflags",
        default="",
        help="extra compiler flags for the kernels' build, one string: "
        "--cflags='-mno-avx512f -mno-avxvnni'",
    )
    ap.add_argument(
        "--with-portable",
        action="store_true",
        help="also time the int8 and float kernels' portable C path",
    )
    ap.add_argument("--stem", help="result files' name (default quant_kernels_t<threads>)")
    ap.add_argument("--note", default="", help="added to the result's note (e.g. the env)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    cflags = args.cflags.split()
    if cflags:
        k = kernels._load(tuple(cflags))
    else:
        k = kernels.load()
        if k is None:
            sys.exit(f"the quant kernels did not build: {kernels.load_error()}")
    rows: list[dict[str, Any]] = []
    for name in args.formats:
        for shape in args.shapes:
            out_features, in_features = (int(v) for v in shape.split("x"))
            w = random_weight(name, out_features, in_features)
            dense_w = w.dequantize(torch.bfloat16)
            for m in args.rows:
                x = torch.randn(m, in_features).bfloat16()
                load = os.getloadavg()[0]
                clock = time.process_time if args.clock == "cpu" else time.perf_counter
                calls = paths(k, w, dense_w, x, args.with_portable)
                times = time_turns(calls, args.repeats, clock)
                med = {p: statistics.median(t) for p, t in times.items()}
                best = {p: min(t) for p, t in times.items()}
                picked = "int8_packed" if "int8_packed" in med else "int8_kernel"
                tq, tb = med[picked], med["bf16_linear"]
                row = {
                    "format": name,
                    "shape": [out_features, in_features],
                    "rows": m,
                    "matmul_picks": picked,
                    "load_average_1min": load,
                    "weight_bytes": w.nbytes,
                    "median_ms": {p: v * 1e3 for p, v in med.items()},
                    "min_ms": {p: v * 1e3 for p, v in best.items()},
                    "picked_ms_per_row": tq * 1e3 / m,
                    "picked_weight_gb_s": w.nbytes / tq / 1e9,
                    "bf16_weight_gb_s": dense_w.numel() * 2 / tb / 1e9,
                    "speedup_vs_bf16": tb / tq,
                }
                for kind in ("int8", "float"):
                    if f"{kind}_portable" in med:
                        row[f"{kind}_simd_vs_portable"] = (
                            med[f"{kind}_portable"] / med[f"{kind}_kernel"]
                        )
                rows.append(row)
                print(
                    f"{name} {out_features}x{in_features} M={m}: "
                    + ", ".join(f"{p} {v * 1e3:.3f} ms" for p, v in med.items())
                    + f" (median; picked {picked}: {tb / tq:.2f}x bf16; "
                    + "".join(
                        f"{kind} {row[kind + '_simd_vs_portable']:.2f}x portable; "
                        for kind in ("int8", "float")
                        if kind + "_simd_vs_portable" in row
                    )
                    + f"load {load:.2f})",
                    flush=True,
                )
    result = {
        "benchmark": "quant_kernels",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": cpu_description(),
        "cpu_flags": cpu_flags(),
        "kernel_simd": k.simd,
        "kernel_amx": k.amx,
        "kernel_cflags": [*kernels.CFLAGS, *cflags],
        "torch": torch.__version__,
        "threads": args.threads,
        "clock": args.clock,
        "load_average_at_end": os.getloadavg(),
        "note": "machine shared with other jobs (2 cores); the calls take turns, so load "
        "slows all alike" + (f"; {args.note}" if args.note else ""),
        "command": " ".join(["benchmarks/quant_kernels.py", *sys.argv[1:]]),
        "commit": git_commit(),
        "results": rows,
    }
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / (
        args.stem or f"quant_kernels_t{args.threads}{'_cpu' if args.clock == 'cpu' else ''}"
    )
    stem.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    portable_head = "| int8 portable | float portable | int8 vs portable | float vs portable "
    lines = [
        f"# Quantized-weight kernels vs bf16 F.linear ({result['date']})",
        "",
        f"- machine: {result['machine']}; flags: {', '.join(result['cpu_flags'])}",
        f"- kernel: {result['kernel_simd']}, AMX-INT8 for 16+ rows: {result['kernel_amx']}; "
        f"torch {result['torch']}; {args.threads} thread(s); "
        f"built with `{' '.join(result['kernel_cflags'])}`",
        f"- {result['note']}; load average at the end: "
        + ", ".join(f"{v:.2f}" for v in result["load_average_at_end"]),
        f"- command: `{result['command']}` at commit {result['commit']}",
        "",
        f"Median (min) ms of one product ({'CPU' if args.clock == 'cpu' else 'wall'} time); "
        "`int8 kernel` (the default at every M, "
        "batch-invariant): activations quantized to int8, integer dot products, one float "
        "chain per output, on the file's layout; `int8 packed`: the same on the weight "
        "repacked as a bf16 engine holds it (Q4_0/Q4_1/Q5_0/Q5_1/Q8_0, rows a multiple of "
        "16; the picked path there); `float kernel` (opt-in CHUNKSERVE_QUANT_FLOAT_KERNEL=1, "
        "decode rows only): the weight dequantized exactly in registers, float32 products and "
        "sums; "
        "`dequant tiles` (the float opt-in's prefill path): the weight dequantized to bf16 by "
        "the kernel, then torch; GB/s: the quantized weight's bytes over the picked path's "
        "median; load: the 1-minute load average when the row started.",
        "",
        "| format | out x in | M | int8 kernel | int8 packed | float kernel | dequant tiles "
        "| bf16 F.linear "
        + (portable_head if args.with_portable else "")
        + "| picked ms/row | picked GB/s | bf16 GB/s | picked vs bf16 | load |",
        "|---|---|---|" + "---|" * (14 if args.with_portable else 10),
    ]
    shown = PATHS + (PORTABLE if args.with_portable else [])
    for r in rows:
        med, best = r["median_ms"], r["min_ms"]
        cells = [f"{med[p]:.3f} ({best[p]:.3f})" if p in med else "-" for p in shown]
        if args.with_portable:
            cells += [
                f"{r[key]:.2f}x" if key in r else "-"
                for key in ("int8_simd_vs_portable", "float_simd_vs_portable")
            ]
        lines.append(
            f"| {r['format']} | {r['shape'][0]}x{r['shape'][1]} | {r['rows']} | "
            + " | ".join(cells)
            + f" | {r['picked_ms_per_row']:.3f} | {r['picked_weight_gb_s']:.2f} | "
            f"{r['bf16_weight_gb_s']:.2f} | {r['speedup_vs_bf16']:.2f}x | "
            f"{r['load_average_1min']:.2f} |"
        )
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print(f"wrote {stem}.json and .md")


if __name__ == "__main__":
    main()
