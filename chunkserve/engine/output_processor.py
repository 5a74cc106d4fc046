"""The front end's output side: token-id deltas from the core -> text deltas.

``OutputProcessor`` keeps one state per request: its incremental detokeniser, stop strings
(text held back while one could still be completing), logprobs, what was already sent, and
its metrics (``RequestMetrics``): tokens are timed when they reach the front end (what a
client sees), the core adds when it was first scheduled, its prefill time and preemptions.
A stop string ends a request here, not in the core: ``process`` returns the ids the core
must finish (``EngineCore.finish_requests``); a request whose processing raises fails alone
(``failed``).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from chunkserve.engine.core_types import CoreOutput
from chunkserve.engine.tokenizer import IncrementalDetokenizer, Tokenizer
from chunkserve.scheduling.request import RequestMetrics
from chunkserve.scheduling.sampling_params import SamplingParams

logger = logging.getLogger("chunkserve")


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # the top-n alternatives (token id, logprob)


@dataclass
class PromptTokenLogprob(TokenLogprob):
    rank: int = 1  # the token's rank in its distribution (1: the most likely)


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
    # ``prompt_logprobs``: per prompt token (None for the first), on the first output.
    prompt_logprobs: list[PromptTokenLogprob | None] | None = None


@dataclass
class _RequestState:
    """Per-request text state: detokeniser, stop strings, what was already sent."""

    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    detok: IncrementalDetokenizer
    holdback: int  # chars held back while a stop string could still be completing
    metrics: RequestMetrics
    token_ids: list[int] = field(default_factory=list)
    sent_len: int = 0
    sent_tokens: int = 0
    logprobs: list[TokenLogprob] | None = None
    sent_logprobs: int = 0
    text: str = ""


@dataclass
class Processed:
    """What ``OutputProcessor.process`` made of one step's core outputs."""

    outputs: list[RequestOutput]
    stopped: list[str]  # finished by a stop string: the core must finish them
    failed: dict[str, str]  # request id -> error: processing raised; the core must fail them


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._states: dict[str, _RequestState] = {}

    def add_request(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival_time: float,
    ) -> None:
        max_stop = max((len(s) for s in params.stop), default=0)
        self._states[request_id] = _RequestState(
            prompt=prompt,
            prompt_token_ids=prompt_token_ids,
            params=params,
            detok=IncrementalDetokenizer(
                self.tokenizer,
                prompt_token_ids,
                params.skip_special_tokens,
                params.keep_special_token_ids,
            ),
            holdback=max(0, max_stop - 1),
            metrics=RequestMetrics(arrival_time),
            logprobs=[] if params.logprobs is not None else None,
        )

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._states

    def __len__(self) -> int:
        return len(self._states)

    def process(self, core_outputs: list[CoreOutput]) -> Processed:
        done = Processed([], [], {})
        now = time.monotonic()
        for co in core_outputs:
            state = self._states.get(co.request_id)
            if state is None:
                continue  # ended here already (a stop string, an abort): the rest is moot
            _time(state.metrics, co, now)
            try:
                out = self._make_output(state, co)
            except Exception as exc:
                logger.exception("output processing of %s failed", co.request_id)
                error = f"{type(exc).__name__}: {exc}"
                if not co.finished:
                    done.failed[co.request_id] = error
                out = self.final(co, error, finish_reason="error")
            else:
                if out.finished and not co.finished:
                    done.stopped.append(co.request_id)
            if out.finished:
                self._states.pop(co.request_id, None)
                state.metrics.finished_time = state.metrics.finished_time or now
            done.outputs.append(out)
        return done

    def final(
        self, co: CoreOutput, error: str | None = None, finish_reason: str | None = None
    ) -> RequestOutput:
        """The last output of a request that ends without a new token (abort, error)."""
        state = self._states.pop(co.request_id, None)
        metrics = None
        if state is not None:
            metrics = state.metrics
            _core_timing(metrics, co)
            metrics.finished_time = metrics.finished_time or time.monotonic()
        return RequestOutput(
            request_id=co.request_id,
            prompt=state.prompt if state else None,
            prompt_token_ids=state.prompt_token_ids if state else [],
            text=state.text if state else "",
            token_ids=list(state.token_ids) if state else [],
            delta_text="",
            delta_token_ids=[],
            finished=True,
            finish_reason=finish_reason or co.finish_reason,
            metrics=metrics,
            error=error if error is not None else co.error,
            num_cached_tokens=co.num_cached_tokens,
        )

    def _make_output(self, state: _RequestState, co: CoreOutput) -> RequestOutput:
        if not co.new_token_ids:
            return self.final(co)
        finished, finish_reason, stop_reason = co.finished, co.finish_reason, co.stop_reason
        params = state.params
        tokens = co.new_token_ids
        if not params.stop:
            state.detok.add_tokens(tokens)
            if finished:
                state.detok.flush()
            full = state.detok.text
        else:
            # A token at a time: a stop string ends the output at the token that completes
            # it, also when a step brings several (accepted draft tokens).
            for n, token in enumerate(tokens, 1):
                state.detok.add_tokens([token])
                if finished and n == len(tokens):
                    state.detok.flush()
                full = state.detok.text
                hit = find_stop(full, len(state.text), params.stop)
                if hit is not None:
                    idx, stop = hit
                    full = full[: idx + len(stop) if params.include_stop_str_in_output else idx]
                    finished, finish_reason, stop_reason = True, "stop", stop
                    tokens = tokens[:n]
                    break
        if state.logprobs is not None and co.new_logprobs is not None:
            for token, (logprob, top) in zip(tokens, co.new_logprobs):
                state.logprobs.append(TokenLogprob(token, logprob, top))
        state.token_ids.extend(tokens)
        del state.metrics.token_times[len(state.token_ids) :]  # tokens cut by a stop string
        state.text = full
        visible = len(full) if finished else max(state.sent_len, len(full) - state.holdback)
        delta_text = full[state.sent_len : visible]
        state.sent_len = visible
        delta_tokens = state.token_ids[state.sent_tokens :]
        state.sent_tokens = len(state.token_ids)
        delta_logprobs = None
        if state.logprobs is not None:
            delta_logprobs = state.logprobs[state.sent_logprobs :]
            state.sent_logprobs = len(state.logprobs)
        return RequestOutput(
            request_id=co.request_id,
            prompt=state.prompt,
            prompt_token_ids=state.prompt_token_ids,
            text=full[:visible],
            token_ids=list(state.token_ids),
            delta_text=delta_text,
            delta_token_ids=delta_tokens,
            finished=finished,
            finish_reason=finish_reason,
            stop_reason=stop_reason,
            logprobs=state.logprobs,
            delta_logprobs=delta_logprobs,
            num_cached_tokens=co.num_cached_tokens,
            metrics=state.metrics,
            prompt_logprobs=_prompt_logprobs(state.prompt_token_ids, co.prompt_logprobs),
        )


