"""Prefill/decode disaggregation: connectors and the decode side's scheduling alone, then one
prefill and one decode instance behind ``chunkserve router`` (real servers on loopback
ports), checked against the decode instance serving the same requests colocated."""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
import torch

from chunkserve.config import SchedulerConfig
from chunkserve.disagg.connector import KVHandle, TransferError, new_transfer_id, transfer_plan
from chunkserve.disagg.shm import ShmConnector, shm_path
from chunkserve.disagg.torch_p2p import TorchConnector
from chunkserve.scheduling.kv_cache import KVCacheManager
from chunkserve.scheduling.request import Request, RequestStatus
from chunkserve.scheduling.sampling_params import KVTransferParams, SamplingParams
from chunkserve.scheduling.scheduler import Scheduler
from tests.conftest import NATURAL_PROMPTS
from tests.test_server import MODEL, ChunkserveProcess, PausedCores, Server, wait_for

LAYOUT = (2, 2, 4, 3, 8)  # num_layers, K/V, block_size, num_kv_heads, head_dim


def handle(num_tokens: int = 10, first: int = 0, kind: str = "shm") -> KVHandle:
    blocks = -(-(num_tokens - first) // LAYOUT[2])
    return KVHandle(kind, new_transfer_id(), "", first, num_tokens, blocks, LAYOUT, "float32")


# ---- handles and connectors ----------------------------------------------------------------
def test_handle_round_trip_and_bad_fields_named() -> None:
    h = handle(10)
    assert KVHandle.from_dict(h.as_dict()) == h
    for field, value in [
        ("kind", "nfs"),
        ("transfer_id", "../../etc/passwd"),
        ("layout", [2, 3, 4, 3, 8]),
        ("dtype", "int8"),
        ("first_token", 3),  # not block-aligned
        ("num_blocks", 99),
        ("num_tokens", -1),
    ]:
        with pytest.raises(ValueError, match=rf"kv_transfer_params\.send\.{field}"):
            KVHandle.from_dict({**h.as_dict(), field: value})
    with pytest.raises(ValueError, match=r"send\.extra"):
        KVHandle.from_dict({**h.as_dict(), "extra": 1})
    with pytest.raises(TransferError, match="same model"):
        h.check_fits((2, 2, 4, 3, 16), "float32")


def test_transfer_plan_sends_sliding_groups_only_their_window() -> None:
    """One full group: every block of the range (all layers). KV groups: a full group's
    every block, a sliding group's only those the window of token ``num_tokens`` reaches
    (its first key: ``num_tokens - W + 1``), token block by token block."""
    assert transfer_plan(8, 30, (None,), 4) == [(0, i) for i in range(2, 8)]
    # 30 tokens, next token at 30 sees 30 - 6 + 1 = 25.. -> from block 6 (tokens 24-27).
    plan = transfer_plan(0, 30, (None, 6), 4)
    assert plan == [(0, 0), (0, 1), (0, 2), (0, 3), (0, 4), (0, 5), (0, 6), (1, 6), (0, 7), (1, 7)]
    # A window reaching past the transfer's start (a cached prefix on the decode side).
    assert transfer_plan(24, 30, (None, 12), 4) == [(0, 6), (1, 6), (0, 7), (1, 7)]
    # A window covering the whole prompt: every block; one ending on a block edge.
    assert transfer_plan(0, 8, (100,), 4) == [(0, 0), (0, 1)]
    assert transfer_plan(0, 9, (5,), 4) == [(0, 1), (0, 2)]  # keys 5..9: blocks 1, 2
    h = KVHandle(
        "shm", new_transfer_id(), "", 0, 30, len(plan), LAYOUT, "float32", windows=(None, 6)
    )
    assert h.plan() == plan
    back = KVHandle.from_dict(json.loads(json.dumps(h.as_dict())))
    assert back == h and back.windows == (None, 6)
    for windows, field in (
        ([None, 0], "windows"),
        ([None, "6"], "windows"),
        ([], "windows"),
        ("full", "windows"),
        ([None, True], "windows"),
        ([None], "num_blocks"),  # 10 blocks are the plan of (None, 6), not of (None,)
    ):
        with pytest.raises(ValueError, match=f"send.{field}"):
            KVHandle.from_dict({**h.as_dict(), "windows": windows})
    with pytest.raises(TransferError, match="windows"):
        h.check_fits(LAYOUT, "float32", (None, 8))
    h.check_fits(LAYOUT, "float32", (None, 6))


def test_kv_transfer_params_need_exactly_one_side() -> None:
    with pytest.raises(ValueError, match="kv_transfer_params"):
        SamplingParams(kv_transfer_params={})
    with pytest.raises(ValueError, match="prefill_url"):
        SamplingParams(kv_transfer_params={"prefill_url": "file:///etc"})
    with pytest.raises(ValueError, match="kv_transfer_params"):
        SamplingParams(kv_transfer_params={"bogus": 1})
    p = SamplingParams(kv_transfer_params={"prefill_url": "http://127.0.0.1:1"})
    assert isinstance(p.kv_transfer_params, KVTransferParams)


def _blocks(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn((n, *LAYOUT), generator=g)


def test_shm_transfer_arrives_in_order_and_leaves_no_file() -> None:
    conn = ShmConnector()
    inbox, h = conn.open_inbox(handle(10), "http://p")
    assert h.address == shm_path(h.transfer_id) and os.path.exists(h.address)
    out = conn.open_outbox(KVHandle.from_dict(h.as_dict()))  # as it travels
    data = _blocks(3, 0)
    assert inbox.num_ready() == 0
    out.send(0, data[:2])
    assert inbox.num_ready() == 2
    with pytest.raises(TransferError, match="out of order"):
        out.send(0, data[2:])
    out.send(2, data[2:])
    assert inbox.num_ready() == 3
    assert torch.equal(inbox.read(0, 3), data)
    out.close()
    inbox.close()
    inbox.close()  # idempotent
    assert not os.path.exists(h.address)


def test_shm_outbox_opens_only_the_handles_file() -> None:
    conn = ShmConnector()
    inbox, h = conn.open_inbox(handle(10), "http://p")
    try:
        with pytest.raises(TransferError, match="address"):
            conn.open_outbox(KVHandle(**{**h.__dict__, "address": "/tmp/x"}))
        bigger = KVHandle(**{**h.__dict__, "num_tokens": 14, "num_blocks": 4})
        with pytest.raises(TransferError, match="not the handle's"):
            conn.open_outbox(bigger)
        gone = KVHandle(**{**h.__dict__, "transfer_id": new_transfer_id()})
        gone = KVHandle(**{**gone.__dict__, "address": shm_path(gone.transfer_id)})
        with pytest.raises(TransferError, match="No such file"):
            conn.open_outbox(gone)
    finally:
        inbox.close()


def test_torch_transfer_between_two_pairs_of_threads() -> None:
    """The decode side's store and receiver thread, the prefill side's sender thread (one
    process here; two in a deployment), two transfers interleaved, one closed early."""
    recv = TorchConnector("127.0.0.1", torch.device("cpu"))
    send = TorchConnector("127.0.0.1", torch.device("cpu"))
    try:
        a, ha = recv.open_inbox(handle(12), "http://p")
        b, hb = recv.open_inbox(handle(8), "http://p")
        c, hc = recv.open_inbox(handle(4), "http://p")
        assert ha.pair == hb.pair and ha.seq != hb.seq
        oa = send.open_outbox(KVHandle.from_dict(ha.as_dict()))
        ob = send.open_outbox(KVHandle.from_dict(hb.as_dict()))
        oc = send.open_outbox(KVHandle.from_dict(hc.as_dict()))
        da, db = _blocks(3, 1), _blocks(2, 2)
        c.close()  # the decode side gave up on this one: its blocks are dropped
        oc.send(0, _blocks(1, 3))
        oa.send(0, da[:1])
        ob.send(0, db)
        oa.send(1, da[1:])
        deadline = time.time() + 30
        while (a.num_ready() < 3 or b.num_ready() < 2) and time.time() < deadline:
            time.sleep(0.01)
        assert torch.equal(a.read(0, 3), da) and torch.equal(b.read(0, 2), db)
        assert a.failed() is None
    finally:
        send.close()
        recv.close()


# ---- the decode side's scheduling ------------------------------------------------------------
def remote_request(rid: str, n: int, url: str | None = "http://p") -> Request:
    kv = KVTransferParams(prefill_url=url) if url else None
    params = SamplingParams(max_tokens=4, temperature=0.0, kv_transfer_params=kv)
    return Request(rid, list(range(100, 100 + n)), params, max_tokens=4)


def test_remote_request_holds_blocks_until_its_kv_arrives() -> None:
    kv = KVCacheManager(20, 4, enable_prefix_caching=True)
    cfg = SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8, max_model_len=64, block_size=4)
    s = Scheduler(cfg, kv)
    r = remote_request("a", 10)
    s.add_request(r)
    assert s.num_waiting == 1 and s.schedule(64).is_empty  # nothing local to run
    assert s.admit_remote() == [r]
    assert r.status == RequestStatus.WAITING_FOR_KV and len(r.block_ids) == 3
    assert s.schedule(64).is_empty  # waits for its KV, blocks held
    s.kv_received(r, 9)
    out = s.schedule(64)
    assert [(c.start, c.num_tokens) for c in out.prefills] == [(9, 1)]
    s.update(out, {"a": 7})
    assert r.output_token_ids == [7]
    # A second request with the same prompt finds the first's blocks cached here: only
    # the rest is asked for.
    r2 = remote_request("b", 10)
    s.add_request(r2)
    assert s.admit_remote() == [r2] and r2.num_computed_tokens == 8
    s.abort_request("b")  # while its KV arrives: its blocks go back
    s.abort_request("a")
    assert kv.num_free_blocks == 20
    kv.pool.check_invariants()


def test_remote_admission_waits_for_blocks() -> None:
    kv = KVCacheManager(4, 4)
    cfg = SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8, max_model_len=16, block_size=4)
    s = Scheduler(cfg, kv)
    a, b = remote_request("a", 12), remote_request("b", 12)
    s.add_request(a)
    s.add_request(b)
    assert s.admit_remote() == [a]  # b does not fit beside it
    assert s.admit_remote() == []
    s.abort_request("a")
    assert s.admit_remote() == [b]


