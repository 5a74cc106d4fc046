"""The KV block pool alone (no model): which block the prefix cache evicts first, double
frees refused without harm, and ``reset_cache`` dropping cached content while blocks in use
keep theirs."""

from __future__ import annotations

import pytest

from chunkserve.scheduling.kv_cache import NULL_BLOCK, BlockPool, KVCacheManager
from chunkserve.scheduling.request import Request
from chunkserve.scheduling.sampling_params import SamplingParams

BS = 4


def key(i: int) -> bytes:
    return i.to_bytes(16, "little")


def pool_with_cached(num_blocks: int, cached: list[int]) -> BlockPool:
    """A pool whose every block was handed out; ``cached`` (in this order) published under
    ``key(block)``. Nothing freed yet."""
    pool = BlockPool(num_blocks)
    assert pool.allocate(num_blocks) == list(range(1, num_blocks + 1))
    for b in cached:
        pool.register(b, key(b))
    return pool


def take_one_by_one(pool: BlockPool) -> list[int]:
    return [pool.allocate(1)[0] for _ in range(pool.num_free_blocks)]


# ---- eviction order --------------------------------------------------------------------------
def test_uncached_blocks_are_handed_out_before_any_cached_one() -> None:
    pool = pool_with_cached(6, cached=[1, 2, 3])
    pool.free([1, 4, 2, 5, 3, 6])  # cached and uncached interleaved
    order = take_one_by_one(pool)
    assert set(order[:3]) == {4, 5, 6}  # no cached content is lost while these last
    assert order[3:] == [1, 2, 3]  # then the cached ones, least recently freed first
    pool.check_invariants()


def test_cached_blocks_are_evicted_least_recently_freed_first() -> None:
    pool = pool_with_cached(5, cached=[1, 2, 3, 4, 5])
    pool.free([3])
    pool.free([1])
    pool.free([5])
    pool.free([2])
    pool.free([4])
    evicted = []
    for _ in range(5):
        (b,) = pool.allocate(1)
        evicted.append(b)
        assert pool.lookup(key(b)) is None  # handing it out dropped its cached content
        # Every block not handed out yet still hits.
        assert all(pool.lookup(key(o)) == o for o in {1, 2, 3, 4, 5} - set(evicted))
    assert evicted == [3, 1, 5, 2, 4]
    pool.check_invariants()


def test_a_hit_makes_a_cached_block_most_recently_used() -> None:
    pool = pool_with_cached(3, cached=[1, 2, 3])
    pool.free([1])
    pool.free([2])
    pool.free([3])
    pool.incref([1])  # a prefix hit revives block 1 from the free list ...
    assert pool.num_free_blocks == 2
    pool.free([1])  # ... and its new owner ends: now the most recently freed
    assert take_one_by_one(pool) == [2, 3, 1]


def test_blocks_still_shared_are_not_freed_by_one_owner() -> None:
    pool = pool_with_cached(2, cached=[1])
    pool.incref([1])  # two owners
    pool.free([1])
    assert pool.num_free_blocks == 0 and pool.lookup(key(1)) == 1
    pool.free([1])
    assert pool.num_free_blocks == 1


def make_request(rid: str, tokens: list[int]) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=1), max_tokens=1)


def test_a_finished_requests_tail_is_evicted_before_its_head() -> None:
    """A request's blocks are freed in reverse: the pool short of a block evicts the end of
    the sequence, so the (more shareable) start of the prompt still hits."""
    kv = KVCacheManager(4, BS, enable_prefix_caching=True)
    prompt = list(range(100, 100 + 4 * BS))
    a = make_request("a", prompt)
    assert kv.allocate_slots(a, a.num_tokens)
    a.num_computed_tokens = a.num_tokens
    kv.cache_full_blocks(a)
    first, last = a.block_ids[0], a.block_ids[-1]
    kv.free(a)
    other = make_request("b", [7] * BS)
    assert kv.allocate_slots(other, 1) and other.block_ids == [last]
    again = make_request("c", prompt + [1])
    blocks, hit = kv.match_prefix(again)
    assert blocks[0][0] == first and hit == 3 * BS  # all but the evicted last block
    kv.free(other)
    kv.pool.check_invariants()


