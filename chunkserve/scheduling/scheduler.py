"""Iteration-level scheduler with a token budget: stall-free (Sarathi-Serve) batching.

Pure Python, no torch. Each ``schedule()`` spends one token budget
(``max_num_batched_tokens``) and a sequence budget (``max_num_seqs``):

1. running decodes first, one token each (decode-maximal: a long prompt never stalls them);
2. then the prefill share, over the prefills in progress and the waiting requests (admitted
   while sequence slots and KV blocks last). By default (``prefill_order="shortest"``) the
   prompts with the least left to compute go first (a waiting one's length counts less the
   longer it waits), after a block for each prefill in progress that got nothing in the last
   step; with ``"arrival"``, prefills in progress then waiting requests, in policy order.
   The policy's priorities (``scheduling_policy="priority"``) come before length.

A chunk that does not end its prompt is cut at a KV-block boundary where it can be, so the
next chunk starts on a fresh block (and full blocks can be shared by a prefix cache).

With chunked prefill off the old behaviour returns: a step either prefills whole prompts
(decodes wait: the stall every benchmark compares against) or decodes all running requests.

When the pool runs out of blocks, the least urgent running request (newest arrival under
FCFS) is preempted: its blocks are freed and it recomputes later from its place by arrival.

Disaggregated decode (``kv_transfer_params.prefill_url``): such a request waits in its own
queue (``remote_waiting``, by arrival); ``admit_remote`` gives it blocks for its whole prompt
(after its cached prefix) while they last, and it waits in ``receiving`` (status
``WAITING_FOR_KV``, never preempted: another instance is writing its blocks) until
``kv_received`` makes it a running prefill with one token left: the step that computes that
token samples its first output.
"""

from __future__ import annotations

import bisect
import itertools
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence, Set
from dataclasses import dataclass, field

from chunkserve.config import SchedulerConfig
from chunkserve.scheduling.kv_cache import KVCacheManager
from chunkserve.scheduling.request import Request, RequestStatus


@dataclass
class ScheduledChunk:
    """``num_tokens`` tokens of ``request`` starting at position ``start``."""

    request: Request
    start: int
    num_tokens: int
    # A decode's draft tokens (speculative decoding): the chunk is the request's last token
    # then these, ``1 + len(draft_token_ids)`` rows, each sampled to verify the next.
    draft_token_ids: list[int] = field(default_factory=list)
    # True if this chunk ends the request's known tokens: its last row is sampled. Fixed
    # when the chunk is made, so it still describes the step after ``update`` appended the
    # sampled token (cost models read the step's shape then).
    samples: bool = field(init=False)
    num_accepted: int = field(init=False, default=0)  # drafts verification accepted

    def __post_init__(self) -> None:
        self.samples = self.end - len(self.draft_token_ids) == self.request.num_tokens

    def extend(self, extra: int) -> None:
        """Grow the chunk by ``extra`` tokens (the scheduler's leftover budget)."""
        self.num_tokens += extra
        self.samples = self.end == self.request.num_tokens

    @property
    def end(self) -> int:
        return self.start + self.num_tokens


@dataclass
class SchedulerOutput:
    """One step's batch. Batch order is ``prefills`` then ``decodes``::

    tokens:  | chunk A (start 256, 128 tok) | chunk B (start 0, 37 tok) | dC | dD | dE |
    sees:    | A[0 .. 256+i]                | B[0 .. i]                 | C  | D  | E  |
    """

    prefills: list[ScheduledChunk] = field(default_factory=list)
    decodes: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    token_budget: int = 0
    num_running: int = 0
    num_waiting: int = 0
    kv_usage: float = 0.0

    @property
    def chunks(self) -> list[ScheduledChunk]:
        return self.prefills + self.decodes

    @property
    def num_prefill_tokens(self) -> int:
        return sum(c.num_tokens for c in self.prefills)

    @property
    def num_decode_tokens(self) -> int:
        """Decode rows, draft tokens included."""
        return sum(c.num_tokens for c in self.decodes)

    @property
    def num_draft_tokens(self) -> int:
        return sum(len(c.draft_token_ids) for c in self.decodes)

    @property
    def num_batched_tokens(self) -> int:
        return self.num_prefill_tokens + self.num_decode_tokens

    @property
    def is_empty(self) -> bool:
        return not self.prefills and not self.decodes

    @property
    def kind(self) -> str:
        """``prefill``, ``decode``, ``mixed`` or ``idle``."""
        if self.prefills and self.decodes:
            return "mixed"
        if self.prefills:
            return "prefill"
        return "decode" if self.decodes else "idle"


