"""Where a batch-1 decode step of the embedded model (kept in its bits, bf16) spends its time:
the forward pass and the logits of one decode row timed in CPU time (``time.thread_time``:
a busy shared machine inflates it far less than wall time), with the quantized kernels real
and with them replaced by an empty output (what is left is the Python and torch work
around them), and each layer's products alone, one after another as a step runs them.
Engine steps (scheduler, runner, sampler, output processing) are timed in wall time beside.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/quant_decode_step.py --threads 1

Writes ``quant_decode_step_t<threads>.json`` under ``--out-dir`` (``--label`` names a run in
it; runs with other labels are kept).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch

from chunkserve import LLM, SamplingParams
from chunkserve.provenance import cpu_description, git_commit
from chunkserve.quant import kernels
from chunkserve.quant.weight import QuantizedWeight


def median_min(fn, repeats: int, clock=time.thread_time) -> tuple[float, float]:
    """(median, min) of ``fn``'s time over ``repeats`` calls, in ms, after 3 warm-up calls."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        t0 = clock()
        fn()
        times.append(clock() - t0)
    return round(statistics.median(times) * 1e3, 3), round(min(times) * 1e3, 3)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=60)
    ap.add_argument("--label", default="run")
    ap.add_argument("--out-dir", default="benchmarks/results")
    args = ap.parse_args()
    llm = LLM(dtype="bfloat16", num_threads=args.threads, max_model_len=1024)
    engine = llm.engine
    runner = engine.core.worker.runner
    model = runner.model

    # A decode step's layout and attention metadata, captured from a real request.
    captured: dict = {}
    prepare = runner.prepare

    def capture(layout):
        meta = prepare(layout)
        captured["step"] = (layout, meta)
        return meta

    runner.prepare = capture
    params = SamplingParams(max_tokens=40, min_tokens=40, temperature=0.0, ignore_eos=True)
    engine.add_request(list(range(100, 124)), params)
    while engine.has_unfinished():
        engine.step()
    runner.prepare = prepare
    layout, meta = captured["step"]

    def forward() -> torch.Tensor:
        with torch.inference_mode():
            hidden = model(layout, runner.kv_caches, runner.attn, meta)
            return model.compute_logits(hidden[layout.logits_indices])

    real = kernels.QuantKernels._call

    def empty(self, fn, code, data, x):
        return torch.empty(x.shape[0], data.shape[0], dtype=x.dtype)

    out: dict = {"load_1min": os.getloadavg()[0]}
    out["forward_ms"] = median_min(forward, args.repeats)
    kernels.QuantKernels._call = empty
    try:
        out["forward_kernels_empty_ms"] = median_min(forward, args.repeats)
    finally:
        kernels.QuantKernels._call = real

    weights = [
        m.qweight
        for name, m in model.named_modules()
        if isinstance(getattr(m, "qweight", None), QuantizedWeight) and "embed" not in name
    ]
    k = kernels.load()
    xs = {w.shape[1]: torch.randn(1, w.shape[1], dtype=torch.bfloat16) for w in weights}
    layers, head = weights[:-1], weights[-1]  # the tied head last (``lm_head``)

    def product(w: QuantizedWeight) -> None:
        """The weight's product as a step runs it (packed where the step packed it)."""
        if getattr(w, "packed", None) is not None:
            k.gemm_packed(w.format.code, w.packed, xs[w.shape[1]])
        else:
            k.gemm(w.format.code, w.data, xs[w.shape[1]])

    def products() -> None:
        for w in layers:
            product(w)

    out["packed_weights"] = sum(getattr(w, "packed", None) is not None for w in weights)
    out["layer_products_ms"] = median_min(products, args.repeats)
    out["head_product_ms"] = median_min(lambda: product(head), args.repeats)

    def steps() -> list[float]:
        engine.add_request(list(range(100, 124)), SamplingParams(
            max_tokens=65, min_tokens=65, temperature=0.0, ignore_eos=True
        ))  # fmt: skip
        engine.step()  # the prefill
        times = []
        while engine.has_unfinished():
            t0 = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - t0)
        return times

    times = [t for _ in range(3) for t in steps()]
    out["engine_step_wall_ms"] = (
        round(statistics.median(times) * 1e3, 3),
        round(min(times) * 1e3, 3),
    )
    out["load_1min_end"] = os.getloadavg()[0]
    print(json.dumps(out, indent=1))

    path = Path(args.out_dir) / f"quant_decode_step_t{args.threads}.json"
    doc = json.loads(path.read_text()) if path.exists() else {"runs": {}}
    doc["cpu"] = cpu_description()
    doc["note"] = (
        "(median, min) in ms; forward: the model's forward pass and logits for one decode "
        "row (bf16, kept in its bits), CPU time; forward_kernels_empty: the same with the "
        "quantized products replaced by an empty output (the Python and torch work around "
        "them); packed_weights: how many of the products' weights the step repacked "
        "(GGUFWeight.pack); layer_products: the 120 layer products alone, one after another "
        "(M=1, packed as the step runs them), "
        "CPU time; head_product: the tied Q8_0 head; engine_step_wall: Engine.step() of a "
        "batch-1 decode, wall time"
    )
    doc["runs"][args.label] = {"commit": git_commit(), "threads": args.threads, **out}
    path.write_text(json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    main()
