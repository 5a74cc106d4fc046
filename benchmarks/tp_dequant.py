"""What a tensor-parallel rank pays to read and dequantize its share of a quantized
checkpoint tensor stored in a safetensors file, three ways:

- ``whole``: the raw tensors read whole, dequantized whole, then sliced (before
  ``hf_quant.LazyDequant``);
- ``slice``: the raw tensors read whole, only the blocks the slice touches dequantized
  (``LazyDequant`` over in-memory raw tensors: before ``model.lazy``);
- ``lazy``: only the raw blocks the slice touches read from the file (``model.lazy``:
  safetensors' ``get_slice``, as ``loader.iter_hf_weights`` yields them) and dequantized.

Tensors (random codes, shapes of the published models' layers, shrunk by ``--experts``):
- MXFP4 (GPT-OSS-20B's experts: hidden 2880, 2880 columns per expert): ``gate_up_proj``
  read as rank 0 of ``--tp`` reads it (its de-interleaved gate and up columns of every
  expert) and ``down_proj`` (its rows of the input dim: groups of 32 values);
- block FP8 128 x 128 (two DeepSeek-V3-like 7168 x 2048 projections): rank 0's rows of
  one (column parallel) and its columns of the other (row parallel).

The tensors are written to a safetensors file first (in ``--dir``, a temporary directory
by default); each (tensor, way) runs in a fresh process (peak RSS is per process, a memory
map's touched pages included): the seconds of the reads, the peak resident memory above
the process's before them, and the raw bytes taken out of the file.

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
import tempfile
from datetime import datetime, timezone
from pathlib import Path

OUT = Path(__file__).parent / "results" / "tp_dequant"


def _rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def raw_tensors(kind: str, experts: int) -> dict:
    """The checkpoint's raw tensors of ``kind`` (random codes, seed 0)."""
    import torch

    gen = torch.Generator().manual_seed(0)
    if kind == "mxfp4":
        h, inter = 2880, 2880
        out = {}
        for name, rows, cols in (("gate_up_proj", 2 * inter, h), ("down_proj", h, inter)):
            out[f"{name}_blocks"] = torch.randint(
                0, 256, (experts, rows, cols // 32, 16), generator=gen, dtype=torch.uint8
            )
            out[f"{name}_scales"] = torch.randint(
                120, 130, (experts, rows, cols // 32), generator=gen, dtype=torch.uint8
            )
        return out
    m, n = 7168, 2048
    out = {}
    for name in ("col", "row"):  # a column-parallel and a row-parallel projection
        out[f"{name}.weight"] = torch.randn(m, n, generator=gen).to(torch.float8_e4m3fn)
        out[f"{name}.weight_scale_inv"] = torch.rand(m // 128, n // 128, generator=gen)
    return out


def one(kind: str, way: str, tp: int, path: Path, threads: int) -> dict:
    """In this process: read rank 0's share of the file's tensors ``way``'s way, report
    time, memory and the raw bytes read."""
    import time

    import torch
    from safetensors import safe_open

    from chunkserve.model.hf_quant import LazyDequant
    from chunkserve.model.lazy import safetensors_tensor

    torch.set_num_threads(threads)
    read = [0]

    def counted(t):  # a raw tensor's reads counted
        inner = t._read

        def count(box):
            r = inner(box)
            read[0] += r.numel() * r.element_size()
            return r

        t._read = count
        return t

    base = _rss_mib()
    start = time.perf_counter()
    with safe_open(str(path), framework="pt") as f:
        if way == "lazy":
            raw = {name: counted(safetensors_tensor(f, name)) for name in f.keys()}  # noqa: SIM118
        else:
            raw = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118
            read[0] = sum(t.numel() * t.element_size() for t in raw.values())
        if kind == "mxfp4":
            inter = raw["gate_up_proj_blocks"].shape[1] // 2
            c1 = inter // tp  # rank 0's columns of every expert

            def pair(name: str) -> LazyDequant:
                parts = {"blocks": raw[name + "_blocks"], "scales": raw[name + "_scales"]}
                return LazyDequant("mxfp4", parts, torch.bfloat16)

            gate_up, down = pair("gate_up_proj"), pair("down_proj")
            reads = [
                (gate_up, (slice(None), slice(None), slice(0, 2 * c1, 2))),
                (gate_up, (slice(None), slice(None), slice(1, 2 * c1, 2))),
                (down, (slice(None), slice(0, c1))),
            ]
        else:
            col, row = (
                LazyDequant(
                    "fp8",
                    {"weight": raw[f"{k}.weight"], "scale": raw[f"{k}.weight_scale_inv"]},
                    torch.bfloat16,
                    (128, 128),
                )
                for k in ("col", "row")
            )
            m, n = col.shape
            reads = [
                (col, (slice(0, m // tp), slice(None))),
                (row, (slice(None), slice(0, n // tp))),
            ]
        kept = 0
        whole: dict[int, torch.Tensor] = {}  # "whole": each tensor dequantized once
        for tensor, src in reads:
            if way != "whole":
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
        "peak_mib": round(_rss_mib() - base, 1),
        "read_mib": round(read[0] / 2**20, 1),
        "kept_mib": round(kept / 2**20, 1),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--experts", type=int, default=4, help="GPT-OSS-20B has 32")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--dir", type=Path, default=None, help="where to write the files")
    p.add_argument("--one", nargs=3, metavar=("KIND", "WAY", "FILE"), help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.one:
        print(json.dumps(one(a.one[0], a.one[1], a.tp, Path(a.one[2]), a.threads)))
        return
    from safetensors.torch import save_file

    rows = []
    with tempfile.TemporaryDirectory(dir=a.dir) as tmp:
        for kind in ("mxfp4", "fp8"):
            path = Path(tmp) / f"{kind}.safetensors"
            save_file(raw_tensors(kind, a.experts), str(path))
            for way in ("whole", "slice", "lazy"):
                cmd = [sys.executable, __file__, "--one", kind, way, str(path), "--tp",
                       str(a.tp), "--threads", str(a.threads)]  # fmt: skip
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
        f"# Rank 0 of TP={a.tp}: reading and dequantizing its share vs the whole tensor",
        "",
        f"{result['date']}, {cpu}, {a.threads} thread(s), a shared machine; MXFP4: "
        f"{a.experts} GPT-OSS-20B-sized experts; FP8: two 7168 x 2048 in 128 x 128 blocks.",
        "",
        "whole: raw read whole, dequantized whole; slice: raw read whole, its blocks "
        "dequantized; lazy: its raw blocks read from the file and dequantized.",
        "",
        "| tensor | way | seconds | peak MiB above the start | raw MiB read | kept MiB |",
        "|---|---|---|---|---|---|",
        *[
            f"| {r['kind']} | {r['way']} | {r['seconds']} | {r['peak_mib']} | "
            f"{r['read_mib']} | {r['kept_mib']} |"
            for r in rows
        ],
    ]
    (OUT / "report.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
