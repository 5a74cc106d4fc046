"""Speculative decoding, the pure-Python side: prompt-lookup drafts, who speculates, counts.

A step with speculation, end to end::

    step t   ... Scheduler.update appends the tokens; the core asks the proposer for drafts
             of every running decode (``request.draft_token_ids``): n-gram lookup here, or
             the draft model (``draft.DraftModel``, the worker's).
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
from chunkserve.request import Request, RequestStatus

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


class Speculator:
    """Decides how many drafts each request gets, proposes n-gram drafts, and counts what
    verification accepted (the metrics' counters and the step log read these)."""

    def __init__(self, config: SpeculativeConfig, max_model_len: int) -> None:
        self.config = config
        self.max_model_len = max_model_len
        self.num_drafts = 0  # decodes verified with at least one draft token
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_per_position = [0] * config.num_speculative_tokens

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
                self.accepted_per_position[i] += 1
            spec = chunk.request.spec
            spec.num_draft_tokens += k
            spec.num_accepted_tokens += a
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
