"""``<think>...</think>`` reasoning (DeepSeek-R1, Qwen3): see the package's docstring."""

from __future__ import annotations

from chunkserve.entrypoints.openai.tool_parsers.base import Reasoning, ToolParser, safe_end

OPEN, CLOSE = "<think>", "</think>"


class ThinkReasoningParser(ToolParser):
    """Reasoning up to ``</think>``, content after. ``opens_in_reasoning``: the reply starts
    as reasoning (DeepSeek-R1) rather than only after an opening ``<think>`` (Qwen3)."""

    opens_in_reasoning = True
    markers = (OPEN, CLOSE)

    def __init__(self) -> None:
        super().__init__()
        self.state = "start"  # start -> reasoning -> content

    def _advance(self, final: bool):
        if self.state == "start":
            text, lead = self.text, self.pos
            while lead < len(text) and text[lead].isspace():
                lead += 1
            rest = text[lead:]
            if OPEN.startswith(rest) and not final:
                return []  # could still be <think>
            if rest.startswith(OPEN):
                self.state, self.pos = "reasoning", lead + len(OPEN)
            else:
                self.state = "reasoning" if self.opens_in_reasoning else "content"
        return super()._advance(final)

    def _step(self, final: bool):
        text, pos = self.text, self.pos
        if self.state == "reasoning":
            close = text.find(CLOSE, pos)
            if close >= 0:
                self.state = "content"
                return Reasoning(text[pos:close]), [], close + len(CLOSE)
            end = len(text) if final else safe_end(text, pos, CLOSE)
            return (Reasoning(text[pos:end]), [], end) if end > pos else None
        return text[pos:], [], len(text)


class DeepSeekR1ReasoningParser(ThinkReasoningParser):
    name = "deepseek_r1"
    opens_in_reasoning = True
    constrained_reasoning = "think"


class Qwen3ReasoningParser(ThinkReasoningParser):
    name = "qwen3"
    opens_in_reasoning = False
    constrained_reasoning = "optional_think"
