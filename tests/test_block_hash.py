"""One prefix block-hash chain: the prefix cache and the data-parallel router key a prompt's
blocks with the same function, so the router's notion of "this core holds the prefix" is the
cache's own."""

from __future__ import annotations

import random
from collections import OrderedDict

import pytest

from chunkserve.config import EngineConfig
from chunkserve.engine.core_types import CoreRequest
from chunkserve.engine.multiprocess_engine import MultiprocessEngine, _Core
from chunkserve.scheduling.block_hash import block_hashes, extend_block_hashes, hash_block
from chunkserve.scheduling.kv_cache import KVCacheManager
from chunkserve.scheduling.request import Request
from chunkserve.scheduling.sampling_params import SamplingParams

BS = 16


def test_chain_covers_full_blocks_only_and_every_block_before() -> None:
    a = block_hashes(list(range(40)), BS)
    b = block_hashes([*range(32), 99, 98], BS)
    assert len(a) == 2 and a == b  # only full blocks; the third differs but is partial
    assert block_hashes([5, *range(1, 40)], BS)[1] != a[1]  # a chain: block 0 counts
    assert block_hashes(list(range(40)), BS, extra=b"lora-1") != a
    assert a[1] == hash_block(hash_block(None, list(range(16))), list(range(16, 32)))


def test_extend_continues_a_chain_and_refuses_a_partial_block() -> None:
    tokens = list(range(64))
    head = block_hashes(tokens[:32], BS)
    assert extend_block_hashes(list(head), tokens, BS) == block_hashes(tokens, BS)
    with pytest.raises(ValueError, match="num_blocks"):
        extend_block_hashes([], tokens[:40], BS, 3)


def cache_keys(prompt: list[int]) -> list[bytes]:
    """The keys the prefix cache publishes a prompt's full blocks under, once computed."""
    kv = KVCacheManager(num_blocks=64, block_size=BS, enable_prefix_caching=True)
    req = Request("r", prompt, SamplingParams(max_tokens=1), max_tokens=1)
    assert kv.allocate_slots(req, len(prompt))
    req.num_computed_tokens = len(prompt)
    kv.cache_full_blocks(req)
    by_block = {b: h for h, b in kv.pool.cached[0].items()}
    return [by_block[b] for b in req.block_ids[: len(prompt) // BS]]


def router(num_cores: int) -> MultiprocessEngine:
    """A MultiprocessEngine with only its routing state (no core processes)."""
    engine = object.__new__(MultiprocessEngine)
    engine.config = EngineConfig.from_kwargs(block_size=BS)
    engine._cores = [_Core(i, None, None) for i in range(num_cores)]
    engine._routed = [OrderedDict() for _ in range(num_cores)]
    return engine


@pytest.mark.parametrize("length", [15, 16, 40, 100])
def test_router_and_prefix_cache_key_blocks_identically(length: int) -> None:
    prompt = [random.Random(length).randrange(1000) for _ in range(length)]
    engine = router(2)
    core = engine._route(CoreRequest("a", prompt, SamplingParams(), max_tokens=1))
    assert list(engine._routed[core.index]) == cache_keys(prompt)
    assert len(cache_keys(prompt)) == length // BS
