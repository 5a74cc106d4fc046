"""Speculative decoding, the pure-Python side: prompt-lookup drafts, who speculates, counts.

A step with speculation, end to end::

    step t   ... Scheduler.update appends the tokens; the core asks the proposer for drafts
             of every running decode (``request.draft_token_ids``): n-gram lookup here, or
             the draft model (``draft_model.DraftModel``, the worker's).
    step t+1 the scheduler gives each decode 1 + k tokens of the budget (decodes first;
             prefill chunks fill the rest), k trimmed by the budget, ``max_tokens``,
             ``max_model_len`` and ``disable_by_batch_size``; the runner lays a decode with
             drafts out as a (k+1)-row query over its own cache (causal among the drafts)
             in the same forward pass as the prefill chunks; the sampler verifies
             (``Sampler.verify``: greedy exact, rejection sampling otherwise) and returns
             the accepted drafts plus one token of the target's own; ``update`` appends them
             (checking stop conditions after each), counts the accepted rows as computed and
             gives back the blocks that only rejected drafts used.

Pure Python: the scheduler and the core import it.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable
from dataclasses import dataclass, field

from chunkserve.config import SpeculativeConfig
from chunkserve.scheduling.request import Request, RequestStatus

# Per-position acceptance of a request (P(draft j accepted | draft j-1 was)): exponential
# averages with this weight for the newest observation, starting from PRIOR_ACCEPTANCE.
POSITION_ALPHA = 0.2
PRIOR_ACCEPTANCE = 0.7
# The step-time fit of decode steps (``DecodeCost``): weight kept by older steps per step,
# and how strongly a draft row is pulled toward costing what a decode row costs.
COST_FORGET = 0.98
COST_PRIOR_WEIGHT = 4.0
COST_MIN_STEPS = 8
# A request's acceptance is judged over its last this many draft tokens ...
ACCEPTANCE_WINDOW = 32
# ... and after it falls below ``min_acceptance_rate`` the request makes this many tokens
# without drafts before it tries again (the text may turn repetitive later).
PAUSE_TOKENS = 64


def ngram_propose(token_ids: list[int], k: int, n_min: int, n_max: int) -> list[int]:
    """Prompt lookup: the longest suffix of ``token_ids`` (``n_max`` down to ``n_min``
    tokens) that also occurs earlier; the (up to ``k``) tokens that followed its latest
    earlier occurrence. [] if none does."""
    length = len(token_ids)
    if k <= 0 or length <= n_min:
        return []
    buf = array("i", token_ids).tobytes()  # 4 bytes a token: C-speed search
    width = 4
    for n in range(min(n_max, length - 1), n_min - 1, -1):
        suffix = buf[(length - n) * width :]
        end = (length - 1) * width  # a match ends before the last token: one follows it
        while True:
            pos = buf.rfind(suffix, 0, end)
            if pos < 0:
                break
            if pos % width == 0:
                start = pos // width + n
                return token_ids[start : start + k]
            end = pos + len(suffix) - 1  # an unaligned hit: look further back
    return []


@dataclass
class SpecCounts:
    """One step's verification: decodes with drafts, draft tokens, accepted, by position."""

    drafts: int = 0
    draft_tokens: int = 0
    accepted: int = 0
    per_position: list[int] = field(default_factory=list)


class DecodeCost:
    """Time of a decode-only step as ``a + b * decodes + c * draft tokens``, fit online by
    exponentially weighted least squares over measured steps. A draft row is pulled toward
    costing what a decode row costs (``c = b + d``, a ridge on ``d``): until steps with and
    without drafts differ enough to tell, speculation is priced as cheap and tried."""

    def __init__(self) -> None:
        self._xx = [[0.0] * 3 for _ in range(3)]
        self._xy = [0.0] * 3
        self.num_steps = 0
        self.a = self.b = self.c = 0.0

    def observe(self, num_decodes: int, num_drafts: int, seconds: float) -> None:
        x = (1.0, float(num_decodes + num_drafts), float(num_drafts))
        for i in range(3):
            self._xy[i] = COST_FORGET * self._xy[i] + x[i] * seconds
            for j in range(3):
                self._xx[i][j] = COST_FORGET * self._xx[i][j] + x[i] * x[j]
        self.num_steps += 1
        scale = self._xx[0][0] and self._xx[1][1] / self._xx[0][0]  # rows^2 per step
        # Priors: a row costs little beside the step's fixed cost until rows are seen to
        # vary (one step's worth), and a draft row what a decode row costs.
        ridge = [1e-9 * scale, max(scale, 1.0), COST_PRIOR_WEIGHT * max(scale, 1.0)]
        m = [row[:] + [y] for row, y in zip(self._xx, self._xy)]
        for i in range(3):
            m[i][i] += ridge[i]
        a, b, d = _solve3(m)
        self.a, self.b = max(a, 0.0), max(b, 0.0)
        self.c = max(b + d, 0.0)

    @property
    def ready(self) -> bool:
        return self.num_steps >= COST_MIN_STEPS


def _solve3(m: list[list[float]]) -> tuple[float, float, float]:
    """Gaussian elimination with partial pivoting of a 3x4 augmented system."""
    for col in range(3):
        pivot = max(range(col, 3), key=lambda r: abs(m[r][col]))
        m[col], m[pivot] = m[pivot], m[col]
        if abs(m[col][col]) < 1e-30:
            return 0.0, 0.0, 0.0
        for r in range(3):
            if r != col:
                f = m[r][col] / m[col][col]
                for c in range(col, 4):
                    m[r][c] -= f * m[col][c]
    return m[0][3] / m[0][0], m[1][3] / m[1][1], m[2][3] / m[2][2]


