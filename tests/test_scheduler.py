"""The scheduler alone, with a fake runner that records every step's chunks (no torch)."""

from __future__ import annotations

import itertools
import random

import pytest

from chunkserve.config import SchedulerConfig
from chunkserve.scheduling.kv_cache import KVCacheManager
from chunkserve.scheduling.request import Request, RequestStatus
from chunkserve.scheduling.sampling_params import SamplingParams
from chunkserve.scheduling.scheduler import Scheduler, SchedulerOutput

EOS = 2


class FakeRunner:
    """Samples token 5 for every row (never EOS) and records [(id, start, n), ...] per step."""

    def __init__(self) -> None:
        self.steps: list[list[tuple[str, int, int]]] = []
        self.kinds: list[str] = []

    def __call__(self, out: SchedulerOutput) -> dict[str, int]:
        self.steps.append([(c.request.request_id, c.start, c.num_tokens) for c in out.chunks])
        self.kinds.append(out.kind)
        return {c.request.request_id: 5 for c in out.chunks if c.samples}

    def chunks_of(self, request_id: str) -> list[tuple[int, int]]:
        return [(s, n) for step in self.steps for rid, s, n in step if rid == request_id]


def make_request(
    rid: str, prompt_len: int, max_tokens: int = 4, arrival: float = 0.0, priority: int = 0
) -> Request:
    return Request(
        rid,
        list(range(10, 10 + prompt_len)),
        SamplingParams(max_tokens=max_tokens, temperature=0.0),
        max_tokens=max_tokens,
        eos_token_ids=[EOS],
        arrival_time=arrival,
        priority=priority,
    )


def make_scheduler(
    budget: int = 64,
    num_blocks: int = 1000,
    block_size: int = 4,
    max_num_seqs: int = 16,
    chunked: bool = True,
    max_model_len: int = 4096,
    policy: str = "fcfs",
    new_token_ratio: float | None = None,
    prefill_order: str = "shortest",
) -> Scheduler:
    config = SchedulerConfig(
        max_num_batched_tokens=budget,
        max_num_seqs=max_num_seqs,
        max_model_len=max_model_len,
        block_size=block_size,
        enable_chunked_prefill=chunked,
        policy=policy,
        prefill_order=prefill_order,
        **(
            {}
            if new_token_ratio is None
            else {"init_new_token_ratio": new_token_ratio, "min_new_token_ratio": new_token_ratio}
        ),
    )
    return Scheduler(config, KVCacheManager(num_blocks, block_size), clock=lambda: 0.0)


def run(
    sched: Scheduler, runner: FakeRunner, max_steps: int = 10_000, on_step=None
) -> list[SchedulerOutput]:
    outs = []
    while sched.has_unfinished():
        assert len(outs) < max_steps, "scheduler made no progress"
        out = sched.schedule()
        outs.append(out)
        sched.update(out, runner(out))
        if on_step:
            on_step(len(outs), out)
    return outs


def test_exact_chunk_sequence_block_aligned() -> None:
    # Budget 10, blocks of 4: chunks end on block boundaries (8, then 16), the last chunk
    # ends the prompt wherever it falls.
    sched = make_scheduler(budget=10, block_size=4, max_num_seqs=2)
    runner = FakeRunner()
    sched.add_request(make_request("a", 19, max_tokens=2))
    run(sched, runner)
    assert runner.chunks_of("a") == [(0, 8), (8, 8), (16, 3), (19, 1)]


