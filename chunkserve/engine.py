"""The engine: ``add_request / abort_request / step / has_unfinished``.

``step()`` = ``Scheduler.schedule()`` -> ``ModelRunner.execute()`` -> ``Scheduler.update()``,
then detokenisation and stop strings per request, and one ``StepStats`` record (logged).
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from chunkserve.attention import get_attention_backend, triton_usable
from chunkserve.budget import UNPROFILED_WARMUP_STEPS, BudgetController
from chunkserve.config import (
    DEFAULT_CPU_KV_CACHE_MEMORY,
    DEFAULT_GPU_MEMORY_UTILIZATION,
    EngineConfig,
    ModelConfig,
)
from chunkserve.costmodel import DEFAULT_PRIOR, CostModel, OnlineCostModel, StepShape
from chunkserve.kv_cache import NULL_BLOCK, KVCacheManager
from chunkserve.model.llama import LlamaModel
from chunkserve.model.loader import iter_weights, load_model_config, resolve_model
from chunkserve.platform import configure_cpu_runtime, resolve_device, resolve_dtype
from chunkserve.request import (
    INT64_MAX,
    INT64_MIN,
    Request,
    RequestMetrics,
    RequestStatus,
    SamplingParams,
)
from chunkserve.runner import ModelRunner, allocate_kv_caches
from chunkserve.sampler import Sampler
from chunkserve.scheduler import ScheduledChunk, Scheduler, SchedulerOutput
from chunkserve.tokenizer import IncrementalDetokenizer, Tokenizer

logger = logging.getLogger("chunkserve")

# Decode-only steps with more requests than this run eagerly (graph memory grows with size).
MAX_GRAPH_BATCH_SIZE = 256

# Messages of errors after which the device's state cannot be trusted (a CUDA context after a
# device-side assert fails every later call): the engine is dead, not the step.
FATAL_DEVICE_ERRORS = (
    "CUDA error",
    "device-side assert",
    "illegal memory access",
    "unspecified launch failure",
    "NCCL error",
    "CUBLAS_STATUS_",
    "cuDNN error",
)


class DeviceError(RuntimeError):
    """The device failed in a way no later step can recover from."""


def is_fatal_device_error(exc: BaseException) -> bool:
    """Whether ``exc`` leaves the device unusable (out of memory does not: it fails its
    step only)."""
    if isinstance(exc, torch.cuda.OutOfMemoryError):
        return False
    accelerator_error = getattr(torch, "AcceleratorError", None)
    if accelerator_error is not None and isinstance(exc, accelerator_error):
        return True
    text = str(exc)
    return any(m in text for m in FATAL_DEVICE_ERRORS)


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # the top-n alternatives (token id, logprob)


@dataclass
class RequestOutput:
    """A request's output so far. ``text``/``token_ids`` are cumulative; ``delta_*`` are what
    this step added (what a stream sends)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    delta_text: str
    delta_token_ids: list[int]
    finished: bool
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[TokenLogprob] | None = None
    delta_logprobs: list[TokenLogprob] | None = None
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None
    error: str | None = None


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

    @property
    def num_batched_tokens(self) -> int:
        return self.num_prefill_tokens + self.num_decode_tokens


@dataclass
class _OutputState:
    """Per-request text state: detokeniser, stop strings, what was already sent."""

    detok: IncrementalDetokenizer
    stop: list[str]
    holdback: int  # chars held back while a stop string could still be completing
    sent_len: int = 0
    sent_tokens: int = 0
    logprobs: list[TokenLogprob] | None = None
    sent_logprobs: int = 0
    text: str = ""


