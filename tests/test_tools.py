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


# Templates in the shape of real families' (written here, not copied): Qwen2.5's ChatML with
# the tools in a Hermes system block and calls as <tool_call> JSON whose arguments go through
# ``tojson``; Llama 3.1's header tokens with the tools in the first user turn, calls as
# ``{"name", "parameters"}`` JSON (``tojson`` again) and results in an ``ipython`` turn.
QWEN25_STYLE = """
{%- if tools %}
{{- '<|im_start|>system\n' }}
{%- if messages[0].role == 'system' %}{{- messages[0].content }}
{%- else %}{{- 'You are a helpful assistant.' }}{%- endif %}
{{- '\n\n# Tools\n\nYou may call one or more functions. Their signatures are within '
    '<tools></tools> XML tags:\n<tools>' }}
{%- for tool in tools %}{{- '\n' }}{{- tool | tojson }}{%- endfor %}
{{- '\n</tools>\n\nFor each call, return a JSON object with the function name and arguments '
    'within <tool_call></tool_call> XML tags.<|im_end|>\n' }}
{%- elif messages[0].role == 'system' %}
{{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'user' or (message.role == 'assistant' and not message.tool_calls) %}
{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}
{%- elif message.role == 'assistant' %}
{{- '<|im_start|>assistant' }}
{%- if message.content %}{{- '\n' + message.content }}{%- endif %}
{%- for call in message.tool_calls %}
{%- set fn = call.function if call.function is defined else call %}
{{- '\n<tool_call>\n{"name": "' + fn.name + '", "arguments": ' }}
{{- fn.arguments | tojson }}
{{- '}\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\n' }}
{%- elif message.role == 'tool' %}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}
{{- '<|im_start|>user' }}
{%- endif %}
{{- '\n<tool_response>\n' + message.content + '\n</tool_response>' }}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\n' }}{%- endif %}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}
"""

LLAMA31_STYLE = """
{{- bos_token }}
{%- if messages[0].role == 'system' %}
{%- set system = messages[0].content | trim %}{%- set messages = messages[1:] %}
{%- else %}{%- set system = '' %}{%- endif %}
{{- '<|start_header_id|>system<|end_header_id|>\n\n' }}
{%- if tools %}{{- 'Environment: ipython\n' }}{%- endif %}
{{- 'Cutting Knowledge Date: December 2023\n\n' + system + '<|eot_id|>' }}
{%- if tools %}
{%- if not messages or messages[0].role != 'user' %}
{{- raise_exception('tools need a first user message to go in') }}
{%- endif %}
{%- set first = messages[0].content | trim %}{%- set messages = messages[1:] %}
{{- '<|start_header_id|>user<|end_header_id|>\n\n' }}
{{- 'Given the following functions, respond with a JSON for a function call with its proper '
    'arguments that best answers the given prompt.\n\n' }}
{{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name '
    'and its value}. Do not use variables.\n\n' }}
{%- for tool in tools %}{{- tool | tojson(indent=4) }}{{- '\n\n' }}{%- endfor %}
{{- first + '<|eot_id|>' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'assistant' and message.tool_calls %}
{%- if message.tool_calls | length != 1 %}
{{- raise_exception('this model supports one tool call at a time') }}
{%- endif %}
{%- set fn = message.tool_calls[0].function %}
{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{{- '{"name": "' + fn.name + '", "parameters": ' }}{{- fn.arguments | tojson }}{{- '}<|eot_id|>' }}
{%- elif message.role == 'tool' or message.role == 'ipython' %}
{{- '<|start_header_id|>ipython<|end_header_id|>\n\n' }}
{%- if message.content is mapping %}{{- message.content | tojson }}
{%- else %}{{- message.content }}{%- endif %}
{{- '<|eot_id|>' }}
{%- else %}
{{- '<|start_header_id|>' + message.role + '<|end_header_id|>\n\n' }}
{{- message.content | trim + '<|eot_id|>' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{%- endif %}
"""


def with_template(tok: Tokenizer, template: str) -> Tokenizer:
    out = copy.copy(tok)
    out.__dict__.pop("_template_vars", None)
    out.chat_template = template
    out._compiled_template = None
    return out


@pytest.mark.parametrize(
    ("template", "tools_json", "call", "result", "prompt_end"),
    [
        (
            QWEN25_STYLE,
            json.dumps(WEATHER, ensure_ascii=False),
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
            "<|im_start|>user\n<tool_response>\nsunny\n</tool_response><|im_end|>\n",
            "<|im_start|>assistant\n",
        ),
        (
            LLAMA31_STYLE,
            json.dumps(WEATHER, ensure_ascii=False, indent=4),
            "<|start_header_id|>assistant<|end_header_id|>\n\n"
            '{"name": "get_weather", "parameters": {"city": "Paris"}}<|eot_id|>',
            "<|start_header_id|>ipython<|end_header_id|>\n\nsunny<|eot_id|>",
            "<|start_header_id|>assistant<|end_header_id|>\n\n",
        ),
    ],
    ids=["qwen2.5", "llama3.1"],
)
def test_real_templates_render_tools_and_history(
    tok: Tokenizer, template, tools_json, call, result, prompt_end
):
    """The tools (each whole, as the template writes them) and a history whose call's
    ``arguments`` is a JSON string, as clients send it: written once as an object, never a
    string holding JSON; the tool's result in the template's turn; the generation prompt."""
    family = with_template(tok, template)
    assert family.template_uses("tools")
    messages = [{"role": "system", "content": "Be brief."}, *copy.deepcopy(HISTORY)]
    ids = encode_chat_with_tools(family, messages, [WEATHER["function"]])
    text = tok.decode(ids, skip_special_tokens=False)
    assert tools_json in text
    assert call in text and result in text and text.endswith(prompt_end)
    assert "Be brief." in text and "Weather in Paris?" in text
    assert '\\"city\\"' not in text and '"{' not in text  # not double-encoded
    assert ids == tok.encode(text, add_special_tokens=False)
    # The client's history is left as sent (arguments still a string).
    assert isinstance(messages[2]["tool_calls"][0]["function"]["arguments"], str)


def test_a_templates_own_refusal_is_a_400_naming_messages(tok: Tokenizer):
    """Llama 3.1's template takes one call per turn: two are its ``raise_exception``, a
    ValueError naming ``messages`` (a 400), not a server error."""
    family = with_template(tok, LLAMA31_STYLE)
    two = copy.deepcopy(HISTORY)
    two[1]["tool_calls"].append({**two[1]["tool_calls"][0], "id": "call_2"})
    two.append({"role": "tool", "tool_call_id": "call_2", "content": "windy"})
    with pytest.raises(ValueError, match="^messages: this model supports one tool call"):
        encode_chat_with_tools(family, two, [WEATHER["function"]])


def test_embedded_template_gets_the_fallback(tok: Tokenizer):
    ids = encode_chat_with_tools(tok, copy.deepcopy(HISTORY), [WEATHER["function"]])
    text = tok.decode(ids, skip_special_tokens=False)
    assert "<tools>" in text and "<tool_response>\nsunny\n</tool_response>" in text
    plain = encode_chat_with_tools(tok, HISTORY[:1], None)
    assert plain == tok.encode_chat(HISTORY[:1])