def test_decodes_first_then_partial_prefill_then_waiting_by_arrival() -> None:
    sched = make_scheduler(budget=16, block_size=4, max_num_seqs=4, prefill_order="arrival")
    runner = FakeRunner()
    sched.add_request(make_request("short", 3, max_tokens=10, arrival=0.0))
    out = sched.schedule()
    sched.update(out, runner(out))  # "short" prefilled, now decoding
    sched.add_request(make_request("long", 40, max_tokens=2, arrival=1.0))
    sched.add_request(make_request("later", 5, max_tokens=2, arrival=2.0))
    out = sched.schedule()
    sched.update(out, runner(out))
    # Decode of "short" (1 token) first; 15 tokens left: "long" gets 12 (cut back to a block
    # boundary), "later" the last 3 (no boundary in reach, so not cut).
    assert runner.steps[-1] == [("long", 0, 12), ("later", 0, 3), ("short", 3, 1)]
    assert out.kind == "mixed"
    out = sched.schedule()
    sched.update(out, runner(out))
    # Decode, then the prefills in progress in arrival order: "long" 15 -> 12 (boundary at
    # 24), "later" its last 2 tokens.
    assert runner.steps[-1] == [("long", 12, 12), ("later", 3, 2), ("short", 4, 1)]


def test_budget_never_exceeded_and_every_decode_served() -> None:
    rng = random.Random(0)
    sched = make_scheduler(budget=32, block_size=4, max_num_seqs=8, num_blocks=10_000)
    runner = FakeRunner()
    for i in range(30):
        sched.add_request(
            make_request(f"r{i}", rng.randint(1, 150), rng.randint(1, 20), arrival=float(i))
        )

    def check(step: int, out: SchedulerOutput) -> None:
        assert out.num_batched_tokens <= 32
        assert out.num_running <= 8

    decoding_before: set[str] = set()
    outs = []
    while sched.has_unfinished():
        decoding_before = {r.request_id for r in sched.running if not r.is_prefilling}
        out = sched.schedule()
        check(len(outs), out)
        served = {c.request.request_id for c in out.decodes}
        assert decoding_before <= served, "a running decode was skipped"
        outs.append(out)
        sched.update(out, runner(out))
    assert sched.kv.num_free_blocks == sched.kv.num_blocks
    sched.kv.pool.check_invariants()


def test_unchunked_is_whole_prompt_and_stalls_decodes() -> None:
    sched = make_scheduler(budget=16, chunked=False, block_size=4)
    runner = FakeRunner()
    sched.add_request(make_request("a", 5, max_tokens=5, arrival=0.0))
    out = sched.schedule()
    sched.update(out, runner(out))
    sched.add_request(make_request("b", 100, max_tokens=2, arrival=1.0))
    out = sched.schedule()
    sched.update(out, runner(out))
    # The whole 100-token prompt runs alone (over the budget: the first prompt is whole),
    # and the decode of "a" waits: the stall.
    assert runner.steps[-1] == [("b", 0, 100)]
    assert out.kind == "prefill"
    run(sched, runner)
    assert all(k in ("prefill", "decode") for k in runner.kinds)


def test_chunked_steps_with_long_prompt_keep_decoding() -> None:
    sched = make_scheduler(budget=8, block_size=4, max_num_seqs=4)
    runner = FakeRunner()
    sched.add_request(make_request("a", 2, max_tokens=30, arrival=0.0))
    out = sched.schedule()
    sched.update(out, runner(out))
    sched.add_request(make_request("b", 60, max_tokens=2, arrival=1.0))
    run(sched, runner)
    a_steps = [i for i, step in enumerate(runner.steps) if any(r == "a" for r, _, _ in step)]
    # "a" decodes in every step until it finishes: no gap while "b" prefills.
    assert a_steps == list(range(a_steps[0], a_steps[-1] + 1))
    assert runner.chunks_of("b")[:3] == [(0, 4), (4, 4), (8, 4)]


def test_preemption_newest_first_and_recompute() -> None:
    # 6 blocks of 4 tokens = 24 slots; two requests growing to 16 tokens each cannot both fit.
    # Admission reserves prompts only (ratio 0), so both start and the pool runs dry.
    sched = make_scheduler(
        budget=64, block_size=4, num_blocks=6, max_num_seqs=4, new_token_ratio=0.0
    )
    runner = FakeRunner()
    a = make_request("a", 8, max_tokens=8, arrival=0.0)
    b = make_request("b", 8, max_tokens=8, arrival=1.0)
    sched.add_request(a)
    sched.add_request(b)
    preempted: list[str] = []
    run(sched, runner, on_step=lambda i, out: preempted.extend(r.request_id for r in out.preempted))
    assert preempted and set(preempted) == {"b"}  # the newest is the victim
    assert a.num_output_tokens == 8 and b.num_output_tokens == 8
    assert b.metrics.num_preemptions >= 1
    # After preemption "b" recomputes prompt + its outputs so far from position 0.
    b_chunks = runner.chunks_of("b")
    restarts = [s for s, n in b_chunks if s == 0]
    assert len(restarts) == 1 + b.metrics.num_preemptions
    assert sched.kv.num_free_blocks == 6
    sched.kv.pool.check_invariants()


