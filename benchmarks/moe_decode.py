"""A mixture-of-experts decode step against its floor and against a dense model (issue 41's
targets), on this CPU.

The MoE model: Mixtral's shape shrunk to fit this machine (``--hidden`` 1024, ``--layers`` 6,
16 query / 4 KV heads, 8 experts of ``--expert-inter`` 3584 columns, top 2, the embedded
model's 49,152-token vocabulary), random weights (``load_format dummy``), fp32. The dense
model: the same attention and vocabulary, one MLP as wide as all 8 experts together (the
same total parameters).

Measured, in one run, with decode steps of ``--batches`` requests at ``--context`` tokens
through the engine's model runner (``tuning.profiler.ShapeRunner``):

- the MoE step's time, the experts its tokens touched (recorded from the router), and the
  matmul floor of that step: the same ``F.linear`` calls over the same rows timed alone
  (every layer's QKV, output and router projections, each touched expert's gate/up and down
  over the rows routed to it, the LM head), step and floor timed in turn (the VM drifts);
  also the floor of the touched experts alone;
- the dense model's step at the same batches, timed in turn with the MoE step: its time
  over the MoE step's (the median of the rounds' ratios).

    PYTHONPATH=$PWD .venv/bin/python benchmarks/moe_decode.py --threads 2

Writes ``benchmarks/results/moe_decode/results.json`` and ``report.md``, naming the CPU.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from chunkserve.entrypoints.llm import LLM
from chunkserve.model import moe
from chunkserve.provenance import cpu_description, git_commit
from chunkserve.scheduling.costmodel import StepShape
from chunkserve.tuning.profiler import ShapeRunner

VOCAB = 49152


def write_model_dir(out: Path, args: argparse.Namespace, dense: bool) -> Path:
    """A config.json (no weights: random ones are drawn) and the embedded model's
    tokenizer."""
    from chunkserve.engine.tokenizer import Tokenizer
    from chunkserve.model.loader import embedded_model_path, open_gguf

    out.mkdir(parents=True, exist_ok=True)
    cfg: dict[str, Any] = dict(
        vocab_size=VOCAB,
        hidden_size=args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=16,
        num_key_value_heads=4,
        rms_norm_eps=1e-5,
        max_position_embeddings=4096,
        rope_theta=1e6,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    )
    if dense:
        cfg.update(
            architectures=["LlamaForCausalLM"],
            model_type="llama",
            intermediate_size=args.experts * args.expert_inter,
        )
    else:
        cfg.update(
            architectures=["MixtralForCausalLM"],
            model_type="mixtral",
            intermediate_size=args.expert_inter,
            num_local_experts=args.experts,
            num_experts_per_tok=args.top_k,
        )
    (out / "config.json").write_text(json.dumps(cfg))
    gguf = embedded_model_path()
    Tokenizer.from_gguf(gguf, open_gguf(gguf))._tk.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<|im_start|>"}))
    return out


def make_llm(path: Path, args: argparse.Namespace) -> LLM:
    return LLM(
        model=str(path),
        load_format="dummy",
        dtype="float32",
        num_threads=args.threads,
        max_model_len=args.context + 16,
        kv_cache_memory=max(args.batches) * (args.context + 32) * 2 * args.layers * 4 * 64 * 4,
    )


class RouteRecorder:
    """Records the experts each MoE layer's router picks during one step."""

    def __init__(self) -> None:
        self.ids: list[torch.Tensor] = []
        self.original = moe.route

    def __enter__(self) -> RouteRecorder:
        def recording(logits, top_k, renormalize):
            weights, ids = self.original(logits, top_k, renormalize)
            self.ids.append(ids.clone())
            return weights, ids

        moe.route = recording
        return self

    def __exit__(self, *exc: object) -> None:
        moe.route = self.original


@torch.inference_mode()
def floor_calls(
    model, ids_per_layer: list[torch.Tensor], rows: int, sampled: int
) -> tuple[list, list]:
    """The step's matmuls as (input, weight) pairs: all of them, and the experts' alone."""
    h = model.config.hidden_size
    every, experts = [], []
    x = torch.randn(rows, h)
    for layer, ids in zip(model.layers, ids_per_layer, strict=True):
        a, m = layer.attn, layer.mlp
        every.append((x, a.qkv.weight))
        every.append((torch.randn(rows, a.q_size), a.o.weight))
        every.append((x, m.router))
        counts = torch.bincount(ids.reshape(-1), minlength=m.w13.shape[0]).tolist()
        for e, n in enumerate(counts):
            if n:
                xe = torch.randn(n, h)
                he = torch.randn(n, m.w2.shape[2])
                pair = [(xe, m.w13[e]), (he, m.w2[e])]
                every += pair
                experts += pair
    every.append((x[:sampled], model.lm_head.weight))
    return every, experts


def time_calls(calls: list) -> float:
    t0 = time.perf_counter()
    for x, w in calls:
        F.linear(x, w)
    return time.perf_counter() - t0


