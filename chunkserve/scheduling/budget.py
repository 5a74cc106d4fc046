"""Online token budgets: each step's prefill share chosen from a step-time cost model.

Two targets (``config.BudgetPolicy``):

- ``adaptive`` (the default): a step that carries prefill may take ``decode_slowdown``
  times the recent mean time of the decodes alone (an average over steps: the steps with
  prefill take about the same time, and a heavy one's decodes leave less room instead of
  growing it, since the tail is where a stall shows), planned below that by the spread of
  measured mixed steps (``SPREAD_QUANTILE``: a bound, not a mean). Relative to the
  machine's own decode step, so no number of milliseconds or tokens is chosen for the
  hardware: 512 tokens is ~10 ms on an H100 and ~1 s on one fp32 CPU thread.
  A fixed slowdown alone falls behind under load: it gives prefill a fixed share of the
  machine's time, ``(s - 1) / s``, and prompts arriving faster than that share computes
  them queue without end. So the prefill load is measured too: the work of the prompts
  that arrived over the last ``LOAD_WINDOW_S`` seconds (each prompt's predicted prefill
  time alone, without a step's fixed cost: ``CostModel.prefill_work_s``) per second, or
  the work waiting spread over that window if that is more. Chunked, that work costs more
  (each chunk re-reads its prefix): the controller measures by how much from the chunks it
  runs (``chunking_overhead``). When that share, times ``LOAD_MARGIN``, is more than the
  slowdown gives, steps take ``1 / (1 - share)`` times the mean decode step instead (at
  most ``MAX_PREFILL_SHARE``): in steady load the prefill is spread evenly over the steps,
  as the best static budget for that load would spread it, and the queue stays bounded.
  With nothing decoding no stream is there to protect, but one may arrive: a step may take
  ``IDLE_STEP_FACTOR`` times the step's fixed cost (its overhead stays small) when prompts
  come rarely, and at most ``IDLE_ARRIVAL_CHANCE`` of the mean time between the prompts
  that arrived over the load window (not counting those it works for), so about that share
  of arrivals finds such a step running and waits for it: on the stall workload a third of
  the short prompts arrived while a document was prefilled, and waited ~200 ms for its
  steps of 25x the fixed cost. That step is never shorter than a step with prefill beside
  decodes may be (the slowdown times the recent mean decode step), nor than the prefill
  load needs: an idle step pays the fixed cost for prefill alone, so at a load share ``s``
  it takes at least the fixed cost times ``1 / (1 - s)`` (the prefill's share of the step
  is then at least ``s``), and a load the machine cannot meet gets the longest steps.
- ``itl-target`` (``--itl-slo-ms``): the predicted step stays under a fixed time, planned
  below it by how much measured steps have exceeded their predictions.

In the adaptive policy, the prompts whose rest fits the target whole (planned at position
0, beside the decodes; a waiting prompt ``WHOLE_PROMPT_SLACK`` over it: split, its first token
would wait a step more) get room for all of it and no more, decodes or not (plus one block
for a long prompt in progress that got nothing in the last step): the scheduler serves the
shortest prompts first, so a short prompt arriving while a long one is chunked is prefilled
in the next step or two, and the long one still moves at least every other step.

Bounding every step at the slowdown has a price on a machine where a step costs the sum of
its parts (a CPU): beside decodes, prefill gets ``(s - 1) / s`` of the machine, so a prompt
too long for one step waits about ``s / (s - 1)`` times its whole-prompt prefill (more when
prompts queue). Whole-prompt prefill (chunking off) stalls every stream once per prompt, for
the whole prompt. So in the adaptive policy a waiting prompt that no ordinary step fits
whole, but one *long step* (``longest_step_s``: ``IDLE_STEP_FACTOR`` times the step's fixed
cost) does, is prefilled whole in one, with the waiting prompts after it that fit too (first
token as soon as whole-prompt prefill would give it; one bounded stall per stream), while
the long-step credit lasts: every token gap (a decode in a step) earns the policy's
``long_step_share`` of a credit (``--long-step-share``, default 0.005), a long step costs
one per decode it stalls, and at most ``LONG_STEPS_BANKED`` long steps' worth at the current
batch is kept. So long steps are at most that share of all gaps
(a p99 ITL stays with the ordinary steps), none longer than the longest step; prompts too long
for one long step are chunked under the slowdown (the stall workload's documents). A long
step is planned only for prompts the scheduler would start whole, in its own order and
within its limits (``Scheduler.starts_in_order``), and the credit is spent (and the step
counted) only when the step that ran prefilled one of them whole. It is weighed before a
short prompt is split at its start beside a prompt in progress.

Each step the running decodes are fixed (never dropped); the controller asks the cost model
how many prefill tokens fit beside them and hands the scheduler that budget. Whenever
prefill is waiting, a step carries at least ``min_prefill_tokens`` (one KV block) of it, even
when the decodes alone are over the target: prefill never starves. Such steps are counted
and logged as over target.

After the step, the measured time corrects the model in two ways: the linear model is refit
over a window of recent steps (a stale or missing profile converges), and a fast per-kind
scale (an exponential average of measured / predicted, for decode-only steps and for mixed
steps apart) follows a machine whose speed changes within a few steps, long before the
window's refit does.

Pure Python: no torch.
"""

