"""The shape runner behind ``chunkserve profile`` and ``benchmarks/cpu_floor.py``: the steps it
builds have the shape asked for, and leave no KV block held, also when building fails."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from chunkserve.scheduling.costmodel import StepShape
from chunkserve.tuning.profiler import ShapeRunner
from tests.conftest import assert_no_blocks_in_use


def _cpu_floor():
    path = Path(__file__).parent.parent / "benchmarks" / "cpu_floor.py"
    spec = importlib.util.spec_from_file_location("cpu_floor", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_built_steps_have_the_shape_and_free_their_blocks(shared_engine) -> None:
    runner = ShapeRunner(shared_engine.core)
    shape = StepShape(
        decode_context_lens=(40, 90, 17), prefill_chunks=((32, 48), (0, 20)), prefill_samples=1
    )
    out, reqs = runner.build(shape)
    try:
        assert StepShape.of(out) == shape
        assert [c.num_tokens for c in out.prefills] == [48, 20]
        assert [c.start for c in out.decodes] == [39, 89, 16]
        assert shared_engine.core.kv.num_free_blocks < shared_engine.core.kv.num_blocks
    finally:
        runner.free(reqs)
    assert_no_blocks_in_use(shared_engine)
    times = runner.time_shape_runs(StepShape(decode_context_lens=(8,) * 4), repeats=2)
    assert len(times) == 2 and all(t > 0 for t in times)
    assert_no_blocks_in_use(shared_engine)


def test_a_shape_too_big_for_the_cache_fails_and_holds_nothing(shared_engine) -> None:
    kv = shared_engine.core.kv
    too_many = kv.num_blocks * kv.block_size // 1000 + 1
    runner = ShapeRunner(shared_engine.core)
    with pytest.raises(ValueError, match="too small"):
        runner.build(StepShape(decode_context_lens=(1000,) * too_many))
    assert_no_blocks_in_use(shared_engine)


def test_floor_accounting_counts_the_models_work(shared_engine) -> None:
    cf = _cpu_floor()
    model = shared_engine.core.worker.runner.model
    cfg = model.config
    per_layer = (
        (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim * cfg.hidden_size
        + cfg.hidden_size * cfg.num_heads * cfg.head_dim
        + 3 * cfg.hidden_size * cfg.intermediate_size
    )
    assert cf.linear_macs(model) == cfg.num_layers * per_layer
    # 3 rows after 2 cached tokens see 3, 4 and 5 keys.
    per_key = 2 * cfg.num_heads * cfg.head_dim * cfg.num_layers
    assert cf.attention_macs(model, 2, 3) == 12 * per_key
    assert cf.kv_bytes_per_token(model) == 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 4
