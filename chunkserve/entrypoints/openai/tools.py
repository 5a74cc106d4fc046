"""Tool calling in the chat API: the request's ``tools`` / ``tool_choice`` checked, the tools
and the tool-call history put into the prompt, and the constraint for forced calls.

- ``tools`` are OpenAI function tools; each ``parameters`` must be a valid JSON schema
  (checked with ``jsonschema``); a bad one is a 400 naming ``tools[i].function.parameters``.
- ``tool_choice``: ``none`` (tools are not shown to the model, its reply is plain content),
  ``auto`` (the default with tools: calls are parsed from the reply by ``--tool-call-parser``),
  ``required`` or ``{"type": "function", "function": {"name": ...}}`` (forced: see below).
- ``parallel_tool_calls: false``: only the first call is returned.
- History: an assistant message's ``tool_calls`` (``arguments`` a JSON string, as clients send
  it) reach the template with ``arguments`` decoded to an object, so templates that ``tojson``
  it do not double-encode; a ``tool`` message needs a ``tool_call_id`` of an earlier call.
- Rendering: a chat template that reads a ``tools`` variable gets the tools (and the messages
  as they are). A template that does not (the embedded SmolLM2's) gets the Hermes fallback:
  the tools as a ``<tools>`` block in the system prompt (one is added if the conversation has
  none), calls in the history written as ``<tool_call>`` blocks in the assistant's text, and
  tool results as user turns holding ``<tool_response>`` blocks.
- Forced calls are valid by construction (structured outputs): the reply is constrained to
  Hermes ``<tool_call>`` blocks whose JSON is ``{"name", "arguments"}`` of one of the chosen
  tools, its arguments valid against the tool's ``parameters`` (an xgrammar EBNF grammar made
  from the JSON schema's; one block for a named function or with ``parallel_tool_calls``
  false). The Hermes parser reads the reply whatever ``--tool-call-parser`` says.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
# Deepest nesting of a tool's schema taken (structured outputs' limit: xgrammar's converter
# recurses, and the grammar of a forced call is built in the API server's process).
MAX_SCHEMA_DEPTH = 32


def _depth(value: Any) -> int:
    deepest, stack = 0, [(value, 1)]
    while stack:
        v, d = stack.pop()
        deepest = max(deepest, d)
        children = v.values() if isinstance(v, dict) else v if isinstance(v, list) else ()
        stack.extend((x, d + 1) for x in children)
    return deepest


@dataclass
class ToolSpec:
    """A request's checked tools and choice."""

    tools: list[dict[str, Any]]  # the ``function`` objects (name, description, parameters)
    choice: str  # "none", "auto", "required" or "named"
    named: str | None = None
    parallel: bool = True
    by_name: dict[str, dict[str, Any]] = field(default_factory=dict)

    @property
    def forced(self) -> bool:
        return self.choice in ("required", "named")

    def constraint(self) -> str | None:
        """The EBNF grammar (xgrammar's) a forced choice constrains the reply to, else None:
        one or more Hermes ``<tool_call>`` blocks (exactly one for a named function or with
        ``parallel_tool_calls`` false), each ``{"name": ..., "arguments": ...}`` with the
        arguments valid against that tool's schema. ``ValueError`` naming ``tools`` when
        xgrammar cannot turn a schema into a grammar."""
        if not self.forced:
            return None
        chosen = [t for t in self.tools if self.choice == "required" or t["name"] == self.named]
        calls = [
            {
                "type": "object",
                "properties": {
                    "name": {"const": t["name"]},
                    "arguments": t.get("parameters") or {"type": "object"},
                },
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
            for t in chosen
        ]
        schema = calls[0] if len(calls) == 1 else {"anyOf": calls}
        import xgrammar

        try:
            grammar = str(
                xgrammar.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False)
            )
        except Exception as exc:  # xgrammar raises RuntimeError for what it cannot convert
            raise ValueError(f"tools: a schema xgrammar cannot constrain to: {exc}") from None
        # The schema's rule ``root`` becomes ``tool_call_json`` (its other rules keep their
        # names, ``root_...``, which do not clash), under a root of Hermes blocks.
        text = re.sub(r"^root ::=", "tool_call_json ::=", str(grammar), count=1, flags=re.M)
        block = '("<tool_call>\\n" tool_call_json "\\n</tool_call>")'
        repeat = "+" if self.choice == "required" and self.parallel else ""
        return f"{text}\nroot ::= {block}{repeat}\n"


