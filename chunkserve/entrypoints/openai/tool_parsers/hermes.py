"""Hermes / Qwen format: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, any
number of them, with text around them."""

from __future__ import annotations

import json

from chunkserve.entrypoints.openai.tool_parsers.base import ToolParser, as_call, safe_end

OPEN = "<tool_call>"
CLOSE = "</tool_call>"


class HermesToolParser(ToolParser):
    name = "hermes"
    markers = (OPEN, CLOSE)  # special in some vocabularies (added tokens in Qwen's)

    def _step(self, final: bool):
        text, pos = self.text, self.pos
        start = text.find(OPEN, pos)
        if start < 0:
            end = len(text) if final else safe_end(text, pos, OPEN)
            return (text[pos:end], [], end) if end > pos else None
        if start > pos:
            return text[pos:start], [], start
        close = text.find(CLOSE, pos + len(OPEN))
        if close < 0:
            return (text[pos:], [], len(text)) if final else None
        end = close + len(CLOSE)
        try:
            call = as_call(json.loads(text[pos + len(OPEN) : close]))
        except ValueError:
            call = None
        if call is None:
            return text[pos:end], [], end  # broken: the block stays content
        return "", [call], end
