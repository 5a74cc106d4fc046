"""All-reduce through shared memory for the tensor-parallel ranks of one CPU node.

Why: gloo's all-reduce costs ~1.5-2 ms per call on the 2-core VM this was built on, even for
one row of 576 values (measured: ``ProcessGroupGloo.allreduce`` of [1, 576] bf16 in 2.1 ms
and fp32 in 1.7 ms, against an 80 us TCP round trip between the same two processes: the call
hops through gloo's worker and transport threads). A decode step makes two per layer, so at
30 layers gloo alone took 60% of a TP=2 step. The group (rendezvous, the step broadcast,
failure detection) stays on torch.distributed; only the forward pass's sums of ranks on one
host take this path, as vLLM's and SGLang's CPU backends do. Off with
``tensor_parallel_shm=False`` (``--no-tensor-parallel-shm``).

Layout of the mapped file (``/dev/shm``, unlinked once every rank has mapped it)::

    [counter of rank 0 | pad to 64 bytes] ... [counter of rank N-1 | pad]
    [rank 0: slot 0 (capacity bytes), slot 1] ... [rank N-1: slot 0, slot 1]

Call ``s`` (counting from 1) of every rank: copy its tensor into its slot ``s % 2``, publish
``s`` in its counter, wait until every counter reaches ``s``, then sum the slots in rank order
(so every rank gets the same bits). A rank cannot write slot ``s % 2`` again (call ``s + 2``)
before every other rank has published ``s + 1``, which each does only after reading call
``s``'s slots: two slots need no second barrier. x86-64 only: its stores become visible to
other cores in program order, so a counter is never seen before the data it publishes.
"""

from __future__ import annotations

import os
import platform
import time
import uuid
from collections.abc import Callable

import torch

LINE = 64  # bytes per counter: one cache line each, so ranks never share a line
# Spin this many checks before yielding the core between checks (a rank waits for the other
# ranks' share of one layer: tens to hundreds of microseconds while decoding).
SPIN_CHECKS = 20_000
LIVENESS_EVERY_S = 0.1


def shm_supported(size: int, capacity: int) -> bool:
    """x86-64 with room in /dev/shm for the file (a full /dev/shm would fault on first
    touch, not fail the create)."""
    if platform.machine() not in ("x86_64", "AMD64") or not os.path.isdir("/dev/shm"):
        return False
    st = os.statvfs("/dev/shm")
    return st.f_bavail * st.f_frsize > 2 * (size * LINE + size * 2 * capacity)


def sum_in_rank_order(out: torch.Tensor, parts: list[torch.Tensor]) -> torch.Tensor:
    """``out`` = ((parts[0] + parts[1]) + parts[2]) ..., elementwise, in place: each
    element's sum is the same whatever the tensor's size or the element's place in it (the
    deterministic mode's sums: ``TPGroup.all_reduce``)."""
    out.copy_(parts[0])
    for part in parts[1:]:
        out.add_(part)
    return out


class ShmAllReduce:
    def __init__(
        self,
        path: str,
        rank: int,
        size: int,
        capacity: int,
        alive: Callable[[], None],
        timeout_s: float,
    ) -> None:
        """Map ``path`` (made by ``create``). ``alive`` raises if another rank is known to
        be gone; it is called while waiting."""
        self.rank, self.size, self.capacity = rank, size, capacity
        self.alive, self.timeout_s = alive, timeout_s
        total = size * LINE + size * 2 * capacity
        self._buf = torch.from_file(path, shared=True, size=total, dtype=torch.uint8)
        counters = self._buf[: size * LINE].view(torch.int64).numpy()
        self._counters = counters[:: LINE // 8]  # [size] views, one per cache line
        self._seq = int(self._counters[rank])  # 0 on a fresh file
        self._data = size * LINE

    @staticmethod
    def create(size: int, capacity: int) -> str:
        """A zeroed file for ``size`` ranks; its path (every rank maps it, then unlink)."""
        path = f"/dev/shm/chunkserve-tp-{uuid.uuid4().hex}"
        with open(path, "wb") as f:
            f.truncate(size * LINE + size * 2 * capacity)
        return path

    def _slot(self, rank: int, parity: int, nbytes: int) -> torch.Tensor:
        start = self._data + (2 * rank + parity) * self.capacity
        return self._buf[start : start + nbytes]

    def fits(self, x: torch.Tensor) -> bool:
        return x.numel() * x.element_size() <= self.capacity

    def _exchange(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Publish ``x`` (contiguous, at most ``capacity`` bytes) and wait for every rank's;
        views of all of them, in rank order, valid until this rank's next call but one."""
        nbytes = x.numel() * x.element_size()
        self._seq += 1
        seq, parity = self._seq, self._seq % 2
        self._slot(self.rank, parity, nbytes).copy_(x.view(-1).view(torch.uint8))
        self._counters[self.rank] = seq
        self._wait(seq)
        return [self._slot(r, parity, nbytes).view(x.dtype).view(x.shape) for r in range(self.size)]

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks, in place (in rank order: the same bits on every rank)."""
        return sum_in_rank_order(x, self._exchange(x))

    def gather(self, x: torch.Tensor) -> list[torch.Tensor] | None:
        """Every rank's ``x`` (same shapes), copied, on rank 0; None on the others."""
        parts = self._exchange(x)
        return [p.clone() for p in parts] if self.rank == 0 else None

    def _wait(self, seq: int) -> None:
        counters = self._counters
        checks = 0
        deadline = next_alive = None
        while (counters < seq).any():
            checks += 1
            if checks < SPIN_CHECKS:
                continue
            now = time.monotonic()
            if deadline is None:
                deadline, next_alive = now + self.timeout_s, now + LIVENESS_EVERY_S
            elif now > deadline:
                raise TimeoutError(
                    f"tensor-parallel shared-memory all-reduce: no rank-wide sum in "
                    f"{self.timeout_s:.0f} s (a rank hung)"
                )
            elif now > next_alive:
                self.alive()
                next_alive = now + LIVENESS_EVERY_S
            os.sched_yield()
