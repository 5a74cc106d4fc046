"""Online token budget from an inter-token-latency target (``--itl-slo-ms``).

Each step: the running decodes are fixed (never dropped); the controller asks the cost model
how many prefill tokens fit beside them so that the predicted step time stays under the
target, and hands the scheduler that budget. After the step, the measured time corrects the
model (a non-negative refit over a window of recent steps), so a stale or missing
profile converges.

Pure Python: no torch.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass

from chunkserve.costmodel import StepShape
from chunkserve.request import RequestStatus

logger = logging.getLogger("chunkserve.budget")

RATIO_WINDOW = 200
MAX_PLANNED_CHUNKS = 4
RATIO_QUANTILE = 0.98
# An overshoot shrinks the plan at once for this many steps (the window quantile alone
# would let a run of under-predicted steps, e.g. the deep end of a long prompt, repeat it).
RECENT_STEPS = 4


@dataclass
class BudgetDecision:
    token_budget: int
    num_decodes: int
    prefill_room: int  # prefill tokens predicted to fit under the target
    predicted_s: float  # predicted time of the step at that budget
    decode_only: bool  # the decodes alone are predicted over the target


class BudgetController:
    def __init__(
        self,
        model,
        itl_slo_s: float,
        max_prefill_tokens: int,
        min_prefill_tokens: int = 16,
        log_every: int = 50,
    ) -> None:
        if itl_slo_s <= 0:
            raise ValueError("itl_slo_ms: must be > 0")
        self.model = model  # an OnlineCostModel
        self.itl_slo_s = itl_slo_s
        self.max_prefill_tokens = max_prefill_tokens
        self.min_prefill_tokens = min_prefill_tokens
        self.log_every = log_every
        self.num_decode_only = 0
        self.last: BudgetDecision | None = None
        # measured / predicted of recent steps: the plan aims below the target by their
        # high quantile, so measured steps (with their noise) stay within it.
        self._ratios: deque[float] = deque(maxlen=RATIO_WINDOW)
        self._recent: deque[float] = deque(maxlen=RECENT_STEPS)

    def plan_target_s(self) -> float:
        """The step time to plan for: the target shrunk by the model's under-prediction,
        the ``RATIO_QUANTILE`` of the window or the worst of the last few steps, whichever
        is larger (10% margin until enough steps ran)."""
        latest = max(self._recent, default=1.0)
        if len(self._ratios) < 20:
            return self.itl_slo_s / max(latest, 1.0 / 0.9)
        ratios = sorted(self._ratios)
        q = ratios[int(RATIO_QUANTILE * (len(ratios) - 1))]
        return self.itl_slo_s / max(q, latest, 1.0)

    def decide(self, scheduler) -> BudgetDecision:
        """The budget for the scheduler's next step."""
        decode_lens: list[int] = []
        prefill_start = 0
        for r in scheduler.running:
            if r.status != RequestStatus.RUNNING:
                continue
            if r.is_prefilling:
                prefill_start = max(prefill_start, r.num_computed_tokens)
            else:
                decode_lens.append(r.num_tokens)
        if not any(r.is_prefilling for r in scheduler.running) and scheduler.waiting:
            prefill_start = max(prefill_start, scheduler.waiting[0].num_computed_tokens)
        # Prefills that may share the step: those in progress and the waiting head.
        num_chunks = min(
            MAX_PLANNED_CHUNKS,
            sum(1 for r in scheduler.running if r.is_prefilling) + bool(scheduler.waiting),
        )
        room = self.model.max_prefill_tokens(
            decode_lens,
            prefill_start,
            self.plan_target_s(),
            self.max_prefill_tokens,
            num_chunks,
        )
        if room == 0 and not decode_lens:
            room = self.min_prefill_tokens  # nothing else runs: always make progress
        shape = StepShape(
            tuple(decode_lens), ((prefill_start, room),) if room else (), prefill_samples=1
        )
        predicted = self.model.predict(shape)
        decode_only = room == 0 and bool(
            scheduler.waiting or any(r.is_prefilling for r in scheduler.running)
        )
        if decode_only:
            self.num_decode_only += 1
            if self.num_decode_only % self.log_every == 1:
                logger.info(
                    "ITL target %.0f ms: %d decodes alone are predicted at %.0f ms; running "
                    "decodes only (%d such steps so far)",
                    1e3 * self.itl_slo_s,
                    len(decode_lens),
                    1e3 * predicted,
                    self.num_decode_only,
                )
        self.last = BudgetDecision(
            len(decode_lens) + room, len(decode_lens), room, predicted, decode_only
        )
        return self.last

    def observe(
        self,
        out,
        measured_s: float,
        interval_s: float | None = None,
        shape: StepShape | None = None,
    ) -> None:
        """Correct the model with the step that ran (``out`` is its SchedulerOutput).
        ``interval_s``: the time since the previous step ended, when the decodes waited
        that long: the gap they saw, the step plus the engine loop's work between steps
        (new requests, handing out tokens). The margin is planned on that gap; the model
        is fit on the step alone. ``shape``: ``StepShape.of(out)``, if the caller has it."""
        if out.is_empty:
            return
        if shape is None:
            shape = StepShape.of(out)
        predicted = self.model.predict(shape)
        if predicted > 0:
            ratio = max(measured_s, interval_s or 0.0) / predicted
            self._ratios.append(ratio)
            self._recent.append(ratio)
        self.model.observe(shape, measured_s)
