"""Tool-call parsers on fixed model outputs in each format: the non-streamed result, and the
same output streamed cut at every possible point (one cut and, for short texts, two) adding
up to it. Broken calls stay content."""

from __future__ import annotations

import json

import pytest

from chunkserve.entrypoints.openai.tool_parsers import (
    HermesToolParser,
    Llama3JsonToolParser,
    MistralToolParser,
    ToolCallDelta,
    collect,
    get_tool_parser,
)
from chunkserve.entrypoints.openai.tool_parsers.base import ToolParser

WEATHER = {"city": "Paris", "unit": "celsius"}
TIME = {"tz": "Europe/Paris"}


def same(text: str):
    """A case whose whole output stays content."""
    return text, (text, [])


def plain(result):
    return result.content, [(c.name, json.loads(c.arguments)) for c in result.tool_calls]


def streamed(cls: type[ToolParser], pieces: list[str]):
    parser = cls()
    events = []
    for piece in pieces:
        events += parser.feed(piece)
    events += parser.finish()
    return events


def check_all_splits(cls: type[ToolParser], text: str, expected) -> None:
    assert plain(cls.extract(text)) == expected
    for i in range(len(text) + 1):
        got = plain(collect(streamed(cls, [text[:i], text[i:]])))
        assert got == expected, f"cut at {i}: {text[:i]!r} | {text[i:]!r}"
    # Character by character, and every pair of cuts on short texts.
    assert plain(collect(streamed(cls, list(text)))) == expected
    if len(text) <= 120:
        for i in range(len(text) + 1):
            for j in range(i, len(text) + 1):
                got = plain(collect(streamed(cls, [text[:i], text[i:j], text[j:]])))
                assert got == expected, (i, j)


HERMES = [
    (
        'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": '
        '{"city": "Paris", "unit": "celsius"}}\n</tool_call>',
        ("Let me check.\n", [("get_weather", WEATHER)]),
    ),
    (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": '
        '"celsius"}}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": '
        '{"tz": "Europe/Paris"}}\n</tool_call> done',
        ("\n done", [("get_weather", WEATHER), ("get_time", TIME)]),
    ),
    # Arguments sent as a JSON string are decoded (never double-encoded).
    (
        '<tool_call>{"name": "get_time", "arguments": "{\\"tz\\": \\"Europe/Paris\\"}"}'
        "</tool_call>",
        ("", [("get_time", TIME)]),
    ),
    # A string holding the closing tag (a forced call's grammar allows it): the JSON decides
    # where the call ends.
    (
        '<tool_call>\n{"name": "note", "arguments": {"text": "a</tool_call>b"}}\n</tool_call>!',
        ("!", [("note", {"text": "a</tool_call>b"})]),
    ),
    same('<tool_call>{"name": "n", "arguments": {"t": "</tool_call>"}} x</tool_call>'),
    # Broken JSON, a missing name, half a tag, an unclosed call: all content.
    (
        '<tool_call>{"name": "f", "arguments": {"a": }</tool_call> ok',
        ('<tool_call>{"name": "f", "arguments": {"a": }</tool_call> ok', []),
    ),
    same('<tool_call>{"arguments": {}}</tool_call>'),
    same("a <tool_ca"),
    same('x<tool_call>{"name": "f", "arguments": {}}'),
    same("no calls here < > </tool_call>"),
]


@pytest.mark.parametrize("text,expected", HERMES)
def test_hermes(text, expected):
    check_all_splits(HermesToolParser, text, expected)


LLAMA = [
    (
        '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}',
        ("", [("get_weather", WEATHER)]),
    ),
    (
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "unit": '
        '"celsius"}}; {"name": "get_time", "parameters": {"tz": "Europe/Paris"}}',
        ("", [("get_weather", WEATHER), ("get_time", TIME)]),
    ),
    (
        'Sure. <|python_tag|>{"name": "get_time", "parameters": {"tz": "Europe/Paris"}} after',
        ("Sure.  after", [("get_time", TIME)]),
    ),
    # JSON inside prose is not a call; broken JSON and objects that are not calls are content.
    same('The answer is {"name": "x", "parameters": {}}'),
    same('{"name": "f", "parameters": {"a": 1}'),
    same('{"result": 3} is it'),
    same("<|python_tag|>print(1)"),
    same("  <|python_t"),
]


@pytest.mark.parametrize("text,expected", LLAMA)
def test_llama3_json(text, expected):
    check_all_splits(Llama3JsonToolParser, text, expected)


MISTRAL = [
    (
        '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "unit": '
        '"celsius"}}, {"name": "get_time", "arguments": {"tz": "Europe/Paris"}}]',
        ("", [("get_weather", WEATHER), ("get_time", TIME)]),
    ),
    (
        'I will look. [TOOL_CALLS] [{"name": "get_time", "arguments": {"tz": "Europe/Paris"}}]'
        " then",
        ("I will look.  then", [("get_time", TIME)]),
    ),
    same('[TOOL_CALLS][{"name": "f", "arguments": {]'),
    same('[TOOL_CALLS][{"name": 3}] x'),
    same("[TOOL_CALLS] nothing"),
    same("text [TOOL_CA"),
]


@pytest.mark.parametrize("text,expected", MISTRAL)
def test_mistral(text, expected):
    check_all_splits(MistralToolParser, text, expected)


def test_mistral_ids_are_nine_alphanumerics_and_unique():
    calls = MistralToolParser.extract(MISTRAL[0][0]).tool_calls
    assert [len(c.id) for c in calls] == [9, 9] and calls[0].id != calls[1].id
    assert all(c.id.isalnum() for c in calls)


def test_stream_deltas_in_openai_order():
    """Name and id first (empty arguments), then the arguments; indexes count calls; content
    before a call is out before the call's tag is complete."""
    parser = HermesToolParser()
    assert parser.feed("Hi <tool") == ["Hi "]
    assert parser.feed('_call>{"name": "f", "argu') == []
    events = parser.feed('ments": {"a": 1}}</tool_call>')
    assert len(events) == 2
    first, second = events
    assert isinstance(first, ToolCallDelta) and first.index == 0 and first.name == "f"
    assert first.id and first.id.startswith("call_") and first.arguments == ""
    assert second == ToolCallDelta(0, None, None, '{"a": 1}')
    assert parser.finish() == []


def test_registry():
    assert get_tool_parser("hermes") is HermesToolParser
    with pytest.raises(ValueError, match="tool_call_parser"):
        get_tool_parser("nope")