@torch.inference_mode()
def measure(
    moe_llm: LLM, dense_llm: LLM, args: argparse.Namespace, done: Callable[[dict], None]
) -> None:
    """Per batch: the MoE step, its floors and the dense step, timed in turn (the machine's
    load drifts; each ratio is the median of the rounds' ratios); ``done`` gets each
    batch's row."""
    model = moe_llm.engine.core.worker.runner.model
    runner, dense = ShapeRunner(moe_llm.engine.core), ShapeRunner(dense_llm.engine.core)
    for batch in args.batches:
        shape = StepShape(decode_context_lens=(args.context,) * batch)
        step, reqs = runner.build(shape)
        dense_step, dense_reqs = dense.build(shape)
        try:
            runner.worker.runner.execute(step)  # warm-up
            dense.worker.runner.execute(dense_step)
            with RouteRecorder() as rec:
                runner.worker.runner.execute(step)
            # Padded rows (a CPU step pads its token count) are routed too: the floor
            # counts the rows the step actually multiplied.
            rows = rec.ids[0].shape[0]
            every, experts = floor_calls(model, rec.ids, rows, batch)
            steps, floors, expert_floors, dense_steps = [], [], [], []
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                runner.worker.runner.execute(step)
                steps.append(time.perf_counter() - t0)
                floors.append(time_calls(every))
                expert_floors.append(time_calls(experts))
                t0 = time.perf_counter()
                dense.worker.runner.execute(dense_step)
                dense_steps.append(time.perf_counter() - t0)
        finally:
            runner.free(reqs)
            dense.free(dense_reqs)
        touched = [len(set(ids[:batch].reshape(-1).tolist())) for ids in rec.ids]
        row = dict(
            batch=batch,
            rows_multiplied=rows,
            step_ms=1e3 * statistics.median(steps),
            floor_ms=1e3 * statistics.median(floors),
            experts_floor_ms=1e3 * statistics.median(expert_floors),
            step_over_floor=statistics.median([s / f for s, f in zip(steps, floors, strict=True)]),
            experts_touched_per_layer=touched,
            dense_step_ms=1e3 * statistics.median(dense_steps),
            dense_over_moe=statistics.median(
                [d / s for d, s in zip(dense_steps, steps, strict=True)]
            ),
        )
        print(row, flush=True)
        done(row)


def params(model) -> int:
    return sum(p.numel() for p in model.parameters())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--expert-inter", type=int, default=3584)
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16, 64])
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--out-dir", default="benchmarks/results/moe_decode")
    args = p.parse_args()
    torch.manual_seed(0)
    results: dict[str, Any] = dict(
        machine=cpu_description(),
        commit=git_commit(),
        date=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        args=vars(args),
    )
    with tempfile.TemporaryDirectory() as tmp:
        moe_llm = make_llm(write_model_dir(Path(tmp) / "moe", args, dense=False), args)
        dense_llm = make_llm(write_model_dir(Path(tmp) / "dense", args, dense=True), args)
        results["moe_params"] = params(moe_llm.engine.core.worker.runner.model)
        results["dense_params"] = params(dense_llm.engine.core.worker.runner.model)
        results["steps"] = []
        measure(moe_llm, dense_llm, args, lambda row: save(results, row, args.out_dir))
        moe_llm.engine.shutdown()
        dense_llm.engine.shutdown()
    print(report(results))


def save(results: dict[str, Any], row: dict[str, Any], out_dir: str) -> None:
    """Adds a batch's row and writes the results so far (a run the machine's load makes
    too slow to finish keeps the batches it measured)."""
    results["steps"].append(row)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    (out / "report.md").write_text(report(results))


def report(r: dict[str, Any]) -> str:
    a = r["args"]
    lines = [
        "# MoE decode step: floor and dense comparison",
        "",
        f"Machine: {r['machine']}; {a['threads']} threads; commit {r['commit']}; {r['date']}.",
        f"MoE: hidden {a['hidden']}, {a['layers']} layers, {a['experts']} experts top "
        f"{a['top_k']} of {a['expert_inter']} columns, vocab {VOCAB}, fp32, random weights: "
        f"{r['moe_params'] / 1e6:.0f}M parameters. Dense: one MLP of "
        f"{a['experts'] * a['expert_inter']} columns: {r['dense_params'] / 1e6:.0f}M.",
        f"Decode steps at {a['context']} tokens of context; medians of {a['repeats']}.",
        "",
        "| batch | MoE step ms | floor ms | step / floor | experts floor ms | experts "
        "touched per layer | dense step ms | dense / MoE |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for m in r["steps"]:
        lines.append(
            f"| {m['batch']} | {m['step_ms']:.1f} | {m['floor_ms']:.1f} | "
            f"{m['step_over_floor']:.2f} | {m['experts_floor_ms']:.1f} | "
            f"{m['experts_touched_per_layer']} | {m['dense_step_ms']:.1f} | "
            f"{m['dense_over_moe']:.2f} |"
        )
    lines += [
        "",
        "Floor: the step's own matmuls (QKV, output, router, each touched expert's gate/up "
        "and down over its rows, over every row the step multiplied, padding included; the "
        "LM head over the sampled rows) timed alone (attention is not in it), in turn with "
        "the step. Targets (issue 41): step within 1.5x "
        "of the floor; batch-1 decode >= 2.5x faster than the dense model.",
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
