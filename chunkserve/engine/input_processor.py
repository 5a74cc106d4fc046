"""The front end's input side: prompts (text or token ids) -> token ids, and every check a
request needs, made once, here at the edge, against the model (its vocabulary and context
length). What passes is a ``CheckedRequest``: the front end queues it without checking again
(``FrontEnd.add_checked``), and the core takes it as a ``core.CoreRequest``.

Reads only the tokenizer and immutable configuration, so any thread may call it (the server
checks on its event loop's thread; the engine thread only queues).
"""

from __future__ import annotations

import copy
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from chunkserve.config import ModelConfig
from chunkserve.disagg.connector import KVHandle
from chunkserve.engine.tokenizer import Tokenizer
from chunkserve.scheduling.sampling_params import INT64_MAX, INT64_MIN, SamplingParams
from chunkserve.worker import structured


@dataclass(frozen=True)
class CheckedRequest:
    """A request that passed every check against this engine (made by ``InputProcessor``
    alone): its token ids, its text if it came as text, its sampling parameters and
    priority, and ``max_tokens`` resolved against the context length."""

    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    max_tokens: int
    priority: int = 0


class InputProcessor:
    def __init__(
        self,
        tokenizer: Tokenizer,
        model_config: ModelConfig,
        max_model_len: int,
        disaggregation_mode: str | None = None,
        sampling_defaults: dict[str, Any] | None = None,
        max_tokens_cap: int | None = None,
    ):
        self.tokenizer = tokenizer
        self.model_config = model_config
        self.max_model_len = max_model_len
        self.disaggregation_mode = disaggregation_mode
        # The model's generation config (``model.generation``): each applies to a request
        # that leaves its field unset.
        self.sampling_defaults = dict(sampling_defaults or {})
        # vLLM's server-wide limit from a generation config (``generation.max_tokens_cap``).
        self.max_tokens_cap = max_tokens_cap

    def process(
        self,
        prompt: str | Sequence[int] | None,
        params: SamplingParams | None = None,
        priority: int = 0,
        prompt_token_ids: Sequence[int] | None = None,
    ) -> CheckedRequest:
        """A prompt (text or token ids) and its parameters, tokenised and checked;
        ``ValueError`` naming the bad field."""
        text, token_ids = self.tokenize_prompt(prompt, prompt_token_ids)
        return self.check(text, token_ids, SamplingParams() if params is None else params, priority)

    def check(
        self, prompt: str | None, token_ids: list[int], params: SamplingParams, priority: int = 0
    ) -> CheckedRequest:
        """Check a tokenised prompt (from ``tokenize_prompt``: its ids are in the
        vocabulary) and its parameters against this engine; ``ValueError`` naming the bad
        field. ``params`` is validated unless it passed ``validate()`` since its fields were
        last set (``SamplingParams.validate_if_changed``)."""
        if not isinstance(params, SamplingParams):
            raise ValueError("sampling_params: must be a SamplingParams")
        params.validate_if_changed()
        if self.sampling_defaults:
            defaults = self.sampling_defaults
            if "max_tokens" in defaults:  # a default length fits beside the prompt
                room = max(1, self.max_model_len - len(token_ids))
                defaults = {**defaults, "max_tokens": min(defaults["max_tokens"], room)}
            params = params.with_defaults(defaults)
        cap = self.max_tokens_cap
        if cap is not None and (params.max_tokens is None or params.max_tokens > cap):
            params = copy.copy(params)  # the caller's object stays as it was
            object.__setattr__(params, "max_tokens", cap)
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
            self._check_choices(params.structured_outputs)
        n = len(token_ids)
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
            return CheckedRequest(prompt, token_ids, params, self.max_model_len - n, priority)
        if n + params.max_tokens > self.max_model_len:
            raise ValueError(
                f"max_tokens: this model's maximum context length is {self.max_model_len} "
                f"tokens, but {n + params.max_tokens} were requested ({n} in the prompt and "
                f"{params.max_tokens} for the completion)"
            )
        return CheckedRequest(prompt, token_ids, params, params.max_tokens, priority)

    def _check_choices(self, constraint) -> None:
        """A choice the vocabulary cannot write (a character whose bytes no token holds:
        the tokenizer drops them) would leave the grammar with no allowed token mid-output:
        a ValueError naming it instead. Decoding may only move spaces around (its clean-up),
        so the check is on the characters, spaces aside, and on replacement characters."""
        for i, choice in enumerate(constraint.choice or ()):
            back = self.tokenizer.decode(self.tokenizer.encode(choice, add_special_tokens=False))
            if back == choice:
                continue
            if ("\ufffd" in back and "\ufffd" not in choice) or "".join(back.split()) != "".join(
                choice.split()
            ):
                raise ValueError(
                    f"{constraint.field('choice')}[{i}]: {choice[:40]!r} cannot be written "
                    f"with this model's vocabulary (its tokenizer has no token for some of "
                    f"its characters)"
                )

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
        self,
        prompt: str | Sequence[int] | dict | None,
        prompt_token_ids: Sequence[int] | None = None,
    ) -> tuple[str | None, list[int]]:
        """(text, token ids) of a prompt given as text, token ids or one of vLLM's prompt
        dicts (``{"prompt": text}``, ``{"prompt_token_ids": ids}``); ids are range-checked.
        Anything else is a ``ValueError`` saying what a prompt may be. Uses only the
        tokenizer and immutable config, so any thread may call it."""
        if isinstance(prompt, dict) and prompt_token_ids is None:
            prompt, prompt_token_ids = _prompt_dict(prompt)
        elif prompt_token_ids is None and _is_ids(prompt):
            prompt_token_ids, prompt = prompt, None
        if prompt_token_ids is not None:
            if not _is_ids(prompt_token_ids):
                raise ValueError(
                    f"prompt_token_ids: must be a list of token ids, got "
                    f"{type(prompt_token_ids).__name__}"
                )
            ids = list(prompt_token_ids)
            if not ids:
                raise ValueError("prompt: must not be empty")
            vocab = self.model_config.vocab_size
            for t in ids:
                if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab:
                    raise ValueError(
                        f"prompt: token id {t!r} is outside the vocabulary [0, {vocab})"
                    )
            if prompt is not None and not isinstance(prompt, str):
                raise ValueError(f"prompt: must be text beside prompt_token_ids, got {prompt!r}")
            return prompt, ids
        if not isinstance(prompt, str):
            raise ValueError(f"prompt: must be {PROMPT_FORMS}, got {type(prompt).__name__}")
        if not prompt:
            raise ValueError("prompt: must not be empty")
        check_unicode("prompt", prompt)
        ids = self.tokenizer.encode(prompt)
        if not ids:
            raise ValueError("prompt: tokenizes to zero tokens")
        return prompt, ids


