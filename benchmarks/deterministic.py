"""What the deterministic mode costs (issue 42's target: <= 1.15x step time at batch-64
decode and a 2,048-token prefill), on this CPU, with the embedded model.

Two engines, one with ``deterministic=True`` and one without (both with the model's default
dtype unless ``--dtype``), in one process; each step shape is run through the engine's
model runner (``tuning.profiler.ShapeRunner``), the two engines' steps timed in turn (the
machine's load drifts; the ratio is the median of the rounds' ratios):

- decode, batch 1 and batch 64, at ``--context`` tokens of context;
- a 2,048-token prefill (one chunk from position 0, its last row sampled).

    PYTHONPATH=$PWD .venv/bin/python benchmarks/deterministic.py --threads 1

Writes ``benchmarks/results/deterministic.json``, naming the CPU, dtype, threads, commit.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

from chunkserve.entrypoints.llm import LLM
from chunkserve.provenance import cpu_description, git_commit
from chunkserve.scheduling.costmodel import StepShape
from chunkserve.tuning.profiler import ShapeRunner

OUT = Path(__file__).resolve().parent / "results" / "deterministic.json"


def make_llm(args: argparse.Namespace, deterministic: bool) -> LLM:
    return LLM(
        dtype=args.dtype,
        num_threads=args.threads,
        max_model_len=args.prefill + 64,
        # 64 decodes of ``--context`` keys, or the prefill; 23,040 bytes a token in bf16.
        kv_cache_memory=max(64 * (args.context + 32), args.prefill + 64) * 23_040 * 2,
        max_num_batched_tokens=args.prefill,
        deterministic=deterministic,
        deterministic_quant_kernel=args.quant_kernel if deterministic else "int8",
        gguf_dequantize=args.dequantize,
    )


@torch.inference_mode()
def measure(plain: LLM, det: LLM, shape: StepShape, repeats: int, clock=time.perf_counter) -> dict:
    runners = ShapeRunner(plain.engine.core), ShapeRunner(det.engine.core)
    built = [r.build(shape) for r in runners]
    try:
        for r, (step, _) in zip(runners, built, strict=True):
            r.worker.runner.execute(step)  # warm-up
        times: list[list[float]] = [[], []]
        for _ in range(repeats):
            for i, (r, (step, _)) in enumerate(zip(runners, built, strict=True)):
                t0 = clock()
                r.worker.runner.execute(step)
                times[i].append(clock() - t0)
    finally:
        for r, (_, reqs) in zip(runners, built, strict=True):
            r.free(reqs)
    ratios = [d / p for p, d in zip(times[0], times[1], strict=True)]
    return dict(
        plain_ms=1e3 * statistics.median(times[0]),
        deterministic_ms=1e3 * statistics.median(times[1]),
        ratio=statistics.median(ratios),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--prefill", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument(
        "--dequantize",
        action="store_true",
        help="the model's weights dequantized at load (float weights: the mode's row tiles)",
    )
    parser.add_argument(
        "--quant-kernel",
        choices=("int8", "bf16"),
        default="int8",
        help="the deterministic engine's deterministic_quant_kernel (bf16: AMX-BF16 CPUs)",
    )
    parser.add_argument(
        "--clock",
        choices=("wall", "cpu"),
        default="wall",
        help="cpu: the process's CPU time (time.process_time), steadier on a busy machine "
        "(time waiting for a core not counted; caches and memory still shared)",
    )
    parser.add_argument(
        "--note", default="", help="how the machine was (shared, quiet); load averages are recorded"
    )
    args = parser.parse_args()
    plain, det = make_llm(args, False), make_llm(args, True)
    dtype = str(plain.engine.core.worker.dtype).removeprefix("torch.")
    shapes = {
        "decode_batch_1": StepShape(decode_context_lens=(args.context,)),
        "decode_batch_64": StepShape(decode_context_lens=(args.context,) * 64),
        f"prefill_{args.prefill}": StepShape(
            prefill_chunks=((0, args.prefill),), prefill_samples=1
        ),
    }
    load_before = os.getloadavg()
    rows = {}
    for name, shape in shapes.items():
        clock = time.process_time if args.clock == "cpu" else time.perf_counter
        rows[name] = measure(plain, det, shape, args.repeats, clock)
        print(name, json.dumps(rows[name]), flush=True)
    result = dict(
        benchmark="deterministic",
        date=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        commit=git_commit(),
        machine=cpu_description(),
        note=args.note,
        load_average_1_5_15=dict(before=load_before, after=os.getloadavg()),
        model="embedded SmolLM2-135M-Instruct"
        + (", dequantized at load" if args.dequantize else ""),
        dtype=dtype,
        threads=torch.get_num_threads(),
        context=args.context,
        repeats=args.repeats,
        clock=args.clock,
        quant_kernel=args.quant_kernel,
        command=f"benchmarks/deterministic.py --threads {args.threads} --dtype {args.dtype}"
        f" --clock {args.clock} --quant-kernel {args.quant_kernel}"
        + (" --dequantize" if args.dequantize else ""),
        steps=rows,
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
