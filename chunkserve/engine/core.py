"""The engine core: the scheduler, the budget controller and the worker. Token ids in, token
ids and step statistics out; no text anywhere in it.

``EngineCore.step()`` = budget ``decide`` -> ``Scheduler.schedule`` -> ``Worker.execute`` ->
``Scheduler.update``, then one ``CoreOutput`` per request that got a token or ended, and one
``StepStats`` record (logged). Requests come in checked
(``input_processor.InputProcessor``): the core asserts what the edge validated instead of
validating it again. Text (detokenising, stop strings) is the front end's
(``output_processor.OutputProcessor``): a stop string it finds comes back as
``finish_requests``.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from chunkserve.config import EngineConfig, ModelConfig
from chunkserve.disagg.connectors import Connectors
from chunkserve.disagg.remote import RemotePrefills
from chunkserve.disagg.sender import KVSender
from chunkserve.engine.core_types import (
    CoreInfo,
    CoreLoad,
    CoreOutput,
    CoreRequest,
    CoreTiming,
)
from chunkserve.engine.step_log import StepLogger, StepStats
from chunkserve.engine.step_loop import StepLoop
from chunkserve.model.loader import ModelSource, load_model_config, release_gguf_readers
from chunkserve.model.source import config_source
from chunkserve.scheduling.budget import UNPROFILED_WARMUP_STEPS, BudgetController
from chunkserve.scheduling.costmodel import (
    DEFAULT_PRIOR,
    CostModel,
    ExpertRouting,
    OnlineCostModel,
    StepShape,
    find_profile,
)
from chunkserve.scheduling.kv_cache import KVCacheManager
from chunkserve.scheduling.request import Request, RequestStatus
from chunkserve.scheduling.scheduler import Scheduler, SchedulerOutput
from chunkserve.worker.speculative import Speculator
from chunkserve.worker.structured import GrammarCompiler
from chunkserve.worker.worker import DeviceError, Worker

logger = logging.getLogger("chunkserve")

# Disaggregated decode with nothing to run but KV arriving: the core polls this often.
TRANSFER_POLL_S = 0.001


@dataclass
class CoreStep:
    """One step's outputs and statistics (``stats`` is None when nothing ran)."""

    outputs: list[CoreOutput] = field(default_factory=list)
    stats: StepStats | None = None


