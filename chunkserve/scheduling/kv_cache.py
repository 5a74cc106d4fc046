"""Paged KV-cache bookkeeping: block pool, free list with reference counts, block tables, and
the prefix cache.

Pure Python: the tensors live in the model runner as one pool per layer slot,
``[num_blocks + 1, block_size, num_kv_heads, head_dim]`` for K and for V. Here a block is an
index into those pools. Token ``pos`` of a request lives in slot
``table[pos // block_size] * block_size + pos % block_size`` of its group's table.

KV groups (a hybrid cache, for models mixing full and sliding-window layers): the model's
layers are cut into groups of equal size, each of one attention kind (``group_windows``:
None for full attention, W for a sliding window of W keys); layer j of every group uses
pool slot j, so one block id means ``group size`` layers' K/V for ``block_size`` tokens of
one group. Every group draws from the one ``BlockPool``, and a request holds one block
table per group (``Request.block_tables``), all of the same length (entry i: tokens
``i * block_size ..``). A sliding group's blocks that no query from ``num_computed_tokens``
on can see (wholly before ``num_computed_tokens - W + 1``) go back to the pool as the
request advances; their entries become the null block, so indexing stays positional and a
sliding table is null blocks then live ones. A model without windows has one full group:
one table, the cost of a plain paged cache.

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
- ``cached[g][h] == b`` iff ``block_hash[b] == h`` and ``block_group[b] == g``;
- ``held_by_group[g]`` is the number of blocks with ref_cnt > 0 handed out for group g
  (their sum: the blocks in use);
- a request's tables each have ``ceil(tokens_allocated / block_size)`` entries; a full
  group's are all live, a sliding group's are null blocks, then live blocks.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from chunkserve.scheduling.block_hash import extend_block_hashes, hash_block
from chunkserve.scheduling.request import Request

__all__ = ["NULL_BLOCK", "BlockPool", "KVCacheManager", "cdiv", "hash_block"]

NULL_BLOCK = 0


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class BlockPool:
    """Fixed set of KV blocks with reference counts, an ordered free list and, per KV group,
    the hash -> block map of the prefix cache."""

    def __init__(self, num_blocks: int, num_groups: int = 1) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks: must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks  # usable blocks, ids 1..num_blocks
        self.ref_cnt = [0] * (num_blocks + 1)
        self.ref_cnt[NULL_BLOCK] = 1  # permanently taken
        self.block_hash: list[bytes | None] = [None] * (num_blocks + 1)
        self.block_group = [0] * (num_blocks + 1)  # the group whose cache maps the block
        self.cached: list[dict[bytes, int]] = [{} for _ in range(num_groups)]
        # Per KV group: the blocks held (ref_cnt > 0) in its tables. A block belongs to the
        # group it was last handed out for (a prefix hit revives it in the same group).
        self.owner = [0] * (num_blocks + 1)
        self.held_by_group = [0] * num_groups
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

    @property
    def num_cached_blocks(self) -> int:
        return sum(len(c) for c in self.cached)

    def allocate(self, n: int, group: int = 0) -> list[int]:
        """Take ``n`` blocks for KV group ``group`` from the head of the free list (ref count
        1 each), evicting their cached content."""
        if n > len(self._free):
            raise RuntimeError(f"KV pool exhausted: asked {n}, free {len(self._free)}")
        out = []
        for _ in range(n):
            block_id, _ = self._free.popitem(last=False)
            self._evict(block_id)
            self.ref_cnt[block_id] = 1
            self.owner[block_id] = group
            out.append(block_id)
        self.held_by_group[group] += n
        return out

    def _evict(self, block_id: int) -> None:
        h = self.block_hash[block_id]
        if h is not None:
            self.block_hash[block_id] = None
            cached = self.cached[self.block_group[block_id]]
            if cached.get(h) == block_id:
                del cached[h]

    def incref(self, block_ids: list[int]) -> None:
        """Share blocks (a prefix-cache hit); revives blocks that sat in the free list."""
        for block_id in block_ids:
            if self.ref_cnt[block_id] == 0:
                del self._free[block_id]
                self.held_by_group[self.owner[block_id]] += 1
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
                self.held_by_group[self.owner[block_id]] -= 1
                self._free[block_id] = None
                if self.block_hash[block_id] is None:
                    self._free.move_to_end(block_id, last=False)

    def register(self, block_id: int, h: bytes, group: int = 0) -> None:
        """Publish a full, computed block of KV group ``group`` under its content hash
        (first one wins)."""
        cached = self.cached[group]
        if h not in cached and self.block_hash[block_id] is None:
            cached[h] = block_id
            self.block_hash[block_id] = h
            self.block_group[block_id] = group

    def lookup(self, h: bytes, group: int = 0) -> int | None:
        return self.cached[group].get(h)

    def reset_cache(self) -> int:
        """Forget all cached content (blocks in use keep their data and their owners);
        returns how many blocks were cached."""
        n = self.num_cached_blocks
        for cached in self.cached:
            cached.clear()
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
        held = [0] * len(self.held_by_group)
        for block_id, count in enumerate(self.ref_cnt[1:], start=1):
            if count > 0:
                held[self.owner[block_id]] += 1
        if held != self.held_by_group:
            raise AssertionError(f"blocks held by group {self.held_by_group}, counted {held}")
        for group, cached in enumerate(self.cached):
            for h, block_id in cached.items():
                if self.block_hash[block_id] != h or self.block_group[block_id] != group:
                    raise AssertionError(f"cache maps a hash to block {block_id} holding another")
        for block_id, h in enumerate(self.block_hash):
            if h is not None and self.cached[self.block_group[block_id]].get(h) != block_id:
                raise AssertionError(f"block {block_id} has a hash the cache does not map")


class KVCacheManager:
    """Grows and frees requests' block tables (one per KV group) over a ``BlockPool``; gives
    back sliding groups' blocks that left their window; finds and publishes cached prefixes
    when ``enable_prefix_caching``.

    ``group_windows``: one entry per KV group, None for full attention, W for a sliding
    window (a query at position p sees keys p - W + 1 .. p)."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = False,
        group_windows: Sequence[int | None] = (None,),
    ) -> None:
        if block_size < 1:
            raise ValueError(f"block_size: must be >= 1, got {block_size}")
        if not group_windows:
            raise ValueError("group_windows: at least one KV group")
        for w in group_windows:
            if w is not None and (isinstance(w, bool) or not isinstance(w, int) or w < 1):
                raise ValueError(f"group_windows: a window must be an int >= 1, got {w!r}")
        self.block_size = block_size
        self.group_windows = tuple(group_windows)
        self.num_groups = len(self.group_windows)
        # The sliding groups, as (group, window).
        self._sliding = [(g, w) for g, w in enumerate(self.group_windows) if w is not None]
        self.pool = BlockPool(num_blocks, self.num_groups)
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
    def group_blocks_used(self) -> list[int]:
        """Blocks held by requests in each KV group (``group_windows``' order)."""
        return list(self.pool.held_by_group)

    @property
    def usage(self) -> float:
        """Fraction of blocks in use, 0..1."""
        return self.pool.num_used_blocks / self.pool.num_blocks

    def num_blocks_for(self, num_tokens: int) -> int:
        """Entries of one block table holding ``num_tokens`` tokens."""
        return cdiv(num_tokens, self.block_size)

    def max_blocks_for(self, num_tokens: int) -> int:
        """Blocks a request of ``num_tokens`` tokens holds at most (every group's table
        full: a prompt computed in one step, before any window moves on)."""
        return self.num_groups * cdiv(num_tokens, self.block_size)

    def slots_for(self, num_tokens: float) -> float:
        """KV slots (block-size units of one group) ``num_tokens`` more tokens of a running
        request will take: every full group holds them all, a sliding group at most its
        window and a block."""
        slots = (self.num_groups - len(self._sliding)) * num_tokens
        for _, w in self._sliding:
            slots += min(num_tokens, w + self.block_size)
        return slots

    def num_held_blocks(self, request: Request) -> int:
        """Live blocks the request holds, over all its groups."""
        return sum(len(t) - t.count(NULL_BLOCK) for t in request.block_tables)

    def _tables(self, request: Request) -> list[list[int]]:
        tables = request.block_tables
        if len(tables) != self.num_groups:
            if any(tables):
                raise RuntimeError(
                    f"request {request.request_id}: {len(tables)} block tables, "
                    f"{self.num_groups} KV groups"
                )
            tables = request.block_tables = [[] for _ in range(self.num_groups)]
        return tables

    def _first_live_block(self, window: int, pos: int) -> int:
        """The first block a query at position ``pos`` or later can see under ``window``."""
        return max(0, pos - window + 1) // self.block_size

    def _out_of_window(self, request: Request) -> list[tuple[list[int], int, int]]:
        """(table, first, stop) per sliding group: ``table[first:stop]`` are the live
        blocks no query from ``num_computed_tokens`` on can see."""
        out = []
        pos = request.num_computed_tokens
        for g, w in self._sliding:
            table = request.block_tables[g]
            stop = min(self._first_live_block(w, pos), len(table))
            first = stop
            while first > 0 and table[first - 1] != NULL_BLOCK:  # nulls are a prefix
                first -= 1
            if first < stop:
                out.append((table, first, stop))
        return out

    def give_back_out_of_window(self, request: Request) -> None:
        """Give back the sliding groups' blocks no query from ``num_computed_tokens`` on
        can see (``allocate_slots`` does it first of all)."""
        for table, first, stop in self._out_of_window(request):
            freed = table[first:stop]
            table[first:stop] = [NULL_BLOCK] * (stop - first)
            self.pool.free(freed)  # oldest first: evicted first

    def num_new_blocks(self, request: Request, num_new_tokens: int) -> int:
        """Blocks the pool gives (net of the out-of-window blocks given back first) so the
        request can hold ``num_computed + num_new_tokens`` tokens; may be negative."""
        tables = self._tables(request)
        total = request.num_computed_tokens + num_new_tokens
        grow = max(0, self.num_blocks_for(total) - len(tables[0]))
        freed = sum(stop - first for _, first, stop in self._out_of_window(request))
        return grow * self.num_groups - freed

    def can_allocate(self, request: Request, num_new_tokens: int) -> bool:
        return self.num_new_blocks(request, num_new_tokens) <= self.pool.num_free_blocks

    def allocate_slots(self, request: Request, num_new_tokens: int) -> bool:
        """Give back the sliding groups' blocks out of the window of the request's next
        token, then extend every table for the next ``num_new_tokens``; False if the pool
        is short (nothing is allocated then)."""
        tables = self._tables(request)
        if self._sliding:
            self.give_back_out_of_window(request)
        total = request.num_computed_tokens + num_new_tokens
        grow = max(0, self.num_blocks_for(total) - len(tables[0]))
        if grow * self.num_groups > self.pool.num_free_blocks:
            return False
        if grow:
            for g, table in enumerate(tables):
                table.extend(self.pool.allocate(grow, g))
        return True

    def trim(self, request: Request) -> None:
        """Give back the blocks past the request's computed tokens (rejected draft tokens
        wrote there; the next step allocates what it needs)."""
        keep = max(self.num_blocks_for(request.num_computed_tokens), request.num_published_blocks)
        for table in request.block_tables:
            if len(table) > keep:
                extra = [b for b in table[keep:] if b != NULL_BLOCK]
                del table[keep:]
                self.pool.free(extra[::-1])

    def free(self, request: Request) -> None:
        """Release all of a request's blocks (finish, abort or preemption)."""
        for table in request.block_tables:
            if table:
                self.pool.free([b for b in reversed(table) if b != NULL_BLOCK])
        request.block_tables = [[] for _ in range(self.num_groups)]
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

    def match_prefix(self, request: Request) -> tuple[list[list[int]], int]:
        """The longest cached prefix of the request's tokens, as one block table per group
        (``[]`` when nothing hits), and the tokens it covers. At least the last token is
        left to compute (its logits are needed).

        A hit of k blocks needs, in a full group, all k blocks cached; in a sliding group
        only those the window of the next query (at position ``k * block_size``) reaches:
        the table has null blocks before them."""
        if not self.enable_prefix_caching or any(request.block_tables):
            return [], 0
        if request.prompt_logprobs is not None:
            # Prompt logprobs need every prompt row's logits: a hit has none, so such a
            # request computes its whole prompt (as vLLM does); its blocks still publish.
            return [], 0
        bs, pool = self.block_size, self.pool
        hashes = self._block_hashes(request, (request.num_tokens - 1) // bs)
        full = [g for g, w in enumerate(self.group_windows) if w is None]
        k = 0
        for h in hashes:  # the full groups: every block of the prefix
            if any(pool.lookup(h, g) is None for g in full):
                break
            k += 1
        # The sliding groups: the window of the hit's end, cut back past a missing block
        # until every group has its window (each pass shortens the hit).
        found = {g: [pool.lookup(h, g) for h in hashes[:k]] for g, _ in self._sliding}
        changed = True
        while changed and k > 0:
            changed = False
            for g, w in self._sliding:
                first = self._first_live_block(w, k * bs)
                blocks = found[g]
                for i in range(k - 1, first - 1, -1):
                    if blocks[i] is None:
                        k, changed = i, True
                        break
        if k == 0:
            return [], 0
        tables = []
        for g, w in enumerate(self.group_windows):
            if w is None:
                tables.append([pool.lookup(h, g) for h in hashes[:k]])
            else:
                first = self._first_live_block(w, k * bs)
                tables.append([NULL_BLOCK] * first + found[g][first:k])
        return tables, k * bs  # type: ignore[return-value]

    def acquire_prefix(self, request: Request, tables: list[list[int]]) -> None:
        """Take the tables of a prefix hit as the start of the request's block tables."""
        for table in tables:
            self.pool.incref([b for b in table if b != NULL_BLOCK])
        request.block_tables = [list(t) for t in tables]
        num_blocks = len(tables[0])
        request.num_published_blocks = num_blocks
        request.num_computed_tokens = request.num_cached_tokens = num_blocks * self.block_size

    def record_query(self, num_tokens: int, num_hit: int) -> None:
        self.num_queried_tokens += num_tokens
        self.num_hit_tokens += num_hit

    def cache_full_blocks(self, request: Request) -> None:
        """Publish the request's blocks that its computed tokens have filled. Accepted
        drafts are computed before they are appended as tokens: their blocks publish once
        they are (a block is keyed by its tokens, all of them). A sliding group's block
        already given back is not published."""
        if not self.enable_prefix_caching:
            return
        num_full = min(request.num_computed_tokens, request.num_tokens) // self.block_size
        if num_full <= request.num_published_blocks:
            return
        hashes = self._block_hashes(request, num_full)
        for g, table in enumerate(request.block_tables):
            for i in range(request.num_published_blocks, num_full):
                if table[i] != NULL_BLOCK:
                    self.pool.register(table[i], hashes[i], g)
        request.num_published_blocks = num_full