def test_admission_reserves_room_for_running_outputs() -> None:
    # 12 blocks of 4 = 48 slots. "a" (8 prompt + 30 outputs) runs; "b" needs 38 slots too,
    # which do not fit beside a's reservation (ratio 1: all outputs reserved), so it waits
    # instead of being admitted and preempted later.
    sched = make_scheduler(
        budget=64, block_size=4, num_blocks=12, max_num_seqs=4, new_token_ratio=1.0
    )
    runner = FakeRunner()
    a = make_request("a", 8, max_tokens=30, arrival=0.0)
    b = make_request("b", 8, max_tokens=30, arrival=1.0)
    sched.add_request(a)
    sched.add_request(b)
    outs = run(sched, runner)
    assert sum(len(o.preempted) for o in outs) == 0
    assert runner.chunks_of("b")[0][0] == 0
    first_b = next(i for i, st in enumerate(runner.steps) if any(r == "b" for r, _, _ in st))
    assert first_b > 0  # b waited for room rather than starting beside a at once
    assert a.num_output_tokens == 30 and b.num_output_tokens == 30


def test_scheduler_trusts_the_edge_and_asserts_what_it_checked() -> None:
    """Lengths and ids are validated once, by ``InputProcessor.check`` (tests there and in
    the server's); the scheduler asserts them."""
    sched = make_scheduler(block_size=4, num_blocks=3, max_model_len=1000)
    with pytest.raises(AssertionError, match="cannot ever fit"):
        sched.add_request(make_request("big", 20, max_tokens=4))
    sched = make_scheduler(max_model_len=32)
    with pytest.raises(AssertionError, match="max_model_len"):
        sched.add_request(make_request("x", 30, max_tokens=5))
    sched.add_request(make_request("x", 3))
    with pytest.raises(AssertionError, match="in use"):
        sched.add_request(make_request("x", 3))
    assert sched.num_waiting == 1


def test_no_request_starved_under_load() -> None:
    # A stream of short requests must not starve an earlier long one (FCFS head of line).
    sched = make_scheduler(budget=16, block_size=4, max_num_seqs=4, num_blocks=40)
    runner = FakeRunner()
    added = [make_request("long", 100, max_tokens=3, arrival=0.0)]
    sched.add_request(added[0])
    step, long_done = 0, None
    while sched.has_unfinished() and step < 500:
        if step < 200 and step % 2 == 0:
            added.append(make_request(f"s{step}", 6, max_tokens=3, arrival=1.0 + step))
            sched.add_request(added[-1])
        out = sched.schedule()
        sched.update(out, runner(out))
        step += 1
        if long_done is None and added[0].is_finished:
            long_done = step
    assert not sched.has_unfinished()
    # The long one finished while shorts still arrived (not after the stream dried up),
    # and every request got all its tokens.
    assert long_done is not None and long_done < 200, long_done
    assert len(added) == 101
    assert all(r.num_output_tokens == 3 for r in added), [
        (r.request_id, r.num_output_tokens) for r in added if r.num_output_tokens != 3
    ]


def test_abort_frees_blocks_in_any_state() -> None:
    sched = make_scheduler(budget=8, block_size=4, max_num_seqs=4)
    runner = FakeRunner()
    for i, n in enumerate((30, 3, 12)):
        sched.add_request(make_request(f"r{i}", n, max_tokens=5, arrival=float(i)))
    out = sched.schedule()
    sched.update(out, runner(out))
    for rid in ("r0", "r1", "r2"):
        req = sched.abort_request(rid)
        assert req is not None and req.status == RequestStatus.FINISHED_ABORTED
    assert not sched.has_unfinished()
    assert sched.kv.num_free_blocks == sched.kv.num_blocks
    assert sched.abort_request("r0") is None


