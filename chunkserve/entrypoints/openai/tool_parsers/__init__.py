"""Tool-call parsers, one module per model output format, chosen by ``--tool-call-parser``.

Each turns a model's reply into ``content`` and ``tool_calls`` (``ToolParser.extract``), or,
fed the reply in pieces as it streams, into content and tool-call deltas that add up to the
same thing (``ToolParser.feed`` / ``finish``). Nothing in a reply fails a request: what is not
a complete, valid call stays content.
"""

from __future__ import annotations

from chunkserve.entrypoints.openai.tool_parsers.base import (
    Event,
    ExtractedOutput,
    ToolCall,
    ToolCallDelta,
    ToolParser,
    collect,
)
from chunkserve.entrypoints.openai.tool_parsers.hermes import HermesToolParser
from chunkserve.entrypoints.openai.tool_parsers.llama3_json import Llama3JsonToolParser
from chunkserve.entrypoints.openai.tool_parsers.mistral import MistralToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    p.name: p for p in (HermesToolParser, Llama3JsonToolParser, MistralToolParser)
}


def get_tool_parser(name: str) -> type[ToolParser]:
    """The parser class named ``name``; ``ValueError`` naming the choices otherwise."""
    try:
        return TOOL_PARSERS[name]
    except KeyError:
        raise ValueError(
            f"tool_call_parser: unknown parser {name!r} (choose from {', '.join(TOOL_PARSERS)})"
        ) from None


__all__ = [
    "TOOL_PARSERS",
    "Event",
    "ExtractedOutput",
    "ToolCall",
    "ToolCallDelta",
    "ToolParser",
    "collect",
    "get_tool_parser",
]
