"""The cost model and the profiler learn mixture-of-experts steps (issue 41, item 4): the
experts feature (the distinct experts a step's rows touch), its fit on synthetic timings, the
budget's bound with it, profiles that carry their routing, and the profiler measuring the
routing of a tiny random MoE model, uniform and Zipf-skewed."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from chunkserve.scheduling.costmodel import (
    DENSE_FEATURES,
    FEATURES,
    CostModel,
    ExpertRouting,
    OnlineCostModel,
    StepShape,
    fit,
    relative_errors,
)


def test_uniform_routing_touches_top_k_per_token_and_saturates_at_all_experts() -> None:
    r = ExpertRouting.uniform(num_experts=8, top_k=2, num_layers=3)
    assert r.touched(0) == 0.0
    assert r.touched(1) == pytest.approx(3 * 2)  # one token: its top_k experts per layer
    assert r.touched(2) == pytest.approx(3 * 8 * (1 - 0.75**2))
    assert r.touched(10_000) == pytest.approx(3 * 8)
    with pytest.raises(ValueError, match="top_k"):
        ExpertRouting.uniform(num_experts=4, top_k=5)


def test_skewed_routing_touches_fewer_experts_than_uniform() -> None:
    # Layer 0: expert 0 takes almost every token; the other choices spread thinly.
    counts = [[1000, 700, 200, 50, 30, 10, 5, 5]]
    r = ExpertRouting.from_counts(counts, num_tokens=1000)
    assert r.inclusion[0][0] == 1.0 and r.inclusion[0][7] == pytest.approx(0.005)
    uniform = ExpertRouting.uniform(8, 2)
    assert r.touched(1) == pytest.approx(2.0)  # a token still picks top_k
    for t in (4, 16, 64):
        assert r.touched(t) < uniform.touched(t)


def _moe_shapes(rng: random.Random) -> list[StepShape]:
    shapes = []
    for d in (1, 2, 3, 4, 6, 8, 12, 16, 32):
        shapes.append(StepShape((rng.randint(50, 300),) * d))
    for p in (1, 2, 4, 8, 16, 64, 256):
        for d in (0, 1, 4):
            shapes.append(StepShape((200,) * d, ((0, p),), prefill_samples=int(d == 0)))
    return shapes


TRUE_WEIGHTS = [0.004, 2e-4, 2e-4, 1e-4, 0.01, 1e-4, 1e-4, 0.002, 0.0, 1.5e-3]


def test_the_experts_feature_fits_synthetic_moe_steps_the_dense_features_cannot() -> None:
    routing = ExpertRouting.uniform(num_experts=64, top_k=4, num_layers=4)
    true = CostModel(TRUE_WEIGHTS, routing=routing)
    rng = random.Random(0)
    train, test = _moe_shapes(rng), _moe_shapes(rng)
    times = [true.predict(s) for s in train]
    test_times = [true.predict(s) for s in test]
    learned = CostModel(fit(train, times, routing=routing), routing=routing)
    assert max(relative_errors(learned, test, test_times)) < 1e-3
    dense = CostModel(fit(train, times))
    assert max(relative_errors(dense, test, test_times)) > 0.1


def test_the_online_model_learns_the_experts_weight_from_measured_steps() -> None:
    routing = ExpertRouting.uniform(num_experts=32, top_k=2, num_layers=2)
    true = CostModel(TRUE_WEIGHTS, routing=routing)
    online = OnlineCostModel([*TRUE_WEIGHTS[:-1], 0.0], prior_weight=1.0, routing=routing)
    blind = OnlineCostModel([*TRUE_WEIGHTS[:-1], 0.0], prior_weight=1.0)  # no routing
    shapes = _moe_shapes(random.Random(1))
    for s in shapes * 3:
        online.observe(s, true.predict(s))
        blind.observe(s, true.predict(s))
    # From a prior that ignored the experts, most of the way to the truth (the ridge toward
    # the prior keeps a little of it).
    assert 0.8 * TRUE_WEIGHTS[-1] < online.weights[-1] <= 1.05 * TRUE_WEIGHTS[-1]
    times = [true.predict(s) for s in shapes]
    assert max(relative_errors(online, shapes, times)) < 0.1
    assert max(relative_errors(blind, shapes, times)) > 0.2


@pytest.mark.parametrize("decodes", [0, 1, 4, 16])
def test_the_budget_bound_counts_the_experts_a_chunk_adds(decodes: int) -> None:
    routing = ExpertRouting.uniform(num_experts=64, top_k=4, num_layers=4)
    model = CostModel(TRUE_WEIGHTS, routing=routing)
    ctx = (200,) * decodes
    alone = model.predict(StepShape(ctx, prefill_samples=1))
    for target in (alone * 1.2, alone * 2, alone * 4):
        p = model.max_prefill_tokens(ctx, 0, target, limit=1 << 14)
        assert model.predict(StepShape(ctx, ((0, p),), prefill_samples=1)) <= target + 1e-12
        more = StepShape(ctx, ((0, p + 1),), prefill_samples=1)
        assert model.predict(more) > target  # the most that fits, not a loose bound


def test_profiles_carry_their_routing_and_old_dense_profiles_still_load(tmp_path: Path) -> None:
    routing = ExpertRouting.from_counts([[30, 10, 0, 0], [20, 20, 0, 0]], num_tokens=20)
    path = tmp_path / "moe.profile.json"
    CostModel(TRUE_WEIGHTS, {"model": "m"}, routing).save(path)
    loaded = CostModel.load(path)
    assert loaded.routing == routing and loaded.weights == TRUE_WEIGHTS
    assert loaded.meta == {"model": "m"}
    old = tmp_path / "old.profile.json"
    old.write_text(json.dumps({"features": list(DENSE_FEATURES), "weights": [1e-3] * 9}))
    dense = CostModel.load(old)
    assert dense.routing is None and dense.weights == [1e-3] * 9 + [0.0]
    other = tmp_path / "other.profile.json"
    other.write_text(json.dumps({"features": list(FEATURES[:5]), "weights": [1e-3] * 5}))
    with pytest.raises(ValueError, match="other features"):
        CostModel.load(other)


# ---- the profiler on a tiny random MoE model ---------------------------------------------------


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory) -> Path:
    """A tiny random Mixtral directory (config.json and tokenizer, no weights)."""
    import argparse
    import importlib.util

    path = Path(__file__).parent.parent / "benchmarks" / "moe_decode.py"
    spec = importlib.util.spec_from_file_location("moe_decode", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    args = argparse.Namespace(hidden=64, layers=2, experts=8, top_k=2, expert_inter=64)
    return module.write_model_dir(tmp_path_factory.mktemp("moe") / "tiny", args, dense=False)


@pytest.fixture(scope="module")
def moe_engine(moe_dir: Path):
    from chunkserve.engine.engine import Engine

    engine = Engine(
        model=str(moe_dir),
        load_format="dummy",
        dtype="float32",
        max_model_len=256,
        kv_cache_memory=16 << 20,
    )
    yield engine
    engine.shutdown()


TINY_GRID = {
    "decodes": (0, 4),
    "decode_context": (32,),
    "prefill_tokens": (0, 64),
    "prefill_start": (0,),
}


@pytest.mark.parametrize("skew", [0.0, 1.5])
def test_the_profiler_measures_the_experts_each_step_touches(
    moe_engine, skew: float, tmp_path: Path
) -> None:
    from chunkserve.tuning.profiler import profile_summary, run_profile, save_profile

    doc = run_profile(moe_engine, TINY_GRID, repeats=1, route_skew=skew)
    moe = doc["moe"]
    assert moe["num_moe_layers"] == 2 and moe["num_experts"] == 8
    by_tokens = {row["tokens"]: row for row in moe["touched"]}
    assert {1, 2, 8} <= set(by_tokens)  # the small decode batches MoE grids add
    assert by_tokens[1]["seen"] == 2 * 2  # one token: top_k experts in each layer
    for row in moe["touched"]:
        assert row["seen"] <= 2 * 8
    routing = ExpertRouting.from_json(doc["routing"])
    assert routing.touched(1) == pytest.approx(4.0)
    assert "without_experts_heldout_mean_rel_error" in doc["fit"]
    assert "without the experts feature" in profile_summary(doc)
    share = moe["expert_share"]
    assert sum(share) == pytest.approx(1.0)
    save_profile(doc, tmp_path / "p.json")
    saved = CostModel.load(tmp_path / "p.json")
    assert saved.routing == routing and saved.weights == doc["weights"]
    if skew:
        assert share[0] > 2 * share[-1]  # the Zipf bias shows in what the routers picked
        assert routing.touched(8) < ExpertRouting.uniform(8, 2, 2).touched(8)


def test_a_route_skew_on_a_dense_model_is_refused(shared_engine) -> None:
    from chunkserve.tuning.profiler import run_profile

    with pytest.raises(ValueError, match="route_skew"):
        run_profile(shared_engine, TINY_GRID, repeats=1, route_skew=1.0)


def test_the_profile_command_profiles_a_weightless_moe_directory(moe_dir, tmp_path) -> None:
    from chunkserve.entrypoints.cli import main

    out = tmp_path / "p.json"
    argv = ["profile", "--quick", "--model", str(moe_dir), "--load-format", "dummy"]
    argv += ["--dtype", "float32", "--repeats", "1", "--max-model-len", "1024"]
    assert main([*argv, "--output", str(out)]) == 0
    saved = CostModel.load(out)
    assert saved.routing is not None and saved.routing.num_layers == 2
    assert saved.routing.touched(1) == pytest.approx(4.0)