def test_max_num_seqs_limits_admission() -> None:
    sched = make_scheduler(budget=64, max_num_seqs=2)
    runner = FakeRunner()
    for i in range(5):
        sched.add_request(make_request(f"r{i}", 4, arrival=float(i)))
    outs = run(sched, runner)
    assert max(o.num_running for o in outs) <= 2


def test_config_rejects_budget_below_max_num_seqs() -> None:
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        SchedulerConfig(max_num_batched_tokens=8, max_num_seqs=16, max_model_len=64, block_size=4)


# ---- priorities ------------------------------------------------------------------------------
def test_priority_admission_order() -> None:
    sched = make_scheduler(budget=64, max_num_seqs=1, policy="priority")
    runner = FakeRunner()
    for rid, prio, arrival in (
        ("low", 5, 0.0),
        ("high", 0, 1.0),
        ("mid", 2, 2.0),
        ("high2", 0, 3.0),
    ):
        sched.add_request(make_request(rid, 4, max_tokens=2, arrival=arrival, priority=prio))
    run(sched, runner)
    first_step = {}
    for i, step in enumerate(runner.steps):
        for rid, _, _ in step:
            first_step.setdefault(rid, i)
    assert sorted(first_step, key=first_step.get) == ["high", "high2", "mid", "low"]


def test_fcfs_ignores_priority() -> None:
    sched = make_scheduler(budget=64, max_num_seqs=1)
    runner = FakeRunner()
    sched.add_request(make_request("a", 4, max_tokens=2, arrival=0.0, priority=9))
    sched.add_request(make_request("b", 4, max_tokens=2, arrival=1.0, priority=0))
    run(sched, runner)
    assert runner.steps[0][0][0] == "a"


def test_priority_preempts_least_urgent_and_keeps_arrival_order() -> None:
    # 8 blocks of 4 = 32 slots. Three running requests grow until the pool runs dry; the
    # least urgent (highest priority value) is preempted first, whatever its arrival.
    sched = make_scheduler(
        budget=64,
        block_size=4,
        num_blocks=8,
        max_num_seqs=4,
        policy="priority",
        new_token_ratio=0.0,
    )
    runner = FakeRunner()
    reqs = [
        make_request("urgent", 4, max_tokens=10, arrival=2.0, priority=0),
        make_request("lazy", 4, max_tokens=10, arrival=0.0, priority=9),
        make_request("normal", 4, max_tokens=10, arrival=1.0, priority=5),
    ]
    for r in reqs:
        sched.add_request(r)
    preempted: list[str] = []
    run(sched, runner, on_step=lambda i, out: preempted.extend(r.request_id for r in out.preempted))
    assert preempted and preempted[0] == "lazy"
    assert "urgent" not in preempted
    assert all(r.num_output_tokens == 10 for r in reqs)
    assert sched.kv.num_free_blocks == sched.kv.num_blocks


def test_preempted_request_keeps_its_place_by_arrival() -> None:
    sched = make_scheduler(
        budget=64, block_size=4, num_blocks=6, max_num_seqs=4, new_token_ratio=0.0
    )
    a = make_request("a", 8, max_tokens=8, arrival=0.0)
    b = make_request("b", 8, max_tokens=8, arrival=1.0)
    sched.add_request(a)
    sched.add_request(b)
    runner = FakeRunner()
    while not any(r.status == RequestStatus.PREEMPTED for r in (a, b)):
        out = sched.schedule()
        sched.update(out, runner(out))
    late = make_request("late", 4, max_tokens=2, arrival=5.0)
    sched.add_request(late)
    # The preempted "b" (arrival 1.0) is ahead of "late" (arrival 5.0) in the queue.
    assert [r.request_id for r in sched.waiting] == ["b", "late"]


