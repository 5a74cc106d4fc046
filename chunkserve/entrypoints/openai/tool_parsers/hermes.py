"""Hermes / Qwen format: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, any
number of them, with text around them."""

from __future__ import annotations

import json

from chunkserve.entrypoints.openai.tool_parsers.base import ToolParser, as_call, safe_end

OPEN = "<tool_call>"
_DECODER = json.JSONDecoder()
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
        body = pos + len(OPEN)
        close = text.find(CLOSE, body)
        if close >= 0:
            try:
                call = as_call(json.loads(text[body:close]))
            except ValueError:
                call = None
            if call is not None:
                return "", [call], close + len(CLOSE)
        # The JSON decides where it ends (a string in it may hold "</tool_call>", which a
        # forced call's grammar allows): a whole object, then the closing tag.
        lead = body
        while lead < len(text) and text[lead].isspace():
            lead += 1
        try:
            value, after = _DECODER.raw_decode(text, lead)
        except ValueError:
            value, after = None, -1
        if after >= 0:
            tail = after
            while tail < len(text) and text[tail].isspace():
                tail += 1
            rest = text[tail : tail + len(CLOSE)]
            call = as_call(value)
            if call is not None and rest == CLOSE:
                return "", [call], tail + len(CLOSE)
            if call is not None and CLOSE.startswith(rest) and not final:
                return None  # the closing tag may still come
        elif not final:
            return None  # incomplete (or broken: decided when the output ends)
        if close < 0:
            return (text[pos:], [], len(text)) if final else None
        end = close + len(CLOSE)
        return text[pos:end], [], end  # broken: the block stays content
