"""The prefill side of disaggregation: a request that came with ``kv_transfer_params.send``
sends its prompt's KV blocks to the decode instance's inbox as the steps compute them.

After each forward pass (before ``Scheduler.update`` may finish the request and free its
blocks), every prefill chunk of such a request sends the blocks of the transfer it
completed: full blocks, and the last partial one once the prompt is done. Blocks a prefix
cache hit gave the request go with its first chunk. A preempted request recomputes and
sends on from where it was: a block goes once. With KV groups (a hybrid cache) the
transfer's blocks are ``KVHandle.plan``'s (group, token block) pairs: a sliding group sends
only the blocks in the window of the decode side's next token, which it still holds when
their chunk completes (its window moves past none of them before the prompt ends).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from chunkserve.disagg.connector import KVHandle, Outbox, TransferError
from chunkserve.disagg.connectors import Connectors
from chunkserve.disagg.remote import TransferEnd, TransferRecord
from chunkserve.scheduling.request import Request


@dataclass
class _Sending:
    handle: KVHandle
    outbox: Outbox
    plan: list[tuple[int, int]]  # (KV group, token block) of each block of the transfer
    sent: int = 0  # blocks of the transfer sent
    num_bytes: int = 0
    copy_s: float = 0.0


class KVSender(TransferEnd):
    def __init__(
        self,
        connectors: Connectors,
        worker,
        block_size: int,
        deterministic: bool = False,
        threads: int = 0,
    ) -> None:
        super().__init__()
        self.connectors = connectors
        self.deterministic = deterministic  # the decode side must run the mode too
        self.threads = threads  # and, in fp32, at these threads
        self.attention = worker.attention.arithmetic if deterministic else ""  # and this
        self.products = worker.invariant_products if deterministic else ""  # and this
        self.worker = worker
        self.block_size = block_size
        self.layout, self.dtype = worker.kv_block_layout()
        self.windows = worker.kv_group_windows
        self._sending: dict[str, _Sending] = {}

    def open(self, request: Request, send: dict) -> None:
        """Open the request's outbox; ``ValueError`` naming the field if the handle does not
        fit this instance or its inbox is not there."""
        handle = KVHandle.from_dict(send)
        try:
            handle.check_fits(
                self.layout,
                self.dtype,
                self.windows,
                self.deterministic,
                self.threads,
                self.attention,
                self.products,
            )
        except TransferError as exc:
            raise ValueError(str(exc)) from None
        if handle.num_tokens != request.num_prompt_tokens:
            raise ValueError(
                f"kv_transfer_params.send.num_tokens: {handle.num_tokens}, but the prompt "
                f"has {request.num_prompt_tokens} tokens"
            )
        if handle.block_size != self.block_size:
            raise ValueError("kv_transfer_params.send.layout: another block size")
        try:
            outbox = self.connectors.open_outbox(handle)
        except TransferError as exc:
            raise ValueError(str(exc)) from None
        self._sending[request.request_id] = _Sending(handle, outbox, handle.plan())

    def after_execute(self, out) -> list[tuple[Request, str]]:
        """Send what this step's prefill chunks completed; the requests whose transfer
        failed, with why."""
        failed = []
        bs = self.block_size
        for chunk in out.prefills:
            r = chunk.request
            s = self._sending.get(r.request_id)
            if s is None:
                continue
            h = s.handle
            if chunk.end >= h.num_tokens:
                done = h.num_blocks
            else:  # the pairs of the token blocks this chunk completed
                complete = chunk.end // bs
                done = s.sent
                while done < h.num_blocks and s.plan[done][1] < complete:
                    done += 1
            if done <= s.sent:
                continue
            tables = r.block_tables
            t0 = time.perf_counter()
            try:
                blocks = self.worker.read_kv_blocks(
                    [tables[g][i] for g, i in s.plan[s.sent : done]]
                )
                s.outbox.send(s.sent, blocks)
            except TransferError as exc:
                failed.append((r, f"KV transfer: {exc}"))
                self.release(r.request_id)
                continue
            s.num_bytes += blocks.numel() * blocks.element_size()
            s.copy_s += time.perf_counter() - t0
            s.sent = done
            if done == h.num_blocks:
                self.records.append(TransferRecord(s.num_bytes, s.copy_s))
                self.release(r.request_id)
        return failed

    def release(self, request_id: str) -> None:
        s = self._sending.pop(request_id, None)
        if s is not None:
            s.outbox.close()

    def close(self) -> None:
        for request_id in list(self._sending):
            self.release(request_id)