@dataclass(frozen=True)
class SchedulerView:
    """What an online budget (``budget.BudgetController.decide``) reads of the scheduler
    before a step, built by ``Scheduler.view()``. Read only: neither it nor its requests
    are changed through it."""

    now: float  # the scheduler's clock
    decode_lens: list[int]  # tokens of each running decode (``Scheduler.running_decodes``)
    num_pending_drafts: int  # draft tokens those decodes would carry next step
    prefilling: list[Request]  # prompts in progress (``Scheduler._prefilling``)
    waiting: Sequence[Request]  # waiting prompts, in policy order
    arrivals: Sequence[Request]  # the latest requests added, oldest first (bounded)
    num_added: int  # requests ever added (``arrivals`` keeps the latest)
    prefilled_last_step_ids: Set[str]  # ids of the prompts the last step advanced
    _waiting_starts: Callable[[int], list[Request]]

    def prefilled_last_step(self, request: Request) -> bool:
        return request.request_id in self.prefilled_last_step_ids

    def waiting_starts(self, limit: int) -> list[Request]:
        """``Scheduler.waiting_starts``: the waiting prompts the next step would start
        whole, one after another, before any prompt in progress."""
        return self._waiting_starts(limit)


# Most waiting requests looked at per step (bounds the scan and the shortest-first sort).
MAX_WAITING_SCAN = 512
# Shortest-first prefill: a waiting prompt's length counts as halved after it waited this
# long (a third after twice as long...), so a long prompt overtakes fresh short ones in time.
PREFILL_AGEING_S = 5.0
WAITING_STATES = (RequestStatus.WAITING, RequestStatus.PREEMPTED)


def _fcfs_key(r: Request) -> tuple:
    return (r.arrival_time, r.arrival_seq)


def _priority_key(r: Request) -> tuple:
    return (r.priority, r.arrival_time, r.arrival_seq)