from __future__ import annotations

import itertools
import logging
from collections import deque
from dataclasses import dataclass

from chunkserve.config import BudgetPolicy
from chunkserve.scheduling.costmodel import NUM_FEATURES, OnlineCostModel, StepShape, dot
from chunkserve.scheduling.scheduler import SchedulerView

logger = logging.getLogger("chunkserve.budget")

RATIO_WINDOW = 200
MAX_PLANNED_CHUNKS = 4
RATIO_QUANTILE = 0.98
# An overshoot shrinks the plan at once for this many steps (the window quantile alone
# would let a run of under-predicted steps, e.g. the deep end of a long prompt, repeat it).
RECENT_STEPS = 4
# Weight of the newest step in the per-kind scales: after a change of speed, 1 - 0.7^k of
# the change is followed after k steps (76% after 4, 94% after 8).
SCALE_ALPHA = 0.3
# One step's measured / predicted moves a scale at most this far (a GC pause or a page
# fault in one step should not halve the next budgets).
SCALE_CLIP = (1 / 3, 3.0)
# The prefill load is the work of the prompts that arrived in the last LOAD_WINDOW_S per
# second, or the work waiting spread over that window if that is more (a queue the load
# estimate missed), priced as whole prompts. The share planned is that load times the
# measured chunking overhead (chunks re-read their prefix, and pay per-chunk costs) times
# LOAD_MARGIN (a queue only drains with room to spare).
LOAD_WINDOW_S = 30.0
LOAD_MARGIN = 1.1
# At most this share, so a step is at most 3x the mean decode step: a load estimate that
# jumps (a long document just arrived; small chunks measured as costly) must not make
# second-long steps (measured: 0.9 let single gaps reach 13x the decode step on the stall
# workload, where a static 64-token budget kept them under 4.5x at the same throughput).
MAX_PREFILL_SHARE = 2.0 / 3.0
# The adaptive target is a bound on the steps that carry prefill, not their mean: they are
# planned below it by this quantile of their recent measured / predicted over the fast
# scale (the spread of their noise and of the model's misfit across shapes, about 1.1-1.2
# on the 2-core EPYC), at most SPREAD_MAX.
SPREAD_QUANTILE = 0.9
SPREAD_MAX = 1.5
# A waiting prompt whose whole prefill fits this many times the target is not split (a
# short one arriving while a document is chunked): split, its first token waits one step
# more (beside decodes the streams wait as long in all, the prefill spread over two steps;
# with nothing decoding, a second fixed cost on top). On the 2-core EPYC, 20-60-token
# prompts beside a decode or two were split 16 + 23 and 32 + 18 under the 2x bound: two
# steps of ~50 ms where one of ~75 ms does. A prompt in progress gets no slack (one step
# is nothing to its TTFT).
WHOLE_PROMPT_SLACK = 1.5
# Beside decodes, the prefill room grows at most this much from one step to the next.
ROOM_GROWTH = 2
# With nothing decoding, a step may take this many times its fixed cost (weights, LM head),
# and at most this share of the mean time between arrivals (see the module doc).
IDLE_STEP_FACTOR = 25.0
IDLE_ARRIVAL_CHANCE = 0.02
# Long steps (see the module doc): how many long steps' worth of credit (at the current
# batch) is kept; the share of gaps they may take is the policy's ``long_step_share``.
LONG_STEPS_BANKED = 2.0
# Without a profile, the load terms wait until the model has seen this many steps.
UNPROFILED_WARMUP_STEPS = 20
# Weight of the newest step in the average time of the decodes alone.
MEAN_ALPHA = 0.05
# Prompts looked at per step for the backlog and the short ones (in progress first, then
# waiting in policy order).
MAX_SCANNED_PROMPTS = 64


