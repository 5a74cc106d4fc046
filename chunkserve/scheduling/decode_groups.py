"""How the torch attention backend groups a step's decodes (pure Python: the cost model
uses it too, to count the padded keys a step reads).

The decodes of a step are batched into a few padded gathers, each padded to the longest
context in its group. Sorted by length and cut into 1..``MAX_DECODE_GROUPS`` equal-count
groups, the cut that reads the fewest padded keys (plus a fixed cost per group) wins.
"""

from __future__ import annotations

from collections.abc import Sequence

MAX_DECODE_GROUPS = 4
# A group costs about as much fixed overhead as gathering this many padded keys.
GROUP_OVERHEAD_KEYS = 2048


def split_decode_groups(lengths: Sequence[int], block_size: int) -> list[list[int]]:
    """Indices of ``lengths`` grouped so that sum(n * padded max) + overhead is smallest,
    trying 1..MAX_DECODE_GROUPS equal-count groups over the lengths sorted ascending."""
    order = sorted(range(len(lengths)), key=lengths.__getitem__)
    blocks = [-(-lengths[i] // block_size) * block_size for i in order]
    best, best_cost = [order], float("inf")
    for k in range(1, min(MAX_DECODE_GROUPS, len(order)) + 1):
        cuts = [round(j * len(order) / k) for j in range(k + 1)]
        cost = sum((cuts[j + 1] - cuts[j]) * blocks[cuts[j + 1] - 1] for j in range(k))
        cost += k * GROUP_OVERHEAD_KEYS
        if cost < best_cost:
            best_cost = cost
            best = [order[cuts[j] : cuts[j + 1]] for j in range(k)]
    return best


def padded_decode_keys(lengths: Sequence[int], block_size: int) -> int:
    """Keys the grouped decodes read: each padded to its group's longest, in blocks."""
    if not lengths:
        return 0
    total = 0
    for group in split_decode_groups(lengths, block_size):
        longest = max(lengths[i] for i in group)
        total += len(group) * -(-longest // block_size) * block_size
    return total
