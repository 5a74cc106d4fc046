"""GPT-OSS's harmony format: the reply is a run of messages, each a header then a body,

    <|channel|>analysis<|message|>...thinking...<|end|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json
        <|message|>{"city": "Paris"}<|call|>            (one line)
    <|start|>assistant<|channel|>final<|message|>...the answer...<|return|>

(the prompt ends with ``<|start|>assistant``; the recipient ``to=functions.NAME`` may also
stand before ``<|channel|>``). The ``analysis`` channel is reasoning (``Reasoning`` events,
``reasoning_content``), ``final`` and ``commentary`` without a recipient are content, and a
message to ``functions.NAME`` is a call whose body is its JSON arguments. A body ends at
``<|end|>``, ``<|call|>``, ``<|return|>``, the next ``<|start|>`` or the end of the reply
(``<|call|>`` and ``<|return|>`` are end-of-sequence tokens, usually not in the text). All
these markers are special tokens: the reply is decoded keeping them. Text outside any header
(a model that ignores the format) is content; a call whose arguments are not a JSON object
stays content (its raw text).

One parser serves as ``--tool-call-parser harmony`` and ``--reasoning-parser harmony``;
``calls=False`` (a request without tools) makes messages to functions content.
"""

from __future__ import annotations

import json
import re

from chunkserve.entrypoints.openai.tool_parsers.base import Reasoning, ToolParser, safe_end

START, CHANNEL, MESSAGE = "<|start|>", "<|channel|>", "<|message|>"
ENDS = ("<|end|>", "<|call|>", "<|return|>")
MARKERS = (START, CHANNEL, MESSAGE, "<|constrain|>", *ENDS)
_CHANNEL = re.compile(r"<\|channel\|>\s*(\w+)")
_RECIPIENT = re.compile(r"to=functions\.([A-Za-z0-9_.-]+)")


def _held(text: str, pos: int) -> int:
    """Where text that might begin a marker starts (the end of what is surely body)."""
    return min(safe_end(text, pos, m) for m in MARKERS)


class HarmonyParser(ToolParser):
    name = "harmony"
    markers = MARKERS
    # A structured output (``response_format``, a forced call's Hermes block) is the final
    # channel's body, after an optional analysis message.
    constrained_reasoning = "harmony"

    def __init__(self, calls: bool = True) -> None:
        super().__init__()
        self.calls = calls
        self.channel: str | None = None  # inside a body: its channel
        self.recipient: str | None = None
        self.body_start = 0

    def _step(self, final: bool):
        if self.channel is None:
            return self._header(final)
        return self._body(final)

    def _header(self, final: bool):
        text, pos = self.text, self.pos
        if not (text.startswith(START, pos) or text.startswith(CHANNEL, pos)):
            # Not a header: content up to the next possible marker.
            if any(m.startswith(text[pos:]) for m in (START, CHANNEL)) and not final:
                return None
            nxt = min(
                (i for i in (text.find(START, pos + 1), text.find(CHANNEL, pos + 1)) if i >= 0),
                default=-1,
            )
            if nxt >= 0:
                return text[pos:nxt], [], nxt
            end = len(text) if final else min(_held(text, pos + 1), len(text))
            return (text[pos:end], [], end) if end > pos else None
        msg = text.find(MESSAGE, pos)
        if msg < 0:
            return (text[pos:], [], len(text)) if final else None
        header = text[pos:msg]
        channel = _CHANNEL.search(header)
        recipient = _RECIPIENT.search(header)
        self.channel = channel.group(1) if channel else "final"
        self.recipient = recipient.group(1) if recipient else None
        self.body_start = msg + len(MESSAGE)
        return "", [], self.body_start

    def _body(self, final: bool):
        text, pos = self.text, self.pos
        ends = [(i, m) for m in (*ENDS, START) if (i := text.find(m, pos)) >= 0]
        stop, marker = min(ends) if ends else (-1, "")
        is_call = self.calls and self.recipient is not None
        if stop < 0 and not final:
            if is_call:
                return None  # a call is decided whole
            end = _held(text, pos)
            if end <= pos:
                return None
            piece = text[pos:end]
            return (Reasoning(piece) if self.channel == "analysis" else piece), [], end
        if stop < 0:
            stop, after = len(text), len(text)
        else:
            after = stop + (0 if marker == START else len(marker))
        channel, recipient, body = self.channel, self.recipient, text[self.body_start : stop]
        self.channel = self.recipient = None
        if is_call:
            try:
                args = json.loads(body)
            except ValueError:
                args = None
            if not isinstance(args, dict):
                return body, [], after  # broken arguments: content
            return "", [(recipient, json.dumps(args, ensure_ascii=False))], after
        piece = text[pos:stop]
        return (Reasoning(piece) if channel == "analysis" else piece), [], after
