"""One step loop for the engine core and the simulator (``engine.step_loop.StepLoop``): the
budget a step follows (tokens and draft tokens) and what the online controller observes
(the step alone, and the gap its decodes saw) come from the same code in both."""

from __future__ import annotations

import pytest

from chunkserve.bench.datasets import BenchRequest
from chunkserve.engine.step_loop import StepLoop
from chunkserve.scheduling.budget import BudgetController
from chunkserve.scheduling.costmodel import OnlineCostModel, StepShape
from chunkserve.scheduling.request import Request
from chunkserve.scheduling.sampling_params import SamplingParams
from chunkserve.scheduling.scheduler import Scheduler
from chunkserve.tuning.simulate import simulate
from tests.test_budget import TRUE, adaptive, make_scheduler, sim_config


class Recorder:
    """Records what the controller observes and the budgets the scheduler is given."""

    def __init__(self, monkeypatch) -> None:
        self.observed: list[tuple] = []  # (step kind, has decodes, measured, interval, shape)
        self.scheduled: list[tuple] = []  # (draft_budget given, the controller's decision)
        self.controller: BudgetController | None = None
        observe, schedule = BudgetController.observe, Scheduler.schedule
        rec = self

        def spy_observe(ctrl, out, measured_s, interval_s=None, shape=None):
            rec.controller = ctrl
            rec.observed.append((out.kind, bool(out.decodes), measured_s, interval_s, shape))
            return observe(ctrl, out, measured_s, interval_s, shape)

        def spy_schedule(sched, token_budget=None, draft_budget=None):
            last = rec.controller.last if rec.controller is not None else None
            rec.scheduled.append((token_budget, draft_budget, last))
            return schedule(sched, token_budget, draft_budget)

        monkeypatch.setattr(BudgetController, "observe", spy_observe)
        monkeypatch.setattr(Scheduler, "schedule", spy_schedule)


def test_simulator_follows_the_cores_loop_draft_budget_and_interval(monkeypatch) -> None:
    """With a serving-loop overhead and the adaptive budget, the simulated controller sees
    what the engine core's does: the step's own time (the prediction, the overhead not in
    it) and, for decodes that ran back to back, the gap they saw (overhead + step); every
    step gets the decision's draft budget. The old simulator fed the step plus overhead as
    the step and no gap, and dropped the draft budget."""
    rec = Recorder(monkeypatch)
    reqs = [BenchRequest([100 + i] * 40, 12, 0.05 * i, "short") for i in range(12)]
    overhead = 0.01
    simulate(reqs, sim_config(256), 500, TRUE, policy=adaptive(), step_overhead_s=overhead)
    assert len(rec.observed) > 10
    for _, _, measured, interval, shape in rec.observed:
        assert measured == pytest.approx(TRUE.predict(shape))  # the step alone
        assert interval is None or interval == pytest.approx(measured + overhead)
    gaps = [o for o in rec.observed[1:] if o[1]]
    assert gaps and all(o[3] is not None for o in gaps)  # decodes: back to back, a gap
    decided = [(d, last) for t, d, last in rec.scheduled[1:] if last is not None]
    assert any(last.draft_budget is not None for _, last in decided)
    for draft_budget, last in decided:
        assert draft_budget == last.draft_budget


def test_loop_gap_interval_and_idle_reset_on_an_injected_clock(monkeypatch) -> None:
    """The core's use of the loop, on a fake clock: the gap is the time since the previous
    step ended, decodes' interval = gap + step, an idle step starts the gap afresh."""
    rec = Recorder(monkeypatch)
    sched = make_scheduler()
    controller = BudgetController(OnlineCostModel(TRUE.weights, prior_weight=1e4), adaptive())
    now = [10.0]
    loop = StepLoop(sched, controller, lambda: now[0])
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    sched.add_request(Request("a", list(range(100, 140)), params, max_tokens=3))
    steps = []
    while sched.has_unfinished():
        assert loop.start() == now[0]
        out, decision = loop.schedule()
        assert decision is controller.last
        now[0] += 0.5  # the step
        sched.update(out, {c.request.request_id: 5 for c in out.chunks if c.samples})
        assert loop.finish(out, StepShape.of(out)) == now[0]
        steps.append(loop.loop_gap)
        now[0] += 0.25  # the loop's work between steps
    assert steps == [None, 0.25, 0.25]
    assert [(m, i) for _, _, m, i, _ in rec.observed] == [(0.5, None), (0.5, 0.75), (0.5, 0.75)]
    loop.start()
    out, _ = loop.schedule()  # nothing to run: idle
    assert out.is_empty
    loop.start()
    assert loop.loop_gap is None
