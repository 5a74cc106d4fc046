"""How close a step runs to this machine's floor: the model's own matmuls timed alone, against
the engine's steps of the same shapes, with a torch profiler table of where each step's time
goes.

Measured, at the given dtype and thread count, on the embedded model's real weights:

- the linear layers (every layer's QKV, output, gate/up and down projections) and the LM head,
  timed as bare matmuls (``layers.linear``: ``F.linear``, or a quantized weight's kernel for a
  GGUF kept in its bits) at 1, 64 and 512 rows: GFLOP/s, and the floor of a step
  that multiplies that many rows;
- batch-64 decode steps (every decode at each of ``--decode-contexts`` tokens) through the
  engine's model runner, and their ratio to the cost of their linear layers and LM head at
  64 rows (the two timed in turn, the median of the pairs' ratios), with the bytes of K and
  V their attention reads;
- a batch-1 decode step (the longest context), and its ratio to the same at 1 row;
- one prefill step of a ``--prefill-tokens`` prompt: tokens/s, and the share of the bound set
  by the matmul rate at 512 rows over its FLOPs (linear layers, attention, one LM-head row);
- the profiler's per-op table for the batch-64 decode step and the prefill step.

    .venv/bin/python benchmarks/cpu_floor.py --dtype float32 --threads 2
    .venv/bin/python benchmarks/cpu_floor.py --dtype auto --threads 2

Writes ``<dtype>_t<threads>.json`` and ``.md`` under ``--out-dir``
(``benchmarks/results/cpu_floor``), naming the CPU model and its bf16 flags.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

from chunkserve.entrypoints.llm import LLM
from chunkserve.model.decoder import DecoderLM as LlamaModel
from chunkserve.model.layers import Weight, linear
from chunkserve.provenance import cpu_description, git_commit
from chunkserve.scheduling.costmodel import StepShape
from chunkserve.tuning.profiler import ShapeRunner

PROFILE_ROWS = 15


def held(module) -> Weight:
    """A layer's weight as it is held: float, or quantized (a GGUF kept in its bits)."""
    return module.weight if module.qweight is None else module.qweight


def shape(w: Weight) -> tuple[int, int]:
    """[out, in] of a weight (a quantized layer's parts of different types: stacked)."""
    if isinstance(w, list):
        return sum(p.shape[0] for p in w), w[0].shape[1]
    return tuple(w.shape)


def layer_weights(layer) -> tuple[Weight, ...]:
    """A block's linear weights: fused QKV, output, fused gate/up, down."""
    a, m = layer.attn, layer.mlp
    return tuple(held(x) for x in (a.qkv, a.o, m.gate_up, m.down))


def linear_macs(model: LlamaModel) -> int:
    """Multiply-accumulates of the linear layers per token (the LM head not counted)."""
    return sum(math.prod(shape(w)) for layer in model.layers for w in layer_weights(layer))


def kv_bytes_per_token(model: LlamaModel) -> int:
    """Bytes of K and V one token holds in the cache, all layers."""
    cfg = model.config
    item = torch.tensor([], dtype=model.dtype).element_size()
    return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * item


def attention_macs(model: LlamaModel, start: int, n: int) -> int:
    """Multiply-accumulates of causal attention for ``n`` query rows after ``start`` cached
    tokens: each row's scores and weighted sum over the keys it sees."""
    cfg = model.config
    keys = n * start + n * (n + 1) // 2
    return 2 * keys * cfg.num_heads * cfg.head_dim * cfg.num_layers


@torch.inference_mode()
def time_linears(model: LlamaModel, rows: int, head_rows: int, repeats: int) -> float:
    """Median seconds of the bare linear layers at ``rows`` rows plus the LM head at
    ``head_rows`` rows (the rows a step samples)."""
    dtype = model.dtype
    inputs: dict[int, torch.Tensor] = {}

    def x(width: int, n: int) -> torch.Tensor:
        key = width * 100_000 + n
        if key not in inputs:
            inputs[key] = torch.randn(n, width, dtype=dtype)
        return inputs[key]

    def run() -> None:
        for layer in model.layers:
            for w in layer_weights(layer):
                linear(x(shape(w)[1], rows), w)
        if head_rows:
            head = held(model.lm_head)
            linear(x(shape(head)[1], head_rows), head)

    if repeats > 1:
        run()  # warm-up (the paired timings run their step in between instead)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def paired(
    runner: ShapeRunner, model: LlamaModel, shape: StepShape, repeats: int
) -> tuple[float, float, float]:
    """The step and its bare linear layers + LM head (its rows, its sampled rows) timed in
    turn, so the VM's drift (tens of percent between minutes) hits both alike: medians of
    each and of the pairs' ratios."""
    rows = shape.num_prefill_tokens + shape.num_decode_tokens
    sampled = shape.num_decode_tokens + shape.prefill_samples
    out, reqs = runner.build(shape)
    steps, linears = [], []
    try:
        runner.worker.runner.execute(out)
        for _ in range(repeats):
            t0 = time.perf_counter()
            runner.worker.runner.execute(out)
            steps.append(time.perf_counter() - t0)
            linears.append(time_linears(model, rows, sampled, 1))
    finally:
        runner.free(reqs)
    ratios = [a / b for a, b in zip(steps, linears)]
    return statistics.median(steps), statistics.median(linears), statistics.median(ratios)


