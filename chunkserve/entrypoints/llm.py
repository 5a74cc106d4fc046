"""Offline entry point: ``LLM(...).generate(prompts, SamplingParams(...))`` and ``.chat``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from chunkserve.config import EngineConfig
from chunkserve.engine.engine import Engine
from chunkserve.engine.input_processor import PROMPT_FORMS
from chunkserve.engine.output_processor import RequestOutput
from chunkserve.scheduling.sampling_params import SamplingParams

# A prompt: text, token ids, or one of vLLM's prompt dicts ({"prompt": text},
# {"prompt_token_ids": [ids]}); ``InputProcessor.tokenize_prompt`` reads each.
Prompt = str | list[int] | dict[str, Any]


# The offline token budget when none is named. ``generate`` returns when the whole batch is
# done: nobody reads a token before, so steps are sized for throughput (whole-matrix
# efficiency from about 512 rows on a CPU) instead of for the gaps between tokens, as a
# server's adaptive default sizes them. vLLM's LLM class likewise defaults to a larger
# budget than its API server. Measured (64 prompts of 20-1,500 tokens, 128 out, fp32, 2
# threads, 2-core EPYC): 349 total tok/s against 318 for the server's adaptive default.
OFFLINE_MAX_NUM_BATCHED_TOKENS = 2048


def offline_config(config: EngineConfig) -> EngineConfig:
    """``config`` with the offline budget, unless a budget, a latency target or a slowdown
    was named (or chunking is off: its budget is the whole prompt's)."""
    named = (
        config.max_num_batched_tokens,
        config.itl_slo_ms,
        config.max_decode_slowdown,
        config.long_step_share,
    )
    if not config.enable_chunked_prefill or any(x is not None for x in named):
        return config
    return config.replace(max_num_batched_tokens=OFFLINE_MAX_NUM_BATCHED_TOKENS)


class LLM:
    """Batch generation on the engine. ``LLM()`` serves the embedded SmolLM2-135M-Instruct;
    ``LLM(model="x.gguf")`` or ``LLM(model="hf_dir")`` any Llama-family model. Keyword
    arguments are ``EngineConfig`` fields; with no budget named, steps carry up to
    ``OFFLINE_MAX_NUM_BATCHED_TOKENS`` tokens (a static budget: throughput, not the gaps
    between tokens nobody sees until the batch ends)."""

    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        self.engine = Engine(offline_config(EngineConfig.from_kwargs(model=model, **kwargs)))
        self.tokenizer = self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate for every prompt; outputs in the prompts' order. A prompt is text, a
        list of token ids, ``{"prompt": text}`` or ``{"prompt_token_ids": [ids]}`` (vLLM's
        prompt dicts); one prompt or a list of them."""
        if isinstance(prompts, (str, dict)) or (
            isinstance(prompts, (list, tuple)) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]  # one prompt
        if not isinstance(prompts, Sequence):
            raise ValueError(
                f"prompts: must be a prompt or a list of prompts; a prompt is {PROMPT_FORMS}, "
                f"got {type(prompts).__name__}"
            )
        prompts = list(prompts)
        if not prompts:
            raise ValueError("prompts: must not be empty")
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise ValueError(
                    f"sampling_params: {len(params_list)} given for {len(prompts)} prompts"
                )
        return self._run(prompts, params_list, use_tqdm)

    def reset_prefix_cache(self) -> None:
        """Empty the prefix cache (``enable_prefix_caching``): later prompts hit nothing
        cached before this call."""
        self.engine.reset_prefix_cache()

    def chat(
        self,
        messages: Sequence[dict[str, Any]] | Sequence[Sequence[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        """One conversation (a list of messages) or several; the model's chat template turns
        each into a prompt. Returns one output per conversation."""
        if messages and isinstance(messages[0], dict):
            conversations = [messages]
        else:
            conversations = list(messages)
        prompts = [self.tokenizer.encode_chat(c, add_generation_prompt) for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def _run(
        self, prompts: list[Prompt], params_list: list[SamplingParams], use_tqdm: bool
    ) -> list[RequestOutput]:
        engine = self.engine
        ids: list[str] = []
        try:
            for prompt, params in zip(prompts, params_list, strict=True):
                ids.append(engine.add_request(prompt, params))
        except ValueError:
            for rid in ids:  # nothing half-queued stays behind
                engine.abort_request(rid)
            raise
        index = {rid: i for i, rid in enumerate(ids)}
        results: list[RequestOutput | None] = [None] * len(ids)
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(ids), desc="Generating", unit="req", dynamic_ncols=True)
        try:
            remaining = len(ids)
            while remaining:
                for out in engine.step():
                    if out.finished and out.request_id in index:
                        results[index[out.request_id]] = out
                        remaining -= 1
                        if bar is not None:
                            bar.update(1)
        except BaseException:
            for rid in ids:
                engine.abort_request(rid)
            raise
        finally:
            if bar is not None:
                bar.close()
        return [r for r in results if r is not None]
