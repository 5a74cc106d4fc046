"""Hardware ceilings the GPU benchmarks are judged against: device-memory copy bandwidth and the
dense matmul rate, measured with torch on the device at hand.

- Copy: ``dst.copy_(src)`` of a 2 GiB tensor, bytes read + bytes written per copy, rotating
  over 3 buffer pairs so no copy finds its source in L2. Median of 20 after 5 warm-ups.
- Matmul: ``torch.matmul`` of 8192 x 8192 by 8192 x 8192 bf16 random-normal matrices,
  2 * n^3 FLOPs per product. Median of 20 after 5 warm-ups.

CUDA times come from ``torch.cuda.Event`` pairs around each op; elsewhere from
``time.perf_counter`` (there ``--quick`` shrinks the sizes so a CPU smoke test takes seconds,
and the matmul runs in float32, the engine's CPU dtype). Writes ``ceilings.json``:

    python benchmarks/gpu/ceilings.py --out benchmarks/results/gpu
    python benchmarks/gpu/ceilings.py --device cpu --quick --out /tmp/gpu_smoke

``decode_floor.py`` and ``prefill.py`` read that file with ``--ceilings FILE`` (and measure
the ceilings themselves when it is absent). This module also holds what the three scripts
share: run metadata and JSON writing.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path

import torch

DEFAULT_OUT = Path(__file__).resolve().parents[1] / "results" / "gpu"


def package_version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        from chunkserve.provenance import cpu_description

        return cpu_description() + ", CPU only"
    except ImportError:
        return "CPU"


def commit() -> str | None:
    try:
        from chunkserve.provenance import git_commit
    except ImportError:
        return None
    return git_commit()


def run_meta(device: torch.device | str, script: str) -> dict:
    """Who ran what where: the header of every results JSON."""
    device = torch.device(device)
    meta = {
        "gpu": device_name(device) if device.type == "cuda" else None,
        "machine": device_name(device),
        "device": str(device),
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "commit": commit(),
        "torch": torch.__version__,
        "triton": package_version("triton"),
        "cuda": torch.version.cuda,
        "python": sys.version.split()[0],
        "command": f"python benchmarks/gpu/{script} " + " ".join(sys.argv[1:]),
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        meta["gpu_memory_gib"] = round(props.total_memory / 2**30, 1)
        meta["gpu_sm_count"] = props.multi_processor_count
    return meta


def write_json(path: Path, payload: dict) -> None:
    """Write via a temporary file, so a run killed mid-write leaves the last complete copy."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(payload, indent=2))
    tmp.replace(path)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_op(
    fn: Callable[[int], object], device: torch.device, iters: int, warmup: int
) -> list[float]:
    """Seconds per call of ``fn(i)``, one timing per call. CUDA: an event pair around each
    call, read after one final synchronise; elsewhere a perf_counter pair."""
    for i in range(warmup):
        fn(i)
    sync(device)
    if device.type == "cuda":
        pairs = []
        for i in range(iters):
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            fn(warmup + i)
            end.record()
            pairs.append((start, end))
        torch.cuda.synchronize(device)
        return [s.elapsed_time(e) / 1e3 for s, e in pairs]
    times = []
    for i in range(iters):
        t0 = time.perf_counter()
        fn(warmup + i)
        times.append(time.perf_counter() - t0)
    return times


def copy_bandwidth(
    device: torch.device, nbytes: int, num_pairs: int = 3, iters: int = 20, warmup: int = 5
) -> dict:
    """Device-to-device ``copy_`` bandwidth, counting read + written bytes."""
    numel = nbytes // 4
    pairs = []
    for _ in range(num_pairs):
        src = torch.empty(numel, dtype=torch.float32, device=device).fill_(1.0)
        dst = torch.empty(numel, dtype=torch.float32, device=device).fill_(0.0)
        pairs.append((src, dst))

    def one(i: int) -> None:
        src, dst = pairs[i % num_pairs]
        dst.copy_(src)

    times = time_op(one, device, iters, warmup)
    moved = 2 * numel * 4
    pairs.clear()
    med = statistics.median(times)
    return {
        "tensor_bytes": numel * 4,
        "bytes_per_copy": moved,
        "buffer_pairs": num_pairs,
        "iters": iters,
        "median_s": med,
        "min_s": min(times),
        "bandwidth_gbs": moved / med / 1e9,
        "best_gbs": moved / min(times) / 1e9,
    }


