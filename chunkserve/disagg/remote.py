"""The decode side of disaggregation: ask a prefill instance for a prompt's KV cache and
take its blocks into this instance's pool as they arrive.

For each admitted request (``Scheduler.admit_remote``: its blocks are allocated, its cached
prefix counted) the prompt's tokens ``[num_computed_tokens, n - 1)`` are asked for: an
inbox opens, and ``POST <prefill_url>/v1/completions`` carries the prompt's first ``n - 1``
token ids with ``kv_transfer_params.send`` (the handle) and ``max_tokens`` 1; the prefill
instance computes them chunked, under its own budget and with its own prefix cache, and
sends each chunk's blocks at once. Every step here, ``poll`` copies the blocks that arrived
into the request's blocks; when all did, the request runs with one token left, and the step
that computes it samples the first token: here, once, with this instance's sampler, so the
outputs are those of a colocated server. The prefill instance's own sampled token is
discarded.

With KV groups (a hybrid cache) the request holds every group's blocks for the prompt while
it waits; the transfer fills a full group's all and a sliding group's those in the window of
the token computed here (``KVHandle.plan``); the rest, never written, are given back before
anything is published to the prefix cache (``Scheduler.kv_received``).

The HTTP calls run on one background thread's event loop; ending a request here (finish,
abort, failure) cancels its call, which closes the connection, so the prefill instance
aborts its side too.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field, replace

import httpx

from chunkserve.disagg.connector import Inbox, KVHandle, new_transfer_id
from chunkserve.disagg.connectors import Connectors
from chunkserve.scheduling.request import Request

logger = logging.getLogger("chunkserve.disagg")

# Longest a prefill instance may take to answer (it queues under load: a long wait).
PREFILL_TIMEOUT_S = 600.0
CONNECT_TIMEOUT_S = 5.0
# After the prefill instance answered, the blocks still in flight must land within this.
ARRIVAL_GRACE_S = 30.0
# Copying arrived blocks into the pool takes at most about this long per step (the rest
# waits for the next step): a long prompt's blocks arriving at once must not stall the
# decodes' step. Slices are sized from the measured seconds per block so the last one ends
# inside the budget (fixed 8-block slices overshot it: 3-36 ms of copying in one step,
# measured on the 2-core EPYC); at least one block a step moves.
COPY_BUDGET_S = 0.01
MAX_COPY_SLICE_BLOCKS = 64


@dataclass
class TransferRecord:
    """One request's transfer as this end saw it."""

    num_bytes: int
    copy_s: float  # moving its blocks at this end (decode: into the pool; prefill: out)
    wait_s: float = 0.0  # decode: from asking to the last block in


class TransferEnd:
    """What both ends keep: the records of the transfers that ended since the last look."""

    def __init__(self) -> None:
        self.records: list[TransferRecord] = []

    def take_records(self) -> list[TransferRecord]:
        records, self.records = self.records, []
        return records


@dataclass
class _Transfer:
    request: Request
    inbox: Inbox
    block_ids: list[int]  # the pool's blocks for the transfer's blocks, in order
    end: int  # the tokens computed once all arrived
    asked_at: float
    call: Future
    copied: int = 0
    copy_s: float = 0.0
    answered_at: float | None = None
    num_bytes: int = 0
    errors: list[str] = field(default_factory=list)


