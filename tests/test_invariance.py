"""Chunked, unchunked and preempted runs produce the same greedy tokens (fp32: the embedded
model's quantized weights multiply in float arithmetic, ``GGUFWeight.matmul``)."""

from __future__ import annotations

import random

import pytest

from chunkserve.engine.engine import Engine
from chunkserve.scheduling.sampling_params import SamplingParams
from tests.conftest import NATURAL_PROMPTS, assert_no_blocks_in_use, pin_step_times, random_prompt

MAX_TOKENS = 8


def workload() -> list[list[int]]:
    """6 prompts of mixed lengths (with the 2 natural ones, 8): several are longer than the
    small budgets, one than 512."""
    rng = random.Random(1234)
    lengths = [3, 17, 64, 150, 530, 41]
    prompts = [random_prompt(rng, n) for n in lengths]
    return prompts


def natural_prompts(engine: Engine) -> list[list[int]]:
    return [engine.tokenizer.encode(p) for p in NATURAL_PROMPTS[:2]]


def run_staggered(
    engine: Engine, prompts: list[list[int]], max_tokens: int = MAX_TOKENS
) -> list[list[int]]:
    """Add half the prompts at once, the rest one every 3 steps while others decode."""
    params = SamplingParams(max_tokens=max_tokens, min_tokens=max_tokens, temperature=0.0)
    ids: list[str] = []
    pending = list(prompts)
    for _ in range(len(prompts) // 2):
        ids.append(engine.add_request(pending.pop(0), params))
    results: dict[str, list[int]] = {}
    step = 0
    while engine.has_unfinished() or pending:
        if pending and step % 3 == 0:
            ids.append(engine.add_request(pending.pop(0), params))
        for out in engine.step():
            if out.finished:
                assert out.finish_reason == "length"
                results[out.request_id] = out.token_ids
        step += 1
    return [results[i] for i in ids]


def make_engine(**kwargs) -> Engine:
    base = dict(dtype="float32", max_model_len=1024, kv_cache_memory=96 << 20, block_size=16)
    base.update(kwargs)
    return Engine(**base)


@pytest.fixture(scope="module")
def reference() -> tuple[list[list[int]], list[list[int]]]:
    """Unchunked run: whole prompts, the baseline."""
    engine = make_engine(enable_chunked_prefill=False, max_num_batched_tokens=2048)
    prompts = workload() + natural_prompts(engine)
    tokens = run_staggered(engine, prompts)
    assert_no_blocks_in_use(engine)
    return prompts, tokens


@pytest.mark.parametrize("budget", [16, 64, 100, 512])
def test_chunked_matches_unchunked(reference, budget: int) -> None:
    prompts, expected = reference
    engine = make_engine(max_num_batched_tokens=budget)
    chunk_steps = []
    engine.step_listeners.append(lambda s: chunk_steps.append(s))
    assert run_staggered(engine, prompts) == expected
    assert all(s.num_batched_tokens <= budget for s in chunk_steps)
    assert any(s.kind == "mixed" for s in chunk_steps)
    assert_no_blocks_in_use(engine)


def test_adaptive_default_matches_unchunked(reference) -> None:
    """No budget named: the adaptive budget picks each step's share online (steps of
    different budgets, mixed steps, a prefill-only step when nothing decodes), and the
    greedy tokens are those of the unchunked run."""
    prompts, expected = reference
    engine = make_engine()
    assert engine.core.budget_policy.kind == "adaptive" and engine.core.controller is not None
    # The budgets follow the measured step times: on a fake clock they are the same on any
    # machine, however loaded (a step: a fixed cost and a cost per batched token).
    pin_step_times(engine, fixed=0.02, per_token=2e-4)
    steps = []
    engine.step_listeners.append(steps.append)
    assert run_staggered(engine, prompts) == expected
    assert any(s.kind == "mixed" for s in steps)
    assert len({s.token_budget for s in steps if s.num_prefill_tokens}) > 3
    assert all(s.target_time is not None for s in steps if s.num_prefill_tokens)
    assert_no_blocks_in_use(engine)


def test_long_steps_match_unchunked(reference) -> None:
    """The adaptive budget with credit for long steps (waiting prompts prefilled whole in one
    step beside the decodes) and with none: the greedy tokens of the unchunked run."""
    prompts, expected = reference
    for share, credit in ((0.05, 1e9), (0.0, 0.0)):
        engine = make_engine(long_step_share=share)
        pin_step_times(engine)
        controller = engine.core.controller
        controller.long_credit = credit
        if share:
            # Whether a long step pays is the step-cost model's call (tested in
            # test_budget); here every step that may take one does, on any machine.
            controller._takes_long_step = lambda decode_lens, target_s: bool(decode_lens)
        steps = []
        engine.step_listeners.append(steps.append)
        assert run_staggered(engine, prompts) == expected
        assert any(s.long_step for s in steps) == bool(share)
        assert_no_blocks_in_use(engine)


def preemption_workload() -> list[list[int]]:
    """The workload of ``preemption_reference`` (tests/conftest.py), shared with the
    speculative and tensor-parallel preemption tests."""
    rng = random.Random(99)
    return [random_prompt(rng, n) for n in (40, 90, 150, 200, 260, 33, 120)]


PREEMPT_TOKENS = 60
BYTES_PER_BLOCK = 2 * 30 * 3 * 64 * 4 * 16  # fp32 K+V of 16 tokens over 30 layers


def short_preemption_workload() -> list[list[int]]:
    """This file's preemption workload: half the shared one's prompt lengths."""
    rng = random.Random(99)
    return [random_prompt(rng, n) for n in (20, 45, 75, 100, 130, 17, 60)]


SHORT_PREEMPT_TOKENS = 30
PREEMPT_BLOCKS = 15


@pytest.fixture(scope="module")
def short_preemption_reference() -> list[list[int]]:
    """The short workload unchunked in a pool with room to spare: nobody preempted."""
    engine = make_engine(enable_chunked_prefill=False, max_num_batched_tokens=1024)
    tokens = run_staggered(engine, short_preemption_workload(), SHORT_PREEMPT_TOKENS)
    assert engine.core.scheduler.num_preemptions == 0
    assert_no_blocks_in_use(engine)
    return tokens


@pytest.mark.parametrize("chunked", [True, False])
def test_preemption_matches_unpreempted(short_preemption_reference, chunked: bool) -> None:
    # 15 blocks of 16 = 240 slots for 7 requests that grow by 30 outputs each, admitted as
    # soon as their prompts fit (conservativeness 0): the pool runs dry and requests are
    # preempted and recomputed.
    engine = make_engine(
        schedule_conservativeness=0.0,
        enable_chunked_prefill=chunked,
        max_num_batched_tokens=64 if chunked else 1024,
        kv_cache_memory=(PREEMPT_BLOCKS + 1) * BYTES_PER_BLOCK,
        max_model_len=PREEMPT_BLOCKS * 16,
    )
    assert engine.core.worker.num_blocks == PREEMPT_BLOCKS
    got = run_staggered(engine, short_preemption_workload(), SHORT_PREEMPT_TOKENS)
    assert got == short_preemption_reference
    assert engine.core.scheduler.num_preemptions > 0
    assert_no_blocks_in_use(engine)
