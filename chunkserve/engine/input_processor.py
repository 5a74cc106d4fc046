"""The front end's input side: prompts (text or token ids) -> token ids, and every check a
request needs, made once, here at the edge, against the model (its vocabulary and context
length). What passes is a ``core.CoreRequest`` the core takes without checking again.

Reads only the tokenizer and immutable configuration, so any thread may call it.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from chunkserve.config import ModelConfig
from chunkserve.disagg.connector import KVHandle
from chunkserve.engine.tokenizer import Tokenizer
from chunkserve.scheduling.sampling_params import INT64_MAX, INT64_MIN, SamplingParams
from chunkserve.worker import structured


class InputProcessor:
    def __init__(
        self,
        tokenizer: Tokenizer,
        model_config: ModelConfig,
        max_model_len: int,
        disaggregation_mode: str | None = None,
    ):
        self.tokenizer = tokenizer
        self.model_config = model_config
        self.max_model_len = max_model_len
        self.disaggregation_mode = disaggregation_mode

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
        if params.structured_outputs is not None:
            structured.check(params.structured_outputs)  # parses: the core compiles it
        n = num_prompt_tokens
        if n < 1:
            raise ValueError("prompt: must not be empty")
        if n >= self.max_model_len:
            raise ValueError(
                f"prompt: {n} tokens is too long; max_model_len is "
                f"{self.max_model_len} (prompt + at least one output token)"
            )
        self._check_kv_transfer(params, n)
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

    def _check_kv_transfer(self, params: SamplingParams, num_prompt_tokens: int) -> None:
        kv = params.kv_transfer_params
        if kv is None:
            return
        mode = self.disaggregation_mode
        if kv.prefill_url is not None and mode != "decode":
            raise ValueError(
                "kv_transfer_params.prefill_url: only a decode instance "
                "(--disaggregation-mode decode) takes a prefill instance to use"
            )
        if kv.send is not None:
            if mode != "prefill":
                raise ValueError(
                    "kv_transfer_params.send: only a prefill instance "
                    "(--disaggregation-mode prefill) sends KV blocks"
                )
            handle = KVHandle.from_dict(kv.send)
            if handle.num_tokens != num_prompt_tokens:
                raise ValueError(
                    f"kv_transfer_params.send.num_tokens: {handle.num_tokens}, but the prompt "
                    f"has {num_prompt_tokens} tokens"
                )
            if handle.kind == "shm" and not os.path.isfile(handle.address):
                # The decode instance made the inbox before asking: a client's error (400),
                # not one of this instance (the core would fail the request: a 500).
                raise ValueError(
                    f"kv_transfer_params.send.address: no KV inbox at {handle.address!r}"
                )

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
