"""Paged KV-cache bookkeeping: block pool, free list with reference counts, block tables.

Pure Python: the tensors live in the model runner as one pool per layer,
``[num_blocks, block_size, num_kv_heads, head_dim]`` for K and for V. Here a block is an index
into those pools. Token ``pos`` of a request lives in slot
``block_ids[pos // block_size] * block_size + pos % block_size``.

Block 0 is the null block: never handed out, it pads block tables and absorbs the KV writes
of padding rows (the runner pads a step's token count to a few bucket sizes). Usable blocks
are ``1..num_blocks``; the pools hold ``num_blocks + 1``.

Invariants:
- a block is in the free list iff its reference count is 0;
- ``num_free_blocks + sum(blocks with ref_cnt > 0) == num_blocks``;
- a request's ``block_ids`` cover exactly ``ceil(tokens_allocated / block_size)`` blocks.

The free list is ordered (oldest freed first) so a prefix cache can keep freed, still-valid
blocks at its tail and evict them only when the pool runs dry (least recently used first).
"""

from __future__ import annotations

from collections import OrderedDict

from chunkserve.request import Request

NULL_BLOCK = 0


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class BlockPool:
    """Fixed set of KV blocks with reference counts and an ordered free list."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks: must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks  # usable blocks, ids 1..num_blocks
        self.ref_cnt = [0] * (num_blocks + 1)
        self.ref_cnt[NULL_BLOCK] = 1  # permanently taken
        # Insertion order = eviction order. Values unused (an ordered set).
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
        """Take ``n`` blocks from the head of the free list (ref count 1 each)."""
        if n > len(self._free):
            raise RuntimeError(f"KV pool exhausted: asked {n}, free {len(self._free)}")
        out = []
        for _ in range(n):
            block_id, _ = self._free.popitem(last=False)
            self.ref_cnt[block_id] = 1
            out.append(block_id)
        return out

    def incref(self, block_ids: list[int]) -> None:
        """Share blocks (a prefix-cache hit); revives blocks that sat in the free list."""
        for block_id in block_ids:
            if self.ref_cnt[block_id] == 0:
                del self._free[block_id]
            self.ref_cnt[block_id] += 1

    def free(self, block_ids: list[int]) -> None:
        """Drop one reference from each block; blocks reaching 0 go to the free list tail.

        Callers pass a request's blocks in reverse order so that, under a prefix cache, the
        tail of a sequence is evicted before its (more shareable) head.
        """
        for block_id in block_ids:
            count = self.ref_cnt[block_id]
            if count <= 0:
                raise RuntimeError(f"double free of KV block {block_id}")
            self.ref_cnt[block_id] = count - 1
            if count == 1:
                self._free[block_id] = None

    def check_invariants(self) -> None:
        """Raise if the free list and reference counts disagree (used by tests)."""
        if self.ref_cnt[NULL_BLOCK] != 1 or NULL_BLOCK in self._free:
            raise AssertionError("the null block was handed out or freed")
        for block_id, count in enumerate(self.ref_cnt[1:], start=1):
            if count < 0:
                raise AssertionError(f"block {block_id} has ref_cnt {count}")
            if (count == 0) != (block_id in self._free):
                raise AssertionError(
                    f"block {block_id}: ref_cnt {count}, in free list: {block_id in self._free}"
                )


class KVCacheManager:
    """Grows and frees requests' block tables over a ``BlockPool``."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if block_size < 1:
            raise ValueError(f"block_size: must be >= 1, got {block_size}")
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)

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

    def free(self, request: Request) -> None:
        """Release all of a request's blocks (finish, abort or preemption)."""
        if request.block_ids:
            self.pool.free(request.block_ids[::-1])
            request.block_ids = []