class _FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now

    monotonic = perf_counter


def test_arrived_blocks_are_copied_in_slices_that_fit_the_step_budget(monkeypatch) -> None:
    """Blocks that arrived at once are copied over several steps: each step's copying ends
    within the budget, sized from the measured time per block (the first slice, unmeasured,
    is one block), and a block slower than the whole budget still moves one a step."""
    from concurrent.futures import Future

    from chunkserve.disagg import remote

    clock = _FakeClock()
    monkeypatch.setattr(remote, "time", clock)

    class Worker:
        per_block_s = 0.002

        kv_group_windows = (None,)

        def kv_block_layout(self):
            return LAYOUT, "float32"

        def write_kv_blocks(self, block_ids, blocks):
            assert len(block_ids) == blocks.shape[0]
            clock.now += self.per_block_s * len(block_ids)

    class Inbox:
        def num_ready(self):
            return 40

        def read(self, start, stop):
            return torch.zeros(stop - start, 2)

        def failed(self):
            return None

        def close(self):
            pass

    received = []
    scheduler = type("S", (), {"kv_received": lambda self, r, end: received.append(end)})()
    worker = Worker()
    ends = remote.RemotePrefills(None, worker, scheduler, 4)
    call: Future = Future()
    r = remote_request("a", 161)
    t = remote._Transfer(r, Inbox(), list(range(1, 41)), 160, clock.now, call)
    ends._transfers["a"] = t
    per_step = []
    while ends.active:
        before, copied = clock.now, t.copied
        assert ends.poll() == []
        per_step.append((t.copied - copied, clock.now - before))
    assert received == [160]
    assert per_step[0] == (5, pytest.approx(0.010))  # 1 block, then 4 in what was left
    assert all(s <= remote.COPY_BUDGET_S + 1e-9 for _, s in per_step)
    assert sum(n for n, _ in per_step) == 40 and len(per_step) == 8
    assert ends.records[0].num_bytes == 40 * 2 * 4

    # The machine slows down 15x (one block now takes longer than the whole budget): the
    # slice sized before it overshoots once, then one block a step moves.
    worker.per_block_s = 0.03
    t2 = remote._Transfer(remote_request("b", 161), Inbox(), list(range(1, 41)), 160, 0.0, Future())
    ends._transfers["b"] = t2
    counts = []
    for _ in range(3):
        copied = t2.copied
        ends.poll()
        counts.append(t2.copied - copied)
    assert counts == [5, 1, 1]


