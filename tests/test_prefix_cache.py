"""Prefix caching: same greedy tokens with the cache on and off (at and off block boundaries,
chunked, preempted), hits save the expected work, and the pool's reference counts hold under
random add/abort/finish sequences (hypothesis)."""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from chunkserve.config import SchedulerConfig
from chunkserve.engine.engine import Engine
from chunkserve.scheduling.kv_cache import KVCacheManager, hash_block
from chunkserve.scheduling.request import Request, RequestStatus
from chunkserve.scheduling.sampling_params import SamplingParams
from chunkserve.scheduling.scheduler import Scheduler
from tests.conftest import assert_no_blocks_in_use, random_prompt

BS = 16
BYTES_PER_BLOCK = 2 * 30 * 3 * 64 * 4 * BS  # fp32


def make_engine(**kw) -> Engine:
    base = dict(
        dtype="float32",
        max_model_len=1024,
        kv_cache_memory=64 << 20,
        block_size=BS,
        max_num_batched_tokens=64,
    )
    base.update(kw)
    return Engine(**base)


def run(
    engine: Engine,
    prompts: list[list[int]],
    max_tokens: int = 8,
    stagger: int = 0,
    stats: list | None = None,
) -> list[list[int]]:
    """Greedy outputs; with ``stagger`` > 0 one prompt is added every ``stagger`` steps."""
    params = SamplingParams(max_tokens=max_tokens, min_tokens=max_tokens, temperature=0.0)
    if stats is not None:
        engine.step_listeners.append(stats.append)
    pending, ids, done, step = list(prompts), [], {}, 0
    while pending or engine.has_unfinished():
        if pending and (stagger == 0 or step % stagger == 0):
            batch = pending if stagger == 0 else pending[:1]
            for p in list(batch):
                ids.append(engine.add_request(p, params))
                pending.remove(p)
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.token_ids
        step += 1
    if stats is not None:
        engine.step_listeners.remove(stats.append)
    return [done[i] for i in ids]


def shared_prefix_prompts() -> list[list[int]]:
    rng = random.Random(5)
    doc = random_prompt(rng, 300)
    return [
        doc + random_prompt(rng, 20),  # 320 = 20 full blocks
        doc[:160] + random_prompt(rng, 40),  # shares exactly 10 blocks (at a boundary)
        doc[:170] + random_prompt(rng, 33),  # shares 170 tokens: 10 blocks + 10 tokens
        doc + random_prompt(rng, 5),
        doc[:7] + random_prompt(rng, 50),  # shares less than a block
        list(doc),  # the whole doc again: hit all but the last block
    ]


@pytest.fixture(scope="module")
def uncached() -> list[list[int]]:
    return run(make_engine(enable_prefix_caching=False), shared_prefix_prompts(), stagger=4)


@pytest.fixture(scope="module")
def module_engine() -> Engine:
    return make_engine()


@pytest.fixture
def engine(module_engine: Engine) -> Engine:
    """The module's engine of ``make_engine()``'s settings, its prefix cache emptied (no
    hit on an earlier test's blocks); left with every request finished."""
    module_engine.reset_prefix_cache()
    yield module_engine
    assert_no_blocks_in_use(module_engine)


def test_cache_on_matches_off(uncached, engine) -> None:
    stats: list = []
    assert run(engine, shared_prefix_prompts(), stagger=4, stats=stats) == uncached
    assert sum(s.prefix_cache_hits for s in stats) > 0
    assert_no_blocks_in_use(engine)


def test_cache_on_unchunked_matches(uncached) -> None:
    engine = make_engine(enable_chunked_prefill=False, max_num_batched_tokens=1024)
    assert run(engine, shared_prefix_prompts(), stagger=4) == uncached
    assert engine.core.kv.num_hit_tokens > 0
    assert_no_blocks_in_use(engine)


def test_cache_under_preemption_matches(uncached) -> None:
    # Admission reserves nothing for outputs and long prompts are not limited: several
    # run at once and the 21-block pool (the longest request's 328 tokens fit) runs dry
    # under their 8 outputs each.
    engine = make_engine(
        kv_cache_memory=22 * BYTES_PER_BLOCK,
        max_model_len=336,
        schedule_conservativeness=0.0,
        long_prefill_token_threshold=0,
    )
    assert run(engine, shared_prefix_prompts(), stagger=1) == uncached
    assert engine.core.scheduler.num_preemptions > 0
    assert engine.core.kv.num_hit_tokens > 0
    assert_no_blocks_in_use(engine)


def prefill_tokens(engine: Engine, prompt: list[int]) -> tuple[int, int]:
    stats: list = []
    run(engine, [prompt], max_tokens=2, stats=stats)
    return sum(s.num_prefill_tokens for s in stats), sum(s.prefix_cache_hits for s in stats)


@pytest.mark.parametrize(("shared", "expected_hit"), [(160, 160), (170, 160), (7, 0)])
def test_hit_lowers_computed_tokens(engine, shared: int, expected_hit: int) -> None:
    rng = random.Random(11)
    doc = random_prompt(rng, 300)
    computed, hit = prefill_tokens(engine, doc)
    assert (computed, hit) == (300, 0)
    tail = random_prompt(rng, 40)
    computed, hit = prefill_tokens(engine, doc[:shared] + tail)
    assert hit == expected_hit
    assert computed == shared + 40 - expected_hit


@pytest.mark.parametrize(("n", "expected"), [(64, 16), (65, 1), (70, 6)])
def test_whole_prompt_cached_still_computes_its_last_token(engine, n: int, expected: int) -> None:
    prompt = random_prompt(random.Random(n), n)
    prefill_tokens(engine, prompt)
    computed, hit = prefill_tokens(engine, prompt)
    assert computed == expected and hit == n - expected


