"""The hybrid KV cache's bookkeeping (``KVCacheManager`` with ``group_windows``): sliding
groups give back the blocks that left their window, every group's table stays positional,
the scheduler counts blocks per group, and prefix hits follow each group's rule. Pure
Python, no model."""

from __future__ import annotations

import random

import pytest

from chunkserve.scheduling.block_hash import block_hashes
from chunkserve.scheduling.kv_cache import NULL_BLOCK, KVCacheManager, cdiv
from chunkserve.scheduling.request import Request
from chunkserve.scheduling.sampling_params import SamplingParams

BS = 4


def make_request(rid: str, prompt: list[int], max_tokens: int = 4) -> Request:
    return Request(rid, prompt, SamplingParams(max_tokens=max_tokens), max_tokens=max_tokens)


def needed_first_block(window: int | None, pos: int) -> int:
    """The first block a query at ``pos`` or later may read (0 without a window)."""
    return 0 if window is None else max(0, pos - window + 1) // BS


def check_tables(kv: KVCacheManager, r: Request, num_allocated_tokens: int) -> None:
    """Every group's table covers the allocated tokens; the blocks the next query's window
    reaches are live and nothing older is held."""
    pos = r.num_computed_tokens
    for g, w in enumerate(kv.group_windows):
        table = r.block_tables[g]
        assert len(table) == cdiv(num_allocated_tokens, BS)
        first = needed_first_block(w, pos)
        assert all(b == NULL_BLOCK for b in table[:first]), (g, table)
        assert all(b != NULL_BLOCK for b in table[first:]), (g, table)


@pytest.mark.parametrize("windows", [(None,), (6,), (None, 6, 6), (None, 9), (5,)])
def test_blocks_held_never_exceed_what_the_windows_need(windows) -> None:
    """A long prompt in random chunks, then decodes: after every allocation a sliding group
    holds only the blocks from its window's first one on, and the pool balances."""
    rng = random.Random(len(windows))
    kv = KVCacheManager(200, BS, group_windows=windows)
    r = make_request("a", list(range(90)), max_tokens=30)
    while r.num_computed_tokens < r.num_tokens:
        n = min(rng.choice([1, 3, 4, 8, 13]), r.num_tokens - r.num_computed_tokens)
        assert kv.allocate_slots(r, n)
        check_tables(kv, r, r.num_computed_tokens + n)
        held = kv.num_held_blocks(r)
        assert kv.num_free_blocks == kv.num_blocks - held
        for g, w in enumerate(windows):
            live = len(r.block_tables[g]) - r.block_tables[g].count(NULL_BLOCK)
            bound = cdiv(r.num_computed_tokens + n, BS) if w is None else cdiv(w - 1 + n, BS) + 1
            assert live <= bound
        r.num_computed_tokens += n
        if r.num_computed_tokens == r.num_tokens and r.num_output_tokens < 30:
            r.append_output_token(7)
    kv.pool.check_invariants()
    kv.free(r)
    assert kv.num_free_blocks == kv.num_blocks and not any(r.block_tables)
    kv.pool.check_invariants()


def test_a_window_counts_the_blocks_it_gives_back_before_it_allocates() -> None:
    """A pool with just enough blocks for the window and the next chunk serves a request
    whose whole history would not fit; ``num_new_blocks`` nets the blocks given back."""
    kv = KVCacheManager(4, BS, group_windows=(5,))
    r = make_request("a", list(range(40)))
    for _ in range(10):
        assert kv.num_new_blocks(r, BS) <= kv.num_free_blocks
        assert kv.allocate_slots(r, BS)
        r.num_computed_tokens += BS
    assert kv.num_held_blocks(r) <= 3
    # Without a window the same pool runs out after four blocks.
    full = KVCacheManager(4, BS)
    r = make_request("b", list(range(40)))
    for _ in range(4):
        assert full.allocate_slots(r, BS)
        r.num_computed_tokens += BS
    assert not full.can_allocate(r, BS) and not full.allocate_slots(r, BS)


def test_trim_and_free_skip_the_null_entries() -> None:
    kv = KVCacheManager(50, BS, group_windows=(None, 5))
    r = make_request("a", list(range(30)))
    assert kv.allocate_slots(r, 20)
    r.num_computed_tokens = 20
    assert kv.allocate_slots(r, 8)  # drafts, say
    assert r.block_tables[1][:4] == [NULL_BLOCK] * 4
    kv.trim(r)  # rejected: back to the computed tokens
    assert [len(t) for t in r.block_tables] == [5, 5]
    kv.free(r)
    assert kv.num_free_blocks == kv.num_blocks
    kv.pool.check_invariants()


