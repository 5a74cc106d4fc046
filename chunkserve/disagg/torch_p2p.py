"""KV transfer over torch.distributed point-to-point: separate hosts (gloo on CPU, NCCL on
CUDA).

Each pair of instances forms its own two-rank process group (made directly over a store, no
``init_process_group``: an instance may pair with many others): the decode instance is rank
0 and serves the store on ``kv_transfer_host``; a prefill instance joins as rank 1 when the
first handle naming that store reaches it. A transfer's blocks go as messages of two parts
on the pair: a header ``[seq, start, num_blocks, numel, dtype]`` (int64) then the blocks.
The decode side's receiver thread puts them into the transfer's staging tensor (by ``seq``;
a transfer already closed has its blocks read and dropped); the prefill side's sender
thread sends what the steps queue, so a step never waits on the network.

A broken pair (the peer died, or nothing arrived for ``PAIR_TIMEOUT_S``) fails the
transfers open on it; the next transfer between the two makes a new pair under a new key.
"""

from __future__ import annotations

import datetime
import hashlib
import itertools
import logging
import queue
import threading

import torch
import torch.distributed as dist

from chunkserve.disagg.connector import Inbox, KVConnector, KVHandle, Outbox, TransferError
from chunkserve.distributed.group import make_process_group

logger = logging.getLogger("chunkserve.disagg")

PAIR_TIMEOUT_S = 120.0
STORE_TIMEOUT_S = 30.0
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_DTYPE_NAMES = ("float32", "bfloat16", "float16")


def _make_group(store: dist.Store, key: str, rank: int, device: torch.device):
    return make_process_group(dist.PrefixStore(key, store), rank, 2, device, PAIR_TIMEOUT_S)


class TorchInbox(Inbox):
    def __init__(self, handle: KVHandle, pair: _RecvPair, device: torch.device) -> None:
        self.handle = handle
        self.pair = pair
        dtype = _DTYPES[_DTYPE_NAMES.index(handle.dtype)]
        # [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]
        self.staging = torch.empty((handle.num_blocks, *handle.layout), dtype=dtype, device=device)
        self.ready = 0  # written by the receiver thread
        self.error: str | None = None

    def num_ready(self) -> int:
        return self.ready

    def read(self, start: int, stop: int) -> torch.Tensor:
        return self.staging[start:stop]

    def failed(self) -> str | None:
        return self.error

    def close(self) -> None:
        self.pair.inboxes.pop(self.handle.seq, None)


class _RecvPair:
    """The decode side of a pair: a thread that joins the group and receives into inboxes."""

    def __init__(self, store: dist.Store, key: str, device: torch.device) -> None:
        self.key = key
        self.device = device
        self.inboxes: dict[int, TorchInbox] = {}
        self.dead: str | None = None
        self._store = store
        self._thread = threading.Thread(target=self._run, name=f"kv-recv-{key}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            group = _make_group(self._store, self.key, 0, self.device)
            while True:
                header = torch.zeros(5, dtype=torch.int64, device=self.device)
                group.recv([header], 1, 0).wait()
                seq, start, n, numel, dtype = header.tolist()
                inbox = self.inboxes.get(seq)
                if inbox is not None:
                    buf = inbox.staging[start : start + n]
                else:  # closed meanwhile: read and drop
                    buf = torch.empty(numel, dtype=_DTYPES[dtype], device=self.device)
                group.recv([buf], 1, 1).wait()
                if inbox is not None:
                    if self.device.type == "cuda":
                        torch.cuda.current_stream().synchronize()
                    inbox.ready = start + n
        except Exception as exc:  # the peer died or went quiet: fail what waits on it
            self.dead = f"KV transfer pair {self.key}: {type(exc).__name__}: {exc}"
            for inbox in list(self.inboxes.values()):
                inbox.error = self.dead
            if self.inboxes:
                logger.warning("%s", self.dead)


class TorchOutbox(Outbox):
    def __init__(self, handle: KVHandle, pair: _SendPair) -> None:
        self.handle, self.pair = handle, pair

    def send(self, start: int, blocks: torch.Tensor) -> None:
        if self.pair.dead:
            raise TransferError(self.pair.dead)
        self.pair.queue.put((self.handle, start, blocks))

    def close(self) -> None:
        pass


class _SendPair:
    """The prefill side of a pair: a thread that joins the group and sends what is queued."""

    def __init__(self, address: str, key: str, device: torch.device) -> None:
        self.address, self.key, self.device = address, key, device
        self.queue: queue.SimpleQueue = queue.SimpleQueue()
        self.dead: str | None = None
        self._thread = threading.Thread(target=self._run, name=f"kv-send-{key}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            host, _, port = self.address.rpartition(":")
            store = dist.TCPStore(
                host,
                int(port),
                2,
                is_master=False,
                timeout=datetime.timedelta(seconds=STORE_TIMEOUT_S),
            )
            group = _make_group(store, self.key, 1, self.device)
            while True:
                item = self.queue.get()
                if item is None:
                    return
                handle, start, blocks = item
                dtype = _DTYPES.index(blocks.dtype)
                header = torch.tensor(
                    [handle.seq, start, blocks.shape[0], blocks.numel(), dtype],
                    dtype=torch.int64,
                    device=self.device,
                )
                group.send([header], 0, 0).wait()
                group.send([blocks.to(self.device).contiguous()], 0, 1).wait()
        except Exception as exc:
            self.dead = f"KV transfer pair {self.key}: {type(exc).__name__}: {exc}"
            logger.warning("%s", self.dead)

    def close(self) -> None:
        self.queue.put(None)


class TorchConnector(KVConnector):
    def __init__(self, host: str, device: torch.device) -> None:
        self.host = host
        self.device = device
        self._store: dist.TCPStore | None = None
        self._recv: dict[str, _RecvPair] = {}  # by peer
        self._send: dict[str, _SendPair] = {}  # by the decode side's address
        self._generation = itertools.count()
        self._seq = itertools.count()

    def open_inbox(self, handle: KVHandle, peer: str) -> tuple[TorchInbox, KVHandle]:
        from dataclasses import replace

        if self._store is None:
            self._store = dist.TCPStore(
                self.host,
                0,
                None,
                is_master=True,
                wait_for_workers=False,
                timeout=datetime.timedelta(seconds=STORE_TIMEOUT_S),
            )
        pair = self._recv.get(peer)
        if pair is None or pair.dead:
            tag = hashlib.blake2b(peer.encode(), digest_size=6).hexdigest()
            pair = _RecvPair(self._store, f"{tag}-{next(self._generation)}", self.device)
            self._recv[peer] = pair
        handle = replace(
            handle,
            kind="torch",
            address=f"{self.host}:{self._store.port}",
            seq=next(self._seq),
            pair=pair.key,
        )
        inbox = TorchInbox(handle, pair, self.device)
        pair.inboxes[handle.seq] = inbox
        return inbox, handle

    def open_outbox(self, handle: KVHandle) -> TorchOutbox:
        pair = self._send.get(handle.address)
        if pair is None or pair.key != handle.pair or pair.dead:
            if pair is not None:
                pair.close()
            pair = _SendPair(handle.address, handle.pair, self.device)
            self._send[handle.address] = pair
        return TorchOutbox(handle, pair)

    def close(self) -> None:
        for pair in self._send.values():
            pair.close()
        self._send.clear()
        self._recv.clear()
        self._store = None
