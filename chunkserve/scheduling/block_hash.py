"""The prefix block-hash chain: one key per full KV block, covering every block before it.

A full block of ``block_size`` token ids is keyed by ``H(parent key, its token ids, extra)``
(blake2b, 128 bits), so equal keys mean equal prefixes. The prefix cache
(``kv_cache.KVCacheManager``) keys its blocks with it and the data-parallel router
(``engine.multiprocess_engine``) remembers which prefixes it sent to which core with it:
both must agree, so both call this module. Pure Python.
"""

from __future__ import annotations

import hashlib
from array import array

ROOT = b"\0" * 16  # the parent key of a sequence's first block


def hash_block(parent: bytes | None, token_ids: list[int], extra: bytes = b"") -> bytes:
    """Chained content hash of one full block."""
    h = hashlib.blake2b(digest_size=16)
    h.update(parent or ROOT)
    h.update(array("q", token_ids).tobytes())
    h.update(extra)
    return h.digest()


def extend_block_hashes(
    hashes: list[bytes],
    token_ids: list[int],
    block_size: int,
    num_blocks: int | None = None,
    extra: bytes = b"",
) -> list[bytes]:
    """Extend ``hashes`` (the chain of ``token_ids``' first blocks, possibly empty) in place
    to ``num_blocks`` blocks (default: every full block of ``token_ids``) and return it."""
    if num_blocks is None:
        num_blocks = len(token_ids) // block_size
    while len(hashes) < num_blocks:
        i = len(hashes)
        block = token_ids[i * block_size : (i + 1) * block_size]
        if len(block) != block_size:
            raise ValueError(f"num_blocks: block {i} of {len(token_ids)} tokens is not full")
        hashes.append(hash_block(hashes[-1] if hashes else None, block, extra))
    return hashes


def block_hashes(token_ids: list[int], block_size: int, extra: bytes = b"") -> list[bytes]:
    """The chain of every full leading block of ``token_ids`` (a partial last block has no
    key)."""
    return extend_block_hashes([], token_ids, block_size, extra=extra)