@pytest.mark.parametrize("how", ["prefill call fails", "blocks stop coming"])
def test_kv_transfer_failing_midway_fails_the_request_and_frees_everything(
    monkeypatch, how: str
) -> None:
    """Two of five blocks arrived, then the prefill instance's answer is an error, or it
    answered but the rest never comes: the request fails with an error naming the prefill
    instance (what the engine core ends it with), and its blocks, its transfer and its
    shared-memory file are gone."""
    from concurrent.futures import Future

    from chunkserve.disagg import remote
    from chunkserve.disagg.connectors import Connectors

    clock = _FakeClock()
    monkeypatch.setattr(remote, "time", clock)
    asks: list[dict] = []
    calls: list[Future] = []
    monkeypatch.setattr(remote, "_ask", lambda client, url, body: asks.append(body))

    class Http:  # the call to the prefill instance: a future the test ends
        client = None

        def run(self, _):
            calls.append(Future())
            return calls[-1]

        def close(self):
            pass

    monkeypatch.setattr(remote, "_HttpLoop", Http)

    class Worker:
        def __init__(self) -> None:
            self.written: list[int] = []

        kv_group_windows = (None,)

        def kv_block_layout(self):
            return LAYOUT, "float32"

        def write_kv_blocks(self, block_ids, blocks):
            assert len(block_ids) == blocks.shape[0]
            self.written += block_ids

    kv = KVCacheManager(20, 4, enable_prefix_caching=True)
    cfg = SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8, max_model_len=64, block_size=4)
    sched = Scheduler(cfg, kv, clock=lambda: 0.0)
    worker = Worker()
    connectors = Connectors("shm", "127.0.0.1", torch.device("cpu"))
    ends = remote.RemotePrefills(connectors, worker, sched, 4)
    r = remote_request("a", 21)  # 20 tokens asked for: 5 blocks
    sched.add_request(r)
    try:
        assert ends.start(sched.admit_remote()) == []
        (body,) = asks
        h = KVHandle.from_dict(body["kv_transfer_params"]["send"])
        assert h.num_blocks == 5 and os.path.exists(h.address)
        outbox = connectors.open_outbox(h)  # the prefill instance's end
        outbox.send(0, _blocks(2, 0))
        assert ends.poll() == []
        assert worker.written == r.block_ids[:2] and r.status == RequestStatus.WAITING_FOR_KV
        if how == "prefill call fails":
            calls[0].set_exception(RuntimeError("HTTP 500: the prefill engine died"))
            why = "HTTP 500: the prefill engine died"
        else:
            calls[0].set_result(None)
            assert ends.poll() == []  # answered: the blocks in flight get a grace period
            clock.now += remote.ARRIVAL_GRACE_S + 1
            why = "3 KV blocks never arrived"
        failed = ends.poll()
        assert [(f.request_id, e) for f, e in failed] == [
            ("a", f"prefill instance http://p failed: {why}")
        ]
        sched.fail_requests([r], failed[0][1])  # what the engine core does with it
        assert r.status == RequestStatus.FINISHED_ERROR and r.error == failed[0][1]
        assert not ends.active and not sched.has_unfinished()
        assert kv.num_free_blocks == kv.num_blocks
        kv.pool.check_invariants()
        assert not os.path.exists(h.address)
        outbox.close()
    finally:
        ends.close()
        connectors.close()