@dataclass
class BudgetDecision:
    token_budget: int
    num_decodes: int
    prefill_room: int  # prefill tokens the step may carry
    predicted_s: float  # predicted time of the step at that budget
    target_s: float | None  # the step time planned for (None: no prefill waiting)
    over_target: bool  # prefill is waiting and not one block fits: a block runs anyway
    # Most draft tokens (speculative decoding) the decodes may carry; None: any the budget
    # leaves (nothing waits to be prefilled).
    draft_budget: int | None = None
    # A long step beside decodes (planned to ``longest_step_s``, not the slowdown; see
    # ``long_step_share``).
    long: bool = False


class BudgetController:
    """Chooses the token budget of every step for an online ``BudgetPolicy``."""

    def __init__(
        self,
        model: OnlineCostModel,
        policy: BudgetPolicy,
        min_prefill_tokens: int = 16,
        log_every: int = 50,
        warmup_steps: int = 0,
    ) -> None:
        if not policy.is_online:
            raise ValueError("budget_policy: a static budget needs no controller")
        self.model = model
        self.policy = policy
        self.max_prefill_tokens = policy.max_num_batched_tokens
        self.min_prefill_tokens = min_prefill_tokens
        # Steps the model observes before the load terms use it (a model that starts from
        # the deliberately pessimistic default prior overprices prompts at first).
        self.warmup_steps = warmup_steps
        self.log_every = log_every
        self.num_over_target = 0
        self.num_long_steps = 0
        # Long-step credit, in token gaps (see the module doc); starts with what one decode
        # banks.
        self.long_credit = LONG_STEPS_BANKED
        self.last: BudgetDecision | None = None
        # measured / predicted of recent steps: the ITL plan aims below the target by their
        # high quantile, so measured steps (with their noise) stay within it.
        self._ratios: deque[float] = deque(maxlen=RATIO_WINDOW)
        self._recent: deque[float] = deque(maxlen=RECENT_STEPS)
        # Fast corrections of the model's predictions, by step kind (see the module doc).
        self.scale = {"decode": 1.0, "mixed": 1.0}
        self._last_room = 0  # prefill tokens of the last step planned beside decodes
        self.load_bound = False  # the last target was the load's, over the slowdown's
        # Mixed steps' measured / predicted over the mixed scale then (see SPREAD_QUANTILE).
        self._spread: deque[float] = deque(maxlen=RATIO_WINDOW)
        # Exponential average of the cost features of recent steps' decodes alone: their
        # mean time, priced by the model as it is now (features are linear in the weights).
        self._mean_alone: list[float] | None = None
        # (arrival time, cost features of its prefill alone) of the prompts of the load
        # window, and their sum.
        self._arrived: deque[tuple[float, tuple[float, ...]]] = deque()
        self._arrived_sum = [0.0] * NUM_FEATURES
        self._num_seen = 0  # of SchedulerView.num_added
        # Averages of the prefill chunks' cost, chunked and as whole prompts (see
        # ``chunking_overhead``).
        self._chunked_s = 0.0
        self._whole_s = 0.0

    @property
    def itl_slo_s(self) -> float | None:
        return self.policy.itl_slo_s

    def plan_target_s(self) -> float:
        """The ITL target's step time to plan for: the target shrunk by the model's
        under-prediction, the ``RATIO_QUANTILE`` of the window or the worst of the last few
        steps, whichever is larger (10% margin until enough steps ran)."""
        slo = self.policy.itl_slo_s
        assert slo is not None, "plan_target_s is the ITL target's"
        latest = max(self._recent, default=1.0)
        if len(self._ratios) < 20:
            return slo / max(latest, 1.0 / 0.9)
        ratios = sorted(self._ratios)
        q = ratios[int(RATIO_QUANTILE * (len(ratios) - 1))]
        return slo / max(q, latest, 1.0)

    def step_target_s(self, view: SchedulerView) -> float:
        """The predicted time the next step may take with these decodes."""
        if self.policy.kind == "itl-target":
            return self.plan_target_s()
        self.load_bound = False
        slowdown = self.policy.decode_slowdown
        assert slowdown is not None
        self._track_arrivals(view)
        if not view.decode_lens:
            return self._idle_target_s(view, slowdown)
        decodes = self.model.features(StepShape(tuple(view.decode_lens)))
        mean = self._mean_alone
        if mean is None:
            self._mean_alone = mean = list(decodes)
        else:
            for i, x in enumerate(decodes):
                mean[i] += MEAN_ALPHA * (x - mean[i])
        alone = dot(self.model.weights, decodes)
        mean_alone = dot(self.model.weights, mean)
        share = min(MAX_PREFILL_SHARE, self.load_share(view))
        # Every step that carries prefill takes about the same time, the slowdown (or what
        # the load needs) times the recent mean decode step: a heavy step's decodes leave
        # less room, instead of growing the step (the tail is what a stall shows in).
        # The load needs more than the slowdown bound gives (rooms are then rounded up).
        self.load_bound = 1.0 / (1.0 - share) > slowdown
        target = max(alone, mean_alone * max(slowdown, 1.0 / (1.0 - share)))
        # measured(mixed) <= target in measured terms, planned in the model's terms.
        return target * self.scale["decode"] / (self.scale["mixed"] * self.mixed_spread)

    def _idle_target_s(self, view: SchedulerView, slowdown: float) -> float:
        """A step with nothing decoding (see the module doc): long when prompts come
        rarely, a small share of the time between arrivals when they come often, never
        shorter than a step with prefill beside the recent decodes may be, nor than the
        prefill load needs."""
        fixed = self.model.predict(StepShape(prefill_samples=1))
        longest = self.longest_step_s()
        share = self.load_share(view)
        if share >= 1.0:
            return longest  # the machine cannot keep up: the fewest fixed costs
        rate = self.arrival_rate(view)
        if rate <= 0.0:
            return longest
        alone = dot(self.model.weights, self._mean_alone) if self._mean_alone else fixed
        shortest = max(slowdown * alone, fixed / (1.0 - share))
        return min(longest, max(shortest, IDLE_ARRIVAL_CHANCE / rate))

    def load_share(self, view: SchedulerView) -> float:
        """Share of the machine's time the prefill load needs, chunked, with a margin
        (0 while an unprofiled model is still warming up)."""
        if self.model.num_updates < self.warmup_steps:
            return 0.0  # the model does not price work yet
        load = max(self.prefill_load(view), self.backlog_work_s(view) / LOAD_WINDOW_S)
        return LOAD_MARGIN * self.chunking_overhead * load

    def arrival_rate(self, view: SchedulerView) -> float:
        """Prompts per second that arrived over the load window, not counting those still
        waiting or being prefilled (a step works for them; the rate is of the others that
        may arrive during it)."""
        since = view.now - LOAD_WINDOW_S
        pending = sum(
            r.arrival_time >= since for r in itertools.chain(view.prefilling, view.waiting)
        )
        return max(0, len(self._arrived) - pending) / LOAD_WINDOW_S

    @property
    def mixed_spread(self) -> float:
        """How far above the fast scale's prediction a mixed step may come out: the
        ``SPREAD_QUANTILE`` of recent ones (1 until 20 ran), within [1, SPREAD_MAX]."""
        if len(self._spread) < 20:
            return 1.0
        ratios = sorted(self._spread)
        return min(SPREAD_MAX, max(1.0, ratios[int(SPREAD_QUANTILE * (len(ratios) - 1))]))

    def prefill_load(self, view: SchedulerView) -> float:
        """Share of the machine's time the arriving prompts need: their prefill work alone
        (``CostModel.prefill_work_s``, with the model's current weights) arrived over the
        last ``LOAD_WINDOW_S``, per second. The window keeps the sum of the prompts' cost
        features, so the load is re-priced every step as the model learns."""
        self._track_arrivals(view)
        if not self._arrived:
            return 0.0
        return max(0.0, dot(self.model.weights, self._arrived_sum)) / LOAD_WINDOW_S

    def _track_arrivals(self, view: SchedulerView) -> None:
        """Bring the load window up to the scheduler's arrivals and its clock."""
        now = view.now
        new = view.num_added - self._num_seen
        self._num_seen = view.num_added
        arrivals = view.arrivals
        for r in itertools.islice(arrivals, max(0, len(arrivals) - new), None):
            row = self.model.features(StepShape((), ((0, r.num_prompt_tokens),)))
            row = (0.0, *row[1:])  # a step's fixed cost is not the prompt's work
            self._arrived.append((r.arrival_time, row))
            self._arrived_sum = [a + b for a, b in zip(self._arrived_sum, row)]
        while self._arrived and self._arrived[0][0] < now - LOAD_WINDOW_S:
            row = self._arrived.popleft()[1]
            self._arrived_sum = [a - b for a, b in zip(self._arrived_sum, row)]
        if not self._arrived:
            self._arrived_sum = [0.0] * NUM_FEATURES  # no float residue

    def backlog_work_s(self, view: SchedulerView) -> float:
        """Predicted prefill work of the prompts waiting or in progress (the first
        ``MAX_SCANNED_PROMPTS``): what the share adds to drain within ``LOAD_WINDOW_S``."""
        return sum(
            self.model.prefill_work_s(r.num_uncomputed_tokens, r.num_computed_tokens)
            for r in itertools.islice(
                itertools.chain(view.prefilling, view.waiting), MAX_SCANNED_PROMPTS
            )
        )

    def _room_for_short(self, view: SchedulerView, target_s: float) -> int:
        """Adaptive budget: room for the prompts whose rest fits the target whole (waiting
        ones with ``WHOLE_PROMPT_SLACK``; shortest first, each priced at its own start
        beside the decodes), plus the blocks owed (``_owed_blocks``); 0 if none fits. The
        scheduler serves the shortest prompts first, so a short prompt arriving while a long
        one is chunked is prefilled in the next step or two."""
        pending = view.prefilling + list(view.waiting[:MAX_SCANNED_PROMPTS])
        in_progress = {id(r) for r in view.prefilling}
        # Each prompt priced at its own start (a rest in progress re-reads its prefix), the
        # step's fixed cost and the decodes once: the features are sums over chunks.
        step_s = self.model.predict(StepShape(tuple(view.decode_lens), prefill_samples=1))
        room, started, largest = 0, False, 0
        for r in sorted(pending, key=lambda r: r.num_uncomputed_tokens):
            started |= id(r) in in_progress
            n = r.num_uncomputed_tokens
            step_s += self.model.prefill_work_s(n, r.num_computed_tokens)
            if step_s > (target_s if started else WHOLE_PROMPT_SLACK * target_s):
                break
            room, largest = room + n, n
        if not room:
            return 0
        return room + self._owed_blocks(view, largest)

    def _room_at_start(self, view: SchedulerView, target_s: float) -> int:
        """When no prompt fits whole and the shortest is a prompt not started beside ones in
        progress: the whole blocks of it that fit the target at its own start (its rest,
        shorter, fits in the next step; planned at the long ones' depth its tokens would be
        overpriced), plus the blocks owed; 0 otherwise, or if not a block fits."""
        prefilling = view.prefilling
        pending = prefilling + list(view.waiting[:MAX_SCANNED_PROMPTS])
        if not prefilling or not pending:
            return 0
        shortest = min(pending, key=lambda r: r.num_uncomputed_tokens)
        if shortest in prefilling:
            return 0
        block = self.min_prefill_tokens
        room = self.model.max_prefill_tokens(
            view.decode_lens,
            shortest.num_computed_tokens,
            target_s,
            shortest.num_uncomputed_tokens,
        )
        room = room // block * block
        if not room:
            return 0  # not a block: over the target, as usual
        return room + self._owed_blocks(view, room)

    def _owed_blocks(self, view: SchedulerView, served: int) -> int:
        """The blocks the scheduler hands first to the prompts in progress that did not
        advance in the last step (each moves one block: every prompt in progress advances
        at least every other step) and whose rest is longer than ``served`` tokens (the
        largest rest the room covers whole)."""
        owed = sum(
            1
            for r in view.prefilling
            if r.num_uncomputed_tokens > served and not view.prefilled_last_step(r)
        )
        return self.min_prefill_tokens * owed

    def decide(self, view: SchedulerView) -> BudgetDecision:
        """The budget for the scheduler's next step (``view``: ``Scheduler.view()``)."""
        decode_lens = view.decode_lens
        starts = [r.num_computed_tokens for r in view.prefilling]  # where they resume
        drafts = view.num_pending_drafts
        if not starts and not view.waiting:
            budget = len(decode_lens) + drafts
            self.last = BudgetDecision(budget, len(decode_lens), 0, 0.0, None, False)
            return self.last
        if not starts:
            starts.append(view.waiting[0].num_computed_tokens)
        # Prefills that may share the step: those in progress and the waiting ones; each
        # chunk reads its own cached prefix.
        starts = sorted(starts, reverse=True)[:MAX_PLANNED_CHUNKS]
        prefill_start, others = starts[0], sum(starts[1:])
        num_chunks = min(MAX_PLANNED_CHUNKS, len(starts) + bool(view.waiting))
        target = self.step_target_s(view)
        short, long = 0, False
        if self.policy.kind == "adaptive":  # a latency target is a hard bound: no extra room
            short = self._room_for_short(view, target)
            # No prompt fits the step whole: a long step for the waiting prompts that fit
            # one whole, if the credit allows one; else the blocks of the shortest that fit.
            if not short and self._takes_long_step(decode_lens, target):
                short = self._room_for_waiting(view, self.longest_step_s())
                if short:
                    long, target = True, self.longest_step_s()
            if not short:
                short = self._room_at_start(view, target)
        # Planned conservatively: as if all tokens were one chunk at the deepest start.
        room = self.model.max_prefill_tokens(
            decode_lens, prefill_start, target, self.max_prefill_tokens, num_chunks, others
        )
        block = self.min_prefill_tokens
        if short:
            # Prompts that fit whole go now, alone (or beside the one block a long prompt is
            # owed): the step that makes their first token is no longer than it must be (a
            # long chunk on top would add to their TTFT and to everyone's gap), with nothing
            # decoding too (a prefill instance's steps). Exactly their tokens: a rounded-up
            # room would hand the rest to a long prompt. Draft tokens (the decodes', going
            # first) come on top, at most as many: out of the room they would cut the short
            # prompts, and without them speculation would pause while prompts arrive.
            room, over, draft_room = short, False, min(drafts, short)
        else:
            over = room < block
            if self.policy.kind == "adaptive":
                if decode_lens:
                    # The model is trusted near the shapes it just measured: beside decodes
                    # the room at most doubles from the last step's (after a change of
                    # speed, a refit still lagging priced 3x the tokens at 1.6x the bound).
                    # Draft tokens come out of the room below: not counted here.
                    room = min(room, max(ROOM_GROWTH * self._last_room, 2 * block) + drafts)
                # Whole blocks (a chunk ends on a block boundary anyway), rounded down where
                # the slowdown is the bound (rounded up, a long prompt's deep chunks came out
                # 1.14x over it on the 2-core EPYC: the tail of every gap), up where the load
                # needs more (rounded down, the share it needs is not met).
                blocks = -(-room // block) if self.load_bound else room // block
                room = min(self.max_prefill_tokens, blocks * block)
            room = max(room, block)
            # Draft tokens are the decodes' and go first, out of the room (verify rows cost
            # about what prefill rows do); one block of prefill still moves.
            draft_room = min(drafts, room - block)
            room = max(block, room - draft_room)
        predicted = self.model.predict(
            StepShape(tuple(decode_lens), ((prefill_start, room + draft_room),), prefill_samples=1)
        )
        if over:
            self.num_over_target += 1
            if self.num_over_target % self.log_every == 1:
                logger.info(
                    "%s: %d decodes leave no room for one block of prefill (predicted "
                    "%.0f ms with it, target %.0f ms); running %d prefill tokens anyway "
                    "(%d such steps so far)",
                    self.policy.describe(),
                    len(decode_lens),
                    1e3 * predicted,
                    1e3 * target,
                    room,
                    self.num_over_target,
                )
        if not long:  # the next ordinary step grows from the last ordinary one's room
            self._last_room = room if decode_lens else 0
        self.last = BudgetDecision(
            len(decode_lens) + draft_room + room,
            len(decode_lens),
            room,
            predicted,
            target,
            over,
            draft_room,
            long,
        )
        return self.last

    def longest_step_s(self) -> float:
        """The longest step the adaptive budget plans: ``IDLE_STEP_FACTOR`` times the step's
        fixed cost (an idle step when prompts come rarely; a long step beside decodes)."""
        return IDLE_STEP_FACTOR * self.model.predict(StepShape(prefill_samples=1))

    def _room_for_waiting(self, view: SchedulerView, target_s: float) -> int:
        """Room for the waiting prompts that the scheduler serves before any prompt in
        progress, would start whole one after another (``Scheduler.starts_in_order``: its
        limits on running requests, long prompts and KV room: ``waiting_starts``), and whose
        whole prefill fits
        ``target_s`` together beside the decodes (0 if the first does not), plus the blocks
        owed to the prompts in progress (``_owed_blocks``), which the scheduler hands out
        first."""
        leading = view.waiting_starts(MAX_SCANNED_PROMPTS)
        step_s = self.model.predict(StepShape(tuple(view.decode_lens), prefill_samples=1))
        room = 0
        for r in leading:
            n = r.num_uncomputed_tokens
            step_s += self.model.prefill_work_s(n, r.num_computed_tokens)
            if step_s > target_s or room + n > self.max_prefill_tokens:
                break
            room += n
        if not room:
            return 0
        return room + self._owed_blocks(view, 0)

    def long_step_served(self, out) -> bool:
        """Whether the step that ran (``out``, planned by the last ``decide``) was a long
        step: planned as one, and it prefilled a waiting prompt whole (its first chunk ends
        the prompt). A plan the scheduler could not follow is no long step: no credit spent,
        none counted."""
        if self.last is None or not self.last.long:
            return False
        return any(c.samples and c.start == c.request.num_cached_tokens for c in out.prefills)

    def _takes_long_step(self, decode_lens: list[int], target_s: float) -> bool:
        """Whether a step beside these decodes, whose prompts none fits whole, is a long one
        (see ``long_step_share``): the adaptive policy, the credit covers one long gap per
        decode, and the longest step is longer than the target."""
        if self.policy.kind != "adaptive" or not decode_lens or not self.policy.long_step_share:
            return False
        return self.long_credit >= len(decode_lens) and self.longest_step_s() > target_s

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
        (new requests, handing out tokens). The ITL margin is planned on that gap; the model
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
            kind = out.kind
            if kind in self.scale:
                r = min(max(measured_s / predicted, SCALE_CLIP[0]), SCALE_CLIP[1])
                if kind == "mixed":
                    self._spread.append(r / self.scale[kind])
                self.scale[kind] += SCALE_ALPHA * (r - self.scale[kind])
        if out.prefills:
            self._observe_chunking(shape)
        if self.long_step_served(out):  # one long gap per decode
            self.num_long_steps += 1
            self.long_credit = max(0.0, self.long_credit - len(out.decodes))
        if out.decodes:  # every gap earns a share of a long one
            n = len(out.decodes)
            share = self.policy.long_step_share
            self.long_credit = min(LONG_STEPS_BANKED * n, self.long_credit + share * n)
        self.model.observe(shape, measured_s)

    def _observe_chunking(self, shape: StepShape) -> None:
        """Average what the step's chunks cost over what the same tokens cost in one whole
        prefill (per-chunk costs, each chunk re-reading its prefix): the load and the backlog
        are priced as whole prompts, and chunked they cost this much more."""
        work = self.model.prefill_work_s

        def alone(k: int) -> float:  # the first k tokens of a prompt, prefilled whole
            return work(k) if k else 0.0

        chunked = sum(work(n, start) for start, n in shape.prefill_chunks)
        whole = sum(alone(start + n) - alone(start) for start, n in shape.prefill_chunks)
        self._chunked_s += MEAN_ALPHA * (chunked - self._chunked_s)
        self._whole_s += MEAN_ALPHA * (whole - self._whole_s)

    @property
    def chunking_overhead(self) -> float:
        """Recent chunked prefill cost over the whole-prompt cost of the same tokens (>= 1)."""
        if self._whole_s <= 0:
            return 1.0
        return max(1.0, self._chunked_s / self._whole_s)