class Engine:
    """Synchronous engine. Not thread-safe: one thread drives ``step()`` (the async server
    wraps it)."""

    def __init__(self, config: EngineConfig | None = None, **kwargs: Any) -> None:
        config = config or EngineConfig.from_kwargs(**kwargs)
        self.config = config
        configure_cpu_runtime()
        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)

        dummy = config.load_format == "dummy"
        source = resolve_model(config.model, weights=not dummy)
        self.model_name = source.name
        self.model_path = str(source.path)
        model_config, reader = load_model_config(source)
        self.model_config: ModelConfig = model_config
        self.tokenizer = Tokenizer.from_source(source, reader, config.tokenizer)
        eos = tuple(sorted(set(self.tokenizer.eos_token_ids) | set(model_config.eos_token_ids)))
        self.eos_token_ids = eos

        max_model_len = config.max_model_len or model_config.max_position_embeddings
        self.max_model_len = max_model_len
        # Everything a bad configuration fails is checked before the weights load.
        sched_config = config.scheduler_config(max_model_len)
        self.scheduler_config = sched_config
        self.budget_policy = config.budget_policy(max_model_len)
        self.block_size = config.block_size
        dtype_size = torch.tensor([], dtype=self.dtype).element_size()
        bytes_per_block = model_config.kv_bytes_per_token(dtype_size) * self.block_size
        sized_by_free_memory = self.device.type == "cuda" and config.kv_cache_memory is None
        if not sized_by_free_memory:
            self._size_kv_cache(bytes_per_block)
        # The cost profile: primes the ITL controller, and with it every step's predicted
        # time is logged beside the measured one (``StepStats.predicted_time``).
        self.profile, profile_path = self._load_profile()
        self.controller = (
            self._make_controller(profile_path) if self.budget_policy.is_online else None
        )
        t0 = time.perf_counter()
        self.model = LlamaModel(
            model_config,
            self.dtype,
            self.device,
            max_positions=max(max_model_len, model_config.max_position_embeddings),
        )
        if dummy:
            self.model.init_dummy_weights(config.seed)
        else:
            self.model.load_weights(iter_weights(source, model_config, reader, self.dtype))
        del reader
        load_time = time.perf_counter() - t0
        if sized_by_free_memory:  # what the weights left free
            self._size_kv_cache(bytes_per_block)
        num_blocks = self.num_blocks

        self.kv = KVCacheManager(num_blocks, self.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(sched_config, self.kv)
        self._prev_step_end: float | None = None
        on_cuda = self.device.type == "cuda"
        attn = get_attention_backend(
            config.attention_backend,
            self.device,
            model_config.num_heads,
            model_config.num_kv_heads,
            model_config.head_dim,
        )
        kv_caches = allocate_kv_caches(
            model_config.num_layers,
            num_blocks,
            self.block_size,
            model_config.num_kv_heads,
            model_config.head_dim,
            self.dtype,
            self.device,
        )
        self.sampler = Sampler(model_config.vocab_size, self.device, seed=config.seed)
        self.model.fused_ops = config.fused_ops and on_cuda and triton_usable(self.device)
        # Padding token counts to a few sizes helps oneDNN's caches on a CPU; on a GPU
        # eager steps run at their exact size and decode-only steps replay CUDA graphs.
        self.runner = ModelRunner(
            self.model,
            attn,
            self.sampler,
            kv_caches,
            self.block_size,
            self.device,
            pad_batches=not on_cuda,
        )
        self.cuda_graphs = on_cuda and not config.enforce_eager and attn.supports_cuda_graphs
        if on_cuda and not config.enforce_eager and not attn.supports_cuda_graphs:
            logger.info("CUDA graphs off: the %s attention backend cannot be captured", attn.name)
        if self.cuda_graphs:
            self.runner.enable_decode_graphs(
                min(sched_config.max_num_seqs, MAX_GRAPH_BATCH_SIZE), max_model_len
            )

        if on_cuda:
            self._warm_up()

        self._states: dict[str, _OutputState] = {}
        self._ids = itertools.count()
        self.step_count = 0
        self.step_listeners: list[Callable[[StepStats], None]] = []
        # Called with the final output of every request that ends: stop, length, abort, error.
        self.finish_listeners: list[Callable[[RequestOutput], None]] = []
        self._decode_log_tokens = 0
        self._decode_log_time = 0.0
        self._decode_log_steps = 0
        logger.info(
            "chunkserve engine: model=%s device=%s dtype=%s attention=%s cuda_graphs=%s "
            "fused_ops=%s "
            "weights loaded in "
            "%.1fs | KV cache: %d blocks x %d tokens = %d tokens (%.0f MiB) | "
            "max_model_len=%d max_num_seqs=%d chunked_prefill=%s policy=%s | %s",
            self.model_name,
            self.device,
            str(self.dtype).removeprefix("torch."),
            attn.name,
            self.cuda_graphs,
            self.model.fused_ops,
            load_time,
            num_blocks,
            self.block_size,
            num_blocks * self.block_size,
            self.kv_cache_memory / 2**20,
            max_model_len,
            sched_config.max_num_seqs,
            sched_config.enable_chunked_prefill,
            sched_config.policy,
            self.budget_policy.describe(),
        )

    def _warm_up(self) -> None:
        """Run a prefill step and a mixed step (a two-block chunk beside a decode) over the
        null block, so GPU kernels compile and libraries initialise before the first request
        pays for it. Allocates no block; the null block is zeroed again after."""
        bs = self.block_size
        params = SamplingParams(max_tokens=1, temperature=0.0)
        prompt = Request("warm-up-0", [0] * (2 * bs), params, max_tokens=1)
        decode = Request("warm-up-1", [0] * (bs + 1), params, max_tokens=1)
        for r in (prompt, decode):
            r.block_ids = [NULL_BLOCK, NULL_BLOCK]
        t0 = time.perf_counter()
        self.runner.execute(SchedulerOutput(prefills=[ScheduledChunk(prompt, 0, 2 * bs)]))
        self.runner.execute(
            SchedulerOutput(
                prefills=[ScheduledChunk(prompt, 0, 2 * bs)],
                decodes=[ScheduledChunk(decode, bs, 1)],
            )
        )
        for k_cache, v_cache in self.runner.kv_caches:
            k_cache[NULL_BLOCK].zero_()
            v_cache[NULL_BLOCK].zero_()
        torch.cuda.synchronize(self.device)
        logger.info("warm-up steps: %.1fs", time.perf_counter() - t0)

    def _load_profile(self) -> tuple[CostModel | None, Path | None]:
        """The cost profile named by ``cost_profile``, else (with an online budget) the one
        saved for this model, device, dtype and thread count, if any."""
        from chunkserve.profiler import find_profile

        path = self.config.cost_profile
        if path is None and self.budget_policy.is_online:
            path = find_profile(self)
        if path is None:
            return None, None
        try:
            return CostModel.load(path), Path(path)
        except ValueError as exc:
            if self.config.cost_profile:
                raise  # the user named it: say what is wrong with it
            logger.warning(
                "online budget: ignoring the profile found (%s); re-run `chunkserve profile`",
                exc,
            )
            return None, None

    def _make_controller(self, path: Path | None) -> BudgetController:
        """The online budget controller, primed from the profile if one was loaded."""
        model = self.profile
        policy = self.budget_policy.describe()
        if model is not None:
            online = OnlineCostModel(model.weights, prior_weight=1.0, meta=model.meta)
            logger.info(
                "%s: cost model from %s (measured %s on %s)",
                policy,
                path,
                model.meta.get("date", "?"),
                model.meta.get("hardware", "?"),
            )
        else:
            online = OnlineCostModel(DEFAULT_PRIOR, prior_weight=1.0)
            logger.info(
                "%s: no profile (`chunkserve profile` makes one); starting from a safe "
                "small budget and learning from measured steps",
                policy,
            )
        return BudgetController(
            online,
            self.budget_policy,
            min_prefill_tokens=self.block_size,
            warmup_steps=0 if model is not None else UNPROFILED_WARMUP_STEPS,
        )

    def _size_kv_cache(self, bytes_per_block: int) -> None:
        """``num_blocks`` from the KV memory; a cache that cannot hold one sequence of
        ``max_model_len`` tokens is a configuration error."""
        kv_memory = self._kv_cache_memory()
        num_blocks = kv_memory // bytes_per_block - 1  # one more is the null block
        capacity = num_blocks * self.block_size
        if capacity < self.max_model_len:
            raise ValueError(
                f"kv_cache_memory: {kv_memory} bytes hold {capacity} tokens, fewer than "
                f"max_model_len ({self.max_model_len}); raise kv_cache_memory to at least "
                f"{-(-self.max_model_len // self.block_size) * bytes_per_block} or lower "
                f"max_model_len"
            )
        self.num_blocks = num_blocks
        self.kv_cache_memory = (num_blocks + 1) * bytes_per_block

    def _kv_cache_memory(self) -> int:
        if self.config.kv_cache_memory is not None:
            return self.config.kv_cache_memory
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            return int(free * DEFAULT_GPU_MEMORY_UTILIZATION)
        return DEFAULT_CPU_KV_CACHE_MEMORY

    # ---- requests --------------------------------------------------------------------------
    def add_request(
        self,
        prompt: str | Sequence[int] | None = None,
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        *,
        prompt_token_ids: Sequence[int] | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
    ) -> str:
        """Queue a request; returns its id. Raises ``ValueError`` naming the bad field."""
        text, token_ids = self.tokenize_prompt(prompt, prompt_token_ids)
        params = sampling_params or SamplingParams()
        max_tokens = self.check_request(len(token_ids), params, priority)
        if request_id is None:
            request_id = f"req-{next(self._ids)}"
        elif request_id in self.scheduler.requests:
            raise ValueError(f"request_id: {request_id!r} is already in use")
        request = Request(
            request_id,
            token_ids,
            params,
            max_tokens=max_tokens,
            eos_token_ids=self.eos_token_ids,
            arrival_time=arrival_time,
            priority=priority,
            prompt=text,
        )
        self.scheduler.add_request(request)
        max_stop = max((len(s) for s in params.stop), default=0)
        self._states[request_id] = _OutputState(
            detok=IncrementalDetokenizer(self.tokenizer, token_ids, params.skip_special_tokens),
            stop=params.stop,
            holdback=max(0, max_stop - 1),
            logprobs=[] if params.logprobs is not None else None,
        )
        return request_id

    def check_request(
        self, num_prompt_tokens: int, params: SamplingParams, priority: int = 0
    ) -> int:
        """Validate a request against this engine without queueing it; return its resolved
        ``max_tokens``. Reads only immutable state, so any thread may call it."""
        if not isinstance(params, SamplingParams):
            raise ValueError("sampling_params: must be a SamplingParams")
        params.validate()
        if (
            not isinstance(priority, int)
            or isinstance(priority, bool)
            or not INT64_MIN <= priority <= INT64_MAX
        ):
            raise ValueError(f"priority: must be a 64-bit integer, got {priority!r}")
        vocab = self.model_config.vocab_size
        for name, ids in (
            ("stop_token_ids", params.stop_token_ids),
            ("logit_bias", params.logit_bias or ()),
        ):
            bad = next((t for t in ids if t >= vocab), None)
            if bad is not None:
                raise ValueError(f"{name}: token id {bad} is outside the vocabulary [0, {vocab})")
        n = num_prompt_tokens
        if n < 1:
            raise ValueError("prompt: must not be empty")
        if n >= self.max_model_len:
            raise ValueError(
                f"prompt: {n} tokens is too long; max_model_len is "
                f"{self.max_model_len} (prompt + at least one output token)"
            )
        if params.max_tokens is None:
            if params.min_tokens > self.max_model_len - n:
                raise ValueError(
                    f"min_tokens: {params.min_tokens} do not fit beside the {n}-token prompt "
                    f"in max_model_len ({self.max_model_len})"
                )
            return self.max_model_len - n
        if n + params.max_tokens > self.max_model_len:
            raise ValueError(
                f"max_tokens: this model's maximum context length is {self.max_model_len} "
                f"tokens, but {n + params.max_tokens} were requested ({n} in the prompt and "
                f"{params.max_tokens} for the completion)"
            )
        return params.max_tokens

    def tokenize_prompt(
        self, prompt: str | Sequence[int] | None, prompt_token_ids: Sequence[int] | None = None
    ) -> tuple[str | None, list[int]]:
        """(text, token ids) of a prompt given as text or ids; ids are range-checked. Uses
        only the tokenizer and immutable config, so any thread may call it."""
        if prompt_token_ids is None and prompt is not None and not isinstance(prompt, str):
            prompt_token_ids, prompt = prompt, None
        if prompt_token_ids is not None:
            ids = list(prompt_token_ids)
            if not ids:
                raise ValueError("prompt: must not be empty")
            vocab = self.model_config.vocab_size
            for t in ids:
                if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab:
                    raise ValueError(
                        f"prompt: token id {t!r} is outside the vocabulary [0, {vocab})"
                    )
            return prompt, ids
        if not isinstance(prompt, str):
            raise ValueError(
                f"prompt: must be a string or a list of token ids, got {type(prompt).__name__}"
            )
        if not prompt:
            raise ValueError("prompt: must not be empty")
        ids = self.tokenizer.encode(prompt)
        if not ids:
            raise ValueError("prompt: tokenizes to zero tokens")
        return prompt, ids

    def abort_request(self, request_id: str) -> bool:
        """Stop a request and free its blocks at once. False if it was not in flight."""
        request = self.scheduler.abort_request(request_id)
        if request is None:
            return False
        self._notify_finished([self._final_output(request)])
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def get_request(self, request_id: str) -> Request | None:
        return self.scheduler.requests.get(request_id)

    # ---- the step --------------------------------------------------------------------------
    def step(self, token_budget: int | None = None) -> list[RequestOutput]:
        """Run one iteration; return an output for every request that got a token (or
        finished) in it."""
        t_start = time.perf_counter()
        queried, hits = self.kv.num_queried_tokens, self.kv.num_hit_tokens
        decision = None
        if token_budget is None and self.controller is not None:
            decision = self.controller.decide(self.scheduler)
            token_budget = decision.token_budget
        out = self.scheduler.schedule(token_budget)
        t_sched = time.perf_counter()
        if out.is_empty:
            self._prev_step_end = None  # idle: the next gap starts afresh
            return []
        try:
            result = self.runner.execute(out)
        except Exception as exc:  # fail this step's requests, keep the engine alive
            if is_fatal_device_error(exc):
                raise DeviceError(f"step {self.step_count}: {type(exc).__name__}: {exc}") from exc
            logger.exception(
                "step %d failed; failing its %d request(s)", self.step_count, len(out.chunks)
            )
            return self._fail_step(out, f"{type(exc).__name__}: {exc}")
        t_fwd = time.perf_counter()
        failed_outputs = []
        if result.failed:  # sampling raised for these rows only
            failed = [c.request for c in out.chunks if c.request.request_id in result.failed]
            for r in failed:
                self.scheduler.fail_requests([r], result.failed[r.request_id])
                failed_outputs.append(self._final_output(r, result.failed[r.request_id]))
        produced = self.scheduler.update(out, result.sampled)
        forward_time = t_fwd - t_sched
        for chunk in out.prefills:
            chunk.request.metrics.prefill_time += forward_time
        outputs = failed_outputs + [
            self._output_or_error(r, result.logprobs.get(r.request_id)) for r in produced
        ]
        t_end = time.perf_counter()

        # The step's shape, once, for the profile's prediction and the controller.
        shape = StepShape.of(out) if self.profile or self.controller else None
        stats = StepStats(
            step=self.step_count,
            kind=out.kind,
            num_prefill_seqs=len(out.prefills),
            num_new_seqs=sum(1 for c in out.prefills if c.start == c.request.num_cached_tokens),
            num_prefill_tokens=out.num_prefill_tokens,
            num_decode_tokens=out.num_decode_tokens,
            num_cached_tokens=sum(
                c.request.num_cached_tokens
                for c in out.prefills
                if c.start == c.request.num_cached_tokens
            ),
            num_preempted=len(out.preempted),
            num_running=out.num_running,
            num_waiting=out.num_waiting,
            kv_usage=out.kv_usage,
            token_budget=out.token_budget,
            schedule_time=(t_sched - t_start) + (t_end - t_fwd),
            forward_time=forward_time,
            layout_time=result.layout_time,
            wall_time=t_end - t_start,
            num_finished=sum(1 for o in outputs if o.finished),
            num_generated_tokens=len(result.sampled),
            prefix_cache_queries=self.kv.num_queried_tokens - queried,
            prefix_cache_hits=self.kv.num_hit_tokens - hits,
            loop_gap=None if self._prev_step_end is None else t_start - self._prev_step_end,
            predicted_time=self.profile.predict(shape) if self.profile else None,
            target_time=decision.target_s if decision else None,
            over_target=bool(decision and decision.over_target and out.prefills),
        )
        self.step_count += 1
        if self.controller is not None:
            # A step with decodes follows the previous one without idling in between (its
            # requests were running): the time since that one ended is their token gap.
            gap = stats.loop_gap
            interval = gap + stats.wall_time if out.decodes and gap is not None else None
            self.controller.observe(out, stats.wall_time, interval, shape)
        self._prev_step_end = t_end
        self._log_step(stats)
        self._notify_finished(outputs)
        for listener in self.step_listeners:
            listener(stats)
        return outputs

    def _output_or_error(self, request: Request, logprob: tuple | None) -> RequestOutput:
        """The request's output for this step; if detokenising or the stop-string scan
        raises, the request fails alone (its blocks freed) and the step goes on."""
        try:
            return self._make_output(request, logprob)
        except Exception as exc:
            logger.exception("output processing of %s failed", request.request_id)
            error = f"{type(exc).__name__}: {exc}"
            if request.is_finished:  # finished by a stop token or length: blocks are free
                request.error = error
                request.status = RequestStatus.FINISHED_ERROR
            else:
                self.scheduler.fail_requests([request], error)
            return self._final_output(request, error)

    def _fail_step(self, out: SchedulerOutput, error: str) -> list[RequestOutput]:
        requests = [c.request for c in out.chunks if not c.request.is_finished]
        self.scheduler.fail_requests(requests, error)
        outputs = [self._final_output(r, error) for r in requests]
        self._notify_finished(outputs)
        return outputs

    def _final_output(self, request: Request, error: str | None = None) -> RequestOutput:
        """The last output of a request that ends without a new token (abort, error)."""
        state = self._states.pop(request.request_id, None)
        self.sampler.forget(request.request_id)
        return RequestOutput(
            request_id=request.request_id,
            prompt=request.prompt,
            prompt_token_ids=request.prompt_token_ids,
            text=state.text if state else "",
            token_ids=list(request.output_token_ids),
            delta_text="",
            delta_token_ids=[],
            finished=True,
            finish_reason=request.finish_reason,
            metrics=request.metrics,
            error=error,
            num_cached_tokens=request.num_cached_tokens,
        )

    def _notify_finished(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            if out.finished:
                for listener in self.finish_listeners:
                    listener(out)

    def _make_output(self, request: Request, logprob: tuple | None) -> RequestOutput:
        state = self._states[request.request_id]
        new_token = request.output_token_ids[-1]
        if state.logprobs is not None and logprob is not None:
            state.logprobs.append(TokenLogprob(new_token, logprob[0], logprob[1]))
        state.detok.add_tokens([new_token])
        if request.is_finished:
            state.detok.flush()
        full = state.detok.text
        if state.stop:
            hit = self._find_stop(full, len(state.text), state.stop)
            if hit is not None:
                idx, stop = hit
                keep = (
                    idx + len(stop) if request.sampling_params.include_stop_str_in_output else idx
                )
                full = full[:keep]
                request.stop_reason = stop
                if request.is_finished:  # it also hit EOS or length on this token
                    request.status = RequestStatus.FINISHED_STOPPED
                else:
                    self.scheduler.finish_request(request, RequestStatus.FINISHED_STOPPED)
        state.text = full
        finished = request.is_finished
        visible = len(full) if finished else max(state.sent_len, len(full) - state.holdback)
        delta_text = full[state.sent_len : visible]
        state.sent_len = visible
        delta_tokens = request.output_token_ids[state.sent_tokens :]
        state.sent_tokens = request.num_output_tokens
        delta_logprobs = None
        if state.logprobs is not None:
            delta_logprobs = state.logprobs[state.sent_logprobs :]
            state.sent_logprobs = len(state.logprobs)
        if finished:
            self._states.pop(request.request_id, None)
            self.sampler.forget(request.request_id)
        return RequestOutput(
            request_id=request.request_id,
            prompt=request.prompt,
            prompt_token_ids=request.prompt_token_ids,
            text=full[:visible],
            token_ids=list(request.output_token_ids),
            delta_text=delta_text,
            delta_token_ids=delta_tokens,
            finished=finished,
            finish_reason=request.finish_reason,
            stop_reason=request.stop_reason,
            logprobs=state.logprobs,
            delta_logprobs=delta_logprobs,
            num_cached_tokens=request.num_cached_tokens,
            metrics=request.metrics,
        )

    @staticmethod
    def _find_stop(text: str, checked_len: int, stops: list[str]) -> tuple[int, str] | None:
        """Earliest stop string in ``text`` that ends after ``checked_len`` (earlier text was
        searched in previous steps)."""
        best: tuple[int, str] | None = None
        for stop in stops:
            idx = text.find(stop, max(0, checked_len - len(stop) + 1))
            if idx != -1 and (best is None or idx < best[0]):
                best = (idx, stop)
        return best

    # ---- logging ---------------------------------------------------------------------------
    def _log_step(self, s: StepStats) -> None:
        if s.kind == "decode":
            self._decode_log_steps += 1
            self._decode_log_tokens += s.num_decode_tokens
            self._decode_log_time += s.wall_time
            if self._decode_log_steps < self.config.log_stats_interval:
                return
            logger.info(
                "Decode batch. #running-req: %d, #token: %d, token usage: %.2f, "
                "#queue-req: %d, gen throughput (token/s): %.1f, step: %.1f ms",
                s.num_running,
                s.num_decode_tokens,
                s.kv_usage,
                s.num_waiting,
                self._decode_log_tokens / max(self._decode_log_time, 1e-9),
                1e3 * self._decode_log_time / self._decode_log_steps,
            )
            self._decode_log_steps = self._decode_log_tokens = 0
            self._decode_log_time = 0.0
            return
        logger.info(
            "%s batch. #new-seq: %d, #prefill-seq: %d, #new-token: %d, #cached-token: %d, "
            "#decode-token: %d, token usage: %.2f, #running-req: %d, #queue-req: %d, "
            "#preempted: %d, budget: %d, step: %.1f ms (schedule %.2f ms)%s%s%s",
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
        )
