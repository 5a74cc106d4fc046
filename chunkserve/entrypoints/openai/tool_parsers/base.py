"""What every tool-call parser shares: one incremental scanner per output, fed text in any
pieces, whose decisions never depend on where the pieces were cut.

A parser's ``_step(final)`` looks at the unread text from ``self.pos`` and either decides the
next piece (content up to a point, or one or more complete tool calls) or says it needs more
text. It decides only what no later text can change, so feeding an output whole or in pieces
gives the same events; ``final=True`` (the output ended) decides everything left, and whatever
is not a complete, valid call (half a tag, broken JSON) becomes content. A call is emitted once
its closing delimiter has arrived and its JSON has parsed: first a delta with index, id, name
and empty arguments, then the arguments string (``json.dumps`` of the object the model wrote).
``extract`` (the non-streamed result) is the same scanner fed the whole text.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str  # a JSON string, as OpenAI sends it


@dataclass
class ToolCallDelta:
    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


@dataclass
class Reasoning:
    """A piece of the reply's reasoning (``reasoning_content``), apart from its content."""

    text: str

    def __bool__(self) -> bool:
        return bool(self.text)


@dataclass
class ExtractedOutput:
    content: str
    tool_calls: list[ToolCall] = field(default_factory=list)
    reasoning: str | None = None  # None: the reply had no reasoning part


Event = str | ToolCallDelta | Reasoning  # a content, tool-call or reasoning delta


def safe_end(text: str, start: int, tag: str) -> int:
    """Where content that might be the beginning of ``tag`` starts: the end of ``text``
    less its longest suffix that is a proper prefix of ``tag``."""
    for k in range(min(len(tag) - 1, len(text) - start), 0, -1):
        if tag.startswith(text[len(text) - k :]):
            return len(text) - k
    return len(text)


def as_call(obj: object) -> tuple[str, str] | None:
    """``(name, arguments JSON string)`` of a decoded call object, or None when it is not one
    (no string ``name``, arguments neither an object nor a string holding a JSON object)."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return obj["name"], json.dumps(args, ensure_ascii=False)


class ToolParser:
    """Base class; subclasses implement ``_step``."""

    name = ""
    # The special tokens this format writes, which the reply must be decoded keeping
    # (``SamplingParams.keep_special_token_ids``): detokenized without special tokens, as
    # chat replies are, the parser would never see them.
    markers: tuple[str, ...] = ()
    # As a reasoning parser: what a structured output (a forced call, ``response_format``)
    # lets come before it (``StructuredOutputsParams.reasoning``); None: the constraint
    # starts at the first token, so there is no reasoning before it.
    constrained_reasoning: str | None = None

    def __init__(self) -> None:
        self.text = ""
        self.pos = 0
        self.count = 0

    def new_id(self) -> str:
        return f"call_{uuid.uuid4().hex[:24]}"

    def feed(self, piece: str) -> list[Event]:
        """The events the text so far decides (``piece`` appended)."""
        self.text += piece
        return self._advance(final=False)

    def finish(self) -> list[Event]:
        """The output ended: everything left, undecided text as content."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> list[Event]:
        out: list[Event] = []
        while self.pos < len(self.text):
            step = self._step(final)
            if step is None:
                break
            content, calls, end = step
            assert end > self.pos or (final and end == len(self.text))
            if content:
                out.append(content)
            for name, arguments in calls:
                out.append(ToolCallDelta(self.count, self.new_id(), name, ""))
                out.append(ToolCallDelta(self.count, arguments=arguments))
                self.count += 1
            self.pos = end
        return out

    def _step(self, final: bool) -> tuple[str | Reasoning, list[tuple[str, str]], int] | None:
        """``(content, calls, new position)`` for the next decided piece, or None (the
        content may be a ``Reasoning`` piece)."""
        raise NotImplementedError

    @classmethod
    def extract(cls, text: str) -> ExtractedOutput:
        """The non-streamed result of a whole output."""
        parser = cls()
        return collect(parser.feed(text) + parser.finish())


def collect(events: list[Event]) -> ExtractedOutput:
    """Streamed events added up: the content and the calls they make."""
    content = []
    reasoning: list[str] | None = None
    calls: list[ToolCall] = []
    for ev in events:
        if isinstance(ev, str):
            content.append(ev)
        elif isinstance(ev, Reasoning):
            reasoning = (reasoning or []) + [ev.text]
        elif ev.id is not None:
            assert ev.index == len(calls)
            calls.append(ToolCall(ev.id, ev.name or "", ev.arguments))
        else:
            calls[ev.index].arguments += ev.arguments
    return ExtractedOutput(
        "".join(content), calls, None if reasoning is None else "".join(reasoning)
    )