# ---- double free -----------------------------------------------------------------------------
def test_double_free_is_refused_and_leaves_the_pool_as_it_was() -> None:
    pool = pool_with_cached(4, cached=[2])
    pool.free([1])
    before = (list(pool.ref_cnt), list(pool._free), dict(pool.cached[0]))
    with pytest.raises(RuntimeError, match="double free of KV block 1"):
        pool.free([1])
    # A list that frees a live block twice: refused before anything is freed.
    with pytest.raises(RuntimeError, match="double free of KV block 2"):
        pool.free([3, 2, 2])
    with pytest.raises(RuntimeError, match=f"double free of KV block {NULL_BLOCK}"):
        pool.free([4, NULL_BLOCK])
    assert (list(pool.ref_cnt), list(pool._free), dict(pool.cached[0])) == before
    pool.check_invariants()


def test_freeing_a_request_twice_frees_its_blocks_once() -> None:
    kv = KVCacheManager(4, BS, enable_prefix_caching=True)
    a, b = make_request("a", [5] * (2 * BS)), make_request("b", [6] * BS)
    assert kv.allocate_slots(a, a.num_tokens) and kv.allocate_slots(b, b.num_tokens)
    kv.free(a)
    kv.free(a)  # a request's table is emptied: a second release is a no-op ...
    assert kv.num_free_blocks == 3 and len(b.block_ids) == 1  # ... and b keeps its block
    stale = list(b.block_ids)
    kv.free(b)
    with pytest.raises(RuntimeError, match="double free"):
        kv.pool.free(stale)  # a stale copy of a freed table is caught
    kv.pool.check_invariants()


# ---- reset_prefix_cache ----------------------------------------------------------------------
def test_reset_drops_cached_content_and_keeps_blocks_in_use() -> None:
    kv = KVCacheManager(8, BS, enable_prefix_caching=True)
    prompt = list(range(100, 100 + 3 * BS))
    done = make_request("done", prompt)
    live = make_request("live", prompt[: 2 * BS] + [1, 2, 3, 4, 5])
    for r in (done, live):
        blocks, _ = kv.match_prefix(r)
        kv.acquire_prefix(r, blocks) if blocks else None
        assert kv.allocate_slots(r, r.num_tokens - r.num_computed_tokens)
        r.num_computed_tokens = r.num_tokens
        kv.cache_full_blocks(r)
    assert live.num_cached_tokens == 2 * BS  # it shares two blocks with "done"
    kv.free(done)
    held, free = list(live.block_ids), kv.num_free_blocks
    ref_cnt = list(kv.pool.ref_cnt)
    # done's three blocks (two shared with live, one freed) and live's own full one
    assert kv.reset_prefix_cache() == 4
    assert kv.match_prefix(make_request("again", prompt + [3])) == ([], 0)
    # Nothing was freed or taken: "live" runs on with its blocks.
    assert live.block_ids == held and kv.num_free_blocks == free
    assert kv.pool.ref_cnt == ref_cnt
    kv.pool.check_invariants()
    # Blocks filled after the reset are cached again.
    nxt = make_request("next", [9] * (2 * BS))
    assert kv.allocate_slots(nxt, nxt.num_tokens)
    nxt.num_computed_tokens = nxt.num_tokens
    kv.cache_full_blocks(nxt)
    assert kv.match_prefix(make_request("n2", [9] * (2 * BS) + [1]))[1] == 2 * BS
    kv.free(nxt)
    kv.free(live)
    assert kv.num_free_blocks == kv.num_blocks
    kv.pool.check_invariants()


def test_blocks_filled_by_accepted_drafts_publish_once_they_are_tokens() -> None:
    """With speculation a step computes the accepted drafts' rows before they are appended
    as tokens: a block is published only when all its tokens are the request's, under the
    key of those tokens (never a key of a partial block)."""
    from chunkserve.scheduling.block_hash import block_hashes

    kv = KVCacheManager(8, BS, enable_prefix_caching=True)
    r = Request("a", [10, 11, 12, 13, 14, 15], SamplingParams(max_tokens=8), max_tokens=8)
    assert kv.allocate_slots(r, 12)
    r.num_computed_tokens = 9  # the prompt and 3 accepted drafts, not yet tokens
    kv.cache_full_blocks(r)
    assert r.num_published_blocks == 1
    for token in (16, 17, 18):
        r.append_output_token(token)
    kv.cache_full_blocks(r)
    assert r.num_published_blocks == 2
    want = block_hashes(r.token_ids, BS)
    assert [kv.pool.lookup(h) for h in want] == r.block_ids[:2]