# ---- the prefill side's sending ----------------------------------------------------------------
def test_decode_side_takes_sliding_groups_window_and_gives_the_rest_back(monkeypatch) -> None:
    """KV groups (one full, one sliding of W = 6) on the decode side: the handle asks for the
    plan's blocks (the full group's 10, the sliding group's 2 in the window of token 40),
    they land in those groups' tables, and once all arrived the sliding blocks before the
    window, never written, go back to the pool unpublished; the request runs."""
    from concurrent.futures import Future

    from chunkserve.disagg import remote
    from chunkserve.disagg.connectors import Connectors

    asks: list[dict] = []
    monkeypatch.setattr(remote, "_ask", lambda client, url, body: asks.append(body))

    class Http:
        client = None

        def run(self, _):
            return Future()

        def close(self):
            pass

    monkeypatch.setattr(remote, "_HttpLoop", Http)
    windows = (None, 6)

    class Worker:
        kv_group_windows = windows

        def __init__(self) -> None:
            self.written: list[int] = []

        def kv_block_layout(self):
            return LAYOUT, "float32"

        def write_kv_blocks(self, block_ids, blocks):
            assert len(block_ids) == blocks.shape[0]
            self.written += block_ids

    kv = KVCacheManager(40, 4, enable_prefix_caching=True, group_windows=windows)
    cfg = SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8, max_model_len=64, block_size=4)
    sched = Scheduler(cfg, kv, clock=lambda: 0.0)
    worker = Worker()
    connectors = Connectors("shm", "127.0.0.1", torch.device("cpu"))
    ends = remote.RemotePrefills(connectors, worker, sched, 4)
    r = remote_request("a", 41)  # 40 tokens asked for
    sched.add_request(r)
    try:
        assert ends.start(sched.admit_remote()) == []
        (body,) = asks
        h = KVHandle.from_dict(body["kv_transfer_params"]["send"])
        assert h.windows == windows and h.num_blocks == 12 and h.layout == LAYOUT
        tables = [list(t) for t in r.block_tables]
        assert all(len(t) == 11 for t in tables)  # the whole prompt, every group
        outbox = connectors.open_outbox(h)
        outbox.send(0, _blocks(12, 0))
        assert ends.poll() == []
        assert worker.written == [tables[g][i] for g, i in h.plan()]
        assert r.status == RequestStatus.RUNNING and r.num_computed_tokens == 40
        # Blocks 0-7 of the sliding group went back (never written), unpublished.
        assert r.block_tables[1][:8] == [0] * 8 and r.block_tables[1][8:] == tables[1][8:]
        assert all(kv.pool.ref_cnt[b] == 0 and kv.pool.block_hash[b] is None for b in tables[1][:8])
        assert all(kv.pool.block_hash[b] is not None for b in tables[0][:10] + tables[1][8:10])
        kv.pool.check_invariants()
        outbox.close()
    finally:
        ends.close()
        connectors.close()


