"""The ITL-target budget controller with a fake runner whose step time is a known function,
the cost model fit, and the simulator (the real scheduler against a cost model)."""

from __future__ import annotations

import itertools
import random

import pytest

from chunkserve.bench.datasets import BenchRequest
from chunkserve.bench.loadgen import summarize
from chunkserve.config import DEFAULT_LONG_STEP_SHARE, BudgetPolicy, SchedulerConfig
from chunkserve.scheduling.budget import IDLE_STEP_FACTOR, LONG_STEPS_BANKED, BudgetController
from chunkserve.scheduling.costmodel import (
    DEFAULT_PRIOR,
    FEATURES,
    CostModel,
    OnlineCostModel,
    StepShape,
    fit,
    relative_errors,
)
from chunkserve.scheduling.decode_groups import padded_decode_keys, split_decode_groups
from chunkserve.scheduling.kv_cache import KVCacheManager
from chunkserve.scheduling.request import Request
from chunkserve.scheduling.sampling_params import SamplingParams
from chunkserve.scheduling.scheduler import Scheduler
from chunkserve.tuning.simulate import parse_cost_scale, simulate

BLOCK = 16  # the schedulers below use 16-token blocks

# The "hardware": seconds = 25 ms + 0.9 ms/prefill token + 0.4 ms/decode + attention terms
# + 3 ms per 1k prefix keys a chunk reads + 4 ms for the LM head when the step samples
# + 0.3 ms per 1k padded keys the grouped decodes read.
TRUE = CostModel([0.025, 9e-4, 4e-4, 2e-4, 0.03, 5e-4, 3e-3, 4e-3, 3e-4, 0.0])
SLO = 0.120


def itl(slo: float, cap: int = 8192) -> BudgetPolicy:
    return BudgetPolicy("itl-target", cap, itl_slo_s=slo)


def adaptive(
    slowdown: float = 2.0, cap: int = 8192, long_step_share: float = DEFAULT_LONG_STEP_SHARE
) -> BudgetPolicy:
    return BudgetPolicy("adaptive", cap, decode_slowdown=slowdown, long_step_share=long_step_share)


def true_time(out) -> float:
    return TRUE.predict(StepShape.of(out))


def make_scheduler(num_blocks: int = 4000) -> Scheduler:
    config = SchedulerConfig(
        max_num_batched_tokens=8192,
        max_num_seqs=64,
        max_model_len=8192,
        block_size=16,
        long_prefill_token_threshold=0,
    )
    return Scheduler(config, KVCacheManager(num_blocks, 16), clock=lambda: 0.0)


def feed(sched: Scheduler, rng: random.Random, n_long: int, n_short: int) -> None:
    for i in range(n_long):
        p = [rng.randrange(100, 40000) for _ in range(3000)]
        sched.add_request(
            Request(f"L{i}-{rng.random()}", p, SamplingParams(max_tokens=8), max_tokens=8)
        )
    for i in range(n_short):
        p = [rng.randrange(100, 40000) for _ in range(30)]
        sched.add_request(
            Request(f"S{i}-{rng.random()}", p, SamplingParams(max_tokens=150), max_tokens=150)
        )


def drive(controller: BudgetController, steps: int, seed: int = 0, loop_s: float = 0.0):
    """Run the scheduler with budgets from the controller; step time = the true model, and
    ``loop_s`` more between steps (the engine loop's own work: the decodes wait for it)."""
    rng = random.Random(seed)
    sched = make_scheduler()
    feed(sched, rng, 6, 12)
    log = []
    for _ in range(steps):
        if not sched.has_unfinished():
            break
        decision = controller.decide(sched.view())
        out = sched.schedule(decision.token_budget)
        measured = true_time(out)
        controller.observe(out, measured, measured + loop_s if out.decodes else None)
        # The room the true model leaves for prefill beside these decodes, at the position
        # the controller planned for:
        decodes = [c.end for c in out.decodes]
        start = max((c.start for c in out.prefills), default=0)
        true_room = TRUE.max_prefill_tokens(decodes, start, SLO, 8192)
        pending = (
            sum(r.num_uncomputed_tokens for r in sched.running + sched.waiting if r.is_prefilling)
            + out.num_prefill_tokens
        )
        log.append((decision, out, measured, true_room, pending))
        sched.update(out, {c.request.request_id: 5 for c in out.chunks if c.samples})
    return log


def test_with_an_exact_profile_budgets_meet_the_target_and_use_the_room() -> None:
    model = OnlineCostModel(TRUE.weights, prior_weight=1e4)
    log = drive(BudgetController(model, itl(SLO)), steps=300)
    busy = [
        (d, out, t, room, pending)
        for d, out, t, room, pending in log
        if out.prefills and pending > room + 64
    ]
    assert len(busy) > 50
    for d, out, t, room, _ in busy:
        assert d.predicted_s <= SLO + 1e-9
        assert t <= SLO * 1.01
        # At least 80% of the room is used (chunks are cut to 16-token blocks).
        assert out.num_prefill_tokens >= 0.8 * room - 16