def _prompt_logprobs(
    prompt: list[int], scored: list[tuple[float, list, int] | None] | None
) -> list[PromptTokenLogprob | None] | None:
    if scored is None:
        return None
    out: list[PromptTokenLogprob | None] = []
    for token, entry in zip(prompt, scored):
        if entry is None:
            out.append(None)
        else:
            logprob, top, rank = entry
            out.append(PromptTokenLogprob(token, logprob, [tuple(t) for t in top], rank))
    return out


def _core_timing(metrics: RequestMetrics, co: CoreOutput) -> None:
    if co.timing is not None:
        metrics.first_scheduled_time = co.timing.first_scheduled_time
        metrics.prefill_time = co.timing.prefill_time
        metrics.num_preemptions = co.timing.num_preemptions


def _time(metrics: RequestMetrics, co: CoreOutput, now: float) -> None:
    """Fold one core output into a request's metrics: its tokens arrive ``now``."""
    _core_timing(metrics, co)
    if co.new_token_ids:
        if metrics.first_token_time is None:
            metrics.first_token_time = now
        metrics.token_times.extend([now] * len(co.new_token_ids))


def find_stop(text: str, checked_len: int, stops: list[str]) -> tuple[int, str] | None:
    """Earliest stop string in ``text`` that ends after ``checked_len`` (earlier text was
    searched in previous steps)."""
    best: tuple[int, str] | None = None
    for stop in stops:
        idx = text.find(stop, max(0, checked_len - len(stop) + 1))
        if idx != -1 and (best is None or idx < best[0]):
            best = (idx, stop)
    return best
