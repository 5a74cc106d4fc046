"""``chunkserve profile``: measure the real model over a grid of step shapes on this hardware
and fit the step-time cost model (``costmodel``). Also ``chunkserve tune``.

A shape is built directly as a SchedulerOutput (fabricated requests whose earlier tokens are
taken as already computed), run through the engine's ModelRunner, and timed (median of
repeats). The fit is checked on held-out shapes. The result is saved as JSON next to the model
(or under ``~/.cache/chunkserve/profiles`` if that folder is not writable), named by device,
dtype, weight format (a GGUF kept quantized: its types) and threads, which is where
``--itl-slo-ms`` looks for it.
"""

from __future__ import annotations

import itertools
import json
import random
import statistics
import time
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

from chunkserve.engine.core import EngineCore
from chunkserve.engine.engine import Engine
from chunkserve.model.moe import RoutingTap
from chunkserve.provenance import cpu_description, git_commit
from chunkserve.scheduling.costmodel import (
    CostModel,
    ExpertRouting,
    StepShape,
    fit,
    relative_errors,
)
from chunkserve.scheduling.kv_cache import cdiv
from chunkserve.scheduling.request import Request
from chunkserve.scheduling.sampling_params import SamplingParams
from chunkserve.scheduling.scheduler import ScheduledChunk, SchedulerOutput

FULL_GRID = {
    "decodes": (0, 1, 4, 16, 32),
    "decode_context": (256, 1536),
    "prefill_tokens": (0, 16, 64, 128, 256, 512),
    # Up to the long documents chunked prefill exists for: attention over a deep prefix is
    # the term a short-context grid would leave to extrapolation.
    "prefill_start": (0, 1536, 3584),
    # One decode this long among short ones (a document that finished its prompt): the
    # torch backend pads decodes to the longest of their group, so the sum of contexts
    # alone under-predicts these steps.
    "long_decode": (3584,),
}
QUICK_GRID = {
    "decodes": (0, 4, 16),
    "decode_context": (256,),
    "prefill_tokens": (0, 32, 128),
    "prefill_start": (0, 512),
    "long_decode": (1024,),
}
# Decode batches a mixture-of-experts model's grid adds: a batch of a few tokens touches a
# few experts, a larger one nearly all, so the experts' fixed costs need small batches to
# be told apart from the tokens' costs.
MOE_DECODES = (1, 2, 8)


def grid_shapes(
    grid: dict[str, tuple[int, ...]], max_model_len: int | None = None
) -> list[StepShape]:
    """The step shapes of ``grid`` (those that fit ``max_model_len``)."""
    shapes = []
    for d, ctx, p, start in itertools.product(
        grid["decodes"], grid["decode_context"], grid["prefill_tokens"], grid["prefill_start"]
    ):
        if d == 0 and p == 0:
            continue
        if p == 0 and start != grid["prefill_start"][0]:
            continue  # the start does not matter without a prefill chunk
        if d == 0 and ctx != grid["decode_context"][0]:
            continue
        if max_model_len is not None and max(ctx, start + p) > max_model_len:
            continue
        chunks = ((start, p),) if p else ()
        shapes.append(StepShape((ctx,) * d, chunks))
        if d >= 2 and ctx == grid["decode_context"][0] and start == grid["prefill_start"][0]:
            for long in grid.get("long_decode", ()):
                if max_model_len is None or long <= max_model_len:
                    shapes.append(StepShape((long,) + (ctx,) * (d - 1), chunks))
        if d == 0:
            # The same chunk ending its prompt: the step then samples (the LM head runs),
            # which a step with decodes always does.
            shapes.append(StepShape((), ((start, p),), prefill_samples=1))
    return shapes


