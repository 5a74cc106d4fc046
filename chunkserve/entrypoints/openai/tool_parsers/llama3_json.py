"""Llama 3.x JSON format: ``{"name": ..., "parameters": {...}}`` as the whole reply (or after
``<|python_tag|>``, anywhere), several calls separated by ``;``. A reply that does not start
with ``{`` is content, so JSON quoted in prose is never taken for a call. ``<|python_tag|>``
is a special token: it is seen only when special tokens are kept."""

from __future__ import annotations

import json

from chunkserve.entrypoints.openai.tool_parsers.base import ToolParser, as_call, safe_end

TAG = "<|python_tag|>"
_DECODER = json.JSONDecoder()


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"
    markers = (TAG,)

    def __init__(self) -> None:
        super().__init__()
        self.started = False  # past the reply's leading whitespace
        self.in_calls = False  # between calls (after one, or after the tag)

    def _step(self, final: bool):
        text, pos = self.text, self.pos
        if not self.started:
            lead = pos
            while lead < len(text) and text[lead].isspace():
                lead += 1
            if lead == len(text) and not final:
                return None
            self.started = True
            self.in_calls = text.startswith("{", lead)
            if lead > pos:
                return text[pos:lead], [], lead
        if self.in_calls:
            body = pos
            while body < len(text) and (text[body].isspace() or text[body] == ";"):
                body += 1
            if body == len(text):
                return (text[pos:], [], body) if final else None
            if text[body] == "{":
                return self._object(pos, body, final)
            self.in_calls = False
            if body > pos:
                return text[pos:body], [], body
        start = text.find(TAG, pos)
        if start < 0:
            end = len(text) if final else safe_end(text, pos, TAG)
            return (text[pos:end], [], end) if end > pos else None
        if start > pos:
            return text[pos:start], [], start
        body = pos + len(TAG)
        while body < len(text) and text[body].isspace():
            body += 1
        if body == len(text) and not final:
            return None
        if body < len(text) and text[body] == "{":
            return self._object(pos, body, final)
        return text[pos:body], [], body  # a tag with no call after it stays content

    def _object(self, pos: int, body: int, final: bool):
        """The call whose JSON starts at ``body`` (what lies from ``pos`` to it is dropped
        when it is one, content with it when it is not)."""
        text = self.text
        try:
            value, end = _DECODER.raw_decode(text, body)
        except ValueError:
            if not final:
                return None  # incomplete, or broken: decided when the output ends
            self.in_calls = False
            return text[pos:], [], len(text)
        call = as_call(value)
        if call is None:
            self.in_calls = False
            return text[pos:end], [], end
        self.in_calls = True
        return "", [call], end