class EngineCore:
    """Synchronous core. Not thread-safe: one thread drives it."""

    def __init__(
        self,
        config: EngineConfig,
        eos_token_ids: tuple[int, ...],
        source: ModelSource | None = None,
        model_config: ModelConfig | None = None,
        reader: Any = None,
        index: int = 0,
    ) -> None:
        """``source``, ``model_config`` and ``reader`` as the front end loaded them (in
        process), else resolved here (a core in its own process). ``index``: which core of
        a data-parallel group this is."""
        self.config = config
        self.index = index
        if source is None:
            source = config_source(config)
        own_config = model_config is None
        if own_config:
            model_config, reader = load_model_config(source)
        self.model_config = model_config
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len = config.resolve_max_model_len(model_config)
        # Everything a bad configuration fails is checked before the weights load.
        self.scheduler_config = sched_config = config.scheduler_config(max_model_len)
        self.budget_policy = config.budget_policy(max_model_len)
        self.worker = Worker(config, model_config, max_model_len)
        self.worker.plan_weights(source, reader)  # (the profile is per weight format)
        # The cost profile: primes the online controller, and with it every step's
        # predicted time is logged beside the measured one (``StepStats.predicted_time``).
        self.profile, profile_path = self._load_profile(str(source.path))
        if self.profile is not None and self.profile.routing is None:
            self.profile.routing = self._uniform_routing()
        self.controller = (
            self._make_controller(profile_path) if self.budget_policy.is_online else None
        )
        try:
            self.worker.load(source, reader, sched_config.max_num_seqs)
        except BaseException:
            self.worker.shutdown()  # tensor-parallel ranks it started
            raise
        self.kv = KVCacheManager(
            self.worker.num_blocks,
            config.block_size,
            config.enable_prefix_caching,
            self.worker.kv_groups.windows,
        )
        self.scheduler = Scheduler(sched_config, self.kv)
        self.loop = StepLoop(self.scheduler, self.controller, time.perf_counter)
        # Prefill/decode disaggregation (``chunkserve.disagg``): the decode side asks for
        # prompts' KV and takes it in; the prefill side sends it.
        self.connectors: Connectors | None = None
        self.remote: RemotePrefills | None = None
        self.sender: KVSender | None = None
        mode = config.disaggregation_mode
        if mode is not None:
            self.connectors = Connectors(
                config.kv_connector, config.kv_transfer_host, self.worker.device
            )
            # The deterministic mode's fp32 results depend on the thread count: both sides
            # of a pair must run the same (``KVHandle.check_fits``).
            threads = self.worker.num_threads if config.deterministic else 0
            if mode == "decode":
                self.remote = RemotePrefills(
                    self.connectors, self.worker, self.scheduler, config.block_size,
                    config.deterministic, threads,
                )  # fmt: skip
            else:
                self.sender = KVSender(
                    self.connectors, self.worker, config.block_size, config.deterministic, threads
                )
        spec = config.speculative_config
        self.speculator = Speculator(spec, max_model_len) if spec else None
        # Structured outputs: grammars compiled off the step loop; the tokenizer is read
        # when the first one arrives.
        self.grammars = GrammarCompiler(
            lambda: self._load_tokenizer(source), model_config.vocab_size, eos_token_ids
        )
        if own_config and source.kind == "gguf":
            # A core in its own process (it read the config itself): the weights are in,
            # so the GGUF reader (the file's map, whose copied pages stay resident, and its
            # parsed header) can go. A core in a front end's process leaves the shared
            # reader to the front end (``serve`` releases it; tests build many engines
            # from the cached one). The first grammar's tokenizer parses the file again.
            reader = None
            released = release_gguf_readers()
            logger.debug("released %.0f MiB with the GGUF reader", released / 2**20)
        self.step_count = 0
        self._kv_recorded = (0, 0)  # prefix-cache counters as of the last step's record
        self._log = StepLogger(config.log_stats_interval)
        w = self.worker
        logger.info(
            "chunkserve engine core: model=%s device=%s dtype=%s attention=%s cuda_graphs=%s "
            "fused_ops=%s weights loaded in %.1fs | KV cache: %d blocks x %d tokens = %d "
            "tokens (%.0f MiB)%s | max_model_len=%d max_num_seqs=%d chunked_prefill=%s "
            "policy=%s | %s | speculative: %s | tensor_parallel_size=%d | "
            "disaggregation: %s",
            source.name,
            w.device,
            str(w.dtype).removeprefix("torch."),
            w.attention.name,
            w.cuda_graphs,
            w.model.fused_ops,
            w.load_time,
            w.num_blocks,
            w.block_size,
            w.num_blocks * w.block_size,
            w.kv_cache_memory / 2**20,
            _describe_kv_groups(w.kv_groups.windows, w.num_blocks, w.block_size, max_model_len),
            max_model_len,
            sched_config.max_num_seqs,
            sched_config.enable_chunked_prefill,
            sched_config.policy,
            self.budget_policy.describe(),
            spec.describe() if spec else "off",
            config.tensor_parallel_size,
            "off"
            if mode is None
            else f"{mode}" + (f" (kv_connector={config.kv_connector})" if self.remote else ""),
        )

    # ---- setup -----------------------------------------------------------------------------
    def _load_profile(self, model_path: str) -> tuple[CostModel | None, Path | None]:
        """The cost profile named by ``cost_profile``, else (with an online budget) the one
        saved for this model, device, dtype, weight format and thread count, if any."""
        path = self.config.cost_profile
        if path is None and self.budget_policy.is_online:
            w = self.worker
            dtype = str(w.dtype).removeprefix("torch.")
            path = find_profile(model_path, w.device.type, dtype, w.num_threads, w.weights_format)
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

    def _uniform_routing(self) -> ExpertRouting | None:
        """A mixture-of-experts model's routing as a random router spreads it (the cost
        model's experts feature; a profile measured here carries the routing it saw)."""
        mc = self.model_config
        layers = sum(mc.is_moe_layer(i) for i in range(mc.num_layers))
        if not layers:
            return None
        return ExpertRouting.uniform(mc.num_experts, mc.num_experts_per_tok, layers)

    def _make_controller(self, path: Path | None) -> BudgetController:
        """The online budget controller, primed from the profile if one was loaded."""
        model = self.profile
        policy = self.budget_policy.describe()
        if model is not None:
            online = OnlineCostModel(
                model.weights, prior_weight=1.0, meta=model.meta, routing=model.routing
            )
            logger.info(
                "%s: cost model from %s (measured %s on %s)",
                policy,
                path,
                model.meta.get("date", "?"),
                model.meta.get("hardware", "?"),
            )
        else:
            online = OnlineCostModel(
                DEFAULT_PRIOR, prior_weight=1.0, routing=self._uniform_routing()
            )
            logger.info(
                "%s: no profile (`chunkserve profile` makes one); starting from a safe "
                "small budget and learning from measured steps",
                policy,
            )
        return BudgetController(
            online,
            self.budget_policy,
            min_prefill_tokens=self.config.block_size,
            warmup_steps=0 if model is not None else UNPROFILED_WARMUP_STEPS,
        )

    def _load_tokenizer(self, source: ModelSource) -> Any:
        """The model's ``tokenizers.Tokenizer`` (for grammars over its vocabulary)."""
        from chunkserve.engine.tokenizer import Tokenizer
        from chunkserve.model.hub import resolve_tokenizer

        reader = None
        config = self.config
        if config.tokenizer is None and source.kind != "hf":
            _, reader = load_model_config(source)
        path = resolve_tokenizer(config.tokenizer, config.tokenizer_revision, config.download_dir)
        return Tokenizer.from_source(source, reader, path).backend

    def info(self) -> CoreInfo:
        w = self.worker
        return CoreInfo(
            pid=os.getpid(),
            device=str(w.device),
            dtype=str(w.dtype).removeprefix("torch."),
            num_threads=w.num_threads,
            num_blocks=w.num_blocks,
            block_size=w.block_size,
            kv_cache_memory=w.kv_cache_memory,
            budget_policy=self.budget_policy.describe(),
            tp_pids=w.tp_pids,
            kv_group_windows=list(self.kv.group_windows),
        )

    # ---- requests --------------------------------------------------------------------------
    def add_request(self, req: CoreRequest) -> None:
        """Queue a request the front end checked. A request id in use is a ``ValueError``
        (ids are the caller's: the only check the edge cannot make)."""
        if req.request_id in self.scheduler.requests or req.request_id in self.grammars.pending:
            raise ValueError(f"request_id: {req.request_id!r} is already in use")
        request = Request(
            req.request_id,
            req.prompt_token_ids,
            req.params,
            max_tokens=req.max_tokens,
            eos_token_ids=self.eos_token_ids,
            arrival_time=req.arrival_time,
            priority=req.priority,
        )
        kv = req.params.kv_transfer_params
        if kv is not None and (kv.send is None) != (self.sender is None):
            # The edge refuses these (``InputProcessor``); in process, say so again.
            raise ValueError(
                f"kv_transfer_params: this instance's disaggregation_mode is "
                f"{self.config.disaggregation_mode!r}"
            )
        if kv is not None and kv.send is not None:
            assert self.sender is not None
            self.sender.open(request, kv.send)  # a handle that does not fit: ValueError
        if req.params.structured_outputs is not None:
            self.grammars.submit(request)  # scheduled once its grammar is compiled
        else:
            self.scheduler.add_request(request)

    def abort_request(self, request_id: str) -> CoreOutput | None:
        """Stop a request and free its blocks at once; its final output, or None if it was
        not in flight."""
        request = self.scheduler.abort_request(request_id) or self.grammars.abort(request_id)
        if request is None:
            return None
        return self._final(request)

    def reset_prefix_cache(self) -> int:
        """``KVCacheManager.reset_prefix_cache``: no later request hits what is cached now;
        requests in flight run on unaffected. Returns how many blocks were cached."""
        return self.kv.reset_prefix_cache()

    def finish_requests(self, request_ids: list[str], status: RequestStatus) -> None:
        """End requests the front end finished (a stop string): their blocks free now."""
        for request_id in request_ids:
            request = self.scheduler.requests.get(request_id)
            if request is not None:
                self.scheduler.finish_request(request, status)
                self._forget(request_id)

    def fail_request(self, request_id: str, error: str) -> None:
        """A request whose output processing raised: it ends alone, its blocks free."""
        request = self.scheduler.requests.get(request_id)
        if request is not None:
            self.scheduler.fail_requests([request], error)
            self._forget(request_id)

    def _forget(self, request_id: str) -> None:
        """A request ended: drop its sampling state and any KV transfer of it."""
        self.worker.forget(request_id)
        if self.remote is not None:
            self.remote.release(request_id)
        if self.sender is not None:
            self.sender.release(request_id)

    def _fail(self, failures: list[tuple[Request, str]]) -> list[CoreOutput]:
        """End these requests alone with their errors; their final outputs."""
        outputs = []
        for request, error in failures:
            self.scheduler.fail_requests([request], error)
            outputs.append(self._final(request, error))
        return outputs

    def shutdown(self) -> None:
        """Stop the background threads (grammar compiles and masks, KV transfers) and the
        tensor-parallel ranks."""
        self.grammars.shutdown()
        if self.remote is not None:
            self.remote.close()
        if self.sender is not None:
            self.sender.close()
        if self.connectors is not None:
            self.connectors.close()
        runner = self.worker.runner
        if runner is not None and runner.masks is not None:
            runner.masks.shutdown()
        self.worker.shutdown()

    def keepalive(self) -> None:
        """Called while the core idles (no step to run): ``Worker.keepalive``."""
        self.worker.keepalive()

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self.grammars.pending)

    def load(self) -> CoreLoad:
        kv = self.kv
        return CoreLoad(
            self.scheduler.num_running,
            self.scheduler.num_waiting + len(self.grammars.pending),
            kv.num_blocks - kv.num_free_blocks,
            self.scheduler.num_waiting_for_kv,
            kv.group_blocks_used,
        )

    def get_request(self, request_id: str) -> Request | None:
        return self.scheduler.requests.get(request_id) or self.grammars.get(request_id)

    def _admit_grammars(self) -> list[CoreOutput]:
        """Queue the requests whose grammar compiled; the final outputs of those whose
        grammar failed. With nothing else to run, waits a little for a compile."""
        idle = not self.scheduler.has_unfinished()
        ready, failed = self.grammars.collect(timeout=0.05 if idle else 0.0)
        for r in ready:
            self.scheduler.add_request(r)
        return [self._final(r, r.error) for r in failed]

    @property
    def clock(self) -> Callable[[], float]:
        """The clock that times steps (the budget controller's and the speculator's
        measurements: the step loop's): tests replace it to make those measurements
        independent of the machine's speed."""
        return self.loop.clock

    @clock.setter
    def clock(self, clock: Callable[[], float]) -> None:
        self.loop.clock = clock

    # ---- the step --------------------------------------------------------------------------
    def step(self, token_budget: int | None = None) -> CoreStep:
        """Run one iteration: an output for every request that got a token or ended in it."""
        t_start = self.loop.start()
        kv = self.kv
        # Prefix-cache lookups since the last step's record (a step that ran nothing, as
        # while a decode instance admits requests whose KV is to arrive, records none).
        queried, hits = self._kv_recorded
        failed = self._admit_grammars() if self.grammars.pending else []
        if self.remote is not None:  # disaggregated decode: KV asked for, and arriving
            failed += self._fail(self.remote.start(self.scheduler.admit_remote()))
            failed += self._fail(self.remote.poll())
        if self.speculator is not None:
            self.speculator.plan(self.scheduler.running_decodes())
        out, decision = self.loop.schedule(token_budget)
        t_sched = self.clock()
        if out.is_empty:
            if self.remote is not None and self.remote.active:
                time.sleep(TRANSFER_POLL_S)  # only KV in flight: poll again shortly
            return CoreStep(failed)
        try:
            result = self.worker.execute(out)
        except DeviceError as exc:
            raise DeviceError(f"step {self.step_count}: {exc}") from exc
        except Exception as exc:  # fail this step's requests, keep the core alive
            logger.exception(
                "step %d failed; failing its %d request(s)", self.step_count, len(out.chunks)
            )
            return CoreStep(failed + self._fail_step(out, f"{type(exc).__name__}: {exc}"))
        t_fwd = self.clock()
        outputs = failed
        if self.sender is not None:  # before ``update`` may free a finished prompt's blocks
            outputs += self._fail(self.sender.after_execute(out))
        if result.failed:  # sampling raised for these rows only
            for chunk in out.chunks:
                r = chunk.request
                error = result.failed.get(r.request_id)
                if error is not None:
                    self.scheduler.fail_requests([r], error)
                    outputs.append(self._final(r, error))
        before = {c.request.request_id: c.request.num_output_tokens for c in out.chunks}
        for chunk in out.prefills:  # gathered chunk by chunk, by position (a recompute
            r = chunk.request  # after a preemption writes the same values again)
            scored = result.prompt_logprobs.get(r.request_id)
            if scored is not None and r.prompt_logprobs is not None:
                first, entries = scored
                r.prompt_logprobs[first : first + len(entries)] = entries
        produced = self.scheduler.update(out, result.sampled)
        forward_time = t_fwd - t_sched
        for chunk in out.prefills:
            chunk.request.metrics.prefill_time += forward_time
        num_generated = 0
        for r in produced:
            new = r.output_token_ids[before[r.request_id] :]
            num_generated += len(new)
            logprobs = result.logprobs.get(r.request_id)
            prompt_logprobs = None
            if r.prompt_logprobs is not None and not r.prompt_logprobs_sent:
                prompt_logprobs, r.prompt_logprobs_sent = r.prompt_logprobs, True
            outputs.append(
                CoreOutput(
                    r.request_id,
                    new,
                    None if logprobs is None else logprobs[: len(new)],
                    r.finish_reason,
                    r.stop_reason,
                    r.num_cached_tokens,
                    CoreTiming.of(r),
                    r.error,
                    prompt_logprobs,
                )
            )
            if r.is_finished:
                self._forget(r.request_id)
        spec = None
        if self.speculator is not None:
            spec = self.speculator.record(out.decodes)
            self._propose()
        # The step's shape, once, for the profile's prediction and the controller.
        shape = StepShape.of(out) if self.profile or self.controller else None
        t_end = self.loop.finish(out, shape)  # the controller observes the step
        stats = self._stats(out, result, decision, shape, outputs, (queried, hits))
        self._kv_recorded = (kv.num_queried_tokens, kv.num_hit_tokens)
        stats.num_generated_tokens = num_generated
        if spec is not None and spec.drafts:
            stats.num_drafts, stats.num_draft_tokens = spec.drafts, spec.draft_tokens
            stats.num_accepted_tokens = spec.accepted
            stats.accepted_per_position = spec.per_position
        stats.comm_time = result.comm_time
        ends = self.remote or self.sender
        if ends is not None:
            records = ends.take_records()
            if records:
                stats.kv_transfers = [(r.num_bytes, r.copy_s, r.wait_s) for r in records]
        stats.num_masked_rows = result.num_masked_rows
        stats.mask_time, stats.mask_wait_time = result.mask_time, result.mask_wait_time
        compiles = self.grammars.take_records()
        if compiles:
            stats.grammar_compiles = [(c.seconds, c.cached) for c in compiles]
        if self.grammars.num_admitted or self.grammars.pending:  # no scan until grammars are used
            stats.num_structured_requests = len(self.grammars.pending) + sum(
                1 for r in self.scheduler.requests.values() if r.grammar is not None
            )
        stats.loop_gap = self.loop.loop_gap
        stats.schedule_time = (t_sched - t_start) + (t_end - t_fwd)
        stats.forward_time = forward_time
        stats.wall_time = t_end - t_start
        self.step_count += 1
        if self.speculator is not None:
            self.speculator.observe_step(
                out.kind, len(out.decodes), out.num_draft_tokens, stats.wall_time
            )
        self._log.log(stats)
        return CoreStep(outputs, stats)

    def _propose(self) -> None:
        """Drafts for the next step of every running decode (speculative decoding)."""
        assert self.speculator is not None
        decodes = self.scheduler.running_decodes()
        if self.speculator.config.method == "ngram":
            self.speculator.propose_ngram(decodes)
            self._cut_drafts(decodes)
            return
        # Only the drafts that will pay are computed (the draft model's passes cost time).
        ks = self.speculator.paying(decodes, [self.speculator.num_wanted(r) for r in decodes])
        wanted = []
        for r, k in zip(decodes, ks):
            # The draft model writes its KV at the positions it proposes from: their slots
            # must be the request's (the next step's allocation covers them anyway). Drafts
            # are optional: they never take the blocks the decodes' next tokens may need.
            spare = self.kv.num_free_blocks - len(decodes) * self.kv.num_groups
            if k and self.kv.num_new_blocks(r, k) <= spare and self.kv.allocate_slots(r, k):
                wanted.append((r, k))
            else:
                r.draft_token_ids = []
        self.worker.propose_drafts(wanted)
        self._cut_drafts(decodes)

    @staticmethod
    def _cut_drafts(decodes: list[Request]) -> None:
        """Drafts end before the first token a request's grammar rejects (verification
        would reject it, at the price of a row)."""
        for r in decodes:
            if r.grammar is not None and r.draft_token_ids:
                del r.draft_token_ids[r.grammar.valid_drafts(r.draft_token_ids) :]

    def _stats(self, out, result, decision, shape, outputs, kv_before) -> StepStats:
        """The step's record; its times are the caller's to fill in."""
        kv = self.kv
        new = [c for c in out.prefills if c.start == c.request.num_cached_tokens]
        return StepStats(
            step=self.step_count,
            kind=out.kind,
            num_prefill_seqs=len(out.prefills),
            num_new_seqs=len(new),
            num_prefill_tokens=out.num_prefill_tokens,
            num_decode_tokens=out.num_decode_tokens,
            num_cached_tokens=sum(c.request.num_cached_tokens for c in new),
            num_preempted=len(out.preempted),
            num_running=out.num_running,
            num_waiting=out.num_waiting,
            kv_usage=out.kv_usage,
            token_budget=out.token_budget,
            schedule_time=0.0,
            forward_time=0.0,
            layout_time=result.layout_time,
            wall_time=0.0,
            num_finished=sum(1 for o in outputs if o.finished),
            prefix_cache_queries=kv.num_queried_tokens - kv_before[0],
            prefix_cache_hits=kv.num_hit_tokens - kv_before[1],
            predicted_time=self.profile.predict(shape) if self.profile else None,
            target_time=decision.target_s if decision else None,
            over_target=bool(decision and decision.over_target and out.prefills),
            long_step=bool(self.controller and self.controller.long_step_served(out)),
            core=self.index,
        )

    def _fail_step(self, out: SchedulerOutput, error: str) -> list[CoreOutput]:
        requests = [c.request for c in out.chunks if not c.request.is_finished]
        self.scheduler.fail_requests(requests, error)
        return [self._final(r, error) for r in requests]

    def _final(self, request: Request, error: str | None = None) -> CoreOutput:
        """The last output of a request that ends without a new token (abort, error)."""
        self._forget(request.request_id)
        return CoreOutput(
            request.request_id,
            [],
            None,
            request.finish_reason,
            request.stop_reason,
            request.num_cached_tokens,
            CoreTiming.of(request),
            error,
        )