class _HttpLoop:
    """An asyncio loop on its own thread, with one HTTP client."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="kv-http", daemon=True)
        self._thread.start()
        timeout = httpx.Timeout(PREFILL_TIMEOUT_S, connect=CONNECT_TIMEOUT_S)
        self.client: httpx.AsyncClient = self.run(self._client(timeout)).result()

    @staticmethod
    async def _client(timeout: httpx.Timeout) -> httpx.AsyncClient:
        return httpx.AsyncClient(timeout=timeout, limits=httpx.Limits(max_connections=None))

    def run(self, coro) -> Future:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def close(self) -> None:
        self.run(self.client.aclose()).result(5.0)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5.0)


async def _ask(client: httpx.AsyncClient, url: str, body: dict) -> None:
    """Ask a prefill instance; raises with what it said when it did not do it."""
    resp = await client.post(f"{url.rstrip('/')}/v1/completions", json=body)
    if resp.status_code != 200:
        try:
            message = resp.json()["error"]["message"]
        except Exception:
            message = resp.text[:500]
        raise RuntimeError(f"HTTP {resp.status_code}: {message}")
    choice = resp.json()["choices"][0]
    if choice.get("finish_reason") not in ("length", "stop"):
        raise RuntimeError(f"finish_reason {choice.get('finish_reason')!r}")


class RemotePrefills(TransferEnd):
    """The transfers of the requests waiting for their KV (see the module doc)."""

    def __init__(
        self,
        connectors: Connectors,
        worker,
        scheduler,
        block_size: int,
        deterministic: bool = False,
        threads: int = 0,
    ) -> None:
        super().__init__()
        self.connectors = connectors
        self.deterministic = deterministic  # the prefill side must run the mode too
        self.threads = threads  # and, in fp32, at these threads
        self.attention = worker.attention.arithmetic if deterministic else ""  # and this
        self.products = worker.invariant_products if deterministic else ""  # and this
        self.worker = worker
        self.scheduler = scheduler
        self.block_size = block_size
        self.layout, self.dtype = worker.kv_block_layout()
        self.windows = worker.kv_group_windows
        self._transfers: dict[str, _Transfer] = {}
        self._http: _HttpLoop | None = None
        self.block_copy_s = 0.0  # mean seconds to copy one block in (0: not measured yet)

    @property
    def active(self) -> bool:
        return bool(self._transfers)

    def start(self, admitted: list[Request]) -> list[tuple[Request, str]]:
        """Ask for the KV of requests ``Scheduler.admit_remote`` admitted; the ones that
        could not be asked, with why."""
        failed = []
        for r in admitted:
            end = r.num_prompt_tokens - 1  # the last token is computed here: it samples
            first = r.num_computed_tokens
            if first >= end:  # all cached here already
                self.scheduler.kv_received(r, end)
                continue
            handle = KVHandle(
                "shm", new_transfer_id(), "", first, end, 0, self.layout, self.dtype,
                windows=self.windows, deterministic=self.deterministic, threads=self.threads,
                attention=self.attention, products=self.products,
            )  # fmt: skip
            plan = handle.plan()
            handle = replace(handle, num_blocks=len(plan))
            url = r.prefill_url
            assert url is not None
            try:
                inbox, handle = self.connectors.open_inbox(handle, url)
            except Exception as exc:
                failed.append((r, f"KV transfer: {type(exc).__name__}: {exc}"))
                continue
            body = {
                "prompt": r.prompt_token_ids[:end],
                "max_tokens": 1,
                "temperature": 0.0,
                "kv_transfer_params": {"send": handle.as_dict()},
            }
            if self._http is None:
                self._http = _HttpLoop()
            call = self._http.run(_ask(self._http.client, url, body))
            tables = r.block_tables
            self._transfers[r.request_id] = _Transfer(
                r,
                inbox,
                [tables[g][i] for g, i in plan],
                end,
                time.monotonic(),
                call,
            )
        return failed

    def poll(self) -> list[tuple[Request, str]]:
        """Copy the blocks that arrived into the pool; requests whose KV is complete run.
        Returns the requests whose transfer failed, with why."""
        failed = []
        now = time.monotonic()
        deadline = time.perf_counter() + COPY_BUDGET_S
        moved = False  # one block a step moves whatever the clock says
        for request_id, t in list(self._transfers.items()):
            ready = t.inbox.num_ready()
            while t.copied < ready:
                t0 = time.perf_counter()
                n = self._slice_blocks(deadline - t0, moved)
                if n == 0:
                    break
                stop = min(ready, t.copied + n)
                blocks = t.inbox.read(t.copied, stop)
                self.worker.write_kv_blocks(t.block_ids[t.copied : stop], blocks)
                t.num_bytes += blocks.numel() * blocks.element_size()
                del blocks
                elapsed = time.perf_counter() - t0
                t.copy_s += elapsed
                self._learn(elapsed / (stop - t.copied))
                t.copied, moved = stop, True
            if t.copied == len(t.block_ids):
                self._end(request_id)
                self.scheduler.kv_received(t.request, t.end)
                self.records.append(TransferRecord(t.num_bytes, t.copy_s, now - t.asked_at))
                continue
            error = t.inbox.failed()
            if error is None and t.call.done():
                exc = t.call.exception()
                if exc is not None:
                    error = f"{type(exc).__name__}: {exc}" if not str(exc) else str(exc)
                elif t.answered_at is None:
                    t.answered_at = now
                elif now - t.answered_at > ARRIVAL_GRACE_S and ready < len(t.block_ids):
                    error = f"{len(t.block_ids) - t.copied} KV blocks never arrived"
            if error is not None:
                self._end(request_id)
                url = t.request.prefill_url
                failed.append((t.request, f"prefill instance {url} failed: {error}"))
        return failed

    def _slice_blocks(self, left_s: float, moved: bool) -> int:
        """Blocks the next slice may copy in ``left_s`` of the step's copy budget."""
        if self.block_copy_s <= 0.0:  # not measured: one block, then it is
            return 1 if not moved or left_s > 0 else 0
        n = min(MAX_COPY_SLICE_BLOCKS, int(left_s / self.block_copy_s + 1e-6))
        return max(n, 0 if moved else 1)

    def _learn(self, seconds_per_block: float) -> None:
        """Up at once (a slower copy must not overshoot the next step too), down slowly."""
        if seconds_per_block >= self.block_copy_s:
            self.block_copy_s = seconds_per_block
        else:
            self.block_copy_s += 0.25 * (seconds_per_block - self.block_copy_s)

    def release(self, request_id: str) -> None:
        """The request ended: its transfer stops (the call is cancelled)."""
        if request_id in self._transfers:
            self._end(request_id)

    def _end(self, request_id: str) -> None:
        t = self._transfers.pop(request_id)
        t.inbox.close()
        if not t.call.done():
            t.call.cancel()

    def close(self) -> None:
        for request_id in list(self._transfers):
            self._end(request_id)
        if self._http is not None:
            self._http.close()
            self._http = None
