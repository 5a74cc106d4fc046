"""The in-process engine: a ``FrontEnd`` around an ``EngineCore`` in this process, driven by
one thread: ``add_request / abort_request / step / has_unfinished``.

``step()`` = ``EngineCore.step()`` (token ids) -> ``OutputProcessor.process`` (text, stop
strings, logprobs, deltas); a stop string found, or output processing that raised, ends the
request in the core before the next step. The offline ``LLM``, ``chunkserve generate`` and
``chunkserve serve --no-core-process`` drive it.
"""

from __future__ import annotations

from typing import Any

from chunkserve.config import EngineConfig
from chunkserve.engine.core import CoreInfo, CoreLoad, CoreRequest, EngineCore
from chunkserve.engine.frontend import FrontEnd
from chunkserve.engine.output_processor import RequestOutput
from chunkserve.scheduling.request import Request, RequestStatus


class Engine(FrontEnd):
    """Synchronous engine. Not thread-safe: one thread drives ``step()`` (the async server
    wraps it)."""

    def __init__(self, config: EngineConfig | None = None, **kwargs: Any) -> None:
        super().__init__(config or EngineConfig.from_kwargs(**kwargs))
        self.core = EngineCore(
            self.config, self.eos_token_ids, self._source, self.model_config, self._reader
        )
        self._source = self._reader = None  # the core holds what it needs

    def abort_request(self, request_id: str) -> bool:
        """Stop a request and free its blocks at once. False if it was not in flight."""
        final = self.core.abort_request(request_id)
        if final is None:
            return False
        self._notify_finished([self.outputs.final(final)])
        return True

    def shutdown(self) -> None:
        self.core.shutdown()

    def get_request(self, request_id: str) -> Request | None:
        return self.core.get_request(request_id)

    def has_unfinished(self) -> bool:
        return self.core.has_unfinished()

    def step(self, token_budget: int | None = None) -> list[RequestOutput]:
        """Run one iteration; return an output for every request that got a token (or
        finished) in it."""
        step = self.core.step(token_budget)
        return self._process(step.outputs, step.stats)

    # ---- what a server reads ---------------------------------------------------------------
    @property
    def core_infos(self) -> list[CoreInfo]:
        return [self.core.info()]

    def core_loads(self) -> list[CoreLoad]:
        return [self.core.load()]

    @property
    def num_running(self) -> int:
        return self.core.scheduler.num_running

    @property
    def num_waiting(self) -> int:
        return self.core.scheduler.num_waiting

    @property
    def num_blocks(self) -> int:
        return self.core.kv.num_blocks

    @property
    def kv_blocks_used(self) -> int:
        return self.core.kv.num_blocks - self.core.kv.num_free_blocks

    # ---- the core's side -------------------------------------------------------------------
    def _core_add(self, request: CoreRequest) -> None:
        self.core.add_request(request)

    def _core_finish(self, request_ids: list[str]) -> None:
        self.core.finish_requests(request_ids, RequestStatus.FINISHED_STOPPED)

    def _core_fail(self, request_id: str, error: str) -> None:
        self.core.fail_request(request_id, error)

    def _core_reset_prefix_cache(self) -> None:
        self.core.reset_prefix_cache()
