"""The two CPU paths for a prefill chunk that continues a cached sequence, measured per layer:
the C kernel (``cpu_kernels``, reading the paged cache in place) and the torch path the torch
backend takes (the prefix's blocks gathered, then fp32 SDPA or the bf16 blocked matmuls).

    python benchmarks/attention_paths.py --threads 1 --out benchmarks/results/x.json

One chunk of ``rows`` rows after ``keys`` cached keys, over rows x keys x head_dim x heads x
dtype; each time the best of ``--reps`` calls. Prints one line per point and writes a JSON
with the CPU's model name, the flags and the load average at the start and end.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import time

import torch

from chunkserve.attention import cpu_kernels
from chunkserve.attention.torch_ref import TorchAttentionBackend


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return f.read()
    except OSError:
        return ""


def best(fn, reps: int) -> float:
    fn()  # warm up
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return min(ts)


def point(kernel, dtype, heads, kv_heads, head_dim, rows, keys, reps, bs=16):
    gen = torch.Generator().manual_seed(0)
    ctx = keys + rows
    nb = -(-ctx // bs)
    perm = torch.randperm(nb + 8, generator=gen)[:nb]  # scattered blocks, as a pool's are
    k_cache = torch.randn(nb + 8, bs, kv_heads, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(nb + 8, bs, kv_heads, head_dim, generator=gen).to(dtype)
    q = torch.randn(rows, heads, head_dim, generator=gen).to(dtype)
    scale = head_dim**-0.5
    tables = perm.view(1, -1).to(torch.int64).contiguous()
    q_start = torch.tensor([0], dtype=torch.int64)
    q_len = torch.tensor([rows], dtype=torch.int64)
    ctx_lens = torch.tensor([ctx], dtype=torch.int64)
    out = torch.empty_like(q)
    backend = TorchAttentionBackend(heads, kv_heads, head_dim)

    def run_kernel():
        kernel(q, k_cache, v_cache, out, tables, q_start, q_len, ctx_lens, scale)

    def run_torch():
        kc = k_cache.index_select(0, perm).view(-1, kv_heads, head_dim)[:ctx]
        vc = v_cache.index_select(0, perm).view(-1, kv_heads, head_dim)[:ctx]
        return backend._prefill(q, kc, vc, keys, scale)

    tk = best(run_kernel, reps)
    tt = best(run_torch, reps)
    err = (out.float() - run_torch().float()).abs().max().item()
    return tk, tt, err


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--rows", default="16,64,256,512")
    ap.add_argument("--keys", default="500,2000,4000")
    ap.add_argument("--head-dims", default="32,64")
    ap.add_argument("--heads", default="16/4,9/3")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    kernel = cpu_kernels.load()
    if kernel is None:
        raise SystemExit(f"kernel unavailable: {cpu_kernels.load_error()}")
    load0 = os.getloadavg()
    results = []
    grid = itertools.product(
        args.dtypes.split(","),
        [int(x) for x in args.head_dims.split(",")],
        args.heads.split(","),
        [int(x) for x in args.rows.split(",")],
        [int(x) for x in args.keys.split(",")],
    )
    for dt, hd, hh, rows, keys in grid:
        h, hkv = (int(x) for x in hh.split("/"))
        dtype = getattr(torch, dt)
        tk, tt, err = point(kernel, dtype, h, hkv, hd, rows, keys, args.reps)
        r = dict(dtype=dt, head_dim=hd, heads=h, kv_heads=hkv, rows=rows, keys=keys)
        r.update(kernel_ms=round(tk * 1e3, 3), torch_ms=round(tt * 1e3, 3))
        r.update(torch_over_kernel=round(tt / tk, 2), max_abs_diff=err)
        results.append(r)
        print(json.dumps(r), flush=True)
    doc = dict(
        cpu=cpu_name(),
        flags=[f for f in ("avx512f", "avx512_bf16", "amx_bf16") if f in cpu_flags()],
        threads=args.threads,
        torch=torch.__version__,
        loadavg_start=load0,
        loadavg_end=os.getloadavg(),
        kernel=str(kernel.path),
        results=results,
    )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(doc, f, indent=1)


if __name__ == "__main__":
    main()
