"""What one engine step did (``StepStats``) and the log lines made of it."""

from __future__ import annotations

import logging
from dataclasses import dataclass

logger = logging.getLogger("chunkserve")


@dataclass
class StepStats:
    """What one step did; the engine logs it and passes it to ``step_listeners``."""

    step: int
    kind: str  # prefill | decode | mixed
    num_prefill_seqs: int
    num_new_seqs: int
    num_prefill_tokens: int
    num_decode_tokens: int
    num_cached_tokens: int
    num_preempted: int
    num_running: int
    num_waiting: int
    kv_usage: float
    token_budget: int
    schedule_time: float  # seconds in Scheduler.schedule + update
    forward_time: float  # seconds in the runner (layout, forward, sampling)
    layout_time: float  # of which building the BatchLayout and attention metadata
    wall_time: float  # whole step
    num_finished: int = 0
    num_generated_tokens: int = 0  # tokens sampled this step (decodes + finished prompts)
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache this step
    prefix_cache_hits: int = 0  # of which found cached
    # Seconds from the previous step's end to this step's start when no idling came between
    # (requests were running): the serving loop's own work per step (streaming outputs,
    # admitting requests). None after an idle engine.
    loop_gap: float | None = None
    # The cost profile's prediction of this step's time (its fixed weights, not the online
    # controller's refit); None without a profile. wall_time / predicted_time is how far
    # this server runs from the profile, what ``chunkserve simulate --cost-scale`` takes.
    predicted_time: float | None = None
    # An online budget's planned step time (None: static budget, or no prefill waiting),
    # and whether prefill ran beyond it (one block when the decodes left no room).
    target_time: float | None = None
    over_target: bool = False
    # A long step beside decodes (the adaptive budget's, for waiting prompts that fit it
    # whole; at most ``budget.LONG_GAP_SHARE`` of the token gaps).
    long_step: bool = False
    core: int = 0  # which engine core (data parallel) ran the step
    # Speculative decoding: draft tokens the decodes carried (part of num_decode_tokens),
    # and how many verification accepted.
    num_drafts: int = 0  # decodes that carried drafts
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] | None = None  # accepted drafts by position
    # Structured outputs: sampled rows masked by a grammar, seconds filling their masks (on
    # the mask thread, beside the forward pass) and waiting for them after it; grammars
    # handed to requests this step as (seconds compiling, cached); requests with a grammar
    # running or waiting after the step.
    num_masked_rows: int = 0
    mask_time: float = 0.0
    mask_wait_time: float = 0.0
    grammar_compiles: list[tuple[float, bool]] | None = None
    num_structured_requests: int = 0
    # Tensor parallel: seconds rank 0 spent in collectives this step (part of forward_time).
    comm_time: float = 0.0
    # Disaggregation: the KV transfers that ended at this end since the last record, as
    # (bytes, seconds moving them here, seconds from asking to the last block: decode side).
    kv_transfers: list[tuple[int, float, float]] | None = None

    @property
    def num_batched_tokens(self) -> int:
        return self.num_prefill_tokens + self.num_decode_tokens


class StepLogger:
    """SGLang-style step lines: every prefill or mixed step, decode steps summed over
    ``decode_interval`` steps."""

    def __init__(self, decode_interval: int) -> None:
        self.decode_interval = decode_interval
        self._tokens = 0
        self._time = 0.0
        self._steps = 0
        self._drafts = 0
        self._accepted = 0

    def log(self, s: StepStats) -> None:
        if s.kind == "decode":
            self._steps += 1
            self._tokens += s.num_generated_tokens
            self._time += s.wall_time
            self._drafts += s.num_draft_tokens
            self._accepted += s.num_accepted_tokens
            if self._steps < self.decode_interval:
                return
            logger.info(
                "Decode batch. #running-req: %d, #token: %d, token usage: %.2f, "
                "#queue-req: %d, gen throughput (token/s): %.1f, step: %.1f ms%s",
                s.num_running,
                s.num_decode_tokens,
                s.kv_usage,
                s.num_waiting,
                self._tokens / max(self._time, 1e-9),
                1e3 * self._time / self._steps,
                _spec(self._drafts, self._accepted),
            )
            self._steps = self._tokens = self._drafts = self._accepted = 0
            self._time = 0.0
            return
        logger.info(
            "%s batch. #new-seq: %d, #prefill-seq: %d, #new-token: %d, #cached-token: %d, "
            "#decode-token: %d, token usage: %.2f, #running-req: %d, #queue-req: %d, "
            "#preempted: %d, budget: %d, step: %.1f ms (schedule %.2f ms)%s%s%s%s%s",
            "Mixed" if s.kind == "mixed" else "Prefill",
            s.num_new_seqs,
            s.num_prefill_seqs,
            s.num_prefill_tokens,
            s.num_cached_tokens,
            s.num_decode_tokens,
            s.kv_usage,
            s.num_running,
            s.num_waiting,
            s.num_preempted,
            s.token_budget,
            1e3 * s.wall_time,
            1e3 * s.schedule_time,
            "" if s.predicted_time is None else f", predicted {1e3 * s.predicted_time:.1f} ms",
            "" if s.target_time is None else f", target {1e3 * s.target_time:.1f} ms",
            " (over target: one block)" if s.over_target else "",
            " (long step)" if s.long_step else "",
            _spec(s.num_draft_tokens, s.num_accepted_tokens),
        )


def _spec(drafts: int, accepted: int) -> str:
    if not drafts:
        return ""
    return f", spec accepted {accepted}/{drafts} draft tokens ({100 * accepted / drafts:.0f}%)"
