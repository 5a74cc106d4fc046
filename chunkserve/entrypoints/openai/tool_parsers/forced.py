"""Replies to forced tool calls (``tool_choice`` ``required`` or a named function), which
structured outputs made JSON: a named function's reply is its arguments object, a
``required`` reply an array of ``{"name", "parameters"}`` objects. The reply is read when it
ends (a reply cut by ``max_tokens`` is not valid JSON: it stays content)."""

from __future__ import annotations

import json

from chunkserve.entrypoints.openai.tool_parsers.base import ToolParser, as_call


class ForcedToolParser(ToolParser):
    name = "forced"

    def __init__(self, named: str | None = None) -> None:
        super().__init__()
        self.named = named

    def _step(self, final: bool):
        if not final:
            return None
        text = self.text[self.pos :]
        try:
            value = json.loads(text)
        except ValueError:
            return text, [], len(self.text)
        if self.named is not None:
            call = as_call({"name": self.named, "arguments": value})
            calls = [call] if call else []
        else:
            calls = [as_call(v) for v in value] if isinstance(value, list) else []
        if not calls or any(c is None for c in calls):
            return text, [], len(self.text)
        return "", calls, len(self.text)
