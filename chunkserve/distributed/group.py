"""A tensor-parallel rank's view of its group: the collectives of the forward pass and the one
broadcast per step that carries the batch's metadata from rank 0 to the others.

Two process groups over one store (``torch.distributed``), made directly rather than through
``init_process_group`` so no global state is left behind (two engines can live in one
process, one after another or side by side):

- ``device``: the forward pass's all-reduces (after the row-parallel projections and the
  vocabulary-parallel embedding) and the gather of the LM head's logits to rank 0. NCCL on
  CUDA, gloo on CPU.
  On one CPU node the sums go through shared memory instead (``shm``: gloo's latency per
  call is ~100x a layer's work at decode batch sizes on a small VM); gloo takes the ones too
  large for its buffers.
- ``meta``: gloo on the host, the step messages (``send`` / ``recv``). Ranks other than 0 wait
  in it while the engine idles, so its timeout is long; a rank 0 that dies closes its
  connections and the wait ends with an error at once (measured: gloo raises "Connection
  closed by peer").

A step message is one int64 array; it travels in a buffer of a capacity every rank knows
(``[op, length, payload...]``), so one broadcast carries it. A payload that outgrows the
capacity is preceded by one resize message.
"""

from __future__ import annotations

import datetime
import os
import time
from collections.abc import Callable

import numpy as np
import torch
import torch.distributed as dist

from chunkserve.distributed.shm import ShmAllReduce, shm_supported, sum_in_rank_order

# Step-message operations.
OP_SHUTDOWN = 0
OP_STEP = 1  # payload: a step's metadata (``runner.StepArrays.encode``)
OP_RESIZE = 2  # payload: the new capacity
OP_PING = 3  # nothing to do: keeps an idle group's connections in use
OP_ZERO_NULL_BLOCK = 4  # after warm-up steps wrote into the null block

HEADER = 2  # op, payload length
INITIAL_CAPACITY = 4096  # int64 words: a decode step of ~500 requests, a ~1,300-token chunk

# A collective waits this long for the other ranks (one layer's work of the slowest: far
# below it on any machine that can serve); past it the rank is hung and the engine dies.
COLLECTIVE_TIMEOUT_S = 300.0
# Ranks other than 0 wait for the next step message this long (an idle engine sends pings).
META_TIMEOUT = datetime.timedelta(days=20)
# Bytes of one shared-memory all-reduce slot (a rank's tensor): 3,640 rows of 576 bf16
# values; larger sums (long prefill chunks, where gloo's latency matters least) use gloo.
SHM_CAPACITY = 4 << 20


class CollectiveError(RuntimeError):
    """A collective failed (a rank died, hung, or its connection broke): the group is
    unusable and so is the engine."""


def make_process_group(
    store: dist.Store, rank: int, size: int, device: torch.device, timeout_s: float
) -> dist.ProcessGroup:
    """A process group built directly over ``store`` (no global ``init_process_group``
    state, so groups come and go in one process): NCCL for CUDA tensors, else gloo."""
    timeout = datetime.timedelta(seconds=timeout_s)
    if device.type == "cuda":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, size, opts)
    return dist.ProcessGroupGloo(store, rank, size, timeout)


