"""A request's state as counters (its sampling parameters: ``sampling_params``).

Pure Python (no torch): the scheduler imports this module.

Progress is ``num_computed_tokens`` over ``token_ids`` (prompt + outputs so far). A step
computes ``token_ids[num_computed_tokens : num_computed_tokens + n]``. When a chunk reaches
the end of ``token_ids`` the logits of its last row are sampled and one token is appended.
"Prefilling" is derived: the request still has more than one uncomputed token, or has not
produced a token yet. A preempted request drops its KV blocks and sets
``num_computed_tokens = 0``; it then recomputes prompt and outputs as one long prefill.
"""

from __future__ import annotations

import enum
import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from chunkserve.scheduling.sampling_params import SamplingParams

# A prompt token's (logprob, top-n alternatives as (token id, logprob), rank in the
# distribution: 1 for its most likely token).
PromptLogprob = tuple[float, list[tuple[int, float]], int]


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # waiting again, blocks freed, will recompute
    WAITING_FOR_KV = "waiting_for_kv"  # blocks held, the prompt's KV arriving (disaggregated)
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"

    @property
    def finished(self) -> bool:
        return self in _FINISHED

    @property
    def finish_reason(self) -> str | None:
        return self.value if self.finished else None


_FINISHED = {
    RequestStatus.FINISHED_STOPPED,
    RequestStatus.FINISHED_LENGTH,
    RequestStatus.FINISHED_ABORTED,
    RequestStatus.FINISHED_ERROR,
}


@dataclass
class RequestMetrics:
    """Timestamps (``time.monotonic()`` seconds); TTFT, ITL, TPOT and E2E derive from them."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    token_times: list[float] = field(default_factory=list)
    finished_time: float | None = None
    num_preemptions: int = 0
    # Seconds spent in steps that computed this request's prompt (all chunks).
    prefill_time: float = 0.0

    @property
    def queue_time(self) -> float | None:
        if self.first_scheduled_time is None:
            return None
        return self.first_scheduled_time - self.arrival_time

    @property
    def ttft(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def itls(self) -> list[float]:
        """Gaps between consecutive output tokens."""
        t = self.token_times
        return [b - a for a, b in itertools.pairwise(t)]

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first."""
        if len(self.token_times) < 2:
            return None
        return (self.token_times[-1] - self.token_times[0]) / (len(self.token_times) - 1)

    @property
    def e2e_latency(self) -> float | None:
        if self.finished_time is None:
            return None
        return self.finished_time - self.arrival_time


@dataclass
class SpecState:
    """A request's speculation record: draft tokens proposed and accepted, and (after
    acceptance stayed low) the output count up to which it does not speculate."""

    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    recent: list[tuple[int, int]] = field(default_factory=list)  # (proposed, accepted)
    paused_until: int = 0  # number of output tokens
    # P(draft j accepted | draft j - 1 was), averaged (``speculative.Speculator``)
    position_rates: list[float] = field(default_factory=list)


_request_counter = itertools.count()


class Request:
    """One sequence being served. The scheduler owns its status and counters."""

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        sampling_params: SamplingParams,
        *,
        max_tokens: int,
        eos_token_ids: Sequence[int] = (),
        arrival_time: float | None = None,
        priority: int = 0,
        prompt: str | None = None,
    ) -> None:
        if not prompt_token_ids:
            raise ValueError("prompt: must contain at least one token")
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(self.prompt_token_ids)
        self.sampling_params = sampling_params
        self.max_tokens = max_tokens  # resolved: never None
        self.eos_token_ids = frozenset(eos_token_ids)
        self.priority = priority
        self.arrival_seq = next(_request_counter)  # tie-break for equal arrival times
        self.metrics = RequestMetrics(
            arrival_time=time.monotonic() if arrival_time is None else arrival_time
        )

        self.status = RequestStatus.WAITING
        self.token_ids: list[int] = list(self.prompt_token_ids)  # prompt + outputs
        self.output_token_ids: list[int] = []
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # prompt tokens served from the prefix cache
        # ``prompt_logprobs``: per prompt position, (logprob, top, rank) of its token once a
        # chunk computed it (position 0 stays None); None when not asked for. Sent with the
        # request's first output (``prompt_logprobs_sent``).
        self.prompt_logprobs: list[PromptLogprob | None] | None = (
            [None] * self.num_prompt_tokens if sampling_params.prompt_logprobs is not None else None
        )
        self.prompt_logprobs_sent = False
        # One block table per KV group (``kv_cache``): entry i holds the request's tokens
        # ``i * block_size ..``; a sliding-window group's entries out of its window are the
        # null block. A model without windows has one group.
        self.block_tables: list[list[int]] = [[]]
        # Prefix cache: chained hashes of the full blocks of token_ids computed so far, how
        # many of this request's blocks are published, and what else keys its KV (LoRA...).
        self.block_hashes: list[bytes] = []
        self.num_published_blocks = 0
        self.cache_key = b""
        self.stop_reason: int | str | None = None
        self.error: str | None = None
        # Speculative decoding: tokens proposed to follow ``token_ids`` (the next step
        # verifies them; see ``speculative``), and the request's recent acceptance.
        self.draft_token_ids: list[int] = []
        self.spec = SpecState()
        # Structured outputs: the request's grammar matcher (``structured.RequestGrammar``),
        # advanced by every token appended; None without a constraint.
        self.grammar: Any = None

    # ---- derived state -------------------------------------------------------------------
    @property
    def block_ids(self) -> list[int]:
        """The first KV group's block table (the only one of a model without windows)."""
        return self.block_tables[0]

    @block_ids.setter
    def block_ids(self, block_ids: list[int]) -> None:
        """Set a one-group table (a model without windows; tests and warm-up)."""
        self.block_tables = [list(block_ids)]

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_prefilling(self) -> bool:
        """True until only the newest sampled token is left to compute."""
        return self.num_output_tokens == 0 or self.num_uncomputed_tokens > 1

    @property
    def prefill_url(self) -> str | None:
        """Disaggregated decode: the prefill instance computing this prompt's KV."""
        kv = self.sampling_params.kv_transfer_params
        return None if kv is None else kv.prefill_url

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    @property
    def finish_reason(self) -> str | None:
        return self.status.finish_reason

    @property
    def arrival_time(self) -> float:
        return self.metrics.arrival_time

    def append_output_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)
        self.output_token_ids.append(token_id)

    def check_stop_token(self, max_model_len: int) -> RequestStatus | None:
        """Token-level stop conditions after appending a token (stop strings are checked on
        text by the engine's output processor)."""
        params = self.sampling_params
        last = self.output_token_ids[-1]
        if self.grammar is not None:
            if not self.grammar.accept(last):  # masked sampling never picks one
                self.error = f"structured_outputs: the grammar does not allow token {last}"
                return RequestStatus.FINISHED_ERROR
            if self.grammar.terminated:  # the grammar ended (and took its stop token)
                self.stop_reason = None
                return RequestStatus.FINISHED_STOPPED
        if self.num_output_tokens >= params.min_tokens:
            if not params.ignore_eos and last in self.eos_token_ids:
                self.stop_reason = None
                return RequestStatus.FINISHED_STOPPED
            if last in params.stop_token_ids:
                self.stop_reason = last
                return RequestStatus.FINISHED_STOPPED
        if self.num_output_tokens >= self.max_tokens or self.num_tokens >= max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.value}, "
            f"computed={self.num_computed_tokens}/{self.num_tokens}, "
            f"prompt={self.num_prompt_tokens}, out={self.num_output_tokens})"
        )
