"""Attention alone, per layer: the Triton kernels against the torch reference backend on the
same mixed batches (Llama-3-8B's attention shape by default: 32 query heads, 8 KV heads of
128, bf16, 16-token blocks), with their difference.

Cases: decode-only batches, one long prefill chunk from position 0, and a mixed step (a chunk
deep into a long prompt beside decodes). Each row times write-KV + attention for one layer
with ``triton.testing.do_bench`` (median, ms) and reports the bytes and FLOPs it must move and
do, so the time can be read against the copy bandwidth and matmul rate of the same GPU.

    python benchmarks/gpu/attention_backends.py --out benchmarks/results/gpu/attention.json
"""

from __future__ import annotations

import argparse
import json
import random
import time

import torch

from chunkserve.attention import get_attention_backend
from chunkserve.provenance import git_commit
from chunkserve.scheduling.kv_cache import KVCacheManager
from chunkserve.scheduling.request import Request
from chunkserve.scheduling.sampling_params import SamplingParams
from chunkserve.scheduling.scheduler import ScheduledChunk, SchedulerOutput
from chunkserve.worker.model_runner import ModelRunner, allocate_kv_caches

# (name, [(cached tokens, new tokens) of each prefill chunk], decode context lengths)
CASES = [
    ("decode b1 ctx1024", [], [1024]),
    ("decode b16 ctx1024", [], [1024] * 16),
    ("decode b64 ctx1024", [], [1024] * 64),
    ("decode b256 ctx1024", [], [1024] * 256),
    ("decode b64 ctx4096", [], [4096] * 64),
    ("prefill 2048 @0", [(0, 2048)], []),
    ("prefill 8192 @0", [(0, 8192)], []),
    ("mixed 512 @3584 + 32 dec", [(3584, 512)], [2048] * 32),
]


def build(case, heads, kv_heads, head_dim, block_size, dtype, device, backend):
    _, prefills, decodes = case
    items = prefills + [(n - 1, 1) for n in decodes]
    tokens = sum(c + n for c, n in items)
    num_blocks = tokens // block_size + 2 * len(items) + 8
    kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=False)
    ((k_cache, v_cache),) = allocate_kv_caches(
        1, num_blocks, block_size, kv_heads, head_dim, dtype, device
    )
    k_cache.normal_()
    v_cache.normal_()
    attn = get_attention_backend(backend, device, heads, kv_heads, head_dim)
    runner = ModelRunner(None, attn, None, [(k_cache, v_cache)], block_size, device, False)
    out = SchedulerOutput()
    for i, (cached, new) in enumerate(items):
        r = Request(f"r{i}", [1] * (cached + new), SamplingParams(), max_tokens=1)
        r.num_computed_tokens = cached
        if not kv.allocate_slots(r, new):
            raise RuntimeError("pool too small")
        (out.prefills if new > 1 else out.decodes).append(ScheduledChunk(r, cached, new))
    layout, _ = runner.build_layout(out)
    t = layout.num_tokens
    q = torch.randn(t, heads, head_dim, device=device, dtype=dtype)
    k = torch.randn(t, kv_heads, head_dim, device=device, dtype=dtype)
    v = torch.randn(t, kv_heads, head_dim, device=device, dtype=dtype)
    return attn, layout, (q, k, v, k_cache, v_cache)


def cost(case, heads, kv_heads, head_dim, elsize):
    """(bytes read/written at least, FLOPs) for one layer of this case."""
    _, prefills, decodes = case
    flops, kv_bytes = 0.0, 0.0
    per_key = 2 * kv_heads * head_dim * elsize
    for cached, new in prefills:
        keys_seen = new * cached + new * (new + 1) / 2
        flops += 4 * heads * head_dim * keys_seen
        kv_bytes += (cached + new) * per_key
    for n in decodes:
        flops += 4 * heads * head_dim * n
        kv_bytes += n * per_key
    rows = sum(n for _, n in prefills) + len(decodes)
    qo_bytes = 2 * rows * heads * head_dim * elsize + rows * per_key
    return kv_bytes + qo_bytes, flops


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    from triton.testing import do_bench

    device = torch.device("cuda")
    dtype = torch.bfloat16
    shape = (args.heads, args.kv_heads, args.head_dim)
    rows = []
    torch.manual_seed(0)
    random.seed(0)
    print(
        f"{'case':28} {'triton ms':>10} {'torch ms':>10} {'speedup':>8} {'GB/s':>7} "
        f"{'TFLOP/s':>8} {'rel err':>8}"
    )
    for case in CASES:
        result = {"case": case[0]}
        outs = {}
        for backend in ("triton", "torch"):
            torch.manual_seed(1)  # the same data for both backends
            attn, layout, tensors = build(case, *shape, args.block_size, dtype, device, backend)
            meta = attn.prepare(layout)

            def fn(attn=attn, layout=layout, tensors=tensors, meta=meta):
                return attn.forward(*tensors, layout, meta)

            outs[backend] = fn().float()
            result[f"{backend}_ms"] = do_bench(fn, warmup=25, rep=100, return_mode="median")
        ref = outs["torch"]
        err = ((outs["triton"] - ref).norm() / ref.norm()).item()
        nbytes, flops = cost(case, *shape, 2)
        ms = result["triton_ms"]
        result |= {
            "rel_err": err,
            "bytes": nbytes,
            "flops": flops,
            "triton_GBps": nbytes / ms / 1e6,
            "triton_TFLOPs": flops / ms / 1e9,
            "speedup_vs_torch": result["torch_ms"] / ms,
        }
        rows.append(result)
        print(
            f"{case[0]:28} {ms:10.3f} {result['torch_ms']:10.3f} "
            f"{result['speedup_vs_torch']:7.1f}x {result['triton_GBps']:7.0f} "
            f"{result['triton_TFLOPs']:8.1f} {err:8.1e}"
        )
    doc = {
        "benchmark": "attention backends, one layer (write KV + attention)",
        "gpu": torch.cuda.get_device_name(),
        "date": time.strftime("%Y-%m-%d"),
        "commit": git_commit(),
        "torch": torch.__version__,
        "shape": {"heads": args.heads, "kv_heads": args.kv_heads, "head_dim": args.head_dim},
        "block_size": args.block_size,
        "dtype": "bfloat16",
        "command": "python benchmarks/gpu/attention_backends.py",
        "rows": rows,
    }
    if args.out:
        with open(args.out, "w") as f:
            json.dump(doc, f, indent=1)


if __name__ == "__main__":
    main()
