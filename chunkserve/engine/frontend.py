"""The front end of an engine: what a request meets before and after the core.

``FrontEnd`` loads what the edge needs and nothing of the device (model config, tokenizer,
EOS ids, context length), checks and tokenises requests once (``input_processor.InputProcessor``;
a request checked there, as the server's are, is queued as it is: ``add_checked``), turns the
core's token-id deltas into text (``output_processor.OutputProcessor``) and tells the
listeners (the server's metrics). Where the core runs is the subclass's: ``engine.Engine``
(in this process, stepped by the caller) or ``multiprocess_engine.MultiprocessEngine``
(engine-core processes over ZeroMQ).
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

from chunkserve.config import EngineConfig, ModelConfig
from chunkserve.engine.core_types import CoreOutput, CoreRequest
from chunkserve.engine.input_processor import CheckedRequest, InputProcessor
from chunkserve.engine.output_processor import OutputProcessor, RequestOutput
from chunkserve.engine.step_log import StepStats
from chunkserve.engine.tokenizer import Tokenizer
from chunkserve.model.generation import max_tokens_cap, model_eos_ids, sampling_defaults
from chunkserve.model.hub import resolve_tokenizer
from chunkserve.model.source import ModelSource, config_source
from chunkserve.scheduling.sampling_params import SamplingParams

logger = logging.getLogger("chunkserve")

# With requests in flight, an engine that has not finished a step for this many seconds is
# hung (a step on the slowest CPU takes seconds): a server's ``/health`` answers 503, and a
# hung core process is killed, its requests failed.
WATCHDOG_S = 120.0
# A cold engine's first step (lazy initialisation, first kernels; two cold cores on a loaded
# 2-core machine took over 2 s) may take far longer than any later one: until the engine has
# finished a step, the watchdog waits at least this long, whatever its timeout.
FIRST_STEP_ALLOWANCE_S = 60.0
# An overloaded but healthy engine may take long steps (a long prefill chunk of a mixture of
# experts on a busy CPU): the watchdog waits at least this many times the longest step the
# engine has finished (its first, cold, step aside), whatever its timeout.
LONGEST_STEP_FACTOR = 5.0


def watchdog_limit(timeout_s: float, stepped: bool, longest_step_s: float = 0.0) -> float:
    """Seconds without a finished step after which an engine with work is hung: the
    watchdog's timeout, raised to ``LONGEST_STEP_FACTOR`` x ``longest_step_s`` (the longest
    step seen after the first), and to ``FIRST_STEP_ALLOWANCE_S`` before the first step."""
    limit = max(timeout_s, LONGEST_STEP_FACTOR * longest_step_s)
    return limit if stepped else max(limit, FIRST_STEP_ALLOWANCE_S)


class FrontEnd:
    """Input and output processing around an engine core (see the module doc). Subclasses
    implement the ``_core_*`` methods and ``step``."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        source = config_source(config)
        self.model_name = source.name
        self.model_path = str(source.path)
        model_config, reader = self._load_model_config(source)
        self.model_config: ModelConfig = model_config
        tokenizer_dir = resolve_tokenizer(
            config.tokenizer, config.tokenizer_revision, config.download_dir
        )
        self.tokenizer = Tokenizer.from_source(source, reader, tokenizer_dir)
        # Every source's EOS list counts: tokenizer_config.json's eos_token and the
        # tokenizer folder's generation config (``Tokenizer``), the model's config.json and
        # generation_config.json (Llama 3 lists three ids).
        eos = (
            set(self.tokenizer.eos_token_ids)
            | set(model_config.eos_token_ids)
            | set(model_eos_ids(source))
        )
        self.eos_token_ids = tuple(sorted(eos))
        # Requests' defaults where they leave a field unset (``--generation-config``).
        self.sampling_defaults = sampling_defaults(config, source)
        self.max_tokens_cap = max_tokens_cap(config, self.sampling_defaults)
        if self.sampling_defaults:
            logger.info(
                "default sampling parameters from the generation config (requests that "
                "leave them unset): %s%s",
                self.sampling_defaults,
                "" if self.max_tokens_cap is None else f"; max_tokens <= {self.max_tokens_cap}",
            )
        self.max_model_len = config.resolve_max_model_len(model_config)
        # Pure configuration: a bad one fails here, before any core loads weights.
        self.budget_policy = config.budget_policy(self.max_model_len)
        self.inputs = InputProcessor(
            self.tokenizer,
            model_config,
            self.max_model_len,
            config.disaggregation_mode,
            self.sampling_defaults,
            self.max_tokens_cap,
        )
        self.outputs = OutputProcessor(self.tokenizer)
        self._source: ModelSource | None = source
        self._reader = reader
        self._ids = itertools.count()
        # monotonic time of the last step the core finished: a server watches it.
        self.last_progress = time.monotonic()
        self.num_steps_seen = 0  # steps whose stats came back (the first one is slow)
        # The longest wall time of those steps, the first aside (``watchdog_limit``).
        self.longest_step_s = 0.0
        self.step_listeners: list[Callable[[StepStats], None]] = []
        # Called with the final output of every request that ends: stop, length, abort, error.
        self.finish_listeners: list[Callable[[RequestOutput], None]] = []

    def _load_model_config(self, source: ModelSource) -> tuple[ModelConfig, Any]:
        """The model's config and its open GGUF reader (None for a directory; the tokenizer
        reads it). Read here, where the core runs in this process anyway; a subclass whose
        cores run elsewhere takes it from them (reading it needs the model registry, and
        so torch, which the API server's process does without)."""
        from chunkserve.model.loader import load_model_config

        return load_model_config(source)

    # ---- requests --------------------------------------------------------------------------
    def add_request(
        self,
        prompt: str | Sequence[int] | dict | None = None,
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        *,
        prompt_token_ids: Sequence[int] | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
    ) -> str:
        """Check and queue a request (``InputProcessor.process``); returns its id. Raises
        ``ValueError`` naming the bad field."""
        checked = self.inputs.process(prompt, sampling_params, priority, prompt_token_ids)
        return self.add_checked(checked, request_id, arrival_time)

    def add_checked(
        self,
        request: CheckedRequest,
        request_id: str | None = None,
        arrival_time: float | None = None,
    ) -> str:
        """Queue a request the edge has checked (``InputProcessor``), checking nothing of it
        again; returns its id. ``ValueError`` only for a ``request_id`` in use."""
        if request_id is None:
            request_id = f"req-{next(self._ids)}"
        elif request_id in self.outputs:
            raise ValueError(f"request_id: {request_id!r} is already in use")
        arrival_time = time.monotonic() if arrival_time is None else arrival_time
        r = request
        self._core_add(
            CoreRequest(
                request_id, r.prompt_token_ids, r.params, r.max_tokens, arrival_time, r.priority
            )
        )
        self.outputs.add_request(request_id, r.prompt, r.prompt_token_ids, r.params, arrival_time)
        return request_id

    def has_unfinished(self) -> bool:
        return len(self.outputs) > 0

    def reset_prefix_cache(self) -> None:
        """Empty every core's prefix cache (``EngineCore.reset_prefix_cache``) before any
        request added after this call is scheduled; requests in flight run on unaffected."""
        self._core_reset_prefix_cache()

    def step(self) -> list[RequestOutput]:
        raise NotImplementedError

    def shutdown(self) -> None:
        """Stop the cores this front end started (none in process)."""

    def _process(self, core_outputs: list[CoreOutput], stats: StepStats | None):
        """Text for one step's core outputs; the requests a stop string ended, or whose
        processing raised, end in the core too. Returns the outputs."""
        done = self.outputs.process(core_outputs)
        if done.stopped:
            self._core_finish(done.stopped)
        for request_id, error in done.failed.items():
            self._core_fail(request_id, error)
        self._notify_finished(done.outputs)
        if stats is not None:
            self.last_progress = time.monotonic()
            if self.num_steps_seen:
                self.longest_step_s = max(self.longest_step_s, stats.wall_time)
            self.num_steps_seen += 1
            for listener in self.step_listeners:
                listener(stats)
        return done.outputs

    def _notify_finished(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            if out.finished:
                for listener in self.finish_listeners:
                    listener(out)

    # ---- the core's side -------------------------------------------------------------------
    def _core_add(self, request: CoreRequest) -> None:
        raise NotImplementedError

    def _core_finish(self, request_ids: list[str]) -> None:
        raise NotImplementedError

    def _core_fail(self, request_id: str, error: str) -> None:
        raise NotImplementedError

    def _core_reset_prefix_cache(self) -> None:
        raise NotImplementedError
