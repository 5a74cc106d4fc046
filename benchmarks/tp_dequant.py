"""What a tensor-parallel rank pays to dequantize its share of a quantized checkpoint
tensor (``hf_quant.LazyDequant``: the blocks its slice touches) against dequantizing the
whole tensor and slicing it (what every rank did before), on this CPU.

Tensors (random codes, shapes of the published models' layers, shrunk by ``--experts``):
- MXFP4 (GPT-OSS-20B's experts: hidden 2880, 2880 columns per expert): ``gate_up_proj``
  read as rank 0 of ``--tp`` reads it (its de-interleaved gate and up columns of every
  expert) and ``down_proj`` (its rows of the input dim: groups of 32 values);
- block FP8 128 x 128 (a DeepSeek-V3-like 7168 x 2048 projection): rank 0's rows
  (column parallel) and its columns (row parallel).

Each (tensor, way) runs in a fresh process (peak RSS is per process): the seconds of the
reads and the peak resident memory above the process's after the raw tensors were made.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/tp_dequant.py --threads 1

Writes ``benchmarks/results/tp_dequant/results.json`` and ``report.md``, naming the CPU.
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

OUT = Path(__file__).parent / "results" / "tp_dequant"


def _rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def one(kind: str, way: str, tp: int, experts: int, threads: int) -> dict:
    """In this process: make the raw tensors, read rank 0's share, report time and memory."""
    import time

    import torch

    from chunkserve.model.hf_quant import LazyDequant

    torch.set_num_threads(threads)
    gen = torch.Generator().manual_seed(0)
    if kind == "mxfp4":
        h, inter = 2880, 2880
        gate_up = {
            "blocks": torch.randint(
                0, 256, (experts, 2 * inter, h // 32, 16), generator=gen, dtype=torch.uint8
            ),
            "scales": torch.randint(
                120, 130, (experts, 2 * inter, h // 32), generator=gen, dtype=torch.uint8
            ),
        }
        down = {
            "blocks": torch.randint(
                0, 256, (experts, h, inter // 32, 16), generator=gen, dtype=torch.uint8
            ),
            "scales": torch.randint(
                120, 130, (experts, h, inter // 32), generator=gen, dtype=torch.uint8
            ),
        }
        c1 = inter // tp  # rank 0's columns of every expert
        reads = [
            (
                LazyDequant("mxfp4", gate_up, torch.bfloat16),
                (slice(None), slice(None), slice(0, 2 * c1, 2)),
            ),
            (
                LazyDequant("mxfp4", gate_up, torch.bfloat16),
                (slice(None), slice(None), slice(1, 2 * c1, 2)),
            ),
            (LazyDequant("mxfp4", down, torch.bfloat16), (slice(None), slice(0, c1))),
        ]
    else:
        m, n = 7168, 2048
        weight = (torch.randn(m, n, generator=gen)).to(torch.float8_e4m3fn)
        scale = torch.rand(m // 128, n // 128, generator=gen)
        t = LazyDequant("fp8", {"weight": weight, "scale": scale}, torch.bfloat16, (128, 128))
        reads = [(t, (slice(0, m // tp), slice(None))), (t, (slice(None), slice(0, n // tp)))]
    base = _rss_mib()
    start = time.perf_counter()
    kept = 0
    whole: dict[int, torch.Tensor] = {}  # "whole": each tensor dequantized once, as before
    for tensor, src in reads:
        if way == "slice":
            part = tensor[src]
        else:
            if id(tensor) not in whole:
                whole.clear()
                whole[id(tensor)] = tensor.full()
            part = whole[id(tensor)][src].clone()
        kept += part.numel() * part.element_size()
        del part
    whole.clear()
    seconds = time.perf_counter() - start
    return {
        "kind": kind,
        "way": way,
        "seconds": round(seconds, 3),
        "peak_mib_above_raw": round(_rss_mib() - base, 1),
        "kept_mib": round(kept / 2**20, 1),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--experts", type=int, default=4, help="GPT-OSS-20B has 32")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--one", nargs=2, metavar=("KIND", "WAY"), help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.one:
        print(json.dumps(one(a.one[0], a.one[1], a.tp, a.experts, a.threads)))
        return
    rows = []
    for kind in ("mxfp4", "fp8"):
        for way in ("whole", "slice"):
            cmd = [sys.executable, __file__, "--one", kind, way, "--tp", str(a.tp),
                   "--experts", str(a.experts), "--threads", str(a.threads)]  # fmt: skip
            out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
            rows.append(json.loads(out.strip().splitlines()[-1]))
            print(rows[-1], flush=True)
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    result = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "cpu": cpu,
        "tp": a.tp,
        "experts": a.experts,
        "threads": a.threads,
        "rows": rows,
    }
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "results.json").write_text(json.dumps(result, indent=2) + "\n")
    lines = [
        f"# Rank 0 of TP={a.tp}: dequantizing its share vs the whole tensor",
        "",
        f"{result['date']}, {cpu}, {a.threads} thread(s), a shared machine; MXFP4: "
        f"{a.experts} GPT-OSS-20B-sized experts; FP8: 7168 x 2048 in 128 x 128 blocks.",
        "",
        "| tensor | way | seconds | peak MiB above the raw tensors | kept MiB |",
        "|---|---|---|---|---|",
        *[
            f"| {r['kind']} | {r['way']} | {r['seconds']} | {r['peak_mib_above_raw']} | "
            f"{r['kept_mib']} |"
            for r in rows
        ],
    ]
    (OUT / "report.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
