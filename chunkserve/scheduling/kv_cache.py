"""Paged KV-cache bookkeeping: block pool, free list with reference counts, block tables, and
the prefix cache.

Pure Python: the tensors live in the model runner as one pool per layer,
``[num_blocks + 1, block_size, num_kv_heads, head_dim]`` for K and for V. Here a block is an
index into those pools. Token ``pos`` of a request lives in slot
``block_ids[pos // block_size] * block_size + pos % block_size``.

Block 0 is the null block: never handed out or written, all zeros, it pads block tables.
Usable blocks are ``1..num_blocks``.

Prefix cache: a full block is keyed by a chained hash of its content, ``H(parent hash, its
token ids, extra key)`` (``block_hash``: the data-parallel router keys prefixes the same
way), so equal keys mean equal prefixes. A block is
registered the moment the step that fills it has run, so another request with the same
prefix reuses it at once, even while its first owner is still prefilling. Freed cached blocks
stay valid in the free list and are evicted (least recently freed first) only when the pool
needs a block; uncached freed blocks are handed out before any cached one.

Invariants:
- a block is in the free list iff its reference count is 0;
- ``num_free_blocks + (blocks with ref_cnt > 0) == num_blocks``;
- ``cached[h] == b`` iff ``block_hash[b] == h``;
- a request's ``block_ids`` cover exactly ``ceil(tokens_allocated / block_size)`` blocks.
"""

from __future__ import annotations

from collections import OrderedDict

from chunkserve.scheduling.block_hash import extend_block_hashes, hash_block
from chunkserve.scheduling.request import Request

__all__ = ["NULL_BLOCK", "BlockPool", "KVCacheManager", "cdiv", "hash_block"]

NULL_BLOCK = 0


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class BlockPool:
    """Fixed set of KV blocks with reference counts, an ordered free list and the
    hash -> block map of the prefix cache."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks: must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks  # usable blocks, ids 1..num_blocks
        self.ref_cnt = [0] * (num_blocks + 1)
        self.ref_cnt[NULL_BLOCK] = 1  # permanently taken
        self.block_hash: list[bytes | None] = [None] * (num_blocks + 1)
        self.cached: dict[bytes, int] = {}
        # Head = next handed out. Values unused (an ordered set).
        self._free: OrderedDict[int, None] = OrderedDict(
            (i, None) for i in range(1, num_blocks + 1)
        )

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` blocks from the head of the free list (ref count 1 each), evicting
        their cached content."""
        if n > len(self._free):
            raise RuntimeError(f"KV pool exhausted: asked {n}, free {len(self._free)}")
        out = []
        for _ in range(n):
            block_id, _ = self._free.popitem(last=False)
            self._evict(block_id)
            self.ref_cnt[block_id] = 1
            out.append(block_id)
        return out

    def _evict(self, block_id: int) -> None:
        h = self.block_hash[block_id]
        if h is not None:
            self.block_hash[block_id] = None
            if self.cached.get(h) == block_id:
                del self.cached[h]

    def incref(self, block_ids: list[int]) -> None:
        """Share blocks (a prefix-cache hit); revives blocks that sat in the free list."""
        for block_id in block_ids:
            if self.ref_cnt[block_id] == 0:
                del self._free[block_id]
            self.ref_cnt[block_id] += 1

    def free(self, block_ids: list[int]) -> None:
        """Drop one reference from each block. A block reaching 0 goes to the free list:
        at the tail if it holds cached content (evicted last, least recently freed first),
        at the head if not (handed out first).

        Callers pass a request's blocks in reverse order so that the tail of a sequence is
        evicted before its (more shareable) head. A block freed more often than it is held
        (or the null block) is a ``RuntimeError``, raised before any block is freed.
        """
        ref_cnt = self.ref_cnt
        for block_id in block_ids:  # refused before anything is freed: the pool stays whole
            if ref_cnt[block_id] <= 0 or block_id == NULL_BLOCK:
                raise RuntimeError(f"double free of KV block {block_id}")
        if len(set(block_ids)) < len(block_ids):
            for block_id in set(block_ids):
                if block_ids.count(block_id) > ref_cnt[block_id]:
                    raise RuntimeError(f"double free of KV block {block_id}")
        for block_id in block_ids:
            count = ref_cnt[block_id]
            ref_cnt[block_id] = count - 1
            if count == 1:
                self._free[block_id] = None
                if self.block_hash[block_id] is None:
                    self._free.move_to_end(block_id, last=False)

    def register(self, block_id: int, h: bytes) -> None:
        """Publish a full, computed block under its content hash (first one wins)."""
        if h not in self.cached and self.block_hash[block_id] is None:
            self.cached[h] = block_id
            self.block_hash[block_id] = h

    def lookup(self, h: bytes) -> int | None:
        return self.cached.get(h)

    def reset_cache(self) -> int:
        """Forget all cached content (blocks in use keep their data and their owners);
        returns how many blocks were cached."""
        n = len(self.cached)
        self.cached.clear()
        self.block_hash = [None] * (self.num_blocks + 1)
        return n

    def check_invariants(self) -> None:
        """Raise if the free list, reference counts and cache map disagree (used by tests)."""
        if self.ref_cnt[NULL_BLOCK] != 1 or NULL_BLOCK in self._free:
            raise AssertionError("the null block was handed out or freed")
        for block_id, count in enumerate(self.ref_cnt[1:], start=1):
            if count < 0:
                raise AssertionError(f"block {block_id} has ref_cnt {count}")
            if (count == 0) != (block_id in self._free):
                raise AssertionError(
                    f"block {block_id}: ref_cnt {count}, in free list: {block_id in self._free}"
                )
        for h, block_id in self.cached.items():
            if self.block_hash[block_id] != h:
                raise AssertionError(f"cache maps a hash to block {block_id} holding another")
        for block_id, h in enumerate(self.block_hash):
            if h is not None and self.cached.get(h) != block_id:
                raise AssertionError(f"block {block_id} has a hash the cache does not map")


