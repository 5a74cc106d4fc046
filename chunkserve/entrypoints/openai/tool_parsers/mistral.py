"""Mistral format: ``[TOOL_CALLS]`` then a JSON array of ``{"name", "arguments"}`` objects
(the v0.3 tokenizers'). Ids are 9 alphanumeric characters, as Mistral's templates require.
The marker is a special token: the output must be detokenized with special tokens kept."""

from __future__ import annotations

import json
import random
import string

from chunkserve.entrypoints.openai.tool_parsers.base import ToolParser, as_call, safe_end

MARKER = "[TOOL_CALLS]"
_ID_CHARS = string.ascii_letters + string.digits
_DECODER = json.JSONDecoder()


class MistralToolParser(ToolParser):
    name = "mistral"
    markers = (MARKER,)

    def new_id(self) -> str:
        return "".join(random.choices(_ID_CHARS, k=9))

    def _step(self, final: bool):
        text, pos = self.text, self.pos
        start = text.find(MARKER, pos)
        if start < 0:
            end = len(text) if final else safe_end(text, pos, MARKER)
            return (text[pos:end], [], end) if end > pos else None
        if start > pos:
            return text[pos:start], [], start
        body = pos + len(MARKER)
        while body < len(text) and text[body].isspace():
            body += 1
        if body == len(text) or text[body] != "[":
            if body == len(text) and not final:
                return None
            return text[pos:body], [], body  # no array: the marker is content
        try:
            value, end = _DECODER.raw_decode(text, body)
        except ValueError:
            # Incomplete (wait) or broken (content once the output ends).
            return (text[pos:], [], len(text)) if final else None
        calls = [as_call(item) for item in value] if isinstance(value, list) else [None]
        if not calls or any(c is None for c in calls):
            return text[pos:end], [], end
        return "", calls, end