def _describe_kv_groups(
    windows: tuple[int | None, ...], num_blocks: int, block_size: int, max_model_len: int
) -> str:
    """The start-up line's KV groups: a block holds one group's layers; the blocks per group
    a request of ``max_model_len`` tokens holds (a sliding group: its window and a block),
    and how many such requests the pool holds, against full attention's KV on every layer
    (blocks then hold every group's layers: ``num_groups`` times fewer)."""
    if all(w is None for w in windows):
        return ""
    slots = num_blocks * block_size
    num_full = sum(w is None for w in windows)
    kinds = ", ".join(f"{windows.count(w)} x window {w}" for w in sorted(set(windows) - {None}))
    text = f", {len(windows)} KV group(s): {num_full} full, {kinds}"
    if num_full:
        text += f" (~{slots // num_full} tokens of full history)"
    full = -(-max_model_len // block_size)
    per_group = [
        full if w is None else min(full, -(-(w + block_size) // block_size)) for w in windows
    ]
    held = sum(per_group)
    shown = ", ".join(
        f"{'full' if w is None else f'window {w}'}: {n}"
        for w, n in sorted(set(zip(windows, per_group, strict=True)), key=lambda x: x[0] or 0)
    )
    text += (
        f"; blocks per group for a {max_model_len}-token request: {shown} ({held} in all): "
        f"{num_blocks // held} such requests at once, "
        f"{num_blocks // len(windows) // full} with full attention on every layer"
    )
    return text
