"""Reasoning and harmony (issue 44): the ``<think>`` parsers and GPT-OSS's harmony parser on
fixed outputs, cut at every point; parsers chosen from the chat template; special-token
markers kept in the reply's text (and no others); ``reasoning_content`` served, streamed equal
to non-streamed."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
from fastapi.testclient import TestClient
from tokenizers import AddedToken

from chunkserve.engine.async_engine import AsyncEngine
from chunkserve.engine.core_types import CoreOutput
from chunkserve.engine.output_processor import OutputProcessor
from chunkserve.engine.tokenizer import IncrementalDetokenizer, Tokenizer
from chunkserve.entrypoints.openai.api_server import _Handler, build_app, resolve_parsers
from chunkserve.entrypoints.openai.reasoning_parsers import (
    detect_reasoning_parser,
    get_reasoning_parser,
)
from chunkserve.entrypoints.openai.tool_parsers import (
    HarmonyParser,
    HermesToolParser,
    Llama3JsonToolParser,
    MistralToolParser,
    ReplyParser,
    collect,
    detect_tool_parser,
)
from chunkserve.model.loader import open_gguf
from chunkserve.scheduling.sampling_params import SamplingParams


def result(make, pieces: list[str]):
    parser = make()
    events = []
    for piece in pieces:
        events += parser.feed(piece)
    events += parser.finish()
    out = collect(events)
    calls = [(c.name, json.loads(c.arguments)) for c in out.tool_calls]
    return out.content, out.reasoning, calls


def check_splits(make, text: str, expected) -> None:
    assert result(make, [text]) == expected
    for i in range(len(text) + 1):
        assert result(make, [text[:i], text[i:]]) == expected, (text[:i], text[i:])
    assert result(make, list(text)) == expected


THINK = [
    # (parser, reply, (content, reasoning, calls))
    ("deepseek_r1", "I should add.</think>\n\nIt is 4.", ("\n\nIt is 4.", "I should add.", [])),
    ("deepseek_r1", "<think>Hmm</think>Yes", ("Yes", "Hmm", [])),
    ("deepseek_r1", "never closed <thi", ("", "never closed <thi", [])),
    ("deepseek_r1", "", ("", None, [])),
    ("qwen3", "\n<think>a < b</think>\n\nSo a.", ("\n\nSo a.", "a < b", [])),
    ("qwen3", "No thinking here </think> at all", ("No thinking here </think> at all", None, [])),
    ("qwen3", "<thin", ("<thin", None, [])),
    ("qwen3", "<think>cut off", ("", "cut off", [])),
]


@pytest.mark.parametrize(("name", "text", "expected"), THINK)
def test_think_parsers_at_every_split(name, text, expected):
    check_splits(get_reasoning_parser(name), text, expected)


CALL = (
    "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
    '<|message|>{"city": "Paris"}<|call|>'
)
HARMONY = [
    (
        "<|channel|>analysis<|message|>User wants weather.<|end|>" + CALL,
        ("", "User wants weather.", [("get_weather", {"city": "Paris"})]),
    ),
    (
        "<|channel|>analysis<|message|>Easy.<|end|><|start|>assistant<|channel|>final"
        "<|message|>It is <b>4</b>.<|return|>",
        ("It is <b>4</b>.", "Easy.", []),
    ),
    # The end-of-sequence markers are not in the text; the recipient before the channel.
    (
        "<|channel|>analysis<|message|>x<|end|><|start|>assistant to=functions.f<|channel|>"
        'commentary json<|message|>{"a": 1}',
        ("", "x", [("f", {"a": 1})]),
    ),
    # Broken arguments stay content; a model ignoring the format is content.
    ("<|channel|>commentary to=functions.f<|message|>{broken", ("{broken", None, [])),
    ("Just text, no channels.", ("Just text, no channels.", None, [])),
    (
        "<|channel|>analysis<|message|>a<|end|><|start|>assistant<|channel|>final<|message|>b",
        ("b", "a", []),
    ),
]


@pytest.mark.parametrize(("text", "expected"), HARMONY)
def test_harmony_at_every_split(text, expected):
    check_splits(HarmonyParser, text, expected)


def test_harmony_without_tools_keeps_calls_as_content():
    got = result(lambda: HarmonyParser(calls=False), [CALL])
    assert got == ('{"city": "Paris"}', None, [])


def test_reasoning_then_tool_calls():
    text = '<think>use the tool</think>\n<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>'

    def make():
        return ReplyParser(get_reasoning_parser("qwen3")(), HermesToolParser())

    check_splits(make, text, ("\n", "use the tool", [("f", {})]))
    # Llama 3 JSON after reasoning: the content's start is the reply's start for it.
    text = '</think>{"name": "f", "parameters": {"x": 1}}'

    def make_llama():
        return ReplyParser(get_reasoning_parser("deepseek_r1")(), Llama3JsonToolParser())

    check_splits(make_llama, text, ("", None, [("f", {"x": 1})]))


@pytest.mark.parametrize(
    ("template", "tool", "reasoning"),
    [
        ("{{ '<|start|>assistant<|channel|>final<|message|>' }}", "harmony", "harmony"),
        ("{{ '[AVAILABLE_TOOLS]' }}{{ '[TOOL_CALLS]' }}", "mistral", None),
        ("<|im_start|>{{ '<tool_call>' }}{{ '<think>' }}", "hermes", "qwen3"),
        ("<|start_header_id|>{{ '<|python_tag|>' }}", "llama3_json", None),
        ("<｜Assistant｜><think>\n", "hermes", "deepseek_r1"),
        ("<|im_start|>{{ m.content }}", "hermes", None),
        (None, "hermes", None),
    ],
)
def test_parsers_chosen_from_the_template(template, tool, reasoning):
    assert detect_tool_parser(template)[0] == tool
    assert detect_reasoning_parser(template)[0] == reasoning
    chosen = resolve_parsers(template, "auto", "auto")
    assert chosen[:2] == (tool, reasoning) and len(chosen[2]) == 2
    assert resolve_parsers(template, "mistral", "none")[:2] == ("mistral", None)
    with pytest.raises(ValueError, match="^reasoning_parser"):
        resolve_parsers(template, "auto", "o1")


# ---- special tokens --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def marked_tok(gguf_path: Path) -> Tokenizer:
    """The embedded tokenizer with Mistral's and Llama's markers added as special tokens (as
    their real vocabularies have them)."""
    tok = Tokenizer.from_gguf(gguf_path, open_gguf(gguf_path))
    tok.backend.add_special_tokens(
        [AddedToken("[TOOL_CALLS]", special=True), AddedToken("<|python_tag|>", special=True)]
    )
    return tok


def test_a_parsers_marker_is_kept_and_no_other_special_token(marked_tok: Tokenizer):
    tok = marked_tok
    marker = tok.special_token_id("[TOOL_CALLS]")
    end = tok.special_token_id("<|im_end|>")
    assert marker is not None and end is not None
    assert tok.special_token_id("hello") is None
    reply = '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Oslo"}}]'
    ids = tok.encode(reply, add_special_tokens=False)
    assert ids[0] == marker  # one token, as in Mistral's vocabulary
    ids = tok.encode("Hi", add_special_tokens=False) + ids + [end]
    # Decoded as chat replies are (special tokens skipped), the parser sees no call.
    plain = tok.decode(ids)
    assert "[TOOL_CALLS]" not in plain and not MistralToolParser.extract(plain).tool_calls
    # Keeping the marker: the call is found, <|im_end|> still skipped; token by token too.
    for step in (len(ids), 1):
        detok = IncrementalDetokenizer(tok, [end], keep_special_token_ids=[marker])
        for i in range(0, len(ids), step):
            detok.add_tokens(ids[i : i + step])
        detok.flush()
        assert detok.text == "Hi" + reply
        got = MistralToolParser.extract(detok.text)
        assert got.content == "Hi" and [c.name for c in got.tool_calls] == ["get_weather"]


def test_the_server_keeps_its_parsers_markers(marked_tok: Tokenizer):
    """The chat endpoint asks the engine to keep the markers of its parsers: those that are
    special tokens in this vocabulary (Hermes' tags are plain text in it)."""
    state = SimpleNamespace(
        engine=SimpleNamespace(engine=SimpleNamespace(tokenizer=marked_tok)),
        tool_call_parser="mistral",
        reasoning_parser=None,
    )
    h = _Handler(state)
    spec = SimpleNamespace(forced=False, parallel=True)
    marker = marked_tok.special_token_id("[TOOL_CALLS]")
    assert h.kept_special_tokens(h.reply_parser(spec)) == [marker]
    state.tool_call_parser = "llama3_json"
    assert h.kept_special_tokens(h.reply_parser(spec)) == [
        marked_tok.special_token_id("<|python_tag|>")
    ]
    state.tool_call_parser = "hermes"
    assert h.kept_special_tokens(h.reply_parser(spec)) is None
    assert h.reply_parser(None) is None
    # Through the output processor, as the engine detokenizes replies.
    proc = OutputProcessor(marked_tok)
    params = SamplingParams(max_tokens=50, keep_special_token_ids=[marker])
    end = marked_tok.special_token_id("<|im_end|>")
    proc.add_request("r", None, [end], params, 0.0)
    ids = marked_tok.encode('[TOOL_CALLS][{"name": "f", "arguments": {}}]', False) + [end]
    out = proc.process([CoreOutput("r", ids, finish_reason="stop")]).outputs[0]
    assert out.text == '[TOOL_CALLS][{"name": "f", "arguments": {}}]'


# ---- served --------------------------------------------------------------------------------
def test_reasoning_content_served_streamed_equals_non_streamed(shared_engine):
    """deepseek_r1 on the embedded model (which never writes </think>): the whole reply is
    reasoning, content empty; the streamed reasoning deltas add up to the same."""
    app = build_app(
        AsyncEngine(shared_engine), served_model_name="m", reasoning_parser="deepseek_r1"
    )
    body = {
        "messages": [{"role": "user", "content": "What is 2+2?"}],
        "max_tokens": 12,
        "temperature": 0,
    }
    with TestClient(app) as client:
        msg = client.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]
        assert msg["reasoning_content"] and msg["content"] == ""
        r = client.post("/v1/chat/completions", json={**body, "stream": True})
        reasoning, content = "", ""
        for line in r.text.splitlines():
            if line.startswith("data: {"):
                for choice in json.loads(line[6:])["choices"]:
                    reasoning += choice["delta"].get("reasoning_content") or ""
                    content += choice["delta"].get("content") or ""
        assert (reasoning, content) == (msg["reasoning_content"], msg["content"])
    plain = build_app(AsyncEngine(shared_engine), served_model_name="m")
    with TestClient(plain) as client:
        msg = client.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]
        assert "reasoning_content" not in msg and msg["content"] == reasoning


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 12}},
            "required": ["city"],
        },
    },
}