def test_without_a_profile_it_starts_small_and_converges() -> None:
    model = OnlineCostModel(DEFAULT_PRIOR, prior_weight=1.0)
    log = drive(BudgetController(model, itl(SLO)), steps=400)
    # A safe small start: the first budget is small and the learning steps stay in time.
    assert log[0][1].num_prefill_tokens <= 32
    assert all(t <= SLO * 1.05 for _, _, t, _, _ in log[:20])
    late = [
        (d, out, t, room, pending)
        for d, out, t, room, pending in log[60:]
        if out.prefills and pending > room + 64
    ]
    assert len(late) > 30
    over = [t for _, _, t, _, _ in late if t > SLO * 1.05]
    assert len(over) <= 0.05 * len(late)
    used = [out.num_prefill_tokens / max(room, 1) for _, out, _, room, _ in late]
    assert sorted(used)[len(used) // 2] >= 0.8


def test_stale_profile_is_corrected() -> None:
    stale = OnlineCostModel([w * 0.5 for w in TRUE.weights], prior_weight=1.0)  # 2x optimistic
    log = drive(BudgetController(stale, itl(SLO)), steps=300)
    late = [t for _, out, t, _, _ in log[80:] if out.prefills]
    assert late and sum(t > SLO * 1.05 for t in late) <= 0.05 * len(late)


def test_time_between_steps_is_planned_for() -> None:
    # 15 ms of loop work after each step: the gaps the decodes see (step + loop) stay within
    # the target, the step alone is still fit without it.
    model = OnlineCostModel(TRUE.weights, prior_weight=1e4)
    log = drive(BudgetController(model, itl(SLO)), steps=300, loop_s=0.015)
    busy = [(out, t) for _, out, t, room, pending in log[30:] if out.prefills and out.decodes]
    assert len(busy) > 50
    # (the first step with decodes after prefill-only ones may overshoot once: no gap seen yet)
    assert sum(t + 0.015 > SLO * 1.01 for _, t in busy) <= 1
    assert sorted(t for _, t in busy)[len(busy) // 2] >= 0.8 * (SLO - 0.015)
    assert model.weights == pytest.approx(TRUE.weights, rel=1e-3)


def test_an_overshoot_shrinks_the_next_plans_at_once() -> None:
    controller = BudgetController(OnlineCostModel(TRUE.weights, prior_weight=1e4), itl(SLO))
    sched = make_scheduler()
    feed(sched, random.Random(2), 1, 4)
    out = sched.schedule(256)
    for _ in range(40):
        controller.observe(out, true_time(out))
    assert controller.plan_target_s() == pytest.approx(SLO)
    controller.observe(out, 1.5 * true_time(out))  # one step 50% over its prediction
    for _ in range(4):
        assert controller.plan_target_s() == pytest.approx(SLO / 1.5, rel=1e-3)
        controller.observe(out, true_time(out))
    assert controller.plan_target_s() == pytest.approx(SLO)  # the window's quantile again


def test_decodes_alone_over_target_still_move_one_block_of_prefill(caplog) -> None:
    """The decodes alone exceed the ITL target: they all run, prefill still progresses one
    KV block per step (it never starves), and the step is counted and logged over target."""
    model = OnlineCostModel(TRUE.weights, prior_weight=1e4)
    controller = BudgetController(model, itl(0.030))  # below 25 ms + decode costs
    sched = make_scheduler()
    rng = random.Random(1)
    feed(sched, rng, 0, 20)
    for _ in range(2):  # all 20 shorts prefilled, now decoding
        out = sched.schedule(1024)
        sched.update(out, {c.request.request_id: 5 for c in out.chunks if c.samples})
    feed(sched, rng, 1, 0)
    with caplog.at_level("INFO", logger="chunkserve.budget"):
        for step in range(3):
            d = controller.decide(sched.view())
            assert d.over_target and d.prefill_room == 16
            out = sched.schedule(d.token_budget)
            assert len(out.decodes) == 20  # decodes never dropped
            assert [(c.start, c.num_tokens) for c in out.prefills] == [(16 * step, 16)]
            sched.update(out, {c.request.request_id: 5 for c in out.chunks if c.samples})
    assert controller.num_over_target == 3
    assert "leave no room for one block of prefill" in caplog.text


# ---- the adaptive budget (the default) -------------------------------------------------------
class Clock:
    def __init__(self, t: float = 0.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def decoding_scheduler(
    clock: Clock, num_decodes: int, prompt_len: int = 8000, **limits
) -> Scheduler:
    """``num_decodes`` requests decoding (long outputs) and one long prompt waiting, all
    arrived long before ``clock`` (outside the load window): the decodes alone set the
    target. ``limits``: more SchedulerConfig fields (long-prompt limits, prefill order)."""
    fields = {"max_num_seqs": 64, "long_prefill_token_threshold": 0, **limits}
    config = SchedulerConfig(
        max_num_batched_tokens=8192, max_model_len=16384, block_size=16, **fields
    )
    sched = Scheduler(config, KVCacheManager(4000, 16), clock=clock)
    rng = random.Random(7)
    params = SamplingParams(max_tokens=4000)
    for i in range(num_decodes):
        p = [rng.randrange(100, 40000) for _ in range(200)]
        sched.add_request(Request(f"d{i}", p, params, max_tokens=4000, arrival_time=0.0))
    out = sched.schedule(8192)
    sched.update(out, {c.request.request_id: 5 for c in out.chunks if c.samples})
    long = [rng.randrange(100, 40000) for _ in range(prompt_len)]
    sched.add_request(Request("long", long, params, max_tokens=8, arrival_time=0.0))
    return sched


def step_with(controller: BudgetController, sched: Scheduler, clock: Clock, hardware):
    decision = controller.decide(sched.view())
    out = sched.schedule(decision.token_budget)
    measured = hardware.predict(StepShape.of(out))
    controller.observe(out, measured)
    clock.t += measured
    sched.update(out, {c.request.request_id: 5 for c in out.chunks if c.samples})
    return decision, out, measured


def test_adaptive_budget_follows_a_changing_step_cost() -> None:
    """The machine's prefill gets 2x slower mid-run (decodes unchanged), then fast again,
    while 640-token prompts arrive every 30 steps beside 16 decodes: a few steps after each
    change, steps with prefill again take about ``slowdown`` x their decodes alone (on the
    machine as it is), where the profile's plan would be 1.6x over the bound on the slow
    machine and far under it after (long steps aside)."""
    slowdown = 2.0
    slow = CostModel([w * (2.0 if i in (1, 4, 6) else 1.0) for i, w in enumerate(TRUE.weights)])
    clock = Clock(100.0)
    sched = decoding_scheduler(clock, num_decodes=16, prompt_len=16)
    model = OnlineCostModel(TRUE.weights, prior_weight=1.0)
    controller = BudgetController(model, adaptive(slowdown))
    rng = random.Random(11)
    params = SamplingParams(max_tokens=2)
    for phase, hardware in enumerate((TRUE, slow, TRUE)):
        ratios = []
        for k in range(120):
            if k % 30 == 0:
                p = [rng.randrange(100, 40000) for _ in range(640)]
                sched.add_request(Request(f"p{phase}-{k}", p, params, max_tokens=2))
            decision, out, measured = step_with(controller, sched, clock, hardware)
            # A long step (while the credit allows) is planned to the longest step.
            if out.prefills and out.decodes and k >= 8 and not decision.long:
                alone = hardware.predict(StepShape(tuple(c.end for c in out.decodes)))
                ratios.append(measured / alone)
                # Over the bound by at most the block the room is rounded up to (and the
                # model's residual error).
                block = hardware.prefill_work_s(16, out.prefills[0].start)
                assert measured <= 1.1 * slowdown * alone + block, (phase, k)
        assert len(ratios) > 40
        assert slowdown * 0.85 <= sorted(ratios)[len(ratios) // 2] <= slowdown * 1.2, phase
    profile = StepShape((1000,) * 16, ((320, 64),), 1)
    assert slow.predict(profile) / TRUE.predict(profile) > 1.3  # the change is a real one


def test_adaptive_budget_without_a_profile_converges_in_a_few_dozen_steps() -> None:
    """From the pessimistic default prior (prefill tokens 4.4x too expensive) the adaptive
    budget reaches the room the slowdown bound allows within a few dozen steps, and its
    steps never exceed the bound by much while it learns (long steps aside)."""
    clock = Clock(100.0)
    sched = decoding_scheduler(clock, num_decodes=16)
    controller = BudgetController(
        OnlineCostModel(DEFAULT_PRIOR, prior_weight=1.0), adaptive(2.0), warmup_steps=20
    )
    ratios, rooms = [], []
    for _ in range(60):
        decision, out, measured = step_with(controller, sched, clock, TRUE)
        if decision.long:  # planned to the longest step, not the bound
            continue
        decodes = tuple(c.end for c in out.decodes)
        alone = TRUE.predict(StepShape(decodes))
        ratios.append(measured / alone)
        start = max(c.start for c in out.prefills)
        rooms.append(
            (out.num_prefill_tokens, TRUE.max_prefill_tokens(list(decodes), start, 2 * alone, 8192))
        )
    assert max(ratios) <= 2.0 * 1.25
    for got, right in rooms[36:]:
        assert got >= right - 24


def test_adaptive_share_grows_with_the_prefill_load() -> None:
    """Prompts arriving faster than the slowdown bound's share computes them: the load term
    gives prefill more of each step, and the queue drains instead of growing."""
    from chunkserve.scheduling.budget import LOAD_WINDOW_S

    clock = Clock(100.0)
    sched = decoding_scheduler(clock, num_decodes=8, prompt_len=64)
    controller = BudgetController(OnlineCostModel(TRUE.weights, prior_weight=1e4), adaptive(1.2))
    rng = random.Random(3)
    params = SamplingParams(max_tokens=8)
    next_arrival, n = clock.t, 0
    backlog = []
    while clock.t < 100.0 + 3 * LOAD_WINDOW_S:
        while next_arrival <= clock.t:
            p = [rng.randrange(100, 40000) for _ in range(1500)]
            sched.add_request(Request(f"p{n}", p, params, max_tokens=8, arrival_time=next_arrival))
            next_arrival += 4.0
            n += 1
        step_with(controller, sched, clock, TRUE)
        backlog.append(sum(r.num_uncomputed_tokens for r in sched.waiting + sched.running))
    # A 1500-token prompt every 4 s is ~40% of this machine: more than the 1/6 share a 1.2x
    # slowdown gives, yet the backlog stays within a few prompts.
    assert controller.prefill_load(sched.view()) > 0.3
    assert max(backlog[len(backlog) // 2 :]) < 4 * 1500


def test_short_prompt_during_a_long_chunked_prefill_gets_its_first_token_within_two_steps() -> None:
    clock = Clock(100.0)
    sched = decoding_scheduler(clock, num_decodes=8)
    controller = BudgetController(OnlineCostModel(TRUE.weights, prior_weight=1e4), adaptive(2.0))
    for _ in range(20):  # the long prompt is chunked beside the decodes
        step_with(controller, sched, clock, TRUE)
    long = sched.requests["long"]
    assert long.is_prefilling and long.num_computed_tokens > 0
    rng = random.Random(9)
    for i in range(5):
        short = Request(
            f"s{i}",
            [rng.randrange(100, 40000) for _ in range(60)],
            SamplingParams(max_tokens=4),
            max_tokens=4,
            arrival_time=clock.t,
        )
        sched.add_request(short)
        before = long.num_computed_tokens
        for _ in range(2):
            _, out, _ = step_with(controller, sched, clock, TRUE)
            chunks = {c.request.request_id: c.num_tokens for c in out.prefills}
            if short.request_id in chunks:
                # The short prompt's step carries it and one block of the long one, not a
                # long chunk on top: its first token comes as soon as it can.
                assert chunks.get("long", 0) <= BLOCK, chunks
        assert short.num_output_tokens >= 1, i
        assert long.num_computed_tokens > before  # the long one still moved
        for _ in range(3):
            step_with(controller, sched, clock, TRUE)


def test_with_nothing_decoding_a_prompt_arriving_waits_one_bounded_step() -> None:
    """No stream to protect: a long prompt alone moves in steps of about IDLE_STEP_FACTOR
    times a step's fixed cost (many blocks each), not in one long step, so a short prompt
    arriving meanwhile has its first token within two such steps."""
    clock = Clock(100.0)
    sched = decoding_scheduler(clock, num_decodes=0)
    controller = BudgetController(OnlineCostModel(TRUE.weights, prior_weight=1e4), adaptive(2.0))
    bound = IDLE_STEP_FACTOR * TRUE.predict(StepShape(prefill_samples=1))
    for _ in range(3):
        _, out, measured = step_with(controller, sched, clock, TRUE)
        assert out.prefills and not out.decodes
        assert out.num_prefill_tokens >= 4 * BLOCK
        assert measured <= 1.02 * bound
    sched.add_request(
        Request("s", [7] * 30, SamplingParams(max_tokens=4), max_tokens=4, arrival_time=clock.t)
    )
    arrived = clock.t
    for _ in range(2):
        _, out, measured = step_with(controller, sched, clock, TRUE)
        assert measured <= 1.02 * bound
    assert sched.requests["s"].num_output_tokens >= 1
    assert clock.t - arrived <= 2.04 * bound
    assert sched.requests["long"].is_prefilling  # 8,000 tokens: many steps, none of them long


@pytest.mark.parametrize(
    ("gap_s", "prompt_len", "want"),
    [
        (1.0, 30, "floor"),  # one a second: about a step beside one decode
        (10.0, 30, "share"),  # one every 10 s: 2% of that
        (1.0, 3000, "longest"),  # a load the machine cannot meet: the fewest fixed costs
    ],
)
def test_with_nothing_decoding_steps_shrink_as_prompts_arrive_more_often(
    gap_s: float, prompt_len: int, want: str
) -> None:
    """Nothing decodes, but prompts arrived over the load window (done now): a document
    alone moves in steps a prompt arriving meanwhile can wait out, IDLE_ARRIVAL_CHANCE of
    the time between arrivals, never less than a step beside one decode; unless the
    arrivals' prefill is more than the machine can compute, then in the longest steps."""
    from chunkserve.scheduling.budget import IDLE_ARRIVAL_CHANCE, LOAD_WINDOW_S

    clock = Clock(100.0)
    sched = decoding_scheduler(clock, num_decodes=0)
    rng = random.Random(5)
    t = clock.t - LOAD_WINDOW_S + gap_s / 2
    for i in itertools.count():
        if t >= clock.t:
            break
        p = [rng.randrange(100, 40000) for _ in range(prompt_len)]
        params = SamplingParams(max_tokens=4)
        sched.add_request(Request(f"p{i}", p, params, max_tokens=4, arrival_time=t))
        sched.abort_request(f"p{i}")
        t += gap_s
    controller = BudgetController(OnlineCostModel(TRUE.weights, prior_weight=1e4), adaptive(2.0))
    fixed = TRUE.predict(StepShape(prefill_samples=1))
    bound = {
        "floor": 2.0 * fixed,  # the slowdown times a step's fixed cost (no decode seen yet)
        "share": IDLE_ARRIVAL_CHANCE * gap_s,
        "longest": IDLE_STEP_FACTOR * fixed,
    }[want]
    for _ in range(4):
        _, out, measured = step_with(controller, sched, clock, TRUE)
        assert out.prefills and not out.decodes
        assert 0.6 * bound <= measured <= 1.02 * bound, (measured, bound)
    assert sched.requests["long"].is_prefilling


def test_a_short_prompt_a_little_over_the_target_is_not_split() -> None:
    """A waiting prompt whose whole prefill beside the decodes is over the target, but
    within WHOLE_PROMPT_SLACK of it, goes whole in one step: split in two, its first token
    would wait a step more. A prompt in progress gets no such slack."""
    from chunkserve.scheduling.budget import WHOLE_PROMPT_SLACK

    clock = Clock(100.0)
    sched = decoding_scheduler(clock, num_decodes=2)
    controller = BudgetController(OnlineCostModel(TRUE.weights, prior_weight=1e4), adaptive(2.0))
    for _ in range(10):
        decision, out, measured = step_with(controller, sched, clock, TRUE)
        assert measured <= 1.02 * decision.target_s  # the long prompt's chunks keep the bound
    n = 45
    sched.add_request(
        Request("s", [7] * n, SamplingParams(max_tokens=4), max_tokens=4, arrival_time=clock.t)
    )
    decision, out, measured = step_with(controller, sched, clock, TRUE)
    assert {c.request.request_id: c.num_tokens for c in out.prefills} == {"s": n}
    assert decision.target_s < measured <= WHOLE_PROMPT_SLACK * decision.target_s
    assert sched.requests["s"].num_output_tokens == 1


def test_a_long_step_prefills_a_medium_prompt_whole_and_spends_the_credit() -> None:
    """A prompt too long for a step under the slowdown bound, beside 5 decodes, with credit
    for one long gap per decode: one step of up to the longest step prefills it whole (its
    first token in one step, as whole-prompt prefill would give it, not a dozen), and the
    credit is spent: the next prompt is chunked under the bound until the decodes' gaps earn
    it back. A short prompt that fits the bound takes no long step."""
    clock = Clock(100.0)
    sched = decoding_scheduler(clock, num_decodes=4, prompt_len=16)
    controller = BudgetController(OnlineCostModel(TRUE.weights, prior_weight=1e4), adaptive(2.0))
    step_with(controller, sched, clock, TRUE)  # the 16-token prompt: no long step
    assert controller.num_long_steps == 0 and len(sched.running_decodes()) == 5
    controller.long_credit = 5.0
    longest = controller.longest_step_s()
    bound = 2.0 * TRUE.predict(StepShape((202,) * 5))
    assert longest > 3 * bound
    params = SamplingParams(max_tokens=4)
    sched.add_request(Request("m", [7] * 400, params, max_tokens=4, arrival_time=clock.t))
    decision, out, measured = step_with(controller, sched, clock, TRUE)
    assert decision.long and decision.target_s == longest
    assert {c.request.request_id: c.num_tokens for c in out.prefills}["m"] == 400
    assert bound < measured <= 1.02 * longest
    assert sched.requests["m"].num_output_tokens == 1
    assert controller.long_credit == pytest.approx(
        5 * DEFAULT_LONG_STEP_SHARE
    )  # earned by its gaps
    sched.add_request(Request("m2", [8] * 400, params, max_tokens=4, arrival_time=clock.t))
    for _ in range(3):
        decision, out, measured = step_with(controller, sched, clock, TRUE)
        assert not decision.long and out.prefills
        assert measured <= 1.1 * bound + TRUE.prefill_work_s(BLOCK, out.prefills[0].start)
    sched.add_request(Request("s", [9] * 20, params, max_tokens=4, arrival_time=clock.t))
    controller.long_credit = 10.0
    decision, out, measured = step_with(controller, sched, clock, TRUE)
    assert not decision.long and sched.requests["s"].num_output_tokens == 1
    assert controller.num_long_steps == 1


def _document_in_progress(
    clock: Clock, prompt_len: int = 8000, rest: int | None = None, **limits
) -> tuple[Scheduler, BudgetController]:
    """4 decodes and a document chunked for a few steps (until at most ``rest`` tokens of
    it are left), no long-step credit."""
    sched = decoding_scheduler(clock, num_decodes=4, prompt_len=prompt_len, **limits)
    controller = BudgetController(OnlineCostModel(TRUE.weights, prior_weight=1e4), adaptive(2.0))
    controller.long_credit = 0.0
    for _ in range(4):
        step_with(controller, sched, clock, TRUE)
    while rest is not None and sched.requests["long"].num_uncomputed_tokens > rest:
        step_with(controller, sched, clock, TRUE)
    assert sched.requests["long"].is_prefilling and sched.requests["long"].num_computed_tokens
    return sched, controller


def test_a_long_step_beside_a_prompt_in_progress() -> None:
    """A 400-token prompt arriving while a document is chunked, with credit for a long
    step: the long step is weighed before splitting the prompt at its start, so it is
    prefilled whole (first token in one step), and the document still moves when it is
    owed a block."""
    clock = Clock(100.0)
    sched, controller = _document_in_progress(clock)
    controller.long_credit = 5.0
    params = SamplingParams(max_tokens=4)
    sched.add_request(Request("m", [7] * 400, params, max_tokens=4, arrival_time=clock.t))
    owed = not sched.prefilled_last_step(sched.requests["long"])
    decision, out, measured = step_with(controller, sched, clock, TRUE)
    served = {c.request.request_id: c.num_tokens for c in out.prefills}
    assert decision.long and served["m"] == 400
    assert sched.requests["m"].num_output_tokens == 1
    assert ("long" in served) == owed
    assert controller.num_long_steps == 1
    assert controller.long_credit == pytest.approx(1.0 + 4 * DEFAULT_LONG_STEP_SHARE)
    assert measured <= 1.02 * controller.longest_step_s()


@pytest.mark.parametrize(
    "limits",
    [
        # one long prompt in progress at a time: the document is long, so is the prompt
        {"long_prefill_token_threshold": 300, "max_long_partial_prefills": 1},
        # no room to start another request
        {"max_num_seqs": 5},
    ],
    ids=["long-limit", "max-num-seqs"],
)
def test_no_long_step_for_a_prompt_the_scheduler_would_not_start_whole(limits: dict) -> None:
    """A long step is planned only for prompts the scheduler starts whole: where its limits
    hold the prompt back (or cap its first chunk), no long step is planned and no credit is
    spent; the step keeps the bound (plus a deep block), where a long step's room handed to
    the document's rest came out several times over it."""
    clock = Clock(100.0)
    # The document's rest is shorter than the prompt, which waited long enough that ageing
    # serves it first.
    sched, controller = _document_in_progress(clock, prompt_len=2000, rest=360, **limits)
    assert sched.requests["long"].num_uncomputed_tokens > 300  # long by the threshold
    controller.long_credit = 5.0
    params = SamplingParams(max_tokens=4)
    sched.add_request(Request("m", [7] * 400, params, max_tokens=4, arrival_time=clock.t - 60))
    if sched.config.prefill_order == "shortest":
        assert sched.prefill_queue()[0].request_id == "m"
    bound = 2.0 * TRUE.predict(StepShape((205,) * 4))
    for _ in range(3):
        decision, out, measured = step_with(controller, sched, clock, TRUE)
        assert not decision.long
        start = max(c.start for c in out.prefills)
        assert measured <= 1.1 * bound + TRUE.prefill_work_s(BLOCK, start)
    assert controller.num_long_steps == 0 and controller.long_credit >= 5.0


def test_no_long_step_for_a_prompt_capped_by_arrival() -> None:
    """By arrival a long prompt's first chunk is capped (``long_prefill_token_threshold``,
    at most half the step) so that prompts behind it find room: it cannot start whole, so
    no long step is planned for it (planned, the step took 0.6 s and the prompt still had
    no first token: the prompt behind it took the rest)."""
    clock = Clock(100.0)
    sched = decoding_scheduler(
        clock, 4, prompt_len=16, long_prefill_token_threshold=300, prefill_order="arrival"
    )
    controller = BudgetController(OnlineCostModel(TRUE.weights, prior_weight=1e4), adaptive(2.0))
    step_with(controller, sched, clock, TRUE)
    controller.long_credit = 5.0
    params = SamplingParams(max_tokens=4)
    for name, n in (("m", 400), ("z1", 250), ("z2", 250)):
        sched.add_request(Request(name, [7] * n, params, max_tokens=4, arrival_time=clock.t))
    bound = 2.0 * TRUE.predict(StepShape((202,) * 5))
    for _ in range(3):
        decision, _, measured = step_with(controller, sched, clock, TRUE)
        assert not decision.long and measured <= 1.1 * bound
    assert controller.num_long_steps == 0 and controller.long_credit >= 5.0


def test_a_long_step_not_taken_spends_no_credit() -> None:
    """The credit is spent, and the step counted, when a long step ran, not when one was
    planned: a step planned long that did not prefill the prompt whole (here, a smaller
    budget than planned) costs nothing and is not counted."""
    clock = Clock(100.0)
    sched = decoding_scheduler(clock, num_decodes=4, prompt_len=16)
    controller = BudgetController(OnlineCostModel(TRUE.weights, prior_weight=1e4), adaptive(2.0))
    step_with(controller, sched, clock, TRUE)
    controller.long_credit = 5.0
    params = SamplingParams(max_tokens=4)
    sched.add_request(Request("m", [7] * 400, params, max_tokens=4, arrival_time=clock.t))
    decision = controller.decide(sched.view())
    assert decision.long
    out = sched.schedule(decision.token_budget // 4)
    assert not controller.long_step_served(out)
    controller.observe(out, TRUE.predict(StepShape.of(out)))
    assert controller.num_long_steps == 0
    assert controller.long_credit == pytest.approx(5.0 + 5 * DEFAULT_LONG_STEP_SHARE)


def test_long_steps_stall_a_bounded_share_of_the_gaps() -> None:
    """Prompts of 200-600 tokens (too long for a step under the bound, short enough for one
    long step) arriving every 2 s beside 1-6 decodes: long steps take at most
    DEFAULT_LONG_STEP_SHARE of all token gaps (plus the credit banked at the start), each
    within the longest step; they do happen, and the prompts that get one have their first
    token after one step."""
    clock = Clock(100.0)
    sched = decoding_scheduler(clock, num_decodes=1, prompt_len=16)
    controller = BudgetController(OnlineCostModel(TRUE.weights, prior_weight=1e4), adaptive(2.0))
    rng = random.Random(5)
    params, short = SamplingParams(max_tokens=8), SamplingParams(max_tokens=100)
    gaps = long_gaps = 0
    next_prompt, n = clock.t, 0
    while clock.t < 100.0 + 900.0:
        if clock.t >= next_prompt:
            p = [rng.randrange(100, 40000) for _ in range(rng.randrange(200, 600))]
            sched.add_request(Request(f"m{n}", p, params, max_tokens=8, arrival_time=clock.t))
            next_prompt += 2.0
            n += 1
        while len(sched.running_decodes()) < 1 + n % 6:
            p = [rng.randrange(100, 40000) for _ in range(30)]
            r = Request(f"s{clock.t}", p, short, max_tokens=100, arrival_time=clock.t)
            sched.add_request(r)
            step_with(controller, sched, clock, TRUE)
        decision, out, measured = step_with(controller, sched, clock, TRUE)
        gaps += len(out.decodes)
        if decision.long:
            long_gaps += len(out.decodes)
            assert measured <= 1.05 * controller.longest_step_s()
            for c in out.prefills:
                if c.request.request_id.startswith("m"):
                    assert c.start == 0 and c.end == c.request.num_prompt_tokens
    assert controller.num_long_steps >= 10
    assert long_gaps <= DEFAULT_LONG_STEP_SHARE * gaps + LONG_STEPS_BANKED


@pytest.mark.parametrize("policy", [itl(0.08), adaptive(2.0, long_step_share=0.0)])
def test_no_long_steps_under_an_itl_target_or_a_zero_share(policy: BudgetPolicy) -> None:
    """An ITL target is a hard bound, and ``long_step_share=0`` turns long steps off: a
    prompt that one long step would take whole is chunked under the bound, whatever the
    credit."""
    clock = Clock(100.0)
    sched = decoding_scheduler(clock, num_decodes=4, prompt_len=400)
    controller = BudgetController(OnlineCostModel(TRUE.weights, prior_weight=1e4), policy)
    controller.long_credit = 100.0
    bound = 0.08 if policy.kind == "itl-target" else 2.0 * TRUE.predict(StepShape((201,) * 4))
    for _ in range(5):
        decision, out, measured = step_with(controller, sched, clock, TRUE)
        assert not decision.long and out.num_prefill_tokens < 400
        assert measured <= 1.05 * bound
    assert controller.num_long_steps == 0


def test_a_rest_in_progress_is_priced_at_its_depth() -> None:
    """The step that finishes a document prices its rest where it starts (each token reads
    the whole prefix before it), not as a prompt at position 0: planned at position 0, a
    deep rest that "fits" came out up to 2x over its target."""
    clock = Clock(100.0)
    sched = decoding_scheduler(clock, num_decodes=2, prompt_len=12000)
    controller = BudgetController(OnlineCostModel(TRUE.weights, prior_weight=1e4), adaptive(2.0))
    controller.long_credit = 0.0  # all of it under the bound
    while "long" in sched.requests and sched.requests["long"].is_prefilling:
        decision, out, measured = step_with(controller, sched, clock, TRUE)
        assert measured <= 1.1 * decision.target_s + TRUE.prefill_work_s(
            BLOCK, out.prefills[0].start
        )


def test_the_step_that_prefills_a_short_prompt_carries_no_long_chunk() -> None:
    """Few decodes leave room for long chunks; a short prompt arriving goes alone in the
    next step, so its first token (and everyone's gap) does not wait for a long chunk too. A
    second one right after shares its step with the one block the long prompt is then owed
    (it advances at least every other step)."""
    clock = Clock(100.0)
    sched = decoding_scheduler(clock, num_decodes=2)
    controller = BudgetController(OnlineCostModel(TRUE.weights, prior_weight=1e4), adaptive(4.0))
    for _ in range(10):
        _, out, long_step = step_with(controller, sched, clock, TRUE)
    assert out.prefills[0].num_tokens >= 4 * BLOCK  # long chunks between short arrivals
    for name, want in (("s", {"s": 20}), ("t", {"t": 20, "long": BLOCK})):
        sched.add_request(
            Request(
                name, [7] * 20, SamplingParams(max_tokens=4), max_tokens=4, arrival_time=clock.t
            )
        )
        _, out, measured = step_with(controller, sched, clock, TRUE)
        chunks = {c.request.request_id: c.num_tokens for c in out.prefills}
        assert chunks == want, chunks
        assert measured < long_step
        assert sched.requests[name].num_output_tokens == 1
    _, out, _ = step_with(controller, sched, clock, TRUE)
    assert out.prefills[0].num_tokens >= 4 * BLOCK  # and back to long chunks


def test_fit_recovers_a_linear_model_and_reports_heldout_error() -> None:
    rng = random.Random(0)
    shapes = [
        StepShape(
            tuple(rng.choice([128, 1024]) for _ in range(rng.choice([0, 4, 16]))),
            ((rng.choice([0, 1024]), rng.choice([16, 128, 512])),),
        )
        for _ in range(60)
    ]
    times = [TRUE.predict(s) * rng.uniform(0.97, 1.03) for s in shapes]
    model = CostModel(fit(shapes[:48], times[:48]))
    errs = relative_errors(model, shapes[48:], times[48:])
    assert max(errs) < 0.08
    assert all(w >= 0 for w in model.weights)


def test_step_shape_counts_sampling_after_the_step_ran() -> None:
    """The shape of a step read after ``update`` (as the controller and simulator do) still
    says which chunks sampled: a prompt's last chunk and every decode."""
    sched = make_scheduler()
    sched.add_request(
        Request("a", list(range(100, 140)), SamplingParams(max_tokens=4), max_tokens=4)
    )
    sched.add_request(
        Request("b", list(range(200, 300)), SamplingParams(max_tokens=4), max_tokens=4)
    )
    first = sched.schedule(64)  # all of a (40 tokens: ends its prompt), a block of b
    sched.update(first, {c.request.request_id: 5 for c in first.chunks if c.samples})
    assert StepShape.of(first) == StepShape((), ((0, 40), (0, 16)), prefill_samples=1)
    assert StepShape.of(first).features()[FEATURES.index("logits")] == 1.0
    second = sched.schedule(8)  # a decodes; 7 more of b, not its end
    sched.update(second, {c.request.request_id: 5 for c in second.chunks if c.samples})
    assert StepShape.of(second) == StepShape((41,), ((16, 7),), prefill_samples=0)
    only_middle = StepShape((), ((31, 16),))
    assert only_middle.features()[FEATURES.index("logits")] == 0.0  # no row sampled: no LM head
    assert TRUE.predict(StepShape((), ((31, 16),), 1)) - TRUE.predict(only_middle) == (
        pytest.approx(4e-3)
    )


def test_padded_decode_keys_follow_the_backend_grouping() -> None:
    """Alike contexts: the padded keys are the keys. One long decode among 15 short ones:
    its group (of the 4 the backend cuts) is padded to it, not the whole batch."""
    alike = StepShape((256,) * 16)
    assert alike.features()[FEATURES.index("decode_padded_k")] == pytest.approx(16 * 0.256)
    lens = (3584,) + (256,) * 15
    groups = split_decode_groups(lens, 16)
    assert len(groups) == 4 and [0] in [[i for i in g if lens[i] > 256] for g in groups]
    padded = sum(len(g) * max(lens[i] for i in g) for g in groups)
    assert padded == 4 * 3584 + 12 * 256 == padded_decode_keys(lens, 16)
    f = StepShape(lens).features()
    assert f[FEATURES.index("decode_padded_k")] == pytest.approx(padded / 1e3)
    assert f[FEATURES.index("decode_context_k")] == pytest.approx(sum(lens) / 1e3)


def test_max_prefill_tokens_solves_the_quadratic() -> None:
    for start in (0, 2000):
        p = TRUE.max_prefill_tokens([500] * 8, start, SLO, 10**6)
        at = TRUE.predict(StepShape((500,) * 8, ((start, p),)))
        over = TRUE.predict(StepShape((500,) * 8, ((start, p + 1),)))
        assert at <= SLO < over


# ---- simulator ---------------------------------------------------------------------------------
def workload(n_short: int = 30) -> list[BenchRequest]:
    rng = random.Random(4)
    reqs = [
        BenchRequest([rng.randrange(100, 40000) for _ in range(40)], 50, i * 0.5, "short")
        for i in range(n_short)
    ]
    reqs += [
        BenchRequest([rng.randrange(100, 40000) for _ in range(2000)], 8, 2.0 + 5 * i, "long")
        for i in range(3)
    ]
    return sorted(reqs, key=lambda r: r.arrival)


def sim_config(budget: int, chunked: bool = True) -> SchedulerConfig:
    return SchedulerConfig(
        max_num_batched_tokens=budget,
        max_num_seqs=min(64, budget),
        max_model_len=4096,
        block_size=16,
        enable_chunked_prefill=chunked,
    )


def test_simulator_runs_the_real_scheduler_and_shows_the_stall() -> None:
    off, dur_off, _ = simulate(workload(), sim_config(4096, chunked=False), 2000, TRUE)
    on, dur_on, info = simulate(workload(), sim_config(128), 2000, TRUE)
    r_off, r_on = summarize(off, dur_off), summarize(on, dur_on)
    assert r_off["completed"] == r_on["completed"] == 33
    assert all(rec.output_tokens == (50 if rec.kind == "short" else 8) for rec in on)
    # Chunking off: a 2000-token prefill is one step of ~1.8 s+; chunked steps stay small.
    assert r_off["max_itl_ms"] > 1500
    assert r_on["max_itl_ms"] < r_off["max_itl_ms"] / 4
    assert info["steps"] > 0


def test_simulator_with_itl_target_keeps_steps_under_it() -> None:
    recs, dur, _ = simulate(workload(), sim_config(4096), 2000, TRUE, policy=itl(SLO, 4096))
    result = summarize(recs, dur)
    assert result["completed"] == 33
    assert result["max_itl_ms"] <= SLO * 1e3 * 1.02


def test_simulator_population_limit() -> None:
    reqs = [BenchRequest([100 + i] * 20, 10, 0.0, "short") for i in range(12)]
    recs, _, _ = simulate(reqs, sim_config(256), 500, TRUE, max_concurrency=3)
    starts = sorted(r.start for r in recs)
    assert starts[:3] == [0.0, 0.0, 0.0] and starts[3] > 0.0


def test_simulator_ttft_counts_from_arrival_not_from_the_next_step() -> None:
    """A request arriving while a step runs waits for that step to end: its TTFT, as a client
    measures it, includes that wait."""
    reqs = [
        BenchRequest([100 + i for i in range(64)], 4, 0.0, "long"),
        BenchRequest([200, 201, 202, 203], 4, 0.001, "short"),
    ]
    recs, _, _ = simulate(reqs, sim_config(64), 500, TRUE)
    first_step = TRUE.predict(StepShape((), ((0, 64),), prefill_samples=1))
    assert recs[1].start == pytest.approx(0.001)
    # It joins after the first step; its prefill shares the second step with a decode.
    second = TRUE.predict(StepShape((65,), ((0, 4),), prefill_samples=1))
    assert recs[1].ttft == pytest.approx(first_step + second - 0.001)


@pytest.mark.parametrize("bad", [0, -5])
def test_controller_rejects_bad_target(bad: float) -> None:
    with pytest.raises(ValueError, match="itl_slo_ms"):
        BudgetController(OnlineCostModel(TRUE.weights), itl(bad, 512))
    with pytest.raises(ValueError, match="max_decode_slowdown"):
        BudgetController(OnlineCostModel(TRUE.weights), adaptive(0.5 + bad, 512))
    with pytest.raises(ValueError, match="budget_policy"):
        BudgetController(OnlineCostModel(TRUE.weights), BudgetPolicy("static", 512))


def test_simulator_step_overhead_is_added_to_every_step() -> None:
    """A fixed serving-loop overhead lengthens every gap by exactly that much."""
    reqs = [BenchRequest([100 + i] * 20, 10, 0.0, "short") for i in range(4)]
    base, _, info = simulate(reqs, sim_config(256), 500, TRUE)
    slow, _, info_slow = simulate(reqs, sim_config(256), 500, TRUE, step_overhead_s=0.02)
    assert info["steps"] == info_slow["steps"]
    for a, b in zip(base, slow):
        gaps_a = [y - x for x, y in zip(a.chunk_times, a.chunk_times[1:])]
        gaps_b = [y - x for x, y in zip(b.chunk_times, b.chunk_times[1:])]
        assert gaps_b == pytest.approx([g + 0.02 for g in gaps_a])


def test_simulator_cost_scale_multiplies_every_step() -> None:
    """A server running 30% slower than its profile: every simulated step takes 1.3x the
    prediction (the overhead is added after scaling)."""
    reqs = [BenchRequest([100 + i] * 20, 10, 0.0, "short") for i in range(4)]
    base, _, info = simulate(reqs, sim_config(256), 500, TRUE)
    slow, _, info_slow = simulate(
        reqs, sim_config(256), 500, TRUE, cost_scale=1.3, step_overhead_s=0.01
    )
    assert info["steps"] == info_slow["steps"]
    assert info_slow["busy_s"] == pytest.approx(1.3 * info["busy_s"] + 0.01 * info["steps"])
    for a, b in zip(base, slow):
        gaps_a = [y - x for x, y in zip(a.chunk_times, a.chunk_times[1:])]
        gaps_b = [y - x for x, y in zip(b.chunk_times, b.chunk_times[1:])]
        assert gaps_b == pytest.approx([1.3 * g + 0.01 for g in gaps_a])
    for bad in (0.0, -1.0, float("nan"), {"decode": 0.0}, {"decoding": 1.2}, {"mixed": "x"}):
        with pytest.raises(ValueError, match="cost_scale"):
            simulate(reqs, sim_config(256), 500, TRUE, cost_scale=bad)


def test_simulator_correlated_noise() -> None:
    """Correlated noise: each step's time over the noiseless one is log-normal with mean 1,
    the given spread, and the given step-to-step correlation of its log (decode-only steps
    of one request, each the same step without noise)."""
    import math
    import statistics

    reqs = [BenchRequest([100] * 20, 3000, 0.0, "short")]
    base, _, _ = simulate(reqs, sim_config(256), 500, TRUE)
    noisy, _, _ = simulate(reqs, sim_config(256), 500, TRUE, noise=0.2, noise_correlation=0.8)

    def gaps(rec) -> list[float]:
        return [y - x for x, y in zip(rec.chunk_times, rec.chunk_times[1:])]

    logs = [math.log(b / a) for a, b in zip(gaps(base[0]), gaps(noisy[0]))]
    assert statistics.fmean(math.exp(x) for x in logs) == pytest.approx(1.0, abs=0.05)
    assert statistics.pstdev(logs) == pytest.approx(0.2, rel=0.2)
    lag1 = statistics.correlation(logs[:-1], logs[1:])
    assert lag1 == pytest.approx(0.8, abs=0.08)
    for bad in (-0.1, 1.0):
        with pytest.raises(ValueError, match="noise_correlation"):
            simulate(reqs, sim_config(256), 500, TRUE, noise=0.2, noise_correlation=bad)


def test_simulator_cost_scale_per_step_kind() -> None:
    """One scale per step kind: decode-only steps 2x, the prefill step as predicted."""
    reqs = [BenchRequest([100 + i] * 20, 10, 0.0, "short") for i in range(4)]
    base, _, _ = simulate(reqs, sim_config(256), 500, TRUE)
    scaled, _, _ = simulate(reqs, sim_config(256), 500, TRUE, cost_scale={"decode": 2.0})
    for a, b in zip(base, scaled):
        assert b.ttft == pytest.approx(a.ttft)  # the one prefill step: unscaled
        gaps_a = [y - x for x, y in zip(a.chunk_times, a.chunk_times[1:])]
        gaps_b = [y - x for x, y in zip(b.chunk_times, b.chunk_times[1:])]
        assert gaps_b == pytest.approx([2 * g for g in gaps_a])
    assert parse_cost_scale("1.25") == 1.25
    assert parse_cost_scale("decode=1.2, mixed=1.1") == {"decode": 1.2, "mixed": 1.1}
    for bad in ("fast", "decode=", "decode=x,mixed=1"):
        with pytest.raises(ValueError, match="cost_scale"):
            parse_cost_scale(bad)
    with pytest.raises(ValueError, match="step_overhead_s"):
        simulate(reqs, sim_config(256), 500, TRUE, step_overhead_s=-0.01)


@pytest.mark.parametrize("scale", [1.4, 0.7])
def test_simulated_controller_learns_a_scaled_profile(scale: float) -> None:
    """Steps 1.4x slower (0.7x faster) than the profile: the simulated controller starts from
    the profile and learns the truth from the steps, as a server's does: the ITL target
    holds, and the room a pessimistic profile leaves is used."""
    recs, dur, _ = simulate(
        workload(), sim_config(4096), 2000, TRUE, policy=itl(SLO, 4096), cost_scale=scale
    )
    gaps = sorted(y - x for rec in recs for x, y in zip(rec.chunk_times, rec.chunk_times[1:]))
    assert summarize(recs, dur)["completed"] == 33
    over = sum(1 for g in gaps if g > SLO * 1.02)
    assert over <= 0.01 * len(gaps), (over, len(gaps), gaps[-5:])
    assert gaps[int(0.99 * len(gaps))] >= 0.9 * SLO


def test_engine_with_a_profile_reports_each_steps_prediction(tmp_path) -> None:
    """A static-budget engine given a profile predicts every step (the profile's fixed
    weights) and exports measured/predicted, the simulator's ``--cost-scale``."""
    from prometheus_client.parser import text_string_to_metric_families

    from chunkserve.engine.engine import Engine
    from chunkserve.entrypoints.openai.metrics import Metrics

    path = tmp_path / "profile.json"
    TRUE.save(path)
    engine = Engine(
        dtype="float32",
        max_model_len=256,
        kv_cache_memory=16 << 20,
        max_num_batched_tokens=32,
        cost_profile=str(path),
    )
    assert engine.core.controller is None  # no ITL target: the budget stays static
    metrics = Metrics(engine, "m")
    # A fresh server's scrape already has every series, at zero.
    fresh = {
        s.name: s.value
        for f in text_string_to_metric_families(metrics.render().decode())
        for s in f.samples
        if s.labels.get("finished_reason", "stop") == "stop"
    }
    assert fresh["chunkserve:generation_tokens_total"] == 0
    assert fresh["chunkserve:request_success_total"] == 0
    assert fresh["chunkserve:time_to_first_token_seconds_count"] == 0
    engine.step_listeners.append(metrics.on_step)
    seen = []
    engine.step_listeners.append(seen.append)
    shapes = []
    real = engine.core.worker.runner.execute

    def recording(out):
        shapes.append(StepShape.of(out))
        return real(out)

    engine.core.worker.runner.execute = recording
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    for i in range(3):
        engine.add_request([100 + i] * 40, params)
    while engine.has_unfinished():
        engine.step()
    assert len(seen) == len(shapes) > 4
    for stats, shape in zip(seen, shapes):
        assert stats.token_budget == 32
        assert stats.predicted_time == pytest.approx(TRUE.predict(shape))
    families = {f.name: f for f in text_string_to_metric_families(metrics.render().decode())}
    ratio = families["chunkserve:step_time_over_predicted"]
    for kind in {s.kind for s in seen}:
        of_kind = [s for s in seen if s.kind == kind]
        samples = {
            s.name[len(ratio.name) :]: s.value for s in ratio.samples if s.labels["kind"] == kind
        }
        assert samples["_count"] == len(of_kind)
        assert samples["_sum"] == pytest.approx(
            sum(s.wall_time / s.predicted_time for s in of_kind)
        )
    assert {s.kind for s in seen} >= {"prefill", "decode"}


def test_engine_rejects_a_named_profile_it_cannot_use(tmp_path, no_weight_loading) -> None:
    from chunkserve.engine.engine import Engine

    bad = tmp_path / "old.json"
    bad.write_text('{"features": ["const"], "weights": [0.1]}')
    with pytest.raises(ValueError, match="cost_profile"):
        Engine(dtype="float32", max_model_len=256, kv_cache_memory=16 << 20, cost_profile=str(bad))


def _metric_samples(metrics) -> dict:
    from prometheus_client.parser import text_string_to_metric_families

    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in text_string_to_metric_families(metrics.render().decode())
        for s in f.samples
    }


def test_defaults_run_the_adaptive_budget_and_say_so(caplog) -> None:
    """No budget flag: the engine runs the adaptive policy, logs it at start, exports it in
    /metrics, and each step with prefill has a target."""
    from chunkserve.engine.engine import Engine
    from chunkserve.entrypoints.openai.metrics import Metrics

    with caplog.at_level("INFO", logger="chunkserve"):
        engine = Engine(dtype="float32", max_model_len=512, kv_cache_memory=32 << 20)
    assert "adaptive: steps with prefill <= 2x their decodes alone" in caplog.text
    metrics = Metrics(engine, "m")
    engine.step_listeners.append(metrics.on_step)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    engine.add_request([100 + i for i in range(30)], params)
    engine.step()
    engine.add_request([200 + i for i in range(300)], params)  # chunked beside the decode
    while engine.has_unfinished():
        engine.step()
    samples = _metric_samples(metrics)
    info = next(k for k in samples if k[0] == "chunkserve:budget_policy_info")
    labels = dict(info[1])
    assert labels["policy"] == "adaptive" and labels["max_decode_slowdown"] == "2.0"
    assert labels["long_step_share"] == "0.005"
    assert "long steps for waiting prompts that fit one whole in 0.5% of token gaps" in (
        caplog.text
    )
    count = samples[("chunkserve:step_time_target_seconds_count", (("model_name", "m"),))]
    assert count >= 2


def test_explicit_budget_keeps_the_static_schedule_step_for_step() -> None:
    """``max_num_batched_tokens`` named alone: no controller, every step has that budget,
    and the chunks are exactly those the scheduler makes alone with that static budget."""
    from chunkserve.engine.engine import Engine

    engine = Engine(
        dtype="float32", max_model_len=512, kv_cache_memory=32 << 20, max_num_batched_tokens=48
    )
    assert engine.core.controller is None and engine.core.budget_policy.kind == "static"
    chunks, budgets, sampled = [], [], []
    real = engine.core.worker.runner.execute

    def recording(out):
        chunks.append([(c.request.request_id, c.start, c.num_tokens) for c in out.chunks])
        budgets.append(out.token_budget)
        result = real(out)
        sampled.append(dict(result.sampled))
        return result

    engine.core.worker.runner.execute = recording
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    prompts = [[100 + i] * n for i, n in enumerate((30, 200, 9, 120))]
    for p in prompts:
        engine.add_request(p, params)
    while engine.has_unfinished():
        engine.step()
    assert set(budgets) == {48}
    # The same requests through the scheduler alone, fed the engine's sampled tokens.
    sched = Scheduler(
        engine.core.scheduler_config, KVCacheManager(engine.core.worker.num_blocks, 16)
    )
    for i, p in enumerate(prompts):
        sched.add_request(Request(f"req-{i}", p, params, max_tokens=6))
    replay = []
    for step_sampled in sampled:
        out = sched.schedule()
        replay.append([(c.request.request_id, c.start, c.num_tokens) for c in out.chunks])
        sched.update(out, step_sampled)
    assert replay == chunks and not sched.has_unfinished()


def test_chunking_overhead_prices_the_prefix_each_chunk_rereads() -> None:
    """Whole prompts cost what the load prices them at; the same prompt in 64-token chunks
    re-reads its prefix every chunk, and the controller's load share is raised by that."""
    controller = BudgetController(OnlineCostModel(TRUE.weights, prior_weight=1e4), adaptive())
    assert controller.chunking_overhead == 1.0
    for start in range(0, 3000, 64):  # one prompt in 64-token chunks
        shape = StepShape((500,) * 8, ((start, 64),), 0)
        controller._observe_chunking(shape)
    chunked = sum(TRUE.prefill_work_s(64, s) for s in range(0, 3000, 64))
    assert chunked / TRUE.prefill_work_s(3008) > 1.05  # 47 prefix reads and chunk costs
    # The average leans to the latest (deepest, dearest) chunks.
    assert chunked / TRUE.prefill_work_s(3008) < controller.chunking_overhead < 1.2
    whole = BudgetController(OnlineCostModel(TRUE.weights, prior_weight=1e4), adaptive())
    for _ in range(50):
        whole._observe_chunking(StepShape((), ((0, 3000),), 1))
    assert whole.chunking_overhead == pytest.approx(1.0)


def test_offline_llm_defaults_to_a_throughput_budget() -> None:
    """``LLM`` (offline: ``generate`` returns when the batch is done) with no budget named
    runs a static budget of ``OFFLINE_MAX_NUM_BATCHED_TOKENS``; a named budget, target or
    slowdown, or chunking off, is kept as given; ``Engine`` (the server's core) stays
    adaptive."""
    from chunkserve.config import EngineConfig
    from chunkserve.entrypoints.llm import LLM, OFFLINE_MAX_NUM_BATCHED_TOKENS, offline_config

    def policy(**kw):
        return offline_config(EngineConfig.from_kwargs(**kw)).budget_policy(4096)

    assert policy() == BudgetPolicy("static", OFFLINE_MAX_NUM_BATCHED_TOKENS)
    assert policy(max_num_batched_tokens=96) == BudgetPolicy("static", 96)
    assert policy(max_decode_slowdown=3.0).kind == "adaptive"
    assert policy(long_step_share=0.0).kind == "adaptive"
    assert policy(itl_slo_ms=200).kind == "itl-target"
    assert policy(enable_chunked_prefill=False) == EngineConfig().replace(
        enable_chunked_prefill=False
    ).budget_policy(4096)
    assert EngineConfig().budget_policy(4096).kind == "adaptive"
    llm = LLM(dtype="float32", max_model_len=512, kv_cache_memory=32 << 20, load_format="dummy")
    assert llm.engine.core.budget_policy == BudgetPolicy("static", OFFLINE_MAX_NUM_BATCHED_TOKENS)
    assert llm.engine.core.controller is None
