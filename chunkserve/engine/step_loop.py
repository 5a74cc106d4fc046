"""The loop around every step, one for the engine core (``core.EngineCore.step``) and the
simulator (``tuning.simulate``), so the simulator cannot drift from the engine.

Each step: ``start`` (the time since the previous step ended is the loop's gap: the decodes
waited it too), ``schedule`` (the online controller's budget for the step, tokens and draft
tokens, and the scheduler building it), then, once the step ran, ``finish``: the controller
learns from the step's time alone and from the gap its decodes saw (the step plus the gap
before it; none after an idle step). The clock is injected: the core's is
``time.perf_counter``, the simulator's its simulated time (a simulated worker advances it by
the step's predicted duration, the serving loop's overhead falls between steps).
"""

from __future__ import annotations

from collections.abc import Callable

from chunkserve.scheduling.budget import BudgetController, BudgetDecision
from chunkserve.scheduling.costmodel import StepShape
from chunkserve.scheduling.scheduler import Scheduler, SchedulerOutput


class StepLoop:
    def __init__(
        self,
        scheduler: Scheduler,
        controller: BudgetController | None,
        clock: Callable[[], float],
    ) -> None:
        self.scheduler = scheduler
        self.controller = controller
        self.clock = clock
        self.t_start = 0.0  # when the current step started
        self.loop_gap: float | None = None  # its time since the previous step ended
        self._prev_end: float | None = None

    def start(self) -> float:
        """A step begins (before any work of it); its start time."""
        self.t_start = t = self.clock()
        self.loop_gap = None if self._prev_end is None else t - self._prev_end
        return t

    def schedule(
        self, token_budget: int | None = None
    ) -> tuple[SchedulerOutput, BudgetDecision | None]:
        """The step's batch and, with an online budget (and no ``token_budget`` forced),
        the controller's decision it follows (token and draft budgets). An empty batch
        is an idle step: the next gap starts afresh."""
        decision = None
        draft_budget = None
        if token_budget is None and self.controller is not None:
            decision = self.controller.decide(self.scheduler.view())
            token_budget, draft_budget = decision.token_budget, decision.draft_budget
        out = self.scheduler.schedule(token_budget, draft_budget)
        if out.is_empty:
            self._prev_end = None
        return out, decision

    def finish(self, out: SchedulerOutput, shape: StepShape | None = None) -> float:
        """The step ran (its outputs handed back): the controller observes it; its end
        time. ``shape``: ``StepShape.of(out)``, if the caller has it."""
        t_end = self.clock()
        if self.controller is not None:
            # A step with decodes follows the previous one without idling in between (its
            # requests were running): the time since that one ended is their token gap.
            wall = t_end - self.t_start
            gap = self.loop_gap
            interval = gap + wall if out.decodes and gap is not None else None
            self.controller.observe(out, wall, interval, shape)
        self._prev_end = t_end
        return t_end
