"""Tool calling's request side: ``tools`` / ``tool_choice`` checked (a 400 naming the field),
the history's tool calls checked, and the prompt: tools through a template that reads them,
the Hermes fallback for one that does not (the embedded SmolLM2's)."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from chunkserve.engine.tokenizer import Tokenizer
from chunkserve.entrypoints.openai.protocol import ChatCompletionRequest, param_of
from chunkserve.entrypoints.openai.tools import (
    check_history,
    check_tools,
    encode_chat_with_tools,
    hermes_fallback,
)
from chunkserve.model.loader import open_gguf

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
HISTORY = [
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
]

DEEP: dict = {"type": "object"}
for _ in range(70):
    DEEP = {"type": "object", "properties": {"a": DEEP}}

BAD = [
    (dict(tools=[{"type": "retrieval"}]), "tools[0].type"),
    (dict(tools=[{"type": "function", "function": {"name": "a b"}}]), "tools[0].function.name"),
    (
        dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": 3}}}]),
        "tools[0].function.parameters",
    ),
    (
        dict(tools=[{"type": "function", "function": {"name": "f", "parameters": []}}]),
        "tools[0].function.parameters",
    ),
    (dict(tools=[WEATHER, WEATHER]), "tools[1].function.name"),
    (
        dict(tools=[{"type": "function", "function": {"name": "f", "parameters": DEEP}}]),
        "tools[0].function.parameters",
    ),
    (
        dict(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "other"}}),
        "tool_choice.function.name",
    ),
    (dict(tool_choice="required"), "tool_choice"),
    (dict(tool_choice={"type": "function", "function": {"name": "f"}}), "tool_choice"),
    (dict(tools=[WEATHER], tool_choice="sometimes"), "tool_choice"),
]


@pytest.mark.parametrize(("fields", "param"), BAD)
def test_bad_tools_name_the_field(fields, param):
    with pytest.raises(ValueError) as info:
        check_tools(fields.get("tools"), fields.get("tool_choice"), None)
    assert param_of(info.value) == param, str(info.value)


def test_choices():
    assert check_tools(None, None, None) is None
    assert check_tools(None, "none", None) is None
    assert check_tools([WEATHER], "none", None) is None  # tools not shown, reply is content
    auto = check_tools([WEATHER], None, None)
    assert auto.choice == "auto" and not auto.forced and auto.constraint() is None
    named = check_tools([WEATHER], {"type": "function", "function": {"name": "get_weather"}}, 0)
    assert named.forced


@pytest.mark.parametrize(
    ("choice", "parallel", "good", "bad"),
    [
        (
            {"type": "function", "function": {"name": "get_weather"}},
            True,
            ['<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'],
            [
                '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>',
                '<tool_call>\n{"name": "get_weather", "arguments": {}}\n</tool_call>',
                '{"name": "get_weather", "arguments": {"city": "Oslo"}}',
                "Sure!",
            ],
        ),
        (
            "required",
            True,
            [
                '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>',
                '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
                '<tool_call>\n{"name": "get_weather", "arguments": {"city": "A"}}\n</tool_call>',
            ],
            ["", '<tool_call>\n{"name": "nope", "arguments": {}}\n</tool_call>'],
        ),
        (
            "required",
            False,
            ['<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'],
            [
                '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
                '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
            ],
        ),
    ],
)
def test_forced_grammar_admits_only_calls_to_the_chosen_tools(choice, parallel, good, bad):
    """The grammar a forced choice makes, run on whole texts: Hermes blocks of a chosen tool
    with arguments valid against its schema, and nothing else."""
    import xgrammar

    time_tool = {"type": "function", "function": {"name": "get_time", "parameters": {}}}
    spec = check_tools([WEATHER, time_tool], choice, parallel)
    grammar = xgrammar.Grammar.from_ebnf(spec.constraint())
    from xgrammar.testing import _is_grammar_accept_string

    for text in good:
        assert _is_grammar_accept_string(grammar, text), text
    for text in bad:
        assert not _is_grammar_accept_string(grammar, text), text


def test_forced_choice_and_another_constraint_is_400():
    body = ChatCompletionRequest(
        messages=[{"role": "user", "content": "x"}],
        tools=[WEATHER],
        tool_choice="required",
        response_format={"type": "json_object"},
    )
    with pytest.raises(ValueError, match="^tool_choice:"):
        body.structured()
    body.response_format = None
    assert "<tool_call>" in body.structured().grammar


def test_history_checks():
    check_history(copy.deepcopy(HISTORY))
    orphan = copy.deepcopy(HISTORY)
    orphan[2]["tool_call_id"] = "call_9"
    with pytest.raises(ValueError) as info:
        check_history(orphan)
    assert param_of(info.value) == "messages[2].tool_call_id"
    broken = copy.deepcopy(HISTORY)
    broken[1]["tool_calls"][0]["function"]["arguments"] = '{"city": '
    with pytest.raises(ValueError) as info:
        check_history(broken)
    assert param_of(info.value) == "messages[1].tool_calls[0].function.arguments"


def test_hermes_fallback_puts_tools_in_the_system_prompt():
    out = hermes_fallback(copy.deepcopy(HISTORY), [WEATHER["function"]])
    assert [m["role"] for m in out] == ["system", "user", "assistant", "user"]
    assert "<tools>" in out[0]["content"]
    assert json.dumps({"type": "function", "function": WEATHER["function"]}) in out[0]["content"]
    # The call written once as JSON (arguments an object, not a string in a string).
    assert out[2]["content"] == (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    )
    assert out[3]["content"] == "<tool_response>\nsunny\n</tool_response>"
    with_system = hermes_fallback(
        [{"role": "system", "content": "Be brief."}], [WEATHER["function"]]
    )
    assert len(with_system) == 1 and with_system[0]["content"].startswith("Be brief.\n\n")


# A template that reads ``tools`` and ``tojson``s the arguments, as Qwen2.5's does.
TOOLS_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n{%- for tool in tools %}\n{{ tool | tojson }}"
    "{%- endfor %}<|im_end|>\n{% endif %}"
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n"
    "{%- if m.tool_calls %}{%- for c in m.tool_calls %}"
    '<tool_call>{"name": "{{ c.function.name }}", "arguments": '
    "{{ c.function.arguments | tojson }}}</tool_call>{%- endfor %}"
    "{%- else %}{{ m.content }}{%- endif %}<|im_end|>\n{% endfor %}"
)


@pytest.fixture(scope="module")
def tok(gguf_path: Path) -> Tokenizer:
    return Tokenizer.from_gguf(gguf_path, open_gguf(gguf_path))


def test_template_with_tools_renders_them(tok: Tokenizer):
    tools_tok = copy.copy(tok)
    tools_tok.__dict__.pop("_template_vars", None)
    tools_tok.chat_template = TOOLS_TEMPLATE
    tools_tok._compiled_template = None
    assert tools_tok.template_uses("tools") and not tok.template_uses("tools")
    ids = encode_chat_with_tools(tools_tok, copy.deepcopy(HISTORY), [WEATHER["function"]])
    text = tok.decode(ids, skip_special_tokens=False)
    assert json.dumps(WEATHER, ensure_ascii=False) in text
    assert '"arguments": {"city": "Paris"}}</tool_call>' in text  # not double-encoded


def test_embedded_template_gets_the_fallback(tok: Tokenizer):
    ids = encode_chat_with_tools(tok, copy.deepcopy(HISTORY), [WEATHER["function"]])
    text = tok.decode(ids, skip_special_tokens=False)
    assert "<tools>" in text and "<tool_response>\nsunny\n</tool_response>" in text
    plain = encode_chat_with_tools(tok, HISTORY[:1], None)
    assert plain == tok.encode_chat(HISTORY[:1])