class FakeKVWorker:
    """A worker whose KV cache holds each token's id in its slot (one layer, one head, one
    dimension), plus 1000 x its KV group: what a block sends is the tokens it was computed
    for, in the group it was computed for."""

    def __init__(self, block_size: int, windows: tuple[int | None, ...] = (None,)) -> None:
        self.bs = block_size
        self.store: dict[int, torch.Tensor] = {}
        self.kv_group_windows = windows

    def kv_block_layout(self):
        return (1, 2, self.bs, 1, 1), "float32"

    def execute(self, out) -> None:
        for c in out.chunks:
            r = c.request
            for pos in range(c.start, c.start + c.num_tokens):
                for g, table in enumerate(r.block_tables):
                    b = table[pos // self.bs]
                    assert b != 0, "a chunk's own blocks are live"
                    block = self.store.setdefault(b, torch.full((self.bs,), -1.0))
                    block[pos % self.bs] = float(r.token_ids[pos] + 1000 * g)

    def read_kv_blocks(self, block_ids: list[int]) -> torch.Tensor:
        blocks = [self.store[b].clone() for b in block_ids]
        kv = torch.stack(blocks).view(len(block_ids), 1, 1, self.bs, 1, 1)
        return kv.expand(-1, -1, 2, -1, -1, -1).contiguous()  # K and V alike


PRE_STEPS = 8


def test_prefill_side_sends_sliding_groups_only_their_window() -> None:
    """KV groups (one full, one sliding of W = 6): chunk by chunk the full group's every
    block goes, the sliding group's only the two in the window of token 40 (its blocks
    before were given back as the prompt advanced), each holding its group's tokens, in
    the plan's order."""
    from chunkserve.disagg.connectors import Connectors
    from chunkserve.disagg.sender import KVSender

    bs, n, windows = 4, 40, (None, 6)
    cfg = SchedulerConfig(max_num_batched_tokens=8, max_num_seqs=4, max_model_len=64, block_size=bs)
    kv = KVCacheManager(40, bs, group_windows=windows)
    sched = Scheduler(cfg, kv, clock=lambda: 0.0)
    worker = FakeKVWorker(bs, windows)
    connectors = Connectors("shm", "127.0.0.1", torch.device("cpu"))
    sender = KVSender(connectors, worker, bs)
    prompt = list(range(100, 100 + n))
    req = Request("send", prompt, SamplingParams(max_tokens=1), max_tokens=1)
    plan = transfer_plan(0, n, windows, bs)
    assert len(plan) == 12  # 10 full blocks, the sliding group's blocks 8 and 9
    layout = (1, 2, bs, 1, 1)
    h = KVHandle("shm", new_transfer_id(), "", 0, n, 12, layout, "float32", windows=windows)
    inbox, h = connectors.open_inbox(h, "http://decode")
    try:
        sched.add_request(req)
        sender.open(req, h.as_dict())
        given_back = 0
        while sched.has_unfinished():
            out = sched.schedule()
            given_back = max(given_back, req.block_tables[1].count(0))
            worker.execute(out)
            assert sender.after_execute(out) == []
            sched.update(out, {c.request.request_id: 5 for c in out.chunks if c.samples})
        assert given_back >= 6  # the sliding group gave blocks back while sending
        assert inbox.num_ready() == 12
        got = inbox.read(0, 12)[:, 0, 1].reshape(12, bs).tolist()
        want = [[float(t + 1000 * g) for t in prompt[i * bs : (i + 1) * bs]] for g, i in plan]
        assert got == want
        assert not sender._sending
        with pytest.raises(ValueError, match="windows"):  # a decode side of other groups
            other = KVHandle(**{**h.__dict__, "transfer_id": new_transfer_id()})
            sender.open(req, {**other.as_dict(), "windows": [None], "num_blocks": 10})
    finally:
        inbox.close()
        sender.close()
        connectors.close()


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_prefill_side_preemption_resends_only_unsent_blocks(prefix_caching: bool) -> None:
    """The sending request is preempted mid-prompt (an older decode needs its blocks): it
    recomputes from the start, and only the blocks it had not sent go, in order, once, each
    holding its tokens."""
    from chunkserve.disagg.connectors import Connectors
    from chunkserve.disagg.sender import KVSender

    bs, n = 4, 40  # 10 blocks to send
    cfg = SchedulerConfig(
        max_num_batched_tokens=8,
        max_num_seqs=4,
        max_model_len=64,
        block_size=bs,
        init_new_token_ratio=0.0,
        min_new_token_ratio=0.0,
    )
    kv = KVCacheManager(14, bs, enable_prefix_caching=prefix_caching)
    sched = Scheduler(cfg, kv, clock=lambda: 0.0)
    worker = FakeKVWorker(bs)
    connectors = Connectors("shm", "127.0.0.1", torch.device("cpu"))
    sender = KVSender(connectors, worker, bs)
    older = Request("older", [7] * 4, SamplingParams(max_tokens=40), max_tokens=40)
    sched.add_request(older)
    for _ in range(PRE_STEPS):  # it holds 3 full blocks: the rest just fits the prompt
        out = sched.schedule()
        sched.update(out, {"older": 5})
    prompt = list(range(100, 100 + n))
    req = Request("send", prompt, SamplingParams(max_tokens=1), max_tokens=1)
    h = KVHandle("shm", new_transfer_id(), "", 0, n, n // bs, (1, 2, bs, 1, 1), "float32")
    inbox, h = connectors.open_inbox(h, "http://decode")
    sent: list[tuple[int, int, int]] = []  # (first block, blocks, the request's preemptions)
    try:
        sched.add_request(req)
        sender.open(req, h.as_dict())
        outbox = sender._sending["send"].outbox
        real_send = outbox.send

        def send(start, blocks):
            sent.append((start, blocks.shape[0], req.metrics.num_preemptions))
            real_send(start, blocks)

        outbox.send = send
        for _ in range(200):
            if not sched.has_unfinished():
                break
            out = sched.schedule()
            worker.execute(out)
            assert sender.after_execute(out) == []
            sched.update(out, {c.request.request_id: 5 for c in out.chunks if c.samples})
            if req.is_finished and older.request_id in sched.requests:
                sched.abort_request("older")
        assert req.metrics.num_preemptions >= 1
        assert any(p == 0 for *_, p in sent) and any(p >= 1 for *_, p in sent)
        starts = [s for s, _, _ in sent]
        assert starts == sorted(set(starts))  # never a block again
        assert [s + k for s, k, _ in sent][:-1] == starts[1:]  # contiguous, in order
        assert sum(k for _, k, _ in sent) == n // bs and inbox.num_ready() == n // bs
        got = inbox.read(0, n // bs)[:, 0, 1].reshape(-1).tolist()
        assert got == [float(t) for t in prompt]
        assert not sender._sending  # the transfer ended with the prompt
        assert kv.num_free_blocks == kv.num_blocks
    finally:
        inbox.close()
        sender.close()
        connectors.close()


def test_prefill_side_send_failing_midway_fails_the_request_alone() -> None:
    """The decode side went away after two blocks: the sending request fails with the
    connector's error and its outbox closes; the next chunks send nothing."""
    from chunkserve.disagg.connectors import Connectors
    from chunkserve.disagg.sender import KVSender

    bs, n = 4, 24
    cfg = SchedulerConfig(max_num_batched_tokens=8, max_num_seqs=4, max_model_len=64, block_size=bs)
    kv = KVCacheManager(20, bs)
    sched = Scheduler(cfg, kv, clock=lambda: 0.0)
    worker = FakeKVWorker(bs)
    connectors = Connectors("shm", "127.0.0.1", torch.device("cpu"))
    sender = KVSender(connectors, worker, bs)
    req = Request("send", list(range(100, 100 + n)), SamplingParams(max_tokens=1), max_tokens=1)
    h = KVHandle("shm", new_transfer_id(), "", 0, n, n // bs, (1, 2, bs, 1, 1), "float32")
    inbox, h = connectors.open_inbox(h, "http://decode")
    try:
        sched.add_request(req)
        sender.open(req, h.as_dict())
        failures = []
        while sched.has_unfinished():
            out = sched.schedule()
            worker.execute(out)
            if inbox.num_ready() == 2:
                inbox.close()  # the decode side gives up: its file is gone
                sender._sending["send"].outbox.send = _gone
            failed = sender.after_execute(out)
            failures += failed
            if failed:  # what the engine core does with them
                sched.fail_requests([r for r, _ in failed], "KV transfer")
            if not req.is_finished:
                sched.update(out, {c.request.request_id: 5 for c in out.chunks if c.samples})
        assert [(r.request_id, why) for r, why in failures] == [
            ("send", "KV transfer: the decode side went away")
        ]
        assert req.status == RequestStatus.FINISHED_ERROR
        assert not sender._sending and kv.num_free_blocks == kv.num_blocks
    finally:
        inbox.close()
        sender.close()
        connectors.close()


def _gone(start, blocks) -> None:
    raise TransferError("the decode side went away")


# ---- served: one prefill and one decode instance behind the router --------------------------
class Router(ChunkserveProcess):
    def __init__(self, *args: str) -> None:
        super().__init__("router", *args, health="/v1/models", timeout_s=60)


class Deployment:
    def __init__(self) -> None:
        common = ("--enable-prefix-caching", "--num-threads", "1")
        self.prefill = Server("--disaggregation-mode", "prefill", *common)
        self.decode = Server("--disaggregation-mode", "decode", *common)
        self.router = Router("--prefill", self.prefill.base, "--decode", self.decode.base)

    def stop(self) -> None:
        self.router.stop()
        self.decode.stop()
        self.prefill.stop()


@pytest.fixture(scope="module")
def pd() -> Iterator[Deployment]:
    d = Deployment()
    yield d
    d.stop()


LONG = " ".join(NATURAL_PROMPTS) * 3  # ~180 tokens: three 64-token chunks on the prefill side


def _post(base: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(base + path, json={"model": MODEL, **body}, timeout=120)


def _stream_text(base: str, path: str, body: dict) -> str:
    import json

    parts = []
    body = {"model": MODEL, **body, "stream": True}
    with httpx.stream("POST", base + path, json=body, timeout=120) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            assert "error" not in event, event
            for choice in event["choices"]:
                parts.append(choice.get("text") or choice.get("delta", {}).get("content") or "")
    return "".join(parts)


def _text(resp: httpx.Response) -> str:
    assert resp.status_code == 200, resp.text
    choice = resp.json()["choices"][0]
    return choice.get("text") or choice["message"]["content"]


def test_outputs_identical_to_colocated(pd: Deployment) -> None:
    """Through the router the prompt is computed on the prefill instance; sent straight to
    the decode instance (no kv_transfer_params) the same request runs colocated there."""
    before = pd.prefill.metrics()
    for prompt in [NATURAL_PROMPTS[0], LONG]:
        body = {"prompt": prompt, "max_tokens": 8, "temperature": 0.0}
        local = _text(_post(pd.decode.base, "/v1/completions", body))
        assert _text(_post(pd.router.base, "/v1/completions", body)) == local
        assert _stream_text(pd.router.base, "/v1/completions", body) == local
    chat = {
        "messages": [{"role": "user", "content": NATURAL_PROMPTS[1]}],
        "max_tokens": 8,
        "temperature": 0.0,
    }
    local = _text(_post(pd.decode.base, "/v1/chat/completions", chat))
    assert _text(_post(pd.router.base, "/v1/chat/completions", chat)) == local
    assert _stream_text(pd.router.base, "/v1/chat/completions", chat) == local
    after = pd.prefill.metrics()
    # The prefill instance did the prompts (the long one in several chunks: budget 64).
    sent = after["chunkserve:kv_transfer_bytes_count"] - before.get(
        "chunkserve:kv_transfer_bytes_count", 0
    )
    assert sent == 6
    steps = after["chunkserve:iteration_tokens_total_count"]
    assert steps - before["chunkserve:iteration_tokens_total_count"] > 6
    for side in (pd.prefill, pd.decode):
        m = side.wait_idle()
        assert m["chunkserve:kv_cache_blocks_used"] == 0


def test_cached_prefix_on_the_decode_side_is_not_sent_again(pd: Deployment) -> None:
    fresh = " ".join(reversed(LONG.split()))  # no other test sent it: nothing cached yet
    body = {"prompt": fresh + " The end.", "max_tokens": 4, "temperature": 0.0}
    m0 = pd.decode.metrics()
    _text(_post(pd.router.base, "/v1/completions", body))
    m1 = pd.decode.metrics()
    first = m1["chunkserve:kv_transfer_bytes_sum"] - m0.get("chunkserve:kv_transfer_bytes_sum", 0)
    body["prompt"] = fresh + " Another ending, a little longer."
    _text(_post(pd.router.base, "/v1/completions", body))
    m2 = pd.decode.metrics()
    second = m2["chunkserve:kv_transfer_bytes_sum"] - m1["chunkserve:kv_transfer_bytes_sum"]
    block_bytes = 30 * 2 * 16 * 3 * 64 * 4  # SmolLM2's layers, K/V, a block, fp32
    assert first >= 8 * block_bytes  # the whole ~180-token prompt
    assert 0 < second <= 3 * block_bytes  # only the blocks after the shared prefix
    assert m2["chunkserve:prefix_cache_hits_total"] > m1["chunkserve:prefix_cache_hits_total"]


@pytest.mark.parametrize("when", ["prefill", "decode"])
def test_client_disconnect_frees_blocks_on_both_sides(pd: Deployment, when: str) -> None:
    """The client leaves while the prompt is computed on the prefill instance, or while
    tokens stream: the router drops the decode instance's stream, which aborts the request
    and its call to the prefill instance; no block stays held on either side."""
    body = {
        "model": MODEL,
        "prompt": LONG * 2 if when == "prefill" else NATURAL_PROMPTS[2],
        # Far more than a machine makes while the router and the decode instance notice.
        "max_tokens": 100 if when == "prefill" else 400,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
    }
    got = threading.Event()
    key = "chunkserve:request_success_total{%s}"
    before = pd.decode.metrics()
    aborts, before_length = before.get(key % "abort", 0), before.get(key % "length", 0)

    def client() -> None:
        with (
            httpx.Client(timeout=60) as c,
            c.stream("POST", pd.router.base + "/v1/completions", json=body) as resp,
        ):
            for line in resp.iter_lines():
                if line.startswith("data:"):
                    got.set()
                    return

    t = threading.Thread(target=client, daemon=True)
    if when == "prefill":
        # The prefill instance's core is paused before the request comes: the client leaves
        # while its prompt is on the prefill instance, however fast the machine computes it.
        with PausedCores(pd.prefill):
            content = json.dumps({**body, "stream": False}).encode()
            host, port = pd.router.base.removeprefix("http://").split(":")
            conn = socket.create_connection((host, int(port)), timeout=60)
            conn.sendall(
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                b"\r\nContent-Length: %d\r\n\r\n%s" % (len(content), content)
            )
            wait_for(
                lambda: pd.decode.metrics()["chunkserve:num_requests_waiting_for_kv"] == 1,
                "the decode instance waits for the prefill instance's KV",
            )
            conn.close()
            # The router drops the decode instance's stream, the decode instance aborts.
            wait_for(
                lambda: pd.decode.metrics().get(key % "abort", 0) == aborts + 1,
                "the decode instance aborts the request",
            )
    else:
        t.start()
        assert got.wait(60)
        t.join(10)
    for side in (pd.prefill, pd.decode):
        m = side.wait_idle(timeout=30)
        assert m["chunkserve:kv_cache_blocks_used"] == 0
        assert m["chunkserve:num_requests_running"] == 0
    m = pd.decode.metrics()
    assert m["chunkserve:num_requests_waiting_for_kv"] == 0
    assert m.get(key % "abort", 0) == aborts + 1  # this request, not an earlier test's
    assert m.get(key % "length", 0) == before_length


def test_bad_kv_transfer_params_are_refused_at_the_edge(pd: Deployment) -> None:
    body = {"prompt": "hi", "max_tokens": 2}
    r = _post(pd.router.base, "/v1/completions", {**body, "kv_transfer_params": {"x": 1}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "kv_transfer_params"
    r = _post(
        pd.prefill.base,
        "/v1/completions",
        {**body, "kv_transfer_params": {"prefill_url": "http://x"}},
    )
    assert r.status_code == 400 and "prefill_url" in r.json()["error"]["message"]
    h = handle(1).as_dict()
    r = _post(pd.decode.base, "/v1/completions", {**body, "kv_transfer_params": {"send": h}})
    assert r.status_code == 400 and "send" in r.json()["error"]["message"]
    # A handle naming a file that is not there: the prefill instance refuses the request.
    h = {**handle(1).as_dict(), "layout": [30, 2, 16, 3, 64], "num_tokens": 1}
    h["address"] = shm_path(h["transfer_id"])
    r = _post(pd.prefill.base, "/v1/completions", {**body, "kv_transfer_params": {"send": h}})
    assert r.status_code == 400, r.text  # the client's handle, not this instance, is wrong
    assert r.json()["error"]["param"] == "kv_transfer_params.send.address", r.text
    assert httpx.get(pd.prefill.base + "/health").status_code == 200


def test_torch_connector_served_end_to_end(pd: Deployment) -> None:
    """A decode instance receiving KV over torch.distributed point-to-point (gloo on
    loopback) from the prefill instance: through a router, streamed and not, the same greedy
    tokens as the decode instance computing the prompt itself; the KV did arrive over the
    connector, and no block stays held on either side."""
    decode = Server(
        "--disaggregation-mode",
        "decode",
        "--kv-connector",
        "torch",
        "--kv-transfer-host",
        "127.0.0.1",
        "--enable-prefix-caching",
        "--num-threads",
        "1",
    )
    router = None
    block_bytes = 30 * 2 * 16 * 3 * 64 * 4  # SmolLM2's layers, K/V, a block, fp32
    try:
        router = Router("--prefill", pd.prefill.base, "--decode", decode.base)
        for prompt in [NATURAL_PROMPTS[0], LONG]:
            body = {"prompt": prompt, "max_tokens": 8, "temperature": 0.0}
            local = _text(_post(decode.base, "/v1/completions", body))
            # The reference must not lend its cached blocks to the transfer under test.
            assert httpx.post(decode.base + "/reset_prefix_cache", timeout=30).status_code == 200
            m0 = decode.metrics()
            assert _text(_post(router.base, "/v1/completions", body)) == local
            m1 = decode.metrics()
            sent = m1["chunkserve:kv_transfer_bytes_sum"] - m0.get(
                "chunkserve:kv_transfer_bytes_sum", 0
            )
            n = len(httpx.post(decode.base + "/tokenize", json={"prompt": prompt}).json()["tokens"])
            assert sent == -(-(n - 1) // 16) * block_bytes  # the whole prompt came over torch
            assert _stream_text(router.base, "/v1/completions", body) == local
        m = decode.wait_idle()
        assert m["chunkserve:kv_cache_blocks_used"] == 0
        assert m["chunkserve:num_requests_waiting_for_kv"] == 0
        assert pd.prefill.wait_idle()["chunkserve:kv_cache_blocks_used"] == 0
    finally:
        if router is not None:
            router.stop()
        decode.stop()


@pytest.fixture
def doomed() -> Iterator[Deployment]:
    """A deployment of its own for a test that kills its instances (the shared one serves
    the module's other tests, whatever order they run in)."""
    d = Deployment()
    yield d
    d.stop()


def test_dead_instances_give_clean_errors(doomed: Deployment) -> None:
    pd = doomed
    body = {"prompt": NATURAL_PROMPTS[3], "max_tokens": 4, "temperature": 0.0}
    pd.prefill.proc.kill()
    pd.prefill.proc.wait(10)
    r = _post(pd.router.base, "/v1/completions", body)
    assert r.status_code >= 500 and "prefill instance" in r.json()["error"]["message"]
    m = pd.decode.wait_idle()
    assert m["chunkserve:kv_cache_blocks_used"] == 0
    assert httpx.get(pd.decode.base + "/health").status_code == 200  # it serves on
    pd.decode.proc.kill()
    pd.decode.proc.wait(10)
    r = _post(pd.router.base, "/v1/completions", body)
    assert r.status_code == 502 and r.json()["error"]["message"]