def test_urgent_waiting_request_preempts_less_urgent_running() -> None:
    sched = make_scheduler(
        budget=64,
        block_size=4,
        num_blocks=6,
        max_num_seqs=4,
        policy="priority",
        new_token_ratio=0.0,
    )
    runner = FakeRunner()
    batch = make_request("batch", 16, max_tokens=8, arrival=0.0, priority=10)
    sched.add_request(batch)
    out = sched.schedule()
    sched.update(out, runner(out))
    vip = make_request("vip", 12, max_tokens=2, arrival=1.0, priority=0)
    sched.add_request(vip)
    out = sched.schedule()  # vip needs 3 blocks, 1 free: the batch job makes room
    assert [r.request_id for r in out.preempted] == ["batch"]
    assert [c.request.request_id for c in out.prefills] == ["vip"]


# ---- fairness across long prefills -------------------------------------------------------------
def fair_scheduler(prefill_order: str = "shortest", **kw) -> Scheduler:
    config = SchedulerConfig(
        max_num_batched_tokens=64,
        max_num_seqs=16,
        max_model_len=4096,
        block_size=4,
        prefill_order=prefill_order,
        **kw,
    )
    return Scheduler(config, KVCacheManager(2000, 4), clock=lambda: 0.0)


def test_by_arrival_without_limits_short_requests_queue_behind_long_ones() -> None:
    sched = fair_scheduler(prefill_order="arrival")
    runner = FakeRunner()
    for i in range(3):
        sched.add_request(make_request(f"long{i}", 500, max_tokens=1, arrival=float(i)))
    sched.add_request(make_request("short", 10, max_tokens=1, arrival=9.0))
    run(sched, runner)
    first = next(i for i, st in enumerate(runner.steps) if any(r == "short" for r, *_ in st))
    assert first >= 3 * 500 // 64  # after all three long prompts


def test_long_limit_lets_short_requests_start() -> None:
    sched = fair_scheduler(max_long_partial_prefills=1, long_prefill_token_threshold=32)
    runner = FakeRunner()
    for i in range(3):
        sched.add_request(make_request(f"long{i}", 500, max_tokens=1, arrival=float(i)))
    sched.add_request(make_request("short", 10, max_tokens=1, arrival=9.0))
    out = sched.schedule()
    sched.update(out, runner(out))
    # One long prompt, capped at the threshold in the first pass; the other long ones are
    # skipped; the short one starts in the first step; the leftover budget then goes back
    # to the long prompt (cut to a block boundary: 32 + 20 = 52).
    assert sorted(runner.steps[0]) == [("long0", 0, 52), ("short", 0, 10)]
    run(sched, runner)
    long_partial_per_step = [
        sum(1 for r, s, n in step if r.startswith("long") and s + n < 500) for step in runner.steps
    ]
    assert max(long_partial_per_step) <= 1


def test_max_num_partial_prefills_bounds_concurrent_prefills() -> None:
    sched = fair_scheduler(
        prefill_order="arrival", max_num_partial_prefills=2, long_prefill_token_threshold=16
    )
    runner = FakeRunner()
    for i in range(5):
        sched.add_request(make_request(f"r{i}", 100, max_tokens=1, arrival=float(i)))
    outs = run(sched, runner)
    for out in outs:
        assert len(out.prefills) <= 2
    # Capped at 16 in the first pass, the two prompts then share the leftover budget.
    assert runner.steps[0] == [("r0", 0, 48), ("r1", 0, 16)]


# ---- shortest-first prefill (the default prefill_order) -----------------------------------------
def test_short_prompt_goes_before_a_long_prefill_in_progress() -> None:
    sched = make_scheduler(budget=24, block_size=4, max_num_seqs=8)
    runner = FakeRunner()
    sched.add_request(make_request("long", 200, max_tokens=2, arrival=0.0))
    for _ in range(3):
        out = sched.schedule()
        sched.update(out, runner(out))
    sched.add_request(make_request("short", 10, max_tokens=2, arrival=1.0))
    out = sched.schedule()
    sched.update(out, runner(out))
    # The short prompt whole first; the rest of the budget to the long one (block-aligned).
    assert runner.steps[-1] == [("short", 0, 10), ("long", 72, 12)]