def hardware_description(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return cpu_description()


class ShapeRunner:
    """Runs one fabricated step of a given shape through the engine's model runner.

    With a ``tap`` (a mixture-of-experts model's ``RoutingTap``), the routers run through
    it in every run (its bias, if any, shapes the timed steps), and the experts the warm-up
    run picked are kept: ``routes[i]`` the (layer's expert ids [T, top_k]) of the i-th shape
    timed."""

    def __init__(self, core: EngineCore, tap: RoutingTap | None = None) -> None:
        self.core = core
        self.worker = core.worker
        self.rng = random.Random(0)
        self.tap = tap
        self.routes: list[list[torch.Tensor]] = []

    def _request(self, rid: str, num_tokens: int, computed: int, decode: bool) -> Request:
        """A request of ``num_tokens`` tokens, ``computed`` of them in the cache; for a
        decode the last token is a sampled one."""
        ids = [self.rng.randrange(100, 49_000) for _ in range(num_tokens)]
        prompt = ids[:-1] if decode else ids
        r = Request(rid, prompt, SamplingParams(max_tokens=2, temperature=0.0), max_tokens=2)
        if decode:
            r.append_output_token(ids[-1])
        kv = self.core.kv
        if not kv.allocate_slots(r, r.num_tokens):
            raise ValueError(
                "profile: the KV cache is too small for this grid; raise --kv-cache-memory"
            )
        r.num_computed_tokens = computed
        # Zero the blocks: uninitialised memory could hold denormals or NaNs that would
        # distort timings (the engine zeroes blocks on first write).
        held = sorted({b for table in r.block_tables for b in table})
        blocks = torch.tensor(held, dtype=torch.int64, device=self.worker.device)
        for k_cache, v_cache in self.worker.runner.kv_caches:
            k_cache.index_fill_(0, blocks, 0)
            v_cache.index_fill_(0, blocks, 0)
        return r

    def build(self, shape: StepShape) -> tuple[SchedulerOutput, list[Request]]:
        """The step of this shape and its requests (``free`` them after)."""
        out = SchedulerOutput()
        reqs = []
        try:
            for i, ctx in enumerate(shape.decode_context_lens):
                r = self._request(f"d{i}", ctx, ctx - 1, decode=True)
                out.decodes.append(ScheduledChunk(r, ctx - 1, 1))
                reqs.append(r)
            for i, (start, n) in enumerate(shape.prefill_chunks):
                # The first ``prefill_samples`` chunks end their prompt (their last row is
                # sampled); the others stop one token short of it.
                samples = i < shape.prefill_samples
                r = self._request(f"p{i}", start + n + (not samples), start, decode=False)
                out.prefills.append(ScheduledChunk(r, start, n))
                reqs.append(r)
            if StepShape.of(out) != shape:  # e.g. a decode that would not sample
                raise AssertionError(f"profile: built {StepShape.of(out)} for {shape}")
        except BaseException:
            self.free(reqs)
            raise
        return out, reqs

    def free(self, reqs: list[Request]) -> None:
        for r in reqs:
            self.core.kv.free(r)

    def time_shape(self, shape: StepShape, repeats: int) -> float:
        """Median seconds of ``repeats`` runs of the step, after one warm-up run."""
        return statistics.median(self.time_shape_runs(shape, repeats))

    def time_shape_runs(self, shape: StepShape, repeats: int) -> list[float]:
        out, reqs = self.build(shape)
        tap = self.tap
        try:
            if tap is None:
                self.worker.runner.execute(out)  # warm-up (primitive creation, buffers)
            else:
                tap.ids, tap.recording = [], True
                with tap:
                    self.worker.runner.execute(out)
                self.routes.append(tap.ids)
                tap.ids, tap.recording = [], False
            times = []
            for _ in range(repeats):
                if self.worker.device.type == "cuda":
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                if tap is None:
                    self.worker.runner.execute(out)
                else:
                    with tap:
                        self.worker.runner.execute(out)
                if self.worker.device.type == "cuda":
                    torch.cuda.synchronize()
                times.append(time.perf_counter() - t0)
        finally:
            self.free(reqs)
        return times


def measure_overhead(engine: Engine, steps: int = 30) -> float:
    """Mean engine time per step outside the model runner (scheduling, detokenisation)."""
    stats = []
    engine.step_listeners.append(stats.append)
    params = SamplingParams(max_tokens=steps, ignore_eos=True, temperature=0.0)
    for i in range(8):
        engine.add_request([100 + i] * 24, params)
    while engine.has_unfinished():
        engine.step()
    engine.step_listeners.remove(stats.append)
    gaps = [s.wall_time - s.forward_time for s in stats]
    return statistics.fmean(gaps) if gaps else 0.0


def run_profile(
    engine: Engine,
    grid: dict[str, tuple[int, ...]],
    repeats: int = 3,
    heldout_fraction: float = 0.2,
    seed: int = 0,
    progress: Callable[[int, int], None] | None = None,
    route_skew: float = 0.0,
) -> dict[str, Any]:
    """Measure every shape of ``grid``; fit on most, check on the held-out rest; return the
    profile document (the saved model is fit on all shapes).

    A mixture-of-experts model's routing is measured as its shapes run (``moe_routing``):
    the experts' feature is priced by how the profiled tokens spread over the experts.
    ``route_skew``: a Zipf bias of the routers (``RoutingTap``; benchmarks and tests)."""
    num_experts = engine.core.model_config.num_experts
    if num_experts:
        grid = {**grid, "decodes": tuple(sorted({*grid["decodes"], *MOE_DECODES}))}
    elif route_skew:
        raise ValueError("route_skew: the model has no experts")
    shapes = grid_shapes(grid, engine.max_model_len)
    runner = ShapeRunner(engine.core, RoutingTap(route_skew) if num_experts else None)
    times = []
    for i, shape in enumerate(shapes):
        times.append(runner.time_shape(shape, repeats))
        if progress:
            progress(i + 1, len(shapes))
    overhead = measure_overhead(engine)
    routing, moe_doc = (None, None)
    if num_experts:
        routing, moe_doc = moe_routing(shapes, runner.routes, num_experts, route_skew)
    order = list(range(len(shapes)))
    random.Random(seed).shuffle(order)
    n_test = max(1, int(len(shapes) * heldout_fraction))
    test, train = order[:n_test], order[n_test:]

    def heldout(routing: ExpertRouting | None) -> list[float]:
        train_w = fit([shapes[i] for i in train], [times[i] for i in train], routing=routing)
        model = CostModel(train_w, routing=routing)
        return relative_errors(model, [shapes[i] for i in test], [times[i] for i in test])

    test_err = heldout(routing)
    weights = fit(shapes, times, routing=routing)
    weights[0] += overhead  # the engine's own per-step work
    all_err = relative_errors(
        CostModel(weights, routing=routing), shapes, [t + overhead for t in times]
    )
    fit_doc: dict[str, Any] = {
        "num_shapes": len(shapes),
        "heldout_shapes": n_test,
        "heldout_mean_rel_error": statistics.fmean(test_err),
        "heldout_max_rel_error": max(test_err),
        "all_mean_rel_error": statistics.fmean(all_err),
    }
    if routing is not None:
        # The same split fit without the experts feature: what the feature buys.
        dense_err = heldout(None)
        fit_doc["without_experts_heldout_mean_rel_error"] = statistics.fmean(dense_err)
        fit_doc["without_experts_heldout_max_rel_error"] = max(dense_err)
    return {
        "weights": weights,
        "model": engine.model_name,
        "model_path": engine.model_path,
        "device": engine.core.worker.device.type,
        "hardware": hardware_description(engine.core.worker.device),
        "dtype": str(engine.core.worker.dtype).removeprefix("torch."),
        # The quantized types the weights are held in (a quantized model is profiled apart).
        "weight_format": engine.core.worker.weights_format or "float",
        "threads": torch.get_num_threads(),
        "block_size": engine.core.worker.block_size,
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "commit": git_commit(),
        "overhead_s": overhead,
        "fit": fit_doc,
        **({"routing": routing.to_json(), "moe": moe_doc} if routing is not None else {}),
        "samples": [
            {
                "decode_context_lens": list(s.decode_context_lens),
                "prefill_chunks": [list(c) for c in s.prefill_chunks],
                "prefill_samples": s.prefill_samples,
                "time_s": t,
            }
            for s, t in zip(shapes, times)
        ],
    }


def moe_routing(
    shapes: list[StepShape], routes: list[list[torch.Tensor]], num_experts: int, skew: float
) -> tuple[ExpertRouting, dict[str, Any]]:
    """The routing the profiled steps saw (each layer's share of tokens per expert, over
    all of them), and how well it predicts each step's distinct experts: the expected
    count (``ExpertRouting.touched``) against the count the step's routers picked."""
    layers = {len(r) for r in routes}
    if len(layers) != 1 or not routes or not routes[0]:
        raise ValueError(f"profile: saw {sorted(layers)} MoE router calls per step")
    counts = [[0] * num_experts for _ in range(layers.pop())]
    tokens = 0
    for layer_ids in routes:
        tokens += layer_ids[0].shape[0]
        for layer, ids in enumerate(layer_ids):
            for e, c in enumerate(torch.bincount(ids.reshape(-1), minlength=num_experts)):
                counts[layer][e] += int(c)
    routing = ExpertRouting.from_counts(counts, tokens)
    steps = []
    for shape, layer_ids in zip(shapes, routes):
        seen = sum(int(ids.unique().numel()) for ids in layer_ids)
        steps.append((shape.num_tokens, seen, routing.touched(shape.num_tokens)))
    err = [abs(p - s) / s for _, s, p in steps]
    share = [sum(layer[e] for layer in counts) / sum(map(sum, counts)) for e in range(num_experts)]
    return routing, {
        "route_skew": skew,
        "num_moe_layers": len(counts),
        "num_experts": num_experts,
        "expert_share": share,  # of all (token, choice) pairs, over the layers
        "touched_mean_rel_error": statistics.fmean(err),
        "touched_max_rel_error": max(err),
        "touched": [{"tokens": t, "seen": s, "expected": round(p, 3)} for t, s, p in steps],
    }


def save_profile(doc: dict[str, Any], path: Path) -> None:
    routing = ExpertRouting.from_json(doc["routing"]) if doc.get("routing") else None
    meta = {k: v for k, v in doc.items() if k not in ("weights", "routing")}
    model = CostModel(doc["weights"], meta, routing)
    path.parent.mkdir(parents=True, exist_ok=True)
    model.save(path)


def kv_blocks_needed(grid: dict[str, tuple[int, ...]], block_size: int) -> int:
    """KV blocks the largest step of ``grid`` holds (each request rounded up to blocks)."""
    most = 0
    for shape in grid_shapes(grid):
        blocks = sum(cdiv(c + 1, block_size) for c in shape.decode_context_lens)
        blocks += sum(cdiv(s + n + 1, block_size) for s, n in shape.prefill_chunks)
        most = max(most, blocks)
    return most + 8


def tune_table(
    model: CostModel,
    itl_slo_s: float,
    num_decodes: int,
    decode_context: int,
    prefill_start: int,
    candidates: list[int],
) -> list[dict[str, float]]:
    """Predicted step time (the ITL a decode sees while prefill runs) and prefill
    throughput for static budgets."""
    rows = []
    for budget in candidates:
        p = max(0, budget - num_decodes)
        shape = StepShape(
            (decode_context,) * num_decodes, ((prefill_start, p),) if p else (), prefill_samples=1
        )
        t = model.predict(shape)
        rows.append(
            {
                "budget": budget,
                "predicted_itl_ms": 1e3 * t,
                "prefill_tok_s": p / t if t > 0 else 0.0,
                "meets": t <= itl_slo_s,
            }
        )
    return rows


def profile_summary(doc: dict[str, Any]) -> str:
    f = doc["fit"]
    moe = ""
    if "without_experts_heldout_mean_rel_error" in f:
        moe = (
            f" (without the experts feature: mean "
            f"{100 * f['without_experts_heldout_mean_rel_error']:.1f}%, max "
            f"{100 * f['without_experts_heldout_max_rel_error']:.1f}%)"
        )
    return (
        f"{f['num_shapes']} shapes on {doc['hardware']} ({doc['device']}, {doc['dtype']}, "
        f"{doc.get('weight_format', 'float')} weights, "
        f"{doc['threads']} threads); held-out {f['heldout_shapes']} shapes: mean error "
        f"{100 * f['heldout_mean_rel_error']:.1f}%, max {100 * f['heldout_max_rel_error']:.1f}%"
        f"{moe}; weights {json.dumps([round(w, 7) for w in doc['weights']])}"
    )