def matmul_rate(
    device: torch.device, dtype: torch.dtype, n: int, iters: int = 20, warmup: int = 5
) -> dict:
    """Dense ``n x n @ n x n`` rate on random-normal data (2 n^3 FLOPs per product)."""
    gen = torch.Generator(device=device)
    gen.manual_seed(0)
    mats = [torch.randn(n, n, device=device, dtype=dtype, generator=gen) for _ in range(2)]
    mats.append(torch.empty(n, n, device=device, dtype=dtype))
    times = time_op(lambda _i: torch.matmul(mats[0], mats[1], out=mats[2]), device, iters, warmup)
    mats.clear()
    flops = 2 * n**3
    med = statistics.median(times)
    return {
        "n": n,
        "dtype": str(dtype).removeprefix("torch."),
        "flops_per_matmul": flops,
        "iters": iters,
        "median_s": med,
        "tflops": flops / med / 1e12,
        "best_tflops": flops / min(times) / 1e12,
    }


def measure_ceilings(device: torch.device | str = "cuda", quick: bool = False) -> dict:
    """Copy bandwidth and matmul rate on ``device``; ``quick`` shrinks sizes and counts."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    on_gpu = device.type == "cuda"
    copy_bytes = (2 << 30) if not quick else (256 << 20 if on_gpu else 64 << 20)
    n = 8192 if not quick else (4096 if on_gpu else 512)
    iters, warmup = (20, 5) if not quick else (6, 2)
    dtype = torch.bfloat16 if on_gpu else torch.float32
    copy = copy_bandwidth(device, copy_bytes, iters=iters, warmup=warmup)
    mm = matmul_rate(device, dtype, n, iters=iters, warmup=warmup)
    if on_gpu:
        torch.cuda.empty_cache()
    return {
        "device": str(device),
        "device_name": device_name(device),
        "quick": quick,
        "torch": torch.__version__,
        "triton": package_version("triton"),
        "copy": copy,
        "matmul": mm,
        "copy_bandwidth_gbs": copy["bandwidth_gbs"],
        "matmul_tflops": mm["tflops"],
    }


def load_or_measure(path: Path | None, device: torch.device | str, quick: bool) -> dict:
    """The ceilings in ``path`` when it exists (written by this script), else measured now."""
    if path is not None and path.exists():
        data = json.loads(path.read_text())
        ceilings = data.get("ceilings", data)
        ceilings["source"] = str(path)
        print(
            f"ceilings from {path}: copy {ceilings['copy_bandwidth_gbs']:.0f} GB/s, "
            f"matmul {ceilings['matmul_tflops']:.1f} TFLOP/s",
            flush=True,
        )
        return ceilings
    if path is not None:
        print(f"{path} not found: measuring the ceilings here", flush=True)
    ceilings = measure_ceilings(device, quick=quick)
    ceilings["source"] = "measured in this run"
    return ceilings


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--quick", action="store_true", help="small sizes, few repeats")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help="directory for ceilings.json")
    args = ap.parse_args()
    ceilings = measure_ceilings(args.device, quick=args.quick)
    meta = run_meta(args.device, "ceilings.py")
    write_json(args.out / "ceilings.json", {"meta": meta, "ceilings": ceilings})
    copy, mm = ceilings["copy"], ceilings["matmul"]
    print(f"{meta['machine']}; torch {meta['torch']}, triton {meta['triton']}")
    size = f"{copy['tensor_bytes'] / 2**30:.3g} GiB"
    print(f"{'ceiling':<36} {'median':>16} {'best':>16}")
    print(
        f"{'copy_ ' + size + ', read + write':<36} {copy['bandwidth_gbs']:>11.1f} GB/s "
        f"{copy['best_gbs']:>11.1f} GB/s"
    )
    print(
        f"{'matmul ' + str(mm['n']) + '^3 ' + mm['dtype']:<36} {mm['tflops']:>8.3f} TFLOP/s "
        f"{mm['best_tflops']:>8.3f} TFLOP/s"
    )
    print(f"wrote {args.out / 'ceilings.json'}")


if __name__ == "__main__":
    main()