PROMPT_FORMS = (
    "a string, a list of token ids, {'prompt': text} or {'prompt_token_ids': [token ids]}"
)


def _is_ids(value: object) -> bool:
    return isinstance(value, Sequence) and not isinstance(value, (str, bytes))


def _prompt_dict(prompt: dict) -> tuple[object, object]:
    """(text, token ids) of one of vLLM's prompt dicts (``TextPrompt``, ``TokensPrompt``)."""
    unknown = sorted(map(str, set(prompt) - {"prompt", "prompt_token_ids"}))
    if unknown or not prompt:
        what = f"{unknown[0]!r} is not supported" if unknown else "an empty dict"
        raise ValueError(f"prompt: {what}; a prompt is {PROMPT_FORMS}")
    if "prompt_token_ids" in prompt:
        return prompt.get("prompt"), prompt["prompt_token_ids"]
    return prompt["prompt"], None


def lone_surrogate(text: str) -> int | None:
    """Where ``text`` holds a UTF-16 surrogate not paired into a character (JSON's
    ``"\\ud800"``: no Unicode text can hold it, no tokenizer takes it); None if nowhere."""
    try:
        text.encode("utf-8")
        return None
    except UnicodeEncodeError as exc:
        return exc.start


def check_unicode(name: str, text: str) -> None:
    """``ValueError`` naming ``name`` if ``text`` holds a lone surrogate."""
    at = lone_surrogate(text)
    if at is not None:
        raise ValueError(
            f"{name}: not valid Unicode text (a lone UTF-16 surrogate, "
            f"U+{ord(text[at]):04X}, at character {at})"
        )