class KVCacheManager:
    """Grows and frees requests' block tables over a ``BlockPool``; finds and publishes
    cached prefixes when ``enable_prefix_caching``."""

    def __init__(
        self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False
    ) -> None:
        if block_size < 1:
            raise ValueError(f"block_size: must be >= 1, got {block_size}")
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self.enable_prefix_caching = enable_prefix_caching
        self.num_queried_tokens = 0  # prompt tokens looked up in the prefix cache
        self.num_hit_tokens = 0  # of which found

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks in use, 0..1."""
        return self.pool.num_used_blocks / self.pool.num_blocks

    def num_blocks_for(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def num_new_blocks(self, request: Request, num_new_tokens: int) -> int:
        """Blocks to add so the request can hold ``num_computed + num_new_tokens`` tokens."""
        total = request.num_computed_tokens + num_new_tokens
        return max(0, self.num_blocks_for(total) - len(request.block_ids))

    def can_allocate(self, request: Request, num_new_tokens: int) -> bool:
        return self.num_new_blocks(request, num_new_tokens) <= self.pool.num_free_blocks

    def allocate_slots(self, request: Request, num_new_tokens: int) -> bool:
        """Extend the block table for the next ``num_new_tokens``; False if the pool is short
        (nothing is allocated then)."""
        n = self.num_new_blocks(request, num_new_tokens)
        if n > self.pool.num_free_blocks:
            return False
        if n:
            request.block_ids.extend(self.pool.allocate(n))
        return True

    def trim(self, request: Request) -> None:
        """Give back the blocks past the request's computed tokens (rejected draft tokens
        wrote there; the next step allocates what it needs)."""
        keep = max(self.num_blocks_for(request.num_computed_tokens), request.num_published_blocks)
        if len(request.block_ids) > keep:
            extra = request.block_ids[keep:]
            del request.block_ids[keep:]
            self.pool.free(extra[::-1])

    def free(self, request: Request) -> None:
        """Release all of a request's blocks (finish, abort or preemption)."""
        if request.block_ids:
            self.pool.free(request.block_ids[::-1])
            request.block_ids = []
        request.num_published_blocks = 0

    # ---- prefix cache ----------------------------------------------------------------------
    def reset_prefix_cache(self) -> int:
        """Drop every cached block's content from the cache (no later request hits it);
        requests in flight keep their blocks, and blocks they fill from now on are cached
        again. Returns how many blocks were cached."""
        return self.pool.reset_cache()

    def _block_hashes(self, request: Request, num_full_blocks: int) -> list[bytes]:
        """The request's chained block hashes, extended to ``num_full_blocks`` blocks."""
        return extend_block_hashes(
            request.block_hashes,
            request.token_ids,
            self.block_size,
            num_full_blocks,
            request.cache_key,
        )

    def match_prefix(self, request: Request) -> tuple[list[int], int]:
        """Cached blocks that hold a prefix of the request's tokens and the tokens they
        cover. At least the last token is left to compute (its logits are needed)."""
        if not self.enable_prefix_caching or request.block_ids:
            return [], 0
        max_blocks = (request.num_tokens - 1) // self.block_size
        blocks = []
        for h in self._block_hashes(request, max_blocks):
            block_id = self.pool.lookup(h)
            if block_id is None:
                break
            blocks.append(block_id)
        return blocks, len(blocks) * self.block_size

    def acquire_prefix(self, request: Request, blocks: list[int]) -> None:
        """Take the blocks of a prefix hit as the start of the request's block table."""
        self.pool.incref(blocks)
        request.block_ids = list(blocks)
        request.num_published_blocks = len(blocks)
        request.num_computed_tokens = request.num_cached_tokens = len(blocks) * self.block_size

    def record_query(self, num_tokens: int, num_hit: int) -> None:
        self.num_queried_tokens += num_tokens
        self.num_hit_tokens += num_hit

    def cache_full_blocks(self, request: Request) -> None:
        """Publish the request's blocks that its computed tokens have filled. Accepted
        drafts are computed before they are appended as tokens: their blocks publish once
        they are (a block is keyed by its tokens, all of them)."""
        if not self.enable_prefix_caching:
            return
        num_full = min(request.num_computed_tokens, request.num_tokens) // self.block_size
        if num_full <= request.num_published_blocks:
            return
        hashes = self._block_hashes(request, num_full)
        for i in range(request.num_published_blocks, num_full):
            self.pool.register(request.block_ids[i], hashes[i])
        request.num_published_blocks = num_full