def test_structured_outputs_come_after_the_reasoning(shared_engine):
    """With a reasoning parser a forced call or ``response_format`` constrains only what
    follows the reasoning. deepseek_r1 on the embedded model (which never writes </think>):
    the reply is free reasoning up to max_tokens, which counts it, and no call; qwen3 (no
    <think> written: thinking off) gets the call at once."""
    body = {
        "messages": [{"role": "user", "content": "What is the weather in Paris?"}],
        "max_tokens": 8,
        "temperature": 0,
    }
    forced = {"tools": [WEATHER], "tool_choice": "required"}
    app = build_app(
        AsyncEngine(shared_engine), served_model_name="m", reasoning_parser="deepseek_r1"
    )
    with TestClient(app) as client:
        replies = []
        for extra, same_prompt in (
            (forced, {"tools": [WEATHER], "tool_choice": "auto"}),
            ({"response_format": {"type": "json_object"}}, {}),
        ):
            r = client.post("/v1/chat/completions", json={**body, **same_prompt}).json()
            free = r["choices"][0]["message"]
            r = client.post("/v1/chat/completions", json={**body, **extra}).json()
            choice, msg = r["choices"][0], r["choices"][0]["message"]
            assert choice["finish_reason"] == "length" and r["usage"]["completion_tokens"] == 8
            # The unconstrained reply's reasoning: no grammar held its tokens.
            assert msg["reasoning_content"] == free["reasoning_content"], msg
            assert not msg.get("tool_calls") and not msg["content"]
            replies.append(msg)
        # Streamed, the forced call's reply is the same reasoning, in reasoning deltas.
        r = client.post("/v1/chat/completions", json={**body, **forced, "stream": True})
        deltas = [
            choice["delta"]
            for line in r.text.splitlines()
            if line.startswith("data: {")
            for choice in json.loads(line[6:])["choices"]
        ]
        streamed = "".join(d.get("reasoning_content") or "" for d in deltas)
        assert streamed == replies[0]["reasoning_content"]
        assert not any(d.get("content") or d.get("tool_calls") for d in deltas)
    app = build_app(AsyncEngine(shared_engine), served_model_name="m", reasoning_parser="qwen3")
    with TestClient(app) as client:
        r = client.post("/v1/chat/completions", json={**body, **forced, "max_tokens": 60})
        msg = r.json()["choices"][0]["message"]
        assert [c["function"]["name"] for c in msg["tool_calls"]] == ["get_weather"], msg
        assert "city" in json.loads(msg["tool_calls"][0]["function"]["arguments"])