def test_prefill_in_progress_moves_at_least_every_other_step() -> None:
    """A new short prompt every step takes the budget first, yet the long prompt in progress
    advances at least every other step (one block when it got nothing the step before)."""
    sched = make_scheduler(budget=12, block_size=4, max_num_seqs=12, num_blocks=4000)
    runner = FakeRunner()
    sched.add_request(make_request("long", 400, max_tokens=1, arrival=0.0))
    out = sched.schedule()
    sched.update(out, runner(out))
    for i in range(40):
        sched.add_request(make_request(f"s{i}", 12, max_tokens=1, arrival=1.0 + i))
        out = sched.schedule()
        sched.update(out, runner(out))
    moved = [any(r == "long" for r, _, _ in step) for step in runner.steps[1:]]
    assert all(a or b for a, b in itertools.pairwise(moved))
    assert sum(moved) < len(moved)  # the short ones did go first


def test_waiting_long_prompt_ages_past_fresh_short_ones() -> None:
    """Shortest-first with ageing: a long prompt that has waited long enough is admitted
    ahead of short prompts that just arrived."""
    from chunkserve.scheduling.scheduler import PREFILL_AGEING_S

    now = [0.0]
    config = SchedulerConfig(
        max_num_batched_tokens=16, max_num_seqs=16, max_model_len=4096, block_size=4
    )
    sched = Scheduler(config, KVCacheManager(4000, 4), clock=lambda: now[0])
    runner = FakeRunner()
    sched.add_request(make_request("long", 100, max_tokens=1, arrival=0.0))
    admitted_at = None
    for i in range(200):
        now[0] = float(i) * PREFILL_AGEING_S / 10
        sched.add_request(make_request(f"s{i}", 16, max_tokens=1, arrival=now[0]))
        out = sched.schedule()
        sched.update(out, runner(out))
        if any(c.request.request_id == "long" for c in out.prefills):
            admitted_at = i
            break
    # 100 tokens against 16: admitted once it has waited ~5 ageing periods, not never.
    assert admitted_at is not None and 30 <= admitted_at <= 80


def test_priority_comes_before_length() -> None:
    sched = make_scheduler(budget=8, block_size=4, max_num_seqs=8, policy="priority")
    runner = FakeRunner()
    sched.add_request(make_request("short-low", 4, max_tokens=1, arrival=0.0, priority=5))
    sched.add_request(make_request("long-high", 40, max_tokens=1, arrival=1.0, priority=0))
    out = sched.schedule()
    sched.update(out, runner(out))
    assert runner.steps[0] == [("long-high", 0, 8)]


# ---- new_token_ratio: admission's reserve for outputs still to come ---------------------------
def ratio_scheduler(num_blocks: int, init: float, floor: float, decay_steps: int) -> Scheduler:
    config = SchedulerConfig(
        max_num_batched_tokens=64,
        max_num_seqs=8,
        max_model_len=256,
        block_size=4,
        init_new_token_ratio=init,
        min_new_token_ratio=floor,
        new_token_ratio_decay_steps=decay_steps,
    )
    return Scheduler(config, KVCacheManager(num_blocks, 4), clock=lambda: 0.0)


def test_new_token_ratio_decays_linearly_to_its_minimum_on_time() -> None:
    sched = ratio_scheduler(1000, init=0.7, floor=0.15, decay_steps=5)
    runner = FakeRunner()
    sched.add_request(make_request("a", 8, max_tokens=20))
    assert sched.new_token_ratio == 0.7
    seen = []
    for _ in range(8):
        out = sched.schedule()
        sched.update(out, runner(out))
        seen.append(sched.new_token_ratio)
    assert seen[:4] == pytest.approx([0.59, 0.48, 0.37, 0.26])
    assert seen[4:] == [0.15] * 4  # the minimum, exactly, after decay_steps steps


