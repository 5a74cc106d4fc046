"""Offline entry point: ``LLM(...).generate(prompts, SamplingParams(...))`` and ``.chat``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from chunkserve.config import EngineConfig
from chunkserve.engine import Engine
from chunkserve.outputs import RequestOutput
from chunkserve.request import SamplingParams

Prompt = str | list[int]


class LLM:
    """Batch generation on the engine. ``LLM()`` serves the embedded SmolLM2-135M-Instruct;
    ``LLM(model="x.gguf")`` or ``LLM(model="hf_dir")`` any Llama-family model. Keyword
    arguments are ``EngineConfig`` fields."""

    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        self.engine = Engine(EngineConfig.from_kwargs(model=model, **kwargs))
        self.tokenizer = self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate for every prompt (text or token ids); outputs in the prompts' order."""
        if isinstance(prompts, str) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]  # one prompt
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
