"""Prometheus metrics, named in the spirit of vLLM's (``chunkserve:`` prefix).

Fed from the engine thread: ``on_step`` with every ``StepStats`` and ``on_finish`` with every
finished ``RequestOutput``. Each server owns its own ``CollectorRegistry``.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    Info,
    generate_latest,
)

from chunkserve.engine.frontend import FrontEnd
from chunkserve.engine.output_processor import RequestOutput
from chunkserve.engine.step_log import StepStats
from chunkserve.scheduling.request import RequestStatus

_LATENCY_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    1.5,
    2.0,
    3.0,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
_REQUEST_BUCKETS = (
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    20.0,
    40.0,
    60.0,
    120.0,
    300.0,
    600.0,
)
FINISHED_REASONS = tuple(
    s.value
    for s in (
        RequestStatus.FINISHED_STOPPED,
        RequestStatus.FINISHED_LENGTH,
        RequestStatus.FINISHED_ABORTED,
        RequestStatus.FINISHED_ERROR,
    )
)
_RATIO_BUCKETS = (0.5, 0.7, 0.8, 0.9, 0.95, 1.0, 1.05, 1.1, 1.2, 1.3, 1.5, 2.0, 3.0, 5.0)
_BYTES_BUCKETS = tuple(float(1 << k) for k in range(16, 34, 2))  # 64 KiB .. 8 GiB
_TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


class Metrics:
    def __init__(self, engine: FrontEnd, model_name: str) -> None:
        self.engine = engine
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        self._labels = {"model_name": model_name}
        reg = self.registry

        def hist(name: str, doc: str, buckets: tuple) -> Histogram:
            return Histogram(f"chunkserve:{name}", doc, labels, buckets=buckets, registry=reg)

        self.ttft = hist("time_to_first_token_seconds", "Time to first token.", _LATENCY_BUCKETS)
        self.itl = hist(
            "inter_token_latency_seconds",
            "Time between consecutive output tokens of a request.",
            _LATENCY_BUCKETS,
        )
        self.tpot = hist(
            "time_per_output_token_seconds",
            "Mean time per output token after the first, per request.",
            _LATENCY_BUCKETS,
        )
        self.e2e = hist("e2e_request_latency_seconds", "Arrival to finish.", _REQUEST_BUCKETS)
        self.queue_time = hist(
            "request_queue_time_seconds", "Arrival to first scheduled.", _REQUEST_BUCKETS
        )
        self.prefill_time = hist(
            "request_prefill_time_seconds",
            "Time in steps that computed the request's prompt.",
            _REQUEST_BUCKETS,
        )
        self.step_tokens = hist(
            "iteration_tokens_total", "Tokens (prefill + decode) per step.", _TOKEN_BUCKETS
        )
        self.step_time = hist(
            "step_duration_seconds", "Wall time of one engine step.", _LATENCY_BUCKETS
        )
        self.running = Gauge(
            "chunkserve:num_requests_running", "Requests running.", labels, registry=reg
        )
        self.waiting = Gauge(
            "chunkserve:num_requests_waiting", "Requests waiting.", labels, registry=reg
        )
        self.kv_usage = Gauge(
            "chunkserve:kv_cache_usage_perc",
            "Fraction of KV blocks in use (0..1).",
            labels,
            registry=reg,
        )
        self.kv_blocks_used = Gauge(
            "chunkserve:kv_cache_blocks_used", "KV blocks held by requests.", labels, registry=reg
        )
        self.kv_blocks_total = Gauge(
            "chunkserve:kv_cache_blocks_total", "KV blocks in the pool.", labels, registry=reg
        )
        self.kv_group_blocks_used = Gauge(
            "chunkserve:kv_cache_group_blocks_used",
            "KV blocks held by requests, by KV group (a hybrid cache: one group per run of "
            "layers of one attention kind; window: 'full' or the sliding window), summed "
            "over engine cores.",
            [*labels, "group", "window"],
            registry=reg,
        )
        self.token_budget = Gauge(
            "chunkserve:token_budget", "Token budget of the last step.", labels, registry=reg
        )
        policy = engine.budget_policy
        self.budget_policy = Info(
            "chunkserve:budget_policy",
            "How steps get their token budget: static, adaptive (the default) or itl-target; "
            "the cap or static budget in tokens; the adaptive slowdown bound; the ITL target.",
            labels,
            registry=reg,
        )
        self.budget_policy.labels(**self._labels).info(
            {
                "policy": policy.kind,
                "max_num_batched_tokens": str(policy.max_num_batched_tokens),
                "max_decode_slowdown": str(policy.decode_slowdown or ""),
                "itl_slo_ms": str(1e3 * policy.itl_slo_s) if policy.itl_slo_s else "",
                "long_step_share": str(policy.long_step_share) if policy.long_step_share else "",
            }
        )
        self.step_target = hist(
            "step_time_target_seconds",
            "Step time an online budget planned for, in steps that carried prefill.",
            _LATENCY_BUCKETS,
        )
        self.over_target = Counter(
            "chunkserve:budget_over_target_steps",
            "Steps whose decodes left no room for one KV block of prefill within the online "
            "budget's target: one block ran anyway (prefill never starves).",
            labels,
            registry=reg,
        )
        self.long_steps = Counter(
            "chunkserve:budget_long_steps",
            "Long steps beside decodes (the adaptive budget's, for waiting prompts that fit "
            "one whole; a bounded share of the token gaps).",
            labels,
            registry=reg,
        )
        self.prompt_tokens = Counter(
            "chunkserve:prompt_tokens",
            "Prompt tokens computed (prefill, recomputation included).",
            labels,
            registry=reg,
        )
        self.generation_tokens = Counter(
            "chunkserve:generation_tokens", "Output tokens generated.", labels, registry=reg
        )
        self.request_success = Counter(
            "chunkserve:request_success",
            "Finished requests by finish reason.",
            [*labels, "finished_reason"],
            registry=reg,
        )
        self.preemptions = Counter(
            "chunkserve:num_preemptions",
            "Requests preempted (recomputed later).",
            labels,
            registry=reg,
        )
        self.spec_drafts = Counter(
            "chunkserve:spec_decode_num_drafts",
            "Speculative decoding: decodes verified with draft tokens.",
            labels,
            registry=reg,
        )
        self.spec_draft_tokens = Counter(
            "chunkserve:spec_decode_num_draft_tokens",
            "Speculative decoding: draft tokens verified.",
            labels,
            registry=reg,
        )
        self.spec_accepted_tokens = Counter(
            "chunkserve:spec_decode_num_accepted_tokens",
            "Speculative decoding: draft tokens accepted.",
            labels,
            registry=reg,
        )
        self.spec_accepted_per_pos = Counter(
            "chunkserve:spec_decode_num_accepted_tokens_per_pos",
            "Speculative decoding: draft tokens accepted, by position in the draft (0: first).",
            [*labels, "position"],
            registry=reg,
        )
        self.structured_requests = Gauge(
            "chunkserve:num_requests_structured",
            "Requests with an output grammar (structured outputs), running or waiting for "
            "their grammar to compile.",
            labels,
            registry=reg,
        )
        self.grammar_compiles = Counter(
            "chunkserve:structured_output_grammars",
            "Grammars handed to requests, by whether the compiled grammar was cached.",
            [*labels, "cached"],
            registry=reg,
        )
        self.grammar_compile_time = hist(
            "structured_output_compile_seconds",
            "Time to compile a request's grammar (first use of a constraint; cached ones not "
            "counted).",
            _LATENCY_BUCKETS,
        )
        self.mask_time = hist(
            "structured_output_mask_seconds",
            "Per step with grammar rows: time filling their token masks (on the mask thread, "
            "beside the forward pass).",
            _LATENCY_BUCKETS,
        )
        self.mask_wait_time = hist(
            "structured_output_mask_wait_seconds",
            "Per step with grammar rows: time sampling waited for the masks and applied them "
            "after the forward pass.",
            _LATENCY_BUCKETS,
        )
        self.tp_comm_time = hist(
            "tensor_parallel_comm_seconds",
            "Per tensor-parallel step: time rank 0 spent in collectives (the step broadcast, "
            "the sums, the logits gather; waiting for slower ranks included).",
            _LATENCY_BUCKETS,
        )
        self.kv_transfer_bytes = hist(
            "kv_transfer_bytes",
            "Per request: KV cache bytes sent (prefill instance) or received (decode "
            "instance) in prefill/decode disaggregation.",
            _BYTES_BUCKETS,
        )
        self.kv_transfer_time = hist(
            "kv_transfer_seconds",
            "Per request: time this instance spent moving its KV blocks (prefill: reading "
            "them out and handing them to the connector; decode: copying them into the pool).",
            _LATENCY_BUCKETS,
        )
        self.kv_transfer_wait = hist(
            "kv_transfer_wait_seconds",
            "Per request, decode instance: from asking the prefill instance to the last KV "
            "block in (its queue and prefill there included).",
            _REQUEST_BUCKETS,
        )
        self.waiting_for_kv = Gauge(
            "chunkserve:num_requests_waiting_for_kv",
            "Decode instance: requests holding KV blocks while their prompt's KV arrives.",
            labels,
            registry=reg,
        )
        self.prefix_queries = Counter(
            "chunkserve:prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache.",
            labels,
            registry=reg,
        )
        self.prefix_hits = Counter(
            "chunkserve:prefix_cache_hits",
            "Prompt tokens found in the prefix cache.",
            labels,
            registry=reg,
        )
        self.step_gap = hist(
            "step_gap_seconds",
            "Time from one engine step's end to the next one's start while requests run "
            "(the serving loop's own work per step).",
            _LATENCY_BUCKETS,
        )
        self.step_time_ratio = Histogram(
            "chunkserve:step_time_over_predicted",
            "Wall time of one engine step over the cost profile's prediction for it, by step "
            "kind (only with a profile loaded): the means are `chunkserve simulate "
            "--cost-scale`.",
            [*labels, "kind"],
            buckets=_RATIO_BUCKETS,
            registry=reg,
        )
        self.steps = Counter(
            "chunkserve:steps", "Engine steps by kind.", [*labels, "kind"], registry=reg
        )
        # By engine core (``--data-parallel-size``; one core: engine="0").
        per_core = [*labels, "engine"]
        self.core_steps = Counter(
            "chunkserve:engine_core_steps", "Engine steps by core.", per_core, registry=reg
        )
        core_running = Gauge(
            "chunkserve:engine_core_requests_running",
            "Requests running, by engine core.",
            per_core,
            registry=reg,
        )
        core_waiting = Gauge(
            "chunkserve:engine_core_requests_waiting",
            "Requests waiting in an engine core's queue (sent, not yet running).",
            per_core,
            registry=reg,
        )
        core_blocks = Gauge(
            "chunkserve:engine_core_kv_cache_blocks_used",
            "KV blocks held by requests, by engine core (each core has its own cache).",
            per_core,
            registry=reg,
        )
        # Gauges read the engine's state when scraped (plain len() reads: safe across
        # threads), so they are never stale, idle engine included.
        lab = self._labels
        # Every series exists from the start, at zero, so a fresh server's scrape already
        # has them (a rate over a series that appears late misses its first increase).
        for metric in (
            self.ttft,
            self.itl,
            self.tpot,
            self.e2e,
            self.queue_time,
            self.prefill_time,
            self.step_tokens,
            self.step_time,
            self.step_gap,
            self.step_target,
            self.over_target,
            self.long_steps,
            self.prompt_tokens,
            self.generation_tokens,
            self.preemptions,
            self.prefix_queries,
            self.prefix_hits,
        ):
            metric.labels(**lab)
        for reason in FINISHED_REASONS:
            self.request_success.labels(**lab, finished_reason=reason)
        num_blocks = engine.num_blocks
        self.kv_blocks_total.labels(**lab).set(num_blocks)
        self.running.labels(**lab).set_function(lambda: engine.num_running)
        self.waiting.labels(**lab).set_function(lambda: engine.num_waiting)
        self.kv_usage.labels(**lab).set_function(lambda: engine.kv_blocks_used / num_blocks)
        self.kv_blocks_used.labels(**lab).set_function(lambda: engine.kv_blocks_used)
        self.waiting_for_kv.labels(**lab).set_function(
            lambda: sum(load.num_waiting_for_kv for load in engine.core_loads())
        )
        windows = engine.core_infos[0].kv_group_windows
        for g, w in enumerate(windows):
            self.kv_group_blocks_used.labels(
                **lab, group=str(g), window="full" if w is None else str(w)
            ).set_function(lambda g=g: _group_blocks(engine, g))
        for i in range(len(engine.core_infos)):
            core = {**lab, "engine": str(i)}
            self.core_steps.labels(**core)
            core_running.labels(**core).set_function(lambda i=i: engine.core_loads()[i].num_running)
            core_waiting.labels(**core).set_function(lambda i=i: engine.core_loads()[i].num_waiting)
            core_blocks.labels(**core).set_function(
                lambda i=i: engine.core_loads()[i].kv_blocks_used
            )

    def on_step(self, s: StepStats) -> None:
        lab = self._labels
        self.step_tokens.labels(**lab).observe(s.num_batched_tokens)
        self.step_time.labels(**lab).observe(s.wall_time)
        if s.loop_gap is not None:
            self.step_gap.labels(**lab).observe(s.loop_gap)
        if s.predicted_time:
            self.step_time_ratio.labels(**lab, kind=s.kind).observe(s.wall_time / s.predicted_time)
        self.prompt_tokens.labels(**lab).inc(s.num_prefill_tokens)
        self.generation_tokens.labels(**lab).inc(s.num_generated_tokens)
        if s.prefix_cache_queries:
            self.prefix_queries.labels(**lab).inc(s.prefix_cache_queries)
            self.prefix_hits.labels(**lab).inc(s.prefix_cache_hits)
        if s.num_preempted:
            self.preemptions.labels(**lab).inc(s.num_preempted)
        if s.num_draft_tokens:
            self.spec_drafts.labels(**lab).inc(s.num_drafts)
            self.spec_draft_tokens.labels(**lab).inc(s.num_draft_tokens)
            self.spec_accepted_tokens.labels(**lab).inc(s.num_accepted_tokens)
            for pos, n in enumerate(s.accepted_per_position or ()):
                if n:
                    self.spec_accepted_per_pos.labels(**lab, position=str(pos)).inc(n)
        if s.comm_time:
            self.tp_comm_time.labels(**lab).observe(s.comm_time)
        for num_bytes, seconds, wait in s.kv_transfers or ():
            self.kv_transfer_bytes.labels(**lab).observe(num_bytes)
            self.kv_transfer_time.labels(**lab).observe(seconds)
            if wait:
                self.kv_transfer_wait.labels(**lab).observe(wait)
        if s.num_masked_rows:
            self.mask_time.labels(**lab).observe(s.mask_time)
            self.mask_wait_time.labels(**lab).observe(s.mask_wait_time)
        for seconds, cached in s.grammar_compiles or ():
            self.grammar_compiles.labels(**lab, cached=str(cached).lower()).inc()
            if not cached:
                self.grammar_compile_time.labels(**lab).observe(seconds)
        self.structured_requests.labels(**lab).set(s.num_structured_requests)
        self.steps.labels(**lab, kind=s.kind).inc()
        self.core_steps.labels(**lab, engine=str(s.core)).inc()
        self.token_budget.labels(**lab).set(s.token_budget)
        if s.target_time is not None and s.num_prefill_tokens:
            self.step_target.labels(**lab).observe(s.target_time)
        if s.over_target:
            self.over_target.labels(**lab).inc()
        if s.long_step:
            self.long_steps.labels(**lab).inc()

    def on_finish(self, out: RequestOutput) -> None:
        lab = self._labels
        self.request_success.labels(**lab, finished_reason=out.finish_reason or "unknown").inc()
        m = out.metrics
        if m is None:
            return
        if m.ttft is not None:
            self.ttft.labels(**lab).observe(m.ttft)
        for gap in m.itls:
            self.itl.labels(**lab).observe(gap)
        if m.tpot is not None:
            self.tpot.labels(**lab).observe(m.tpot)
        if m.e2e_latency is not None:
            self.e2e.labels(**lab).observe(m.e2e_latency)
        if m.queue_time is not None:
            self.queue_time.labels(**lab).observe(m.queue_time)
        if m.first_token_time is not None:
            self.prefill_time.labels(**lab).observe(m.prefill_time)

    def track_streams(self, bytes_queued: Callable[[], float]) -> None:
        """The server's output waiting for slow clients (``AsyncEngine.queued_bytes``), read
        when ``/metrics`` renders (on the event loop, where it may be read)."""
        gauge = Gauge(
            "chunkserve:stream_queued_bytes",
            "Output waiting for clients that read slower than it is made (merged per stream).",
            list(self._labels),
            registry=self.registry,
        )
        gauge.labels(**self._labels).set_function(bytes_queued)

    def render(self) -> bytes:
        return generate_latest(self.registry)


def _group_blocks(engine: FrontEnd, group: int) -> int:
    """Blocks KV group ``group`` holds over the engine's cores (a core that has not yet
    reported its groups: 0)."""
    return sum(
        load.kv_group_blocks_used[group]
        for load in engine.core_loads()
        if group < len(load.kv_group_blocks_used)
    )