def test_reuse_while_first_request_is_still_prefilling() -> None:
    rng = random.Random(3)
    doc = random_prompt(rng, 600)
    a, b = doc + [101], doc + [202, 203]
    # By arrival, long prompts take at most 32 tokens a step, so B finds budget while A
    # prefills (shortest-first would give A, the shorter remaining, the whole budget).
    engine = make_engine(
        max_num_batched_tokens=64,
        long_prefill_token_threshold=32,
        max_long_partial_prefills=2,
        prefill_order="arrival",
    )
    params = SamplingParams(max_tokens=4, min_tokens=4, temperature=0.0)
    ra = engine.add_request(a, params)
    for _ in range(4):  # A computes 4 chunks (32 each, plus leftover budget)
        engine.step()
    req_a = engine.get_request(ra)
    assert req_a.is_prefilling
    done = req_a.num_computed_tokens
    rb = engine.add_request(b, params)
    engine.step()
    req_b = engine.get_request(rb)
    assert done >= 4 * 32
    assert req_b.num_cached_tokens == done - done % BS  # B started from A's finished chunks
    while engine.has_unfinished():
        engine.step()
    assert_no_blocks_in_use(engine)


def test_reset_prefix_cache_leaves_running_requests_unaffected(engine) -> None:
    """A request decoding on cached blocks when the cache is reset ends with the tokens it
    would have had; a request added after the reset hits nothing; the cache fills again."""
    prompt = random_prompt(random.Random(21), 100)  # 6 full blocks
    params = SamplingParams(max_tokens=12, min_tokens=12, temperature=0.0)
    (reference,) = run(engine, [prompt], max_tokens=12)
    running = engine.add_request(prompt, params)
    while len(engine.get_request(running).output_token_ids) < 4:
        engine.step()
    assert engine.get_request(running).num_cached_tokens == 96  # it hit the first run's
    engine.reset_prefix_cache()
    after = engine.add_request(prompt, params)
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.token_ids
            r = engine.get_request(after)
            if r is not None and r.num_computed_tokens:
                assert r.num_cached_tokens == 0
    assert done == {running: reference, after: reference}
    computed, hit = prefill_tokens(engine, prompt)  # cached again by the one after
    assert (computed, hit) == (4, 96)
    assert_no_blocks_in_use(engine)


def test_block_hash_chains_prefix_and_extra_key() -> None:
    h1 = hash_block(None, [1, 2, 3])
    assert hash_block(None, [1, 2, 3]) == h1
    assert hash_block(h1, [4]) != hash_block(None, [4])
    assert hash_block(None, [1, 2, 3], b"lora-1") != h1


# ---- reference counts under random operations ------------------------------------------------
PREFIXES = [list(range(100, 100 + n)) for n in (0, 4, 9, 16)]


def _req(rid: str, prefix: int, tail: list[int], max_tokens: int) -> Request:
    prompt = PREFIXES[prefix] + tail
    return Request(
        rid,
        prompt or [7],
        SamplingParams(max_tokens=max_tokens),
        max_tokens=max_tokens,
        eos_token_ids=[2],
    )


op = st.one_of(
    st.tuples(
        st.just("add"),
        st.integers(0, 3),
        st.lists(st.integers(3, 60), max_size=12),
        st.integers(1, 6),
    ),
    st.tuples(st.just("step"), st.integers(1, 3)),
    st.tuples(st.just("abort"), st.integers(0, 30)),
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    ops=st.lists(op, min_size=1, max_size=40), chunked=st.booleans(), num_blocks=st.integers(12, 40)
)
def test_refcounts_hold_under_random_add_abort_finish(ops, chunked: bool, num_blocks: int) -> None:
    config = SchedulerConfig(
        max_num_batched_tokens=16,
        max_num_seqs=4,
        max_model_len=48,
        block_size=4,
        enable_chunked_prefill=chunked,
        init_new_token_ratio=0.0,
        min_new_token_ratio=0.0,
    )
    kv = KVCacheManager(num_blocks, 4, enable_prefix_caching=True)
    sched = Scheduler(config, kv, clock=lambda: 0.0)
    added: list[Request] = []

    def check() -> None:
        kv.pool.check_invariants()
        holders = [0] * (num_blocks + 1)
        for r in added:
            if not r.is_finished:
                for b in r.block_ids:
                    holders[b] += 1
            else:
                assert not r.block_ids
        assert holders[1:] == kv.pool.ref_cnt[1:]

    for item in ops:
        if item[0] == "add":
            _, prefix, tail, max_tokens = item
            r = _req(f"r{len(added)}", prefix, tail, max_tokens)
            needed = r.num_prompt_tokens + max_tokens
            if needed > config.max_model_len or kv.num_blocks_for(needed - 1) > kv.num_blocks:
                continue  # the edge refuses it (InputProcessor.check); never reaches here
            sched.add_request(r)
            added.append(r)
        elif item[0] == "step":
            for _ in range(item[1]):
                out = sched.schedule()
                sched.update(out, {c.request.request_id: 5 for c in out.chunks if c.samples})
        elif added:
            sched.abort_request(added[item[1] % len(added)].request_id)
        check()
    for _ in range(500):
        if not sched.has_unfinished():
            break
        out = sched.schedule()
        sched.update(out, {c.request.request_id: 5 for c in out.chunks if c.samples})
        check()
    assert not sched.has_unfinished()
    assert kv.num_free_blocks == kv.num_blocks
    assert all(
        r.status in (RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_ABORTED) for r in added
    )