def test_new_token_ratio_resets_on_preemption_and_decays_again() -> None:
    """Three requests outgrow a 6-block pool: every step with a preemption sets the ratio
    back to its start, and every other step lowers it by (init - min) / decay_steps down to
    the minimum."""
    init, floor, decay = 0.5, 0.1, 4
    sched = ratio_scheduler(6, init, floor, decay)
    runner = FakeRunner()
    for rid in "abc":
        sched.add_request(make_request(rid, 4, max_tokens=12))
    expected, since, steps = init, 0, []
    while sched.has_unfinished():
        assert len(steps) < 500
        assert sched.new_token_ratio == pytest.approx(expected)  # what this step admits by
        out = sched.schedule()
        sched.update(out, runner(out))
        since = 0 if out.preempted else since + 1
        expected = init - (init - floor) * min(since, decay) / decay
        steps.append((bool(out.preempted), sched.new_token_ratio))
        assert sched.new_token_ratio == pytest.approx(expected)
    preempted_at = [i for i, (p, _) in enumerate(steps) if p]
    assert preempted_at and steps[preempted_at[0]][1] == init
    # It reached the minimum before a preemption, then started over.
    assert any(r == floor for _, r in steps[: preempted_at[0]])
    assert sched.kv.num_free_blocks == 6


def test_new_token_ratio_reserve_holds_back_admission_until_it_decays() -> None:
    """The ratio is what admission reserves for a running request's outputs. In 10 blocks,
    "a" (4-token prompt, 32 outputs) runs; "b" (16 tokens) fits beside a reserve of 0.2 of
    a's outputs at once, never beside 0.8 of them, and, with the ratio decaying from 0.8 to
    0.2 over 10 steps, once it has decayed enough, while "a" still runs."""

    def b_admitted(init: float, floor: float) -> tuple[int, bool]:
        sched = ratio_scheduler(10, init=init, floor=floor, decay_steps=10)
        runner = FakeRunner()
        sched.add_request(make_request("a", 4, max_tokens=32))
        out = sched.schedule()
        sched.update(out, runner(out))
        sched.add_request(make_request("b", 16, max_tokens=1))
        for step in itertools.count(1):
            out = sched.schedule()
            if any(c.request.request_id == "b" for c in out.prefills):
                return step, "a" in sched.requests
            sched.update(out, runner(out))
            assert step < 100
        raise AssertionError

    assert b_admitted(0.2, 0.2) == (1, True)
    _, a_running = b_admitted(0.8, 0.8)
    assert not a_running  # only once "a" has finished
    step, a_running = b_admitted(0.8, 0.2)
    assert a_running and 1 < step <= 10


def test_view_is_what_a_budget_reads_before_a_step() -> None:
    """``Scheduler.view()``: the running decodes' lengths, the prompts in progress, the
    waiting ones, and those the next step would start whole, as the scheduler sees them."""
    sched = make_scheduler(budget=12, max_num_seqs=3)
    for rid, n in (("a", 4), ("b", 20), ("c", 6), ("d", 5)):
        sched.add_request(make_request(rid, n, max_tokens=8))
    out = sched.schedule()  # shortest first: a (4), d (5), then 3 tokens of c: 3 running
    sched.update(out, {c.request.request_id: 5 for c in out.chunks if c.samples})
    view = sched.view()
    assert view.decode_lens == [5, 6]  # a and d: prompt + one output
    assert [r.request_id for r in view.prefilling] == ["c"]
    assert [r.request_id for r in view.waiting] == ["b"]
    assert view.prefilled_last_step(sched.requests["c"])
    assert view.num_added == 4 and [r.request_id for r in view.arrivals] == list("abcd")
    assert view.waiting_starts(64) == []  # max_num_seqs: b cannot start
    sched.abort_request("a")  # c, in progress and shorter, still comes before b
    assert sched.view().waiting_starts(64) == []
    sched.abort_request("c")
    assert [r.request_id for r in sched.view().waiting_starts(64)] == ["b"]
