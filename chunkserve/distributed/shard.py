"""Which part of the model each tensor-parallel rank holds (Megatron-style). No torch here.

For ``N`` ranks over a model with ``H`` query heads, ``K`` KV heads (``G = H / K`` query heads
per KV head), ``I`` MLP columns and ``V`` vocabulary rows:

- attention: column-parallel Q/K/V, row-parallel output projection (an all-reduce after it).
  With ``N <= K`` the KV heads are divided (contiguous, as evenly as they go: 3 KV heads on 2
  ranks are 1 + 2) and each rank computes the ``G`` query heads of each of its KV heads, so
  every rank's attention is plain grouped-query attention over its own KV heads. With
  ``N > K`` each KV head is replicated on ``N / K`` ranks that split its query heads
  (``N`` a multiple of ``K`` and ``G`` of ``N / K``);
- MLP: column-parallel gate/up, row-parallel down (an all-reduce after it), ``I`` split
  contiguously;
- embedding and LM head: vocabulary-parallel, ``ceil(V / N)`` rows per rank (the last rank's
  tail is padding: zero rows no token id reaches, logits dropped after the gather);
- norms: replicated;
- mixture-of-experts MLPs: each expert's columns split as the MLP's (or, expert parallel,
  whole experts divided among the ranks; ``model.moe``).

Every rank's KV pool has the same number of blocks (the block tables are the scheduler's, one
for all ranks), sized for the rank with the most KV heads.
"""

from __future__ import annotations

from dataclasses import dataclass

from chunkserve.config import ModelConfig


def _split(n: int, parts: int, i: int) -> tuple[int, int]:
    """Part ``i`` of ``range(n)`` cut into ``parts`` contiguous, near-equal pieces."""
    return i * n // parts, (i + 1) * n // parts


@dataclass(frozen=True)
class ShardPlan:
    rank: int
    size: int
    q_heads: tuple[int, int]  # [first, end) query heads this rank computes
    kv_heads: tuple[int, int]  # [first, end) KV heads it holds (its share of the KV cache)
    intermediate: tuple[int, int]  # [first, end) MLP columns
    vocab: tuple[int, int]  # [first, end) real vocabulary rows
    vocab_shard: int  # rows of its embedding / LM head shard (padded: ceil(V / N))
    max_kv_heads: int  # most KV heads any rank holds (sizes every rank's pool alike)
    # Mixture of experts: each rank holds whole experts (a contiguous range) rather than its
    # columns of every expert (``model.moe``).
    expert_parallel: bool = False

    @property
    def num_heads(self) -> int:
        return self.q_heads[1] - self.q_heads[0]

    @property
    def num_kv_heads(self) -> int:
        return self.kv_heads[1] - self.kv_heads[0]

    @property
    def intermediate_size(self) -> int:
        return self.intermediate[1] - self.intermediate[0]

    @property
    def vocab_start(self) -> int:
        return self.vocab[0]


def _heads(config: ModelConfig, size: int, rank: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """(query heads, KV heads) of one rank, or a ValueError naming tensor_parallel_size."""
    h, k = config.num_heads, config.num_kv_heads
    group = h // k
    if size <= k:
        kv = _split(k, size, rank)
        return (kv[0] * group, kv[1] * group), kv
    replicas = size // k
    if size % k or group % replicas:
        raise ValueError(
            f"tensor_parallel_size: {size} ranks cannot share this model's {k} KV heads "
            f"({h} query heads): use at most {k} ranks, or a multiple of {k} that divides "
            f"{h} (each KV head is then replicated and its query heads split)"
        )
    kv_head = rank // replicas
    width = group // replicas
    first = kv_head * group + (rank % replicas) * width
    return (first, first + width), (kv_head, kv_head + 1)


def plan_shards(
    config: ModelConfig, size: int, rank: int, expert_parallel: bool = False
) -> ShardPlan:
    """Rank ``rank``'s share of the model over ``size`` ranks (a ValueError naming
    ``tensor_parallel_size`` when the model cannot be split that way)."""
    if size < 1 or not 0 <= rank < size:
        raise ValueError(f"tensor_parallel_size: rank {rank} of {size} is out of range")
    if size > config.intermediate_size or size > config.vocab_size:
        raise ValueError(
            f"tensor_parallel_size: {size} ranks are more than the model's MLP width "
            f"({config.intermediate_size}) or vocabulary ({config.vocab_size}) can be split over"
        )
    heads = [_heads(config, size, r) for r in range(size)]
    q_heads, kv_heads = heads[rank]
    max_kv = max(kv[1] - kv[0] for _, kv in heads)
    shard = -(-config.vocab_size // size)
    first = min(rank * shard, config.vocab_size)
    return ShardPlan(
        rank=rank,
        size=size,
        q_heads=q_heads,
        kv_heads=kv_heads,
        intermediate=_split(config.intermediate_size, size, rank),
        vocab=(first, min(first + shard, config.vocab_size)),
        vocab_shard=shard,
        max_kv_heads=max_kv,
        expert_parallel=expert_parallel,
    )
