"""Reasoning parsers, chosen by ``--reasoning-parser``: they split a reply into its
reasoning (``reasoning_content``) and its content, whole or streamed (``Reasoning`` events and
content strings, the same scanner as the tool-call parsers': any cut gives the same result).

- ``deepseek_r1``: the reply is reasoning from its start (a leading ``<think>`` dropped: the
  template may have written it into the prompt) up to ``</think>``, content after it; a
  reply that never closes it is all reasoning.
- ``qwen3``: reasoning only when the reply opens with ``<think>`` (leading whitespace
  allowed), up to ``</think>``; a reply that does not is all content (thinking off).
- ``harmony``: GPT-OSS's analysis channel (``tool_parsers/harmony.py``).

A structured output (forced tool call, ``response_format``) comes after the reasoning: each
parser's ``constrained_reasoning`` tells the grammar what free text precedes it
(``StructuredOutputsParams.reasoning``): a think block, or harmony's analysis message with
the output as the final channel's body.
"""

from __future__ import annotations

from chunkserve.entrypoints.openai.reasoning_parsers.think import (
    DeepSeekR1ReasoningParser,
    Qwen3ReasoningParser,
)
from chunkserve.entrypoints.openai.tool_parsers.base import ToolParser
from chunkserve.entrypoints.openai.tool_parsers.harmony import HarmonyParser

REASONING_PARSERS: dict[str, type[ToolParser]] = {
    "deepseek_r1": DeepSeekR1ReasoningParser,
    "qwen3": Qwen3ReasoningParser,
    "harmony": HarmonyParser,
}


def get_reasoning_parser(name: str) -> type[ToolParser]:
    try:
        return REASONING_PARSERS[name]
    except KeyError:
        raise ValueError(
            f"reasoning_parser: unknown parser {name!r} "
            f"(choose from {', '.join(REASONING_PARSERS)})"
        ) from None


def detect_reasoning_parser(chat_template: str | None) -> tuple[str | None, str]:
    """``(parser or None, why)`` for a model's chat template: harmony for ``<|channel|>``,
    ``<think>`` templates qwen3 when ChatML (``<|im_start|>``) else deepseek_r1, else none."""
    template = chat_template or ""
    if "<|channel|>" in template:
        return "harmony", "the chat template writes <|channel|>"
    if "<think>" in template or "</think>" in template:
        if "<|im_start|>" in template:
            return "qwen3", "a ChatML chat template with <think>"
        return "deepseek_r1", "the chat template writes <think>"
    return None, "no reasoning markers in the chat template"


__all__ = ["REASONING_PARSERS", "detect_reasoning_parser", "get_reasoning_parser"]