class Speculator:
    """Decides how many drafts each request gets, proposes n-gram drafts, and counts what
    verification accepted (the metrics' counters and the step log read these).

    How many drafts pay (``plan``): a step's decodes make ``D`` tokens plus, per request,
    the drafts verification accepts; each draft row costs time. From each request's
    measured acceptance by position and the measured cost of a draft row against the step
    (``DecodeCost``), drafts are kept, likeliest first, while each adds more tokens than the
    step's tokens per second would buy with its time: at batch 1 on a CPU a step's fixed cost
    dominates and every likely draft pays; in a large batch a draft row costs about what a
    decode row does and only well-accepted drafts do. So speculation never costs much on
    free text, and ``disable_by_batch_size`` is a cap, not a necessity."""

    def __init__(self, config: SpeculativeConfig, max_model_len: int) -> None:
        self.config = config
        self.max_model_len = max_model_len
        self.num_drafts = 0  # decodes verified with at least one draft token
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.cost = DecodeCost()

    def observe_step(self, kind: str, num_decodes: int, num_drafts: int, seconds: float) -> None:
        """A step's measured time (decode-only steps fit the cost of draft rows)."""
        if kind == "decode":
            self.cost.observe(num_decodes, num_drafts, seconds)

    def acceptance(self, request: Request) -> list[float]:
        """P(draft j accepted | draft j - 1 was), by position, for this request."""
        k = self.config.num_speculative_tokens
        rates = request.spec.position_rates
        if not rates:
            rates.extend([PRIOR_ACCEPTANCE] * k)
        return rates

    def plan(self, decodes: list[Request]) -> None:
        """Trim each decode's drafts to the number that pays this step (see the class doc)."""
        keep = self.paying(decodes, [len(r.draft_token_ids) for r in decodes])
        for r, k in zip(decodes, keep):
            del r.draft_token_ids[k:]

    def paying(self, decodes: list[Request], available: list[int]) -> list[int]:
        """How many of the ``available`` drafts of each decode pay in a step of these
        decodes: all of them until the cost of a draft row is measured."""
        cost = self.cost
        if not any(available) or not cost.ready or cost.c <= 0:
            return list(available)
        # Marginal gain of each draft: the chance it and every draft before it are accepted.
        increments = []
        for i, (r, n) in enumerate(zip(decodes, available)):
            p = 1.0
            for j, rate in enumerate(self.acceptance(r)[:n]):
                p *= rate
                increments.append((p, j, i))
        increments.sort(key=lambda t: -t[0])
        tokens = float(len(decodes))
        seconds = cost.a + cost.b * len(decodes)
        keep = [0] * len(decodes)
        for gain, j, i in increments:
            if seconds <= 0 or gain * seconds <= cost.c * tokens:
                break  # this draft buys fewer tokens than its time is worth
            if keep[i] != j:
                continue  # an earlier draft of the request was not kept
            keep[i] = j + 1
            tokens += gain
            seconds += cost.c
        return keep

    def num_wanted(self, request: Request) -> int:
        """Drafts worth proposing for a running decode: none while it is paused for low
        acceptance, and never more than it may still emit minus the target's own token."""
        if request.status != RequestStatus.RUNNING or request.is_prefilling:
            return 0
        if request.num_output_tokens < request.spec.paused_until:
            return 0
        left = min(
            request.max_tokens - request.num_output_tokens,
            self.max_model_len - request.num_tokens,
        )
        return max(0, min(self.config.num_speculative_tokens, left - 1))

    def propose_ngram(self, requests: Iterable[Request]) -> None:
        cfg = self.config
        for r in requests:
            k = self.num_wanted(r)
            r.draft_token_ids = (
                ngram_propose(r.token_ids, k, cfg.prompt_lookup_min, cfg.prompt_lookup_max)
                if k
                else []
            )

    def record(self, decodes: Iterable) -> SpecCounts:
        """Count a step's verified decodes (``ScheduledChunk`` with ``draft_token_ids`` and
        ``num_accepted``); pause requests whose acceptance stays low. Returns the step's
        counts."""
        step = SpecCounts(per_position=[0] * self.config.num_speculative_tokens)
        floor = self.config.min_acceptance_rate
        for chunk in decodes:
            k = len(chunk.draft_token_ids)
            if not k:
                continue
            a = chunk.num_accepted
            step.drafts += 1
            step.draft_tokens += k
            step.accepted += a
            for i in range(a):
                step.per_position[i] += 1
            spec = chunk.request.spec
            spec.num_draft_tokens += k
            spec.num_accepted_tokens += a
            rates = self.acceptance(chunk.request)
            for j in range(min(k, a + 1)):  # positions verified: up to the first rejection
                rates[j] += POSITION_ALPHA * (float(j < a) - rates[j])
            spec.recent.append((k, a))
            while sum(p for p, _ in spec.recent) - spec.recent[0][0] >= ACCEPTANCE_WINDOW:
                spec.recent.pop(0)
            proposed = sum(p for p, _ in spec.recent)
            accepted = sum(x for _, x in spec.recent)
            if floor and proposed >= ACCEPTANCE_WINDOW and accepted < floor * proposed:
                spec.paused_until = chunk.request.num_output_tokens + PAUSE_TOKENS
                spec.recent.clear()
        self.num_drafts += step.drafts
        self.num_draft_tokens += step.draft_tokens
        self.num_accepted_tokens += step.accepted
        return step

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0
