"""Real prose for long prompts: an excerpt of Shakespeare shipped with the package."""

from __future__ import annotations

import functools
import gzip
import random
from importlib.resources import files
from typing import Protocol


class _Encoder(Protocol):
    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...


@functools.cache
def prose_text() -> str:
    data = files("chunkserve.bench").joinpath("data", "shakespeare.txt.gz").read_bytes()
    return gzip.decompress(data).decode("utf-8")


_TOKEN_CACHE: dict[int, list[int]] = {}


def prose_tokens(tokenizer: _Encoder) -> list[int]:
    """The whole corpus tokenised once per tokenizer (about 400k tokens). The tokenizer's
    working memory for it (155 MiB, measured) goes back to the system after: a benchmark's
    peak RSS is the engine's, not its prompt generator's."""
    key = id(tokenizer)
    if key not in _TOKEN_CACHE:
        from chunkserve.memory import release_free_heap

        _TOKEN_CACHE[key] = tokenizer.encode(prose_text(), add_special_tokens=False)
        release_free_heap()
    return _TOKEN_CACHE[key]


def prose_prompts(tokenizer: _Encoder, lengths: list[int], rng: random.Random) -> list[list[int]]:
    """One token slice of the corpus per length, at random offsets (distinct documents)."""
    tokens = prose_tokens(tokenizer)
    out = []
    for n in lengths:
        if n > len(tokens):
            raise ValueError(f"input_len: {n} tokens is more than the corpus holds")
        start = rng.randrange(0, len(tokens) - n + 1)
        out.append(tokens[start : start + n])
    return out