def check_tools(
    tools: list[Any] | None, tool_choice: Any, parallel_tool_calls: bool | None
) -> ToolSpec | None:
    """The request's ``ToolSpec`` (None without tools and with no or a ``none`` choice);
    ``ValueError`` naming the field for anything malformed."""
    from jsonschema import exceptions, validators

    if tools is not None and not isinstance(tools, list):
        raise ValueError("tools: must be a list of tools")
    functions: list[dict[str, Any]] = []
    for i, tool in enumerate(tools or []):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type", "function") != "function":
            raise ValueError(f"{where}.type: only 'function' tools are supported")
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise ValueError(f"{where}.function: must be an object with a 'name'")
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise ValueError(f"{where}.function.name: must be 1-64 letters, digits, _ or -")
        if any(f["name"] == name for f in functions):
            raise ValueError(f"{where}.function.name: {name!r} is given twice")
        desc = fn.get("description")
        if desc is not None and not isinstance(desc, str):
            raise ValueError(f"{where}.function.description: must be a string")
        params = fn.get("parameters")
        if params is not None:
            if not isinstance(params, dict):
                raise ValueError(f"{where}.function.parameters: must be a JSON schema object")
            if _depth(params) > MAX_SCHEMA_DEPTH:
                raise ValueError(
                    f"{where}.function.parameters: nested deeper than {MAX_SCHEMA_DEPTH} levels"
                )
            try:
                validators.validator_for(params).check_schema(params)
            except exceptions.SchemaError as exc:
                raise ValueError(
                    f"{where}.function.parameters: not a valid JSON schema: {exc.message}"
                ) from None
        functions.append(fn)
    by_name = {f["name"]: f for f in functions}
    parallel = True if parallel_tool_calls is None else bool(parallel_tool_calls)
    if tool_choice is None:
        choice, named = ("auto" if functions else "none"), None
    elif isinstance(tool_choice, str):
        if tool_choice not in ("none", "auto", "required"):
            raise ValueError(
                "tool_choice: must be 'none', 'auto', 'required' or "
                '{"type": "function", "function": {"name": ...}}'
            )
        choice, named = tool_choice, None
    elif isinstance(tool_choice, dict):
        fn = tool_choice.get("function")
        named = fn.get("name") if isinstance(fn, dict) else None
        if tool_choice.get("type", "function") != "function" or not isinstance(named, str):
            raise ValueError(
                'tool_choice: a named choice is {"type": "function", "function": {"name": ...}}'
            )
        if functions and named not in by_name:
            raise ValueError(f"tool_choice.function.name: {named!r} is not in tools")
        choice = "named"
    else:
        raise ValueError("tool_choice: must be a string or an object")
    if choice != "none" and not functions:
        raise ValueError(f"tool_choice: {choice!r} needs tools")
    if choice == "none":
        return None
    return ToolSpec(functions, choice, named, parallel, by_name)