def profile_table(runner: ShapeRunner, shape: StepShape, repeats: int) -> tuple[str, list]:
    """The profiler's table of a step's ops (self CPU time, mean over ``repeats`` steps)."""
    out, reqs = runner.build(shape)
    try:
        runner.worker.runner.execute(out)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(repeats):
                runner.worker.runner.execute(out)
    finally:
        runner.free(reqs)
    averages = prof.key_averages()
    table = averages.table(sort_by="self_cpu_time_total", row_limit=PROFILE_ROWS)
    rows = sorted(averages, key=lambda e: e.self_cpu_time_total, reverse=True)
    ops = [
        {
            "op": e.key,
            "self_ms_per_step": e.self_cpu_time_total / 1e3 / repeats,
            "calls_per_step": e.count / repeats,
        }
        for e in rows[:PROFILE_ROWS]
    ]
    return table, ops


def measure(args: argparse.Namespace) -> dict[str, Any]:
    llm = LLM(dtype=args.dtype, num_threads=args.threads, attention_backend=args.attention_backend)
    core = llm.engine.core
    model = core.worker.runner.model
    runner = ShapeRunner(core)
    reps = args.repeats
    lin = linear_macs(model)
    head = math.prod(shape(held(model.lm_head)))

    matmul = {}
    for rows in (1, 64, 512):
        t = time_linears(model, rows, rows, reps)
        matmul[rows] = {
            "seconds": t,
            "linear_and_head_gflops": 2 * (lin + head) * rows / t / 1e9,
            "head_seconds": time_linears_head(model, rows, reps),
        }

    decode64 = []
    for ctx in args.decode_contexts:
        t64, lin64, ratio = paired(runner, model, StepShape(decode_context_lens=(ctx,) * 64), reps)
        decode64.append(
            {
                "context": ctx,
                "step_s": t64,
                "linear_and_head_s": lin64,
                "ratio": ratio,
                # K and V read for the step's attention, all layers
                "kv_bytes": 64 * ctx * kv_bytes_per_token(model),
            }
        )
    ctx = args.decode_contexts[-1]
    profiled = StepShape(decode_context_lens=(ctx,) * 64)
    t1, lin1, ratio1 = paired(runner, model, StepShape(decode_context_lens=(ctx,)), reps)
    n = args.prefill_tokens
    prefill = StepShape(prefill_chunks=((0, n),), prefill_samples=1)
    tp = runner.time_shape(prefill, max(3, reps // 3))
    rate512 = matmul[512]["linear_and_head_gflops"] * 1e9
    flops = 2 * (lin * n + head + attention_macs(model, 0, n))
    bound = flops / rate512
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())

    table64, ops64 = profile_table(runner, profiled, args.profile_steps)
    tablep, opsp = profile_table(runner, prefill, 2)
    return {
        "machine": cpu_description(),
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "commit": git_commit(),
        "command": "python benchmarks/cpu_floor.py "
        + f"--dtype {args.dtype} --threads {args.threads}"
        + (
            f" --attention-backend {args.attention_backend}"
            if args.attention_backend != "auto"
            else ""
        ),
        "dtype": str(model.dtype).removeprefix("torch."),
        "attention_backend": core.worker.attention.name,
        "threads": torch.get_num_threads(),
        "model": llm.engine.model_name,
        "weight_bytes": weight_bytes,
        "matmul": {str(k): v for k, v in matmul.items()},
        "decode64": decode64,
        "decode64_profile": {"context": ctx, "ops": ops64},
        "decode1": {
            "context": ctx,
            "step_s": t1,
            "linear_and_head_s": lin1,
            "ratio": ratio1,
            "weights_read_gb_per_s": weight_bytes / t1 / 1e9,
        },
        "prefill": {
            "tokens": n,
            "step_s": tp,
            "tokens_per_s": n / tp,
            "matmul_bound_s": bound,
            "share_of_bound": bound / tp,
            "profile": opsp,
        },
        "tables": {"decode64": table64, "prefill": tablep},
    }


@torch.inference_mode()
def time_linears_head(model: LlamaModel, rows: int, repeats: int) -> float:
    head = held(model.lm_head)
    x = torch.randn(rows, shape(head)[1], dtype=model.dtype)
    linear(x, head)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        linear(x, head)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def report(doc: dict[str, Any]) -> str:
    m, d64, d1, p = doc["matmul"], doc["decode64"], doc["decode1"], doc["prefill"]
    lines = [
        f"# CPU steps against the matmul floor ({doc['dtype']}, {doc['threads']} threads, "
        f"{doc.get('attention_backend', 'torch')} attention)",
        "",
        f"Measured {doc['date']} on {doc['machine']}; commit {doc['commit']}; "
        f"model {doc['model']}.",
        "",
        f"Reproduce: `{doc['command']}`",
        "",
        "| rows | linear layers + LM head ms | GFLOP/s | LM head alone ms |",
        "|---|---|---|---|",
    ]
    for rows, v in m.items():
        lines.append(
            f"| {rows} | {1e3 * v['seconds']:.1f} | {v['linear_and_head_gflops']:.0f} | "
            f"{1e3 * v['head_seconds']:.1f} |"
        )
    lines += [
        "",
        "| batch-64 decode, context | step ms | its linear layers + LM head ms | ratio "
        "(median of pairs) | KV read MiB |",
        "|---|---|---|---|---|",
        *(
            f"| {d['context']} | {1e3 * d['step_s']:.1f} | {1e3 * d['linear_and_head_s']:.1f} | "
            f"**{d['ratio']:.2f}** | {d['kv_bytes'] / 2**20:.0f} |"
            for d in d64
        ),
        "",
        f"- Batch-1 decode step (context {d1['context']}): {1e3 * d1['step_s']:.1f} ms, "
        f"{d1['ratio']:.2f}x its linear "
        f"layers and LM head ({1e3 * d1['linear_and_head_s']:.1f} ms); the weights "
        f"({doc['weight_bytes'] / 2**20:.0f} MiB) read at {d1['weights_read_gb_per_s']:.1f} GB/s.",
        f"- Prefill of one {p['tokens']}-token prompt in one step: {p['tokens_per_s']:.0f} tok/s, "
        f"**{100 * p['share_of_bound']:.0f}%** of the bound its FLOPs set at the 512-row matmul "
        f"rate ({1e3 * p['matmul_bound_s']:.0f} ms vs {1e3 * p['step_s']:.0f} ms).",
        "",
        f"## Where the batch-64 decode step's time goes (context "
        f"{doc['decode64_profile']['context']}; torch profiler, self CPU per op)",
        "",
        "```",
        doc["tables"]["decode64"].rstrip(),
        "```",
        "",
        "## Where the prefill step's time goes",
        "",
        "```",
        doc["tables"]["prefill"].rstrip(),
        "```",
        "",
    ]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dtype", default="auto", help="auto (bf16 where the CPU has it), float32")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument(
        "--decode-contexts",
        type=lambda v: sorted(int(x) for x in v.split(",")),
        default=[32, 128, 256],
        help="comma list: tokens per decode of the batch-64 steps (the longest is profiled)",
    )
    p.add_argument("--prefill-tokens", type=int, default=2048)
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--profile-steps", type=int, default=5)
    p.add_argument("--out-dir", type=Path, default=Path("benchmarks/results/cpu_floor"))
    p.add_argument(
        "--attention-backend",
        default="auto",
        help="auto (the CPU kernel where it builds), torch (the gathers and matmuls before it)",
    )
    args = p.parse_args()
    doc = measure(args)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    stem = f"{doc['dtype']}_t{doc['threads']}"
    if args.attention_backend != "auto":
        stem += f"_{doc['attention_backend']}_attention"
    (args.out_dir / f"{stem}.json").write_text(json.dumps(doc, indent=2) + "\n")
    text = report(doc)
    (args.out_dir / f"{stem}.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
