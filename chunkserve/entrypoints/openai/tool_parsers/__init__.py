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
    Reasoning,
    ToolCall,
    ToolCallDelta,
    ToolParser,
    collect,
)
from chunkserve.entrypoints.openai.tool_parsers.harmony import HarmonyParser
from chunkserve.entrypoints.openai.tool_parsers.hermes import HermesToolParser
from chunkserve.entrypoints.openai.tool_parsers.llama3_json import Llama3JsonToolParser
from chunkserve.entrypoints.openai.tool_parsers.mistral import MistralToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    p.name: p for p in (HermesToolParser, Llama3JsonToolParser, MistralToolParser, HarmonyParser)
}

# What a chat template writes for each format, most telling first.
_TEMPLATE_SIGNS = (
    ("<|channel|>", "harmony"),
    ("[TOOL_CALLS]", "mistral"),
    ("<tool_call>", "hermes"),
    ("<|python_tag|>", "llama3_json"),
)


def detect_tool_parser(chat_template: str | None) -> tuple[str, str]:
    """``(parser, why)`` for a model's chat template: the format the template writes tool
    calls in (harmony's ``<|channel|>``, Mistral's ``[TOOL_CALLS]``, Hermes' ``<tool_call>``,
    Llama 3's ``<|python_tag|>`` or its JSON tool prompt), else Hermes, the format of the
    fallback prompt a template without tools gets."""
    template = chat_template or ""
    for sign, name in _TEMPLATE_SIGNS:
        if sign in template:
            return name, f"the chat template writes {sign}"
    if "<|start_header_id|>" in template and "parameters" in template:
        return "llama3_json", "a Llama 3 chat template with JSON tool calls"
    return "hermes", "no tool-call format in the chat template: the Hermes fallback prompt"


class ReplyParser:
    """A reply's reasoning parser and tool-call parser in a row: the reasoning parser splits
    off the reasoning, the tool-call parser reads calls from the content that is left (so a
    format that looks at the start of the reply sees the start of the content). Either may
    be None. A parser that does both (harmony) goes in ``reasoning``."""

    def __init__(self, reasoning: ToolParser | None, tools: ToolParser | None) -> None:
        self.reasoning, self.tools = reasoning, tools

    @property
    def count(self) -> int:
        """Tool calls emitted so far."""
        return (self.reasoning.count if self.reasoning else 0) + (
            self.tools.count if self.tools else 0
        )

    def feed(self, piece: str) -> list[Event]:
        return self._through(self.reasoning.feed(piece) if self.reasoning else [piece], False)

    def finish(self) -> list[Event]:
        return self._through(self.reasoning.finish() if self.reasoning else [], True)

    def _through(self, events: list[Event], final: bool) -> list[Event]:
        if self.tools is None:
            return [e for e in events if e != ""]
        out: list[Event] = []
        for e in events:
            out += self.tools.feed(e) if isinstance(e, str) else [e]
        if final:
            out += self.tools.finish()
        return out


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
    "HarmonyParser",
    "Reasoning",
    "ReplyParser",
    "ToolCall",
    "ToolCallDelta",
    "ToolParser",
    "collect",
    "detect_tool_parser",
    "get_tool_parser",
]