def check_history(messages: list[dict[str, Any]]) -> None:
    """``ValueError`` naming the field for a malformed tool call in the history or a ``tool``
    message that answers no earlier call."""
    ids: set[str] = set()
    for i, m in enumerate(messages):
        calls = m.get("tool_calls")
        if calls is not None:
            if m["role"] != "assistant" or not isinstance(calls, list):
                raise ValueError(f"messages[{i}].tool_calls: a list, on assistant messages")
            for j, call in enumerate(calls):
                where = f"messages[{i}].tool_calls[{j}]"
                fn = call.get("function") if isinstance(call, dict) else None
                if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                    raise ValueError(f"{where}.function: must be an object with a 'name'")
                args = fn.get("arguments", "{}")
                if isinstance(args, str):
                    try:
                        json.loads(args)
                    except ValueError:
                        raise ValueError(f"{where}.function.arguments: not a JSON string") from None
                elif not isinstance(args, dict):
                    raise ValueError(f"{where}.function.arguments: must be a JSON string")
                if isinstance(call.get("id"), str):
                    ids.add(call["id"])
        if m["role"] == "tool":
            call_id = m.get("tool_call_id")
            if not isinstance(call_id, str) or call_id not in ids:
                raise ValueError(
                    f"messages[{i}].tool_call_id: {call_id!r} answers no earlier tool call"
                )


def _decoded_calls(calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for call in calls:
        fn = dict(call["function"])
        if isinstance(fn.get("arguments"), str):
            fn["arguments"] = json.loads(fn["arguments"])
        out.append({**call, "type": call.get("type", "function"), "function": fn})
    return out


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages for a template that knows tools: ``arguments`` decoded to objects."""
    return [
        {**m, "tool_calls": _decoded_calls(m["tool_calls"])} if m.get("tool_calls") else m
        for m in messages
    ]


HERMES_SYSTEM = (
    "You can call functions. Their signatures are within <tools></tools> XML tags:\n"
    "<tools>\n{tools}\n</tools>\n"
    "To call a function, reply with a JSON object holding its name and arguments within "
    "<tool_call></tool_call> XML tags, one block per call:\n"
    '<tool_call>\n{{"name": <function-name>, "arguments": <arguments-object>}}\n</tool_call>'
)


def _hermes_call(call: dict[str, Any]) -> str:
    fn = call["function"]
    args = fn.get("arguments", {})
    if isinstance(args, str):
        args = json.loads(args)
    body = json.dumps({"name": fn["name"], "arguments": args}, ensure_ascii=False)
    return f"<tool_call>\n{body}\n</tool_call>"


def hermes_fallback(
    messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
) -> list[dict[str, Any]]:
    """Messages for a template without tool support: the tools in the system prompt, calls
    and results as Hermes-format text (see the module's docstring)."""
    out: list[dict[str, Any]] = []
    for m in messages:
        if m.get("tool_calls"):
            text = m.get("content") or ""
            blocks = "\n".join(_hermes_call(c) for c in m["tool_calls"])
            out.append({"role": m["role"], "content": f"{text}\n{blocks}" if text else blocks})
        elif m["role"] == "tool":
            block = f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"
            if out and out[-1].get("_tool_responses"):
                out[-1]["content"] += "\n" + block  # consecutive results: one user turn
            else:
                out.append({"role": "user", "content": block, "_tool_responses": True})
        else:
            out.append({k: v for k, v in m.items() if k in ("role", "content", "name")})
    for m in out:
        m.pop("_tool_responses", None)
    if tools:
        listing = "\n".join(json.dumps({"type": "function", "function": t}) for t in tools)
        system = HERMES_SYSTEM.format(tools=listing)
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{system}"}
        else:
            out.insert(0, {"role": "system", "content": system})
    return out


def encode_chat_with_tools(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    add_generation_prompt: bool = True,
) -> list[int]:
    """A chat prompt's tokens: the tools through the template when it reads ``tools``, else
    the Hermes fallback; tool calls in the history checked either way."""
    check_history(messages)
    history = any(m.get("tool_calls") or m["role"] == "tool" for m in messages)
    if not tools and not history:
        return tokenizer.encode_chat(messages, add_generation_prompt)
    if tokenizer.template_uses("tools"):
        wrapped = [{"type": "function", "function": t} for t in tools] if tools else None
        return tokenizer.encode_chat(
            template_messages(messages), add_generation_prompt, tools=wrapped
        )
    return tokenizer.encode_chat(hermes_fallback(messages, tools), add_generation_prompt)