class Scheduler:
    """Owns the waiting and running queues and every request's status and counters."""

    def __init__(
        self,
        config: SchedulerConfig,
        kv: KVCacheManager,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if kv.block_size != config.block_size:
            raise ValueError("block_size: scheduler and KV cache disagree")
        self.config = config
        self.kv = kv
        self.clock = clock
        self._key = _priority_key if config.policy == "priority" else _fcfs_key
        # By arrival, a long prompt's share of a step is capped so shorter ones behind it
        # find room (the leftover goes back to it); shortest-first serves them first anyway.
        self._caps_long = (
            config.prefill_order == "arrival" and config.long_prefill_token_threshold > 0
        )
        self.waiting: list[Request] = []  # sorted by policy key
        self.running: list[Request] = []  # sorted by policy key
        # Disaggregated decode: prompts whose KV another instance computes (module doc).
        self.remote_waiting: list[Request] = []  # by arrival
        self.receiving: dict[str, Request] = {}
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self._prefilled_last_step: set[str] = set()
        # The latest requests added, oldest first (bounded), and how many were ever added:
        # an online budget reads the prefill load arriving from here.
        self.arrivals: deque[Request] = deque(maxlen=MAX_WAITING_SCAN)
        self.num_added = 0
        # Admission's share of outputs to reserve: ``init`` after a preemption (and at
        # start), then linearly down to ``min``, reached after ``decay_steps`` steps exactly.
        self.new_token_ratio = config.init_new_token_ratio
        self._steps_since_preemption = 0

    # ---- queue management ----------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        """Queue a request the edge has checked (``InputProcessor.check``: its length fits
        ``max_model_len``, which the engine sized the cache to hold; its id is new)."""
        assert request.request_id not in self.requests, f"{request.request_id!r} is in use"
        needed = request.num_prompt_tokens + request.max_tokens
        assert needed <= self.config.max_model_len, f"{needed} tokens > max_model_len"
        # The last sampled token is never written to the cache, hence ``needed - 1``.
        assert self.kv.max_blocks_for(needed - 1) <= self.kv.num_blocks, "cannot ever fit"
        self.requests[request.request_id] = request
        if request.prefill_url is not None:
            self.remote_waiting.append(request)  # computed elsewhere: no prefill load here
            return
        self.arrivals.append(request)
        self.num_added += 1
        self._insert(self.waiting, request)

    def _insert(self, queue: list[Request], request: Request) -> None:
        bisect.insort(queue, request, key=self._key)

    def running_decodes(self) -> list[Request]:
        """The running requests whose prompts are computed: the next step decodes them."""
        running = RequestStatus.RUNNING
        return [r for r in self.running if r.status == running and not r.is_prefilling]

    def drafts_allowed(self, num_decodes: int) -> bool:
        """Speculative decoding's ``disable_by_batch_size``: no drafts in a step with more
        decodes than that."""
        limit = self.config.spec_disable_by_batch_size
        return not limit or num_decodes <= limit

    def pending_drafts(self, decodes: Sequence[Request]) -> int:
        """Draft tokens these running decodes would carry next step (speculative decoding),
        before any budget."""
        if not self.drafts_allowed(len(decodes)):
            return 0
        return sum(min(len(r.draft_token_ids), self.max_drafts(r)) for r in decodes)

    def view(self) -> SchedulerView:
        """What an online budget reads before the next step (``SchedulerView``)."""
        decodes = self.running_decodes()
        return SchedulerView(
            now=self.clock(),
            decode_lens=[r.num_tokens for r in decodes],
            num_pending_drafts=self.pending_drafts(decodes),
            prefilling=self._prefilling(),
            waiting=self.waiting,
            arrivals=self.arrivals,
            num_added=self.num_added,
            prefilled_last_step_ids=self._prefilled_last_step,
            _waiting_starts=self.waiting_starts,
        )

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.remote_waiting or self.receiving)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting) + len(self.remote_waiting)

    @property
    def num_waiting_for_kv(self) -> int:
        """Requests holding blocks while their prompt's KV arrives (disaggregated)."""
        return len(self.receiving)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def finish_request(self, request: Request, status: RequestStatus) -> None:
        """Finish (stop, length, abort, error): leaves every queue, frees its blocks."""
        if request.is_finished:
            return
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        elif request.status == RequestStatus.WAITING_FOR_KV:
            del self.receiving[request.request_id]
        elif request.prefill_url is not None and request in self.remote_waiting:
            self.remote_waiting.remove(request)
        else:
            self.waiting.remove(request)
        self.kv.free(request)
        request.status = status
        request.metrics.finished_time = self.clock()
        self.requests.pop(request.request_id, None)

    def abort_request(self, request_id: str) -> Request | None:
        request = self.requests.get(request_id)
        if request is not None:
            self.finish_request(request, RequestStatus.FINISHED_ABORTED)
        return request

    # ---- disaggregated decode -------------------------------------------------------------
    def admit_remote(self) -> list[Request]:
        """Give waiting remote-prefill requests (by arrival) blocks for their whole prompt,
        after the prefix this cache holds, while sequence slots and blocks last. Returns the
        requests admitted: their KV is to be asked for from ``num_computed_tokens`` on."""
        admitted = []
        kv = self.kv
        while self.remote_waiting:
            if len(self.running) + len(self.receiving) >= self.config.max_num_seqs:
                break
            request = self.remote_waiting[0]
            blocks, hit = kv.match_prefix(request)
            if blocks:
                kv.acquire_prefix(request, blocks)
            need = self._future_tokens(request)
            fits = not self.running or need <= self._admission_headroom()
            if not (fits and kv.allocate_slots(request, request.num_uncomputed_tokens)):
                if blocks:  # give the hit back; it stays cached
                    kv.free(request)
                    request.num_computed_tokens = request.num_cached_tokens = 0
                break
            kv.record_query(request.num_tokens, hit)
            self.remote_waiting.pop(0)
            request.status = RequestStatus.WAITING_FOR_KV
            request.metrics.first_scheduled_time = self.clock()
            self.receiving[request.request_id] = request
            admitted.append(request)
        return admitted

    def kv_received(self, request: Request, num_tokens: int) -> None:
        """The prompt's KV up to ``num_tokens`` is in the request's blocks: it runs, a
        prefill with the rest (one token) to compute."""
        assert request.status == RequestStatus.WAITING_FOR_KV
        del self.receiving[request.request_id]
        request.num_computed_tokens = num_tokens
        # A sliding group's blocks before the window of the next token were not sent (nor
        # written): given back before the prefix cache could publish them.
        self.kv.give_back_out_of_window(request)
        self.kv.cache_full_blocks(request)
        request.status = RequestStatus.RUNNING
        self._insert(self.running, request)

    # ---- scheduling ----------------------------------------------------------------------
    def schedule(
        self, token_budget: int | None = None, draft_budget: int | None = None
    ) -> SchedulerOutput:
        """Build the next step. ``token_budget`` overrides ``max_num_batched_tokens`` for this
        step (an online controller may shrink it); decodes are always served.
        ``draft_budget``: most draft tokens the decodes may carry (None: what the budget
        leaves after one token per decode)."""
        budget = self.config.max_num_batched_tokens if token_budget is None else token_budget
        out = SchedulerOutput(token_budget=budget)
        if self.config.enable_chunked_prefill:
            self._schedule_chunked(out, budget, draft_budget)
        else:
            self._schedule_unchunked(out, budget)
        self._steps_since_preemption = 0 if out.preempted else self._steps_since_preemption + 1
        self.new_token_ratio = self._decayed_ratio(self._steps_since_preemption)
        now = self.clock()
        for chunk in out.prefills:
            if chunk.request.metrics.first_scheduled_time is None:
                chunk.request.metrics.first_scheduled_time = now
        out.num_running = len(self.running)
        out.num_waiting = len(self.waiting)
        out.kv_usage = self.kv.usage
        return out

    def _decayed_ratio(self, steps: int) -> float:
        """``new_token_ratio`` ``steps`` steps after the last preemption (computed from the
        count, not by repeated subtraction, so the minimum is reached on time, exactly)."""
        c = self.config
        if steps >= c.new_token_ratio_decay_steps:
            return c.min_new_token_ratio
        span = c.init_new_token_ratio - c.min_new_token_ratio
        return c.init_new_token_ratio - span * steps / c.new_token_ratio_decay_steps

    def _schedule_decodes(self, out: SchedulerOutput, draft_budget: int | None) -> None:
        """Every running decode, one token each plus its draft tokens (speculative
        decoding) while ``draft_budget`` lasts (None: what the step's budget leaves after
        one token per decode); never dropped for prefill."""
        decodes = self.running_decodes()
        if draft_budget is None:
            draft_budget = out.token_budget - len(decodes)
        if not self.drafts_allowed(len(decodes)):
            draft_budget = 0
        for request in decodes:
            if request.status != RequestStatus.RUNNING:
                continue  # preempted for an earlier decode's blocks
            drafts = request.draft_token_ids
            request.draft_token_ids = []
            k = min(len(drafts), max(0, draft_budget), self.max_drafts(request))
            if k and not self.kv.can_allocate(request, 1 + k):
                k = 0  # drafts are optional: never preempt for them
            if self._reserve(request, 1 + k, out):
                draft_budget -= k
                out.decodes.append(
                    ScheduledChunk(request, request.num_computed_tokens, 1 + k, drafts[:k])
                )

    def max_drafts(self, request: Request) -> int:
        """Drafts a decode may verify: the step emits at most 1 + k tokens, within
        ``max_tokens`` and ``max_model_len``."""
        left = min(
            request.max_tokens - request.num_output_tokens,
            self.config.max_model_len - request.num_tokens,
        )
        return max(0, left - 1)

    def _schedule_chunked(
        self, out: SchedulerOutput, budget: int, draft_budget: int | None = None
    ) -> None:
        cfg = self.config
        # 1. Running decodes first, with their drafts.
        self._schedule_decodes(out, draft_budget)

        prefilling = self._prefilling()
        shortest = cfg.prefill_order == "shortest"
        chunks: dict[str, ScheduledChunk] = {}
        if shortest:
            # 2. A prefill in progress that got nothing last step (shorter prompts took the
            # budget) moves one block first: every prompt in progress advances at least
            # every other step, however many shorter ones arrive.
            for request in prefilling:
                left = out.token_budget - out.num_batched_tokens
                if left <= 0:
                    break
                if not self.prefilled_last_step(request):
                    self._grow_prefill(request, min(left, cfg.block_size), out, chunks)

        # 3. The rest of the budget: prefills in progress and waiting requests, in policy
        # order, then shortest-first (aged) or by arrival. By arrival, a long prompt takes
        # at most long_prefill_token_threshold tokens here (the leftover goes back to it at
        # the end). A long waiting prompt over the long limit is skipped so shorter ones
        # start.
        candidates = self.prefill_queue()
        partial = len(prefilling)
        long_partial = sum(1 for r in prefilling if self._is_long(r))
        headroom = self._admission_headroom()
        admitting = True
        in_progress = {id(r) for r in prefilling}
        for request in candidates:
            left = out.token_budget - out.num_batched_tokens
            if left <= 0:
                break
            if id(request) in in_progress:
                self._grow_prefill(request, left, out, chunks)
                continue
            if not admitting or request.status not in WAITING_STATES:
                continue
            if self._admission_closed(len(self.running), partial):
                admitting = False
                continue
            is_long = self._is_long(request)
            if is_long and self._long_limit_reached(long_partial):
                continue
            admitted, headroom = self._try_admit(request, left, headroom, out)
            if not admitted:
                admitting = False  # out of blocks: later requests wait too (no starvation)
                continue
            partial += 1
            long_partial += is_long
        if self._caps_long:
            self._give_leftover_to_long(out)
        self._prefilled_last_step = {c.request.request_id for c in out.prefills}

    def _prefilling(self) -> list[Request]:
        """The running requests whose prompt is in progress (not preempted this step)."""
        return [r for r in self.running if r.status == RequestStatus.RUNNING and r.is_prefilling]

    def _admission_closed(self, num_running: int, num_partial: int) -> bool:
        """Whether no more requests start this step: ``max_num_seqs`` running, or
        ``max_num_partial_prefills`` prompts in progress."""
        cfg = self.config
        return num_running >= cfg.max_num_seqs or bool(
            cfg.max_num_partial_prefills and num_partial >= cfg.max_num_partial_prefills
        )

    def _long_limit_reached(self, num_long_partial: int) -> bool:
        """Whether a long prompt (``_is_long``) may not start: ``max_long_partial_prefills``
        long prompts already in progress (the step skips it for shorter ones)."""
        limit = self.config.max_long_partial_prefills
        return bool(limit and num_long_partial >= limit)

    def starts_in_order(self, requests: Sequence[Request]) -> int:
        """How many of ``requests`` (waiting prompts, in ``prefill_queue`` order) the next
        step would start one after another, each whole and none skipped before them, if its
        budget covered them: the limits on running requests, prompts in progress and long
        prompts, and the KV headroom and free blocks that admission checks (a prefix-cache
        hit, unknown until admission, only makes room). By arrival a long prompt's first
        chunk is capped (``_long_cap``): it does not start whole, so the count stops there."""
        prefilling = self._prefilling()
        running, partial = len(self.running), len(prefilling)
        long_partial = sum(1 for r in prefilling if self._is_long(r))
        headroom = self._admission_headroom()
        free_blocks = self.kv.num_free_blocks
        for i, request in enumerate(requests):
            if request.status not in WAITING_STATES or self._admission_closed(running, partial):
                return i
            is_long = self._is_long(request)
            if is_long and (self._caps_long or self._long_limit_reached(long_partial)):
                return i
            need = self._future_tokens(request)
            blocks = self.kv.num_new_blocks(request, request.num_uncomputed_tokens)
            if (running and need > headroom) or blocks > free_blocks:
                return i
            running, partial, long_partial = running + 1, partial + 1, long_partial + is_long
            headroom, free_blocks = headroom - need, free_blocks - blocks
        return len(requests)

    def prefill_queue(self, limit: int = MAX_WAITING_SCAN) -> list[Request]:
        """The prompts in progress and the first ``limit`` waiting, in the order the next
        step hands out its prefill budget (the block a prompt in progress is owed aside)."""
        prefilling = self._prefilling()
        queue = prefilling + self.waiting[:limit]
        if self.config.prefill_order == "shortest":
            now = self.clock()
            queue.sort(key=lambda r: self._shortest_key(r, now))
        return queue

    def waiting_starts(self, limit: int = MAX_WAITING_SCAN) -> list[Request]:
        """The waiting prompts at the head of ``prefill_queue(limit)`` (before any prompt
        in progress) that the next step would start whole one after another
        (``starts_in_order``)."""
        queue = self.prefill_queue(limit)
        leading = list(itertools.takewhile(lambda r: r.status != RequestStatus.RUNNING, queue))
        return leading[: self.starts_in_order(leading)]

    def prefilled_last_step(self, request: Request) -> bool:
        """Whether the request's prompt advanced in the last step (under shortest-first, a
        prompt in progress that did not moves one block first in the next)."""
        return request.request_id in self._prefilled_last_step

    def _shortest_key(self, request: Request, now: float) -> tuple:
        """Prefill order under ``prefill_order="shortest"``: the policy's priority first,
        then the tokens left to compute, shrunk by the time a waiting request has waited
        (halved after ``PREFILL_AGEING_S``, a third after twice that...), then arrival."""
        remaining = float(request.num_uncomputed_tokens)
        if request.status != RequestStatus.RUNNING:
            remaining /= 1.0 + max(0.0, now - request.arrival_time) / PREFILL_AGEING_S
        urgency = request.priority if self.config.policy == "priority" else 0
        return (urgency, remaining, request.arrival_time, request.arrival_seq)

    def _grow_prefill(
        self,
        request: Request,
        budget: int,
        out: SchedulerOutput,
        chunks: dict[str, ScheduledChunk],
    ) -> None:
        """Give a prefill in progress up to ``budget`` more tokens this step: a new chunk
        (which may preempt others for blocks) or more of the chunk it already has."""
        if request.status != RequestStatus.RUNNING:
            return  # preempted earlier in this step
        chunk = chunks.get(request.request_id)
        if chunk is None:
            n = self._chunk_len(request, budget, out.token_budget)
            if self._reserve(request, n, out):
                chunk = ScheduledChunk(request, request.num_computed_tokens, n)
                out.prefills.append(chunk)
                chunks[request.request_id] = chunk
            return
        self._extend(chunk, self._chunk_len(request, budget, out.token_budget, start=chunk.end))

    def _extend(self, chunk: ScheduledChunk, extra: int) -> None:
        """Grow a chunk by up to ``extra`` tokens, ending on a block boundary unless it ends
        the prompt (nothing if the pool is short)."""
        r = chunk.request
        end = chunk.end + extra
        if end < r.num_tokens:
            end -= end % self.config.block_size
        extra = end - chunk.end
        if extra > 0 and self.kv.allocate_slots(r, chunk.num_tokens + extra):
            chunk.extend(extra)

    def _give_leftover_to_long(self, out: SchedulerOutput) -> None:
        """Budget nobody else took goes back to the long prompts capped in the first pass,
        so the cap costs no throughput when no short prompt is waiting."""
        for chunk in out.prefills:
            left = out.token_budget - out.num_batched_tokens
            if left <= 0:
                return
            remaining = chunk.request.num_tokens - chunk.end
            if remaining > 0 and self._is_long(chunk.request):
                self._extend(chunk, min(left, remaining))

    def _schedule_unchunked(self, out: SchedulerOutput, budget: int) -> None:
        # Whole prompts first: a prefill-only step (decodes stall) whenever one fits.
        headroom = self._admission_headroom()
        while self.waiting and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            left = out.token_budget - out.num_batched_tokens
            if out.prefills and request.num_uncomputed_tokens > left:
                break  # the first prompt of a step is always taken whole
            admitted, headroom = self._try_admit(request, None, headroom, out)
            if not admitted:
                break
        if out.prefills:
            return
        self._schedule_decodes(out, None)

    def _try_admit(
        self, request: Request, budget: int | None, headroom: float, out: SchedulerOutput
    ) -> tuple[bool, float]:
        """Start a waiting request with its first chunk (``budget`` None: the whole prompt).

        A prefix-cache hit is taken first, so only the uncached rest counts against budget
        and blocks. Under the priority policy, less urgent running requests are preempted
        to make room. Returns (admitted, headroom left)."""
        kv = self.kv
        blocks, hit = kv.match_prefix(request)
        if blocks:
            kv.acquire_prefix(request, blocks)
        while True:
            n = (
                request.num_uncomputed_tokens
                if budget is None
                else self._chunk_len(request, budget, out.token_budget)
            )
            need = self._future_tokens(request)
            fits = not self.running or need <= headroom
            if fits and kv.allocate_slots(request, n):
                break
            victim = self.running[-1] if self.running else None
            if (
                self.config.policy != "priority"
                or victim is None
                or victim.priority <= request.priority
            ):
                if blocks:  # give the hit back; it stays cached
                    kv.free(request)
                    request.num_computed_tokens = request.num_cached_tokens = 0
                return False, headroom
            self._preempt(victim, out)
            headroom = self._admission_headroom()
            if budget is not None:
                budget = out.token_budget - out.num_batched_tokens
        kv.record_query(request.num_tokens, hit)
        self._admit(request)
        out.prefills.append(ScheduledChunk(request, request.num_computed_tokens, n))
        return True, headroom - need

    def _is_long(self, request: Request) -> bool:
        threshold = self.config.long_prefill_token_threshold
        return threshold > 0 and request.num_uncomputed_tokens > threshold

    def _future_tokens(self, request: Request) -> float:
        """KV slots a request will still need beyond the blocks it holds: its uncomputed
        tokens plus ``new_token_ratio`` of the outputs it may still produce, in every KV
        group (a sliding group's at most its window: ``KVCacheManager.slots_for``)."""
        outputs = min(
            request.max_tokens - request.num_output_tokens, self.config.output_estimate_clip
        )
        room = len(request.block_ids) * self.kv.block_size - request.num_computed_tokens
        tokens = max(0.0, request.num_uncomputed_tokens + outputs * self.new_token_ratio - room)
        return self.kv.slots_for(tokens)

    def _admission_headroom(self) -> float:
        """Free KV slots left after reserving the running requests' future tokens."""
        reserved = sum(self._future_tokens(r) for r in self.running)
        return self.kv.num_free_blocks * self.kv.block_size - reserved

    def _long_cap(self, token_budget: int) -> int:
        """First-pass share of a long prompt: at most the threshold and at most half the
        step's budget, so short prompts always find room; leftovers are handed back to long
        prompts after admission (``_give_leftover_to_long``)."""
        return max(1, min(self.config.long_prefill_token_threshold, token_budget // 2))

    def _chunk_len(
        self,
        request: Request,
        budget: int,
        token_budget: int | None = None,
        start: int | None = None,
    ) -> int:
        """Tokens of ``request`` to compute from ``start`` (default: its computed tokens)
        within ``budget``; a long prompt's share is capped, and a chunk that does not end
        the prompt ends on a block boundary if one is in reach."""
        begin = request.num_computed_tokens if start is None else start
        remaining = request.num_tokens - begin
        n = min(remaining, budget)
        if token_budget is not None and self._caps_long and self._is_long(request):
            done = begin - request.num_computed_tokens  # already in this step's chunk
            n = min(n, max(0, self._long_cap(token_budget) - done))
        if 0 < n < remaining:
            end = begin + n
            aligned = end - end % self.config.block_size
            if aligned > begin:
                n = aligned - begin
        return n

    def _admit(self, request: Request) -> None:
        self.waiting.remove(request)
        request.status = RequestStatus.RUNNING
        self._insert(self.running, request)

    def _reserve(self, request: Request, num_tokens: int, out: SchedulerOutput) -> bool:
        """Allocate blocks for a running request's next tokens, preempting the least urgent
        running requests until they fit. False if ``request`` itself was preempted."""
        while not self.kv.allocate_slots(request, num_tokens):
            victim = self.running[-1]
            self._preempt(victim, out)
            if victim is request:
                return False
        return True

    def _preempt(self, request: Request, out: SchedulerOutput) -> None:
        """Free a running request's blocks; it recomputes everything when readmitted."""
        out.decodes = [c for c in out.decodes if c.request is not request]
        out.prefills = [c for c in out.prefills if c.request is not request]
        self.running.remove(request)
        self.kv.free(request)
        request.draft_token_ids = []
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_cached_tokens = 0
        request.metrics.num_preemptions += 1
        self.num_preemptions += 1
        out.preempted.append(request)
        self._insert(self.waiting, request)

    # ---- after the forward pass ----------------------------------------------------------
    def update(self, out: SchedulerOutput, sampled: dict[str, list[int] | int]) -> list[Request]:
        """Advance counters by the computed chunks and append sampled tokens.

        ``sampled`` maps request id to the tokens a chunk with ``samples`` produced: one (a
        list or a bare id), or with draft tokens the accepted drafts then the target's own
        token. They are
        appended one by one; a stop condition ends the request there (later ones are
        dropped). Returns the requests that got new tokens this step (finished ones
        included, already out of the queues)."""
        now = self.clock()
        produced = []
        for chunk in out.chunks:
            request = chunk.request
            if request.status != RequestStatus.RUNNING:
                continue  # aborted while the step ran
            tokens = sampled[request.request_id] if chunk.samples else []
            if isinstance(tokens, int):
                tokens = [tokens]
            if chunk.draft_token_ids:
                # Rows computed with the right tokens: the last one and the accepted drafts.
                chunk.num_accepted = len(tokens) - 1
                request.num_computed_tokens += len(tokens)
            else:
                request.num_computed_tokens += chunk.num_tokens
            self.kv.cache_full_blocks(request)
            if not chunk.samples:
                continue
            if request.metrics.first_token_time is None:
                request.metrics.first_token_time = now
            produced.append(request)
            for token in tokens:
                request.append_output_token(token)
                request.metrics.token_times.append(now)
                status = request.check_stop_token(self.config.max_model_len)
                if status is not None:
                    self.finish_request(request, status)
                    break
            else:
                if chunk.draft_token_ids:
                    # The accepted drafts are tokens now: the blocks they filled publish.
                    self.kv.cache_full_blocks(request)
                    self.kv.trim(request)  # blocks only rejected drafts wrote
        return produced

    def fail_requests(self, requests: Iterable[Request], error: str) -> None:
        """Finish requests whose step raised (the engine keeps serving the rest)."""
        for request in requests:
            request.error = error
            self.finish_request(request, RequestStatus.FINISHED_ERROR)
