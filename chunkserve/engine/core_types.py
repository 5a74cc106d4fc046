"""What passes between a front end and an engine core: a checked request (``CoreRequest``),
one step's output for one request (``CoreOutput``, with its ``CoreTiming``), and what a front
end shows about a core (``CoreInfo``, ``CoreLoad``).

Token ids and plain Python only: the API server's process imports these (and
``core_process``'s messages) without the core itself, so it never imports torch
(``tests/test_core_process.py`` checks it).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from chunkserve.scheduling.sampling_params import SamplingParams

if TYPE_CHECKING:
    from chunkserve.scheduling.request import Request


@dataclass
class CoreRequest:
    """A request as the core takes it: token ids, checked at the edge."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    max_tokens: int  # resolved (``InputProcessor.check``)
    arrival_time: float | None = None
    priority: int = 0


@dataclass
class CoreTiming:
    """The core's side of a request's timing (the front end times its tokens itself)."""

    first_scheduled_time: float | None = None
    prefill_time: float = 0.0  # seconds in steps that computed its prompt
    num_preemptions: int = 0

    @classmethod
    def of(cls, request: Request) -> CoreTiming:
        m = request.metrics
        return cls(m.first_scheduled_time, m.prefill_time, m.num_preemptions)


@dataclass
class CoreOutput:
    """What one step added to one request: its new token ids (and their logprobs), and how
    it ended if it did."""

    request_id: str
    new_token_ids: list[int]
    # Per new token: (its logprob, the top alternatives as (token id, logprob)).
    new_logprobs: list[tuple[float, list[tuple[int, float]]]] | None = None
    finish_reason: str | None = None  # stop | length | abort | error
    stop_reason: int | str | None = None  # the stop token id that ended it
    num_cached_tokens: int = 0
    timing: CoreTiming | None = None
    error: str | None = None
    # ``prompt_logprobs`` requests, with their first output: per prompt position (None at
    # 0) its token's (logprob, top-n, rank).
    prompt_logprobs: list[tuple[float, list[tuple[int, float]], int] | None] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class CoreInfo:
    """What a front end prints and exports about a core it may not look into."""

    pid: int
    device: str
    dtype: str
    num_threads: int
    num_blocks: int
    block_size: int
    kv_cache_memory: int
    budget_policy: str
    tp_pids: list[int] = field(default_factory=list)  # its tensor-parallel rank processes
    # Its KV groups' windows (None: full attention); one entry without a hybrid cache.
    kv_group_windows: list[int | None] = field(default_factory=lambda: [None])


@dataclass
class CoreLoad:
    """A core's queues and cache, for gauges and routing."""

    num_running: int = 0
    num_waiting: int = 0
    kv_blocks_used: int = 0
    num_waiting_for_kv: int = 0  # disaggregated decode: holding blocks, KV arriving
    kv_group_blocks_used: list[int] = field(default_factory=list)  # by KV group