class TPGroup:
    """One rank's end of a tensor-parallel group of ``size`` ranks."""

    def __init__(
        self,
        rank: int,
        size: int,
        device_pg,
        meta_pg,
        shm: ShmAllReduce | None = None,
        ordered_sums: bool = False,
    ) -> None:
        self.rank = rank
        self.size = size
        self._dev = device_pg
        self._meta = meta_pg
        self.shm = shm
        # The deterministic mode: every sum in rank order (``all_reduce``).
        self.ordered_sums = ordered_sums
        self._capacity = INITIAL_CAPACITY
        self._buf = torch.zeros(HEADER + self._capacity, dtype=torch.int64)
        # Seconds spent in collectives since ``take_comm_time`` (CPU: the host waits in them;
        # on CUDA the calls only queue work, so this is their launch time).
        self._comm_time = 0.0
        self.last_send = time.monotonic()

    @classmethod
    def join(
        cls,
        store: dist.Store,
        rank: int,
        size: int,
        device: torch.device,
        timeout_s: float = COLLECTIVE_TIMEOUT_S,
        shm_alive: Callable[[], None] | None = None,
        ordered_sums: bool = False,
    ) -> TPGroup:
        """Make both process groups over ``store`` (every rank calls this). ``shm_alive``
        (every rank on one CPU host): sum through shared memory, calling it while waiting
        (it raises when another rank is known to be gone). ``ordered_sums``: the
        deterministic mode's sums (``all_reduce``)."""
        meta = dist.ProcessGroupGloo(dist.PrefixStore("meta", store), rank, size, META_TIMEOUT)
        dev = make_process_group(dist.PrefixStore("device", store), rank, size, device, timeout_s)
        group = cls(rank, size, dev, meta, ordered_sums=ordered_sums)
        use_shm = shm_alive is not None and device.type == "cpu"
        use_shm = use_shm and group.min_int(int(shm_supported(size, SHM_CAPACITY))) == 1
        if use_shm:
            assert shm_alive is not None
            if rank == 0:
                store.set("chunkserve-shm", ShmAllReduce.create(size, SHM_CAPACITY))
            path = store.get("chunkserve-shm").decode()
            group.shm = ShmAllReduce(path, rank, size, SHM_CAPACITY, shm_alive, timeout_s)
        group.barrier()  # every rank has mapped the file: its name can go
        if use_shm and rank == 0:
            os.unlink(path)
        return group

    # ---- the forward pass's collectives ----------------------------------------------------
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks, in place; returns it.

        With ``ordered_sums`` (the deterministic mode) every element's sum is
        ``sum_in_rank_order``'s, as the shared-memory path's is, whatever the tensor's size:
        gloo's ring all-reduce over 3 or more ranks starts each segment's sum at another
        rank, and where a row's elements fall among the segments depends on how many rows
        the step has (measured: over 3 ranks, a bf16 row summed alone and as the first of 3
        rows differ). Sums too large for shared memory (or with no shared memory: ranks on
        several hosts) then gather every rank's tensor and add them in rank order. Two
        ranks' sums need not: one addition per element is the same in either order."""
        t0 = time.perf_counter()
        try:
            if self.shm is not None and x.is_contiguous() and self.shm.fits(x):
                self.shm.all_reduce(x)
            elif self.ordered_sums and self.size > 2:
                parts = [torch.empty_like(x) for _ in range(self.size)]
                self._dev.allgather([parts], [x.contiguous()]).wait()
                sum_in_rank_order(x, parts)
            else:
                self._dev.allreduce([x]).wait()
        except Exception as exc:
            raise CollectiveError(f"tensor-parallel all-reduce failed: {exc}") from exc
        self._comm_time += time.perf_counter() - t0
        return x

    def gather_vocab(self, local: torch.Tensor, vocab_size: int) -> torch.Tensor | None:
        """Each rank's logits over its vocabulary shard [S, V / N] -> rank 0's [S, V] (other
        ranks get None)."""
        t0 = time.perf_counter()
        local = local.contiguous()
        out: list[torch.Tensor] | None = []
        try:
            if self.shm is not None and self.shm.fits(local):
                out = self.shm.gather(local)
            else:
                out = [torch.empty_like(local) for _ in range(self.size)] if self.rank == 0 else []
                opts = dist.GatherOptions()
                opts.rootRank = 0
                self._dev.gather([out] if out else [], [local], opts).wait()
        except Exception as exc:
            raise CollectiveError(f"tensor-parallel logits gather failed: {exc}") from exc
        self._comm_time += time.perf_counter() - t0
        if self.rank != 0:
            return None
        assert out
        return torch.cat(out, dim=-1)[:, :vocab_size]

    def min_int(self, value: int) -> int:
        """The least of every rank's ``value`` (every rank calls it)."""
        t = torch.tensor([value], dtype=torch.int64)
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MIN
        self._meta.allreduce([t], opts).wait()
        return int(t.item())

    def barrier(self) -> None:
        self.min_int(0)

    def take_comm_time(self) -> float:
        t, self._comm_time = self._comm_time, 0.0
        return t

    # ---- step messages (rank 0 sends, the others receive) ---------------------------------
    def send(self, op: int, payload: np.ndarray | None = None) -> None:
        n = 0 if payload is None else int(payload.size)
        t0 = time.perf_counter()
        if n > self._capacity:
            new = max(2 * self._capacity, 1 << (n - 1).bit_length())
            self._buf[0], self._buf[1], self._buf[2] = OP_RESIZE, 1, new
            self._broadcast()
            self._resize(new)
        buf = self._buf.numpy()
        buf[0], buf[1] = op, n
        if n:
            buf[HEADER : HEADER + n] = payload
        self._broadcast()
        self._comm_time += time.perf_counter() - t0
        self.last_send = time.monotonic()

    def recv(self) -> tuple[int, np.ndarray]:
        """The next message (op, payload); resizes happen inside."""
        while True:
            self._broadcast()
            op, n = int(self._buf[0]), int(self._buf[1])
            if op == OP_RESIZE:
                self._resize(int(self._buf[2]))
                continue
            return op, self._buf.numpy()[HEADER : HEADER + n].copy()

    def _broadcast(self) -> None:
        try:
            self._meta.broadcast([self._buf], dist.BroadcastOptions()).wait()
        except RuntimeError as exc:
            raise CollectiveError(f"tensor-parallel step broadcast failed: {exc}") from exc

    def _resize(self, capacity: int) -> None:
        self._capacity = capacity
        self._buf = torch.zeros(HEADER + capacity, dtype=torch.int64)