def test_the_cache_cannot_ever_fit_counts_every_group() -> None:
    kv = KVCacheManager(10, BS, group_windows=(None, 8, 8))
    assert kv.max_blocks_for(13) == 3 * 4
    # A sliding group's future tokens are bounded by its window and a block.
    assert kv.slots_for(100) == 100 + 2 * (8 + BS)
    assert KVCacheManager(10, BS).slots_for(100) == 100


@pytest.mark.parametrize("bad", [(), (0,), (None, -3), (True,), (2.5,)])
def test_bad_group_windows_are_refused(bad) -> None:
    with pytest.raises(ValueError, match="group_windows"):
        KVCacheManager(10, BS, group_windows=bad)


# ---- prefix cache ----------------------------------------------------------------------------
def publish(kv: KVCacheManager, tokens: list[int], group: int, indices) -> list[int]:
    """Cache blocks ``indices`` of ``tokens`` in ``group`` (fresh blocks); their ids."""
    hashes = block_hashes(tokens, BS)
    ids = kv.pool.allocate(len(indices))
    for b, i in zip(ids, indices):
        kv.pool.register(b, hashes[i], group)
    kv.pool.free(ids)
    return ids


def test_a_hit_needs_every_block_in_a_full_group_and_the_window_in_a_sliding_one() -> None:
    w = 6  # a query at 40 sees 35..40: blocks 8 and 9 of the first ten
    kv = KVCacheManager(64, BS, enable_prefix_caching=True, group_windows=(None, w))
    prompt = list(range(100, 141))  # 41 tokens: 10 full blocks before the last token
    full_ids = publish(kv, prompt, 0, range(10))
    win_ids = publish(kv, prompt, 1, [8, 9])  # only the window's blocks
    r = make_request("a", prompt)
    tables, hit = kv.match_prefix(r)
    assert hit == 40
    assert tables[0] == full_ids
    assert tables[1] == [NULL_BLOCK] * 8 + win_ids
    kv.acquire_prefix(r, tables)
    assert r.num_computed_tokens == 40 and kv.num_held_blocks(r) == 12
    kv.pool.check_invariants()
    kv.free(r)
    kv.pool.check_invariants()


def test_a_missing_block_in_the_window_cuts_the_hit_back() -> None:
    kv = KVCacheManager(64, BS, enable_prefix_caching=True, group_windows=(None, 6))
    prompt = list(range(200, 241))
    publish(kv, prompt, 0, range(10))
    publish(kv, prompt, 1, [0, 1, 2, 3, 4, 5, 6, 8, 9])  # block 7 missing
    # 10 blocks need 8, 9 (ok); but the window only needs blocks 8-9, so 40 tokens hit.
    assert kv.match_prefix(make_request("a", prompt))[1] == 40
    kv2 = KVCacheManager(64, BS, enable_prefix_caching=True, group_windows=(None, 6))
    publish(kv2, prompt, 0, range(10))
    publish(kv2, prompt, 1, [0, 1, 2, 3, 4, 5, 6, 7, 8])  # block 9 missing
    # k = 10 needs blocks 8, 9: no; k = 9 needs blocks 7, 8 (a query at 36 sees 31..36).
    tables, hit = kv2.match_prefix(make_request("b", prompt))
    assert hit == 36 and tables[1][:7] == [NULL_BLOCK] * 7
    kv3 = KVCacheManager(64, BS, enable_prefix_caching=True, group_windows=(None, 6))
    publish(kv3, prompt, 0, range(5))  # the full group limits the hit
    publish(kv3, prompt, 1, range(10))
    assert kv3.match_prefix(make_request("c", prompt))[1] == 20


def test_a_request_that_ran_publishes_its_window_blocks_and_another_hits_them() -> None:
    """Blocks published before they left the window stay cached after they are given
    back; a second request with the prompt hits all of it."""
    kv = KVCacheManager(64, BS, enable_prefix_caching=True, group_windows=(None, 6, 6))
    prompt = list(range(300, 345))
    a = make_request("a", prompt)
    while a.num_computed_tokens < a.num_tokens:
        n = min(8, a.num_tokens - a.num_computed_tokens)
        assert kv.allocate_slots(a, n)
        a.num_computed_tokens += n
        kv.cache_full_blocks(a)
    assert a.block_tables[1][0] == NULL_BLOCK  # given back ...
    b = make_request("b", prompt + [1, 2])
    tables, hit = kv.match_prefix(b)
    assert hit == 44  # ... yet still cached: b hits every full block
    kv.acquire_prefix(b, tables)
    # b holds a's full-group blocks and only the window's blocks of each sliding group.
    assert kv.num_held_blocks(b) == 11 + 2 * 2
    kv.free(a)
    kv.free(b)
    kv.pool.check_invariants()
    assert kv.num_free_blocks == kv.num_blocks