def test_forced_calls_keep_the_reasoning_parser(marked_tok: Tokenizer):
    """A forced call's reply is read with the reasoning parser too (its grammar admits the
    reasoning first), each parser telling the grammar its reasoning's format."""
    state = SimpleNamespace(
        engine=SimpleNamespace(engine=SimpleNamespace(tokenizer=marked_tok)),
        tool_call_parser="hermes",
        reasoning_parser="harmony",
    )
    h = _Handler(state)
    forced = SimpleNamespace(forced=True, parallel=True)
    for parser, fmt in (
        ("harmony", "harmony"),
        ("deepseek_r1", "think"),
        ("qwen3", "optional_think"),
    ):
        state.reasoning_parser = parser
        assert h.constrained_reasoning() == fmt
        reply = h.reply_parser(forced)
        assert reply.reasoning.name == parser and isinstance(reply.tools, HermesToolParser)
    state.reasoning_parser = None
    assert h.constrained_reasoning() is None and h.reply_parser(forced).reasoning is None
    # Harmony: the final channel's Hermes block is the call, the analysis the reasoning.
    state.reasoning_parser = "harmony"
    reply = (
        "<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant"
        '<|channel|>final<|message|><tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>'
    )
    parser = h.reply_parser(forced)
    out = collect(parser.feed(reply) + parser.finish())
    assert out.reasoning == "Need the weather." and [c.name for c in out.tool_calls] == ["f"]
    assert not out.content.strip()
