"""Structured outputs: JSON schemas, JSON objects, regexes, choices and grammars on the
embedded model, through the engine (greedy and sampled, chunked and unchunked, preempted,
speculative) and the server (streamed and not, both endpoints, the errors)."""

from __future__ import annotations

import copy
import json
import math
import re

import httpx
import jsonschema
import pytest
from prometheus_client.parser import text_string_to_metric_families

from chunkserve.engine.engine import Engine
from chunkserve.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from chunkserve.scheduling.sampling_params import SamplingParams, StructuredOutputsParams
from chunkserve.worker import structured
from tests.conftest import assert_no_blocks_in_use, pin_step_times
from tests.test_server import MODEL, Server

SCHEMAS = {
    "person": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 20},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "email": {"type": "string", "maxLength": 30},
        },
        "required": ["name", "age"],
    },
    "nested": {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 16},
            "location": {
                "type": "object",
                "properties": {
                    "lat": {"type": "number", "minimum": -90, "maximum": 90},
                    "lon": {"type": "number", "minimum": -180, "maximum": 180},
                },
                "required": ["lat", "lon"],
            },
        },
        "required": ["city", "location"],
    },
    "array_enum": {
        "type": "object",
        "properties": {
            "colors": {
                "type": "array",
                "items": {"type": "string", "enum": ["red", "green", "blue"]},
                "minItems": 1,
                "maxItems": 3,
            },
            "mood": {"enum": ["happy", "sad", "calm"]},
            "score": {"type": "number", "minimum": 0, "maximum": 1},
        },
        "required": ["colors", "mood"],
    },
}
PROMPTS = {
    "person": "Describe a person as JSON with their name, age and email.",
    "nested": "Give a city and its coordinates as JSON.",
    "array_enum": "List some colours you like and your mood, as JSON.",
}
REGEX = r"[A-Z][a-z]{2,8} \d{1,3}"
CHOICES = ["positive", "negative", "neutral"]


def chat_ids(engine: Engine, text: str) -> list[int]:
    return engine.tokenizer.encode_chat([{"role": "user", "content": text}])


def run(engine: Engine, requests: list[tuple[list[int], SamplingParams]]):
    """Add every request, step to the end; outputs in order."""
    ids = [engine.add_request(prompt_token_ids=p, sampling_params=sp) for p, sp in requests]
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    assert_no_blocks_in_use(engine)
    return [done[i] for i in ids]


def constrained_requests(
    engine: Engine, temperature: float, seed: int | None = None, max_tokens: int = 160
):
    """One request per schema, a regex and a choice, and what each output must satisfy."""
    reqs, checks = [], []
    for name, schema in SCHEMAS.items():
        sp = SamplingParams(
            max_tokens=max_tokens,
            temperature=temperature,
            seed=seed,
            structured_outputs=StructuredOutputsParams(json=schema),
        )
        reqs.append((chat_ids(engine, PROMPTS[name]), sp))
        checks.append(lambda text, s=schema: jsonschema.validate(json.loads(text), s))
    sp = SamplingParams(
        max_tokens=40, temperature=temperature, seed=seed, structured_outputs={"regex": REGEX}
    )
    reqs.append((chat_ids(engine, "Name a fruit and a number."), sp))
    checks.append(lambda text: re.fullmatch(REGEX, text) or pytest.fail(f"{text!r} !~ {REGEX}"))
    sp = SamplingParams(
        max_tokens=10, temperature=temperature, seed=seed, structured_outputs={"choice": CHOICES}
    )
    reqs.append((chat_ids(engine, "Classify: 'I love this film!'"), sp))
    checks.append(lambda text: text in CHOICES or pytest.fail(f"{text!r} not a choice"))
    return reqs, checks


def assert_all_valid(outs, checks) -> None:
    for out, check in zip(outs, checks):
        assert out.finish_reason == "stop", (out.text, out.finish_reason, out.error)
        check(out.text)


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine(dtype="float32", max_model_len=1024, kv_cache_memory=64 << 20)


# ---- parameters and the edge (no model) ------------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({}, "structured_outputs"),
        ({"json": {"type": "object"}, "regex": "a"}, "structured_outputs"),
        ({"regex": ""}, "structured_outputs.regex"),
        ({"choice": []}, "structured_outputs.choice"),
        ({"choice": ["a", 3]}, "structured_outputs.choice"),
        ({"json": 5}, "structured_outputs.json"),
        ({"grammar": "x" * 70_000}, "structured_outputs.grammar"),
        ({"json_object": True, "reasoning": "analysis"}, "structured_outputs.reasoning"),
    ],
)
def test_bad_params_name_the_field(fields, field) -> None:
    with pytest.raises(ValueError, match=rf"^{re.escape(field)}: "):
        SamplingParams(structured_outputs=fields)


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"json": {"type": "object", "properties": 5}}, "structured_outputs.json"),
        ({"json": "{not json"}, "structured_outputs.json"),
        ({"regex": "a(b"}, "structured_outputs.regex"),
        ({"grammar": "root ::= undefined_rule"}, "structured_outputs.grammar"),
        ({"json": '{"a": ' * 5000 + "1" + "}" * 5000}, "structured_outputs.json"),
        (
            {"json": json.loads('{"properties": {"a": ' * 40 + "{}" + "}}" * 40)},
            "structured_outputs.json",
        ),
    ],
)
def test_constraints_that_make_no_grammar_are_refused(fields, field) -> None:
    params = StructuredOutputsParams(**fields)
    with pytest.raises(ValueError, match=rf"^{re.escape(field)}: \S"):
        structured.check(params)


def test_every_kind_makes_a_grammar() -> None:
    for fields in (
        {"json": SCHEMAS["nested"]},
        {"json": json.dumps(SCHEMAS["person"])},
        {"json_object": True},
        {"regex": REGEX},
        {"choice": ['say "hi"', "back\\slash", "ünï"]},
        {"grammar": 'root ::= "a" b\nb ::= [0-9]+'},
    ):
        structured.check(StructuredOutputsParams(**fields))


def test_protocol_maps_every_spelling() -> None:
    def so(**body):
        return ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], **body)

    assert so(response_format={"type": "text"}).structured() is None
    p = so(response_format={"type": "json_object"}).structured()
    assert p.kind == "json_object" and p.origin == "response_format"
    schema = SCHEMAS["person"]
    fmt = {"type": "json_schema", "json_schema": {"name": "p", "schema": schema}}
    p = so(response_format=fmt).structured()
    assert json.loads(p.json) == schema and p.origin == "response_format.json_schema.schema"
    assert so(guided_regex="a+").structured().regex == "a+"
    assert so(guided_choice=["a", "b"]).structured().choice == ["a", "b"]
    assert json.loads(so(guided_json=schema).structured().json) == schema
    assert so(guided_grammar='root ::= "a"').structured().grammar == 'root ::= "a"'
    assert json.loads(so(structured_outputs={"json": schema}).structured().json) == schema
    # Fields a client sends as null are absent (vLLM's clients send them all).
    nulls = {"choice": ["a"], "json": None, "json_object": None, "structural_tag": None}
    assert so(structured_outputs=nulls).structured().choice == ["a"]
    comp = CompletionRequest(prompt="x", structured_outputs={"choice": ["a"]})
    assert comp.sampling_params(4, None).structured_outputs.choice == ["a"]
    for body, field in (
        ({"response_format": {"type": "xml"}}, "response_format.type"),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
        ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
        ({"structured_outputs": {"json": {}, "bogus": 1}}, "structured_outputs.bogus"),
    ):
        with pytest.raises(ValueError, match=rf"^{re.escape(field)}: "):
            so(**body).structured()


def test_any_json_number_crosses_the_process_boundary() -> None:
    """A schema is kept as its text: numbers beyond 64 bits do not break msgpack."""
    import msgspec

    from chunkserve.engine.core_types import CoreRequest

    params = SamplingParams(structured_outputs={"json": {"enum": [10**25], "const": 10**30}})
    structured.check(params.structured_outputs)
    req = CoreRequest("r", [1, 2], params, 4)
    back = msgspec.msgpack.decode(msgspec.msgpack.encode(req), type=CoreRequest)
    assert json.loads(back.params.structured_outputs.json) == {"enum": [10**25], "const": 10**30}


def test_a_choice_the_vocabulary_cannot_write_is_refused(engine) -> None:
    """A choice with a character whose bytes no token holds is refused at the edge, naming
    it (else the grammar allows no token once it gets there); choices the vocabulary writes,
    spaces, emoji, CJK and control characters among them, are taken."""

    def params(*choices: str) -> SamplingParams:
        return SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(
            choice=list(choices)))  # fmt: skip

    with pytest.raises(ValueError, match=r"^structured_outputs\.choice\[1\]: .*vocabulary"):
        engine.add_request("hi", params("ok", "ó\U000b51ffé"), "bad")
    for i, good in enumerate(("yes , no", " spaced  out ", "😀 中", "\x01", "ó")):
        engine.add_request("hi", params("ok", good), f"good{i}")
        engine.abort_request(f"good{i}")
    assert_no_blocks_in_use(engine)


def test_drafts_stop_at_the_grammar_end_and_masks_leave_the_state(engine) -> None:
    grammars = engine.core.grammars
    compiled, _ = grammars.compile(StructuredOutputsParams(choice=["yes"]))
    grammar = structured.RequestGrammar(compiled)
    yes = engine.tokenizer.encode("yes", add_special_tokens=False)
    assert len(yes) == 1
    eos = engine.tokenizer.eos_token_ids[0]
    drafts = [yes[0], eos, yes[0]]
    assert grammar.valid_drafts(drafts) == 2  # up to and including the end
    import xgrammar as xgr

    bitmask = xgr.allocate_token_bitmask(4, 49152)
    bitmask.zero_()
    grammar.fill(bitmask, 0, drafts[:2])  # the row after the end allows anything
    assert (bitmask[2] == -1).all() and not (bitmask[3] == -1).all()
    assert grammar.accept(yes[0]) and not grammar.terminated  # the state was unchanged
    assert grammar.accept(eos) and grammar.terminated


def fed(engine: Engine, reasoning: str | None, text: str) -> tuple[int, bool]:
    """Feed ``text``'s tokens and an end of sequence to a fresh matcher of the choice
    ``yes | no`` with ``reasoning`` before it: (tokens taken before the first refused one,
    whether the grammar then ended)."""
    compiled, _ = engine.core.grammars.compile(
        StructuredOutputsParams(choice=["yes", "no"], reasoning=reasoning)
    )
    grammar = structured.RequestGrammar(compiled)
    ids = engine.tokenizer.encode(text, add_special_tokens=False)
    ids.append(engine.tokenizer.eos_token_ids[0])
    for n, token in enumerate(ids):
        if not grammar.accept(token):
            return n, False
    return len(ids), grammar.terminated


def test_the_constraint_starts_where_the_reasoning_ends(engine) -> None:
    """With ``reasoning`` the grammar admits free text (a choice's words, half an end tag
    included) up to ``</think>``, then only the constraint; without it the constraint holds
    from the first token."""

    def whole(text: str) -> tuple[int, bool]:  # every token and the end taken, ended
        return len(engine.tokenizer.encode(text, add_special_tokens=False)) + 1, True

    reasoning = "Hmm, yes or </thin no? no.</think>\n\n"
    assert fed(engine, "think", reasoning + "yes") == whole(reasoning + "yes")
    assert fed(engine, "think", "</think>no") == whole("</think>no")
    assert fed(engine, None, reasoning + "yes") == (0, False)
    assert fed(engine, None, "yes") == whole("yes")
    # After the reasoning, the constraint: free text is refused there, not before.
    refused = whole(reasoning + "maybe")[0] - 2  # its last token, "maybe"
    assert fed(engine, "think", reasoning + "maybe") == (refused, False)
    # Qwen3's: a <think> block or none (thinking off), but no reasoning outside one.
    assert fed(engine, "optional_think", "yes") == whole("yes")
    assert fed(engine, "optional_think", "<think>no?</think>\nyes") == whole(
        "<think>no?</think>\nyes"
    )
    assert fed(engine, "optional_think", "Hmm.</think>yes") == (0, False)


def test_harmony_constraint_is_the_final_channels_body(engine) -> None:
    """``harmony``: an optional analysis message (free text up to its ``<|end|>``), then
    the constraint as the final channel's body; the markers are the vocabulary's special
    tokens (added here to the embedded vocabulary, as GPT-OSS's has them)."""
    from tokenizers import AddedToken

    from chunkserve.entrypoints.openai.tool_parsers.harmony import MARKERS

    tok = copy.deepcopy(engine.tokenizer)
    tok.backend.add_special_tokens([AddedToken(m, special=True) for m in MARKERS])
    end = tok.special_token_id("<|return|>")
    assert end is not None and end >= 49152
    compiler = structured.GrammarCompiler(lambda: tok.backend, end + len(MARKERS), [end])
    compiled, _ = compiler.compile(StructuredOutputsParams(choice=["yes"], reasoning="harmony"))

    def fed(text: str) -> tuple[int, bool]:
        grammar = structured.RequestGrammar(compiled)
        ids = tok.encode(text, add_special_tokens=False) + [end]
        for n, token in enumerate(ids):
            if not grammar.accept(token):
                return n, False
        return len(ids), grammar.terminated

    def whole(text: str) -> tuple[int, bool]:
        return len(tok.encode(text, add_special_tokens=False)) + 1, True

    final = "<|channel|>final<|message|>"
    assert tok.encode(final, add_special_tokens=False)[0] == tok.special_token_id("<|channel|>")
    analysis = "<|channel|>analysis<|message|>yes? no, <|mess yes.<|end|><|start|>assistant"
    assert fed(analysis + final + "yes") == whole(analysis + final + "yes")
    assert fed(final + "yes") == whole(final + "yes")
    assert fed("yes") == (0, False)  # the final channel's header first
    assert fed(analysis + final + "no") == (whole(analysis + final)[0] - 1, False)


def test_max_tokens_counts_the_reasoning(engine) -> None:
    """The embedded model never closes </think>: under ``think`` the reply is free text to
    max_tokens (the choice never starts); without reasoning it is the choice."""
    prompt = chat_ids(engine, "Classify: 'I love this film!'")
    outs = run(
        engine,
        [
            (prompt, SamplingParams(max_tokens=6, temperature=0.0, structured_outputs=so))
            for so in (
                StructuredOutputsParams(choice=CHOICES, reasoning="think"),
                StructuredOutputsParams(choice=CHOICES),
            )
        ],
    )
    assert outs[0].finish_reason == "length" and len(outs[0].token_ids) == 6
    assert outs[0].text not in CHOICES and "</think>" not in outs[0].text
    assert outs[1].finish_reason == "stop" and outs[1].text in CHOICES


# ---- the engine ------------------------------------------------------------------------------


def test_outputs_satisfy_their_constraints_greedy_and_sampled(engine) -> None:
    for temperature, seed in ((0.0, None), (0.8, 7)):
        reqs, checks = constrained_requests(engine, temperature, seed)
        assert_all_valid(run(engine, reqs), checks)


def constrained_outputs(**kwargs) -> tuple[list[list[int]], list, Engine]:
    """The greedy token ids of ``constrained_requests`` (80 tokens at most) on an engine
    made with ``kwargs`` (a 128-token context), checked valid; its step stats; the engine."""
    engine = Engine(dtype="float32", max_model_len=128, **kwargs)
    if "speculative_config" in kwargs:
        pin_step_times(engine)  # which drafts pay: from step times, the same on any machine
    reqs, checks = constrained_requests(engine, 0.0, max_tokens=80)
    stats = []
    engine.step_listeners.append(stats.append)
    outs = run(engine, reqs)
    assert_all_valid(outs, checks)
    return [o.token_ids for o in outs], stats, engine


@pytest.fixture(scope="module")
def whole() -> list[list[int]]:
    """The constrained requests' greedy tokens with chunking off: the reference of the
    chunked, preempted and speculative runs."""
    tokens, _, _ = constrained_outputs(enable_chunked_prefill=False, kv_cache_memory=64 << 20)
    return tokens


def test_chunked_unchunked_and_preempted_give_the_same_valid_outputs(whole) -> None:
    chunked, stats, _ = constrained_outputs(max_num_batched_tokens=32, kv_cache_memory=64 << 20)
    assert chunked == whole
    assert any(s.num_prefill_seqs and s.num_decode_tokens for s in stats)  # mixed steps
    # 10 blocks of 16 tokens (fp32 K and V: 30 layers x 3 heads x 64) for five requests
    # that need 21 together: preemption.
    block = 16 * 30 * 2 * 3 * 64 * 4
    preempted, stats, _ = constrained_outputs(
        max_num_batched_tokens=32, kv_cache_memory=11 * block, schedule_conservativeness=0.0
    )
    assert preempted == whole
    assert sum(s.num_preempted for s in stats) > 0


def test_a_free_request_beside_grammars_is_unchanged(engine) -> None:
    free = (
        chat_ids(engine, "Write a short poem about rivers."),
        SamplingParams(max_tokens=40, temperature=0.0),
    )
    (solo,) = run(engine, [free])
    reqs, checks = constrained_requests(engine, 0.0)
    outs = run(engine, [*reqs[:2], free, *reqs[2:]])
    assert outs[2].token_ids == solo.token_ids
    assert_all_valid(outs[:2] + outs[3:], checks)


def test_a_constraint_that_cannot_finish_in_max_tokens_ends_with_length(engine) -> None:
    sp = SamplingParams(max_tokens=5, temperature=0.0, structured_outputs={"regex": "(ab){40}"})
    (out,) = run(engine, [(chat_ids(engine, "Say abab."), sp)])
    assert out.finish_reason == "length" and len(out.token_ids) == 5
    assert re.fullmatch(r"(ab)*a?", out.text), out.text


def test_logprobs_are_of_the_masked_distribution(engine) -> None:
    sp = SamplingParams(
        max_tokens=10, temperature=0.0, logprobs=20, structured_outputs={"choice": ["yes", "no"]}
    )
    (out,) = run(engine, [(chat_ids(engine, "Is water wet?"), sp)])
    assert out.text in ("yes", "no")
    first = out.logprobs[0]
    # Only tokens that start "yes" or "no" have mass (fewer than 20): their
    # probabilities sum to one, and masked tokens are left out rather than -inf.
    texts = [engine.tokenizer.token_text(t) for t, _ in first.top]
    assert 0 < len(first.top) < 20, texts
    assert all(("yes".startswith(t) or "no".startswith(t)) and t for t in texts), texts
    assert sum(math.exp(lp) for _, lp in first.top) == pytest.approx(1.0, abs=1e-4)
    assert first.logprob == max(lp for _, lp in first.top)


def test_min_tokens_yields_to_a_grammar_that_must_end(engine) -> None:
    sp = SamplingParams(
        max_tokens=10, min_tokens=5, temperature=0.0, structured_outputs={"choice": ["yes"]}
    )
    (out,) = run(engine, [(chat_ids(engine, "Say yes."), sp)])
    assert out.finish_reason == "stop" and out.text == "yes", (out.text, out.error)


def test_grammar_ends_at_its_stop_even_with_ignore_eos(engine) -> None:
    sp = SamplingParams(
        max_tokens=30,
        temperature=0.0,
        ignore_eos=True,
        structured_outputs={"choice": ["alpha", "beta"]},
    )
    (out,) = run(engine, [(chat_ids(engine, "Pick alpha or beta."), sp)])
    assert out.finish_reason == "stop" and out.text in ("alpha", "beta")


def test_abort_while_the_grammar_compiles_frees_everything(engine) -> None:
    schema = {"type": "object", "properties": {"k": {"type": "string", "pattern": "^[a-f]{3}$"}}}
    sp = SamplingParams(max_tokens=20, structured_outputs={"json": schema})
    rid = engine.add_request(prompt_token_ids=chat_ids(engine, "hi"), sampling_params=sp)
    assert engine.get_request(rid) is not None
    assert engine.abort_request(rid)
    assert_no_blocks_in_use(engine)


@pytest.mark.parametrize("overlap", [False, True], ids=["step-thread", "mask-thread"])
def test_a_mask_that_raises_fails_only_its_request(engine, monkeypatch, overlap) -> None:
    """On the mask thread too (torch's inference mode does not cross threads: the failed
    row's overwrite raised there, and that error reached the request, not the grammar's)."""
    from chunkserve.worker.structured import GrammarMasks, RequestGrammar

    def batch_fill(self, matchers, bitmask, indices):
        raise RuntimeError("batch fill broke")

    real_fill = RequestGrammar.fill

    def fill(self, bitmask, row, drafts=()):
        if getattr(self, "bad", False):
            raise RuntimeError("this grammar broke")
        real_fill(self, bitmask, row, drafts)

    monkeypatch.setattr(RequestGrammar, "fill", fill)
    reqs, checks = constrained_requests(engine, 0.0)
    ids = [engine.add_request(prompt_token_ids=p, sampling_params=sp) for p, sp in reqs]
    done = {}
    while engine.core.grammars.pending:  # until every grammar is compiled
        for out in engine.step():
            done[out.request_id] = out
    for out in engine.step():  # one step with masks: the runner's GrammarMasks exists
        done[out.request_id] = out
    engine.get_request(ids[1]).grammar.bad = True
    masks = engine.core.worker.runner.masks
    assert isinstance(masks, GrammarMasks)
    monkeypatch.setattr(masks, "overlap", overlap)
    monkeypatch.setattr(type(masks._batch), "batch_fill_next_token_bitmask", batch_fill)
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    assert_no_blocks_in_use(engine)
    outs = [done[i] for i in ids]
    assert outs[1].finish_reason == "error" and "this grammar broke" in outs[1].error
    assert_all_valid(outs[:1] + outs[2:], checks[:1] + checks[2:])


def test_masks_can_overlap_only_with_a_core_to_spare(monkeypatch) -> None:
    """The condition that puts the mask filling on its own thread: always beside a GPU; on
    a CPU only when torch leaves a core idle (never on 2 cores at 2 threads)."""
    import torch

    monkeypatch.setattr(structured.os, "sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    assert not structured.masks_can_overlap(torch.device("cpu"))
    assert structured.masks_can_overlap(torch.device("cuda", 0))
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    assert structured.masks_can_overlap(torch.device("cpu"))


def test_masks_filled_on_their_thread_give_the_same_outputs(engine, monkeypatch) -> None:
    """The overlapped mask thread forced on (this machine may not have a core for it):
    greedy and seeded sampled outputs are the same tokens as with the masks filled on the
    step's thread, and valid; the filling did run on the mask thread."""
    import threading

    from chunkserve.worker.structured import GrammarMasks

    where: list[tuple[bool, str]] = []
    real_fill = GrammarMasks._fill

    def fill(self, job):
        where.append((self.overlap, threading.current_thread().name))
        real_fill(self, job)

    monkeypatch.setattr(GrammarMasks, "_fill", fill)
    runner = engine.core.worker.runner
    saved = runner.masks
    tokens = {}
    try:
        for overlap in (False, True):
            runner.masks = GrammarMasks(runner.sampler.vocab_size, overlap=overlap)
            greedy, greedy_checks = constrained_requests(engine, 0.0)
            sampled, sampled_checks = constrained_requests(engine, 0.8, seed=7)
            outs = run(engine, greedy + sampled)
            assert_all_valid(outs, greedy_checks + sampled_checks)
            tokens[overlap] = [o.token_ids for o in outs]
            runner.masks.shutdown()
    finally:
        runner.masks = saved
    assert tokens[True] == tokens[False]
    on = {name for overlap, name in where if overlap}
    off = {name for overlap, name in where if not overlap}
    assert on and all(name.startswith("chunkserve-masks") for name in on)
    assert off == {threading.current_thread().name}


def test_speculative_drafts_are_cut_by_the_grammar(whole) -> None:
    spec = {"method": "ngram", "num_speculative_tokens": 4, "min_acceptance_rate": 0.0}
    tokens, _, engine = constrained_outputs(kv_cache_memory=64 << 20, speculative_config=spec)
    assert tokens == whole
    assert engine.core.speculator.num_draft_tokens > 0


# ---- the server ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server():
    s = Server()
    yield s
    s.stop()


def test_server_chat_and_completions_streamed_and_not(server) -> None:
    client = server.client()
    schema = SCHEMAS["person"]
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": schema}}
    messages = [{"role": "user", "content": PROMPTS["person"]}]
    r = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=120, temperature=0, response_format=fmt
    )
    text = r.choices[0].message.content
    jsonschema.validate(json.loads(text), schema)
    assert r.choices[0].finish_reason == "stop"
    stream = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=120,
        temperature=0,
        response_format=fmt,
        stream=True,
    )
    streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert streamed == text
    r = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=120,
        temperature=0.7,
        seed=1,
        response_format={"type": "json_object"},
    )
    assert isinstance(json.loads(r.choices[0].message.content), dict)
    r = client.completions.create(
        model=MODEL,
        prompt="The answer is",
        max_tokens=10,
        temperature=0,
        extra_body={"guided_choice": CHOICES},
    )
    assert r.choices[0].text in CHOICES
    stream = client.completions.create(
        model=MODEL,
        prompt="Call me at",
        max_tokens=30,
        temperature=0,
        stream=True,
        extra_body={"structured_outputs": {"regex": REGEX}},
    )
    text = "".join(c.choices[0].text for c in stream if c.choices)
    assert re.fullmatch(REGEX, text), text


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "object", "properties": 3}},
                }
            },
            "response_format.json_schema.schema",
        ),
        ({"response_format": {"type": "yaml"}}, "response_format.type"),
        ({"guided_regex": "a(b"}, "guided_regex"),
        ({"structured_outputs": {"grammar": "root ::= nope"}}, "structured_outputs.grammar"),
        ({"guided_json": {"type": "object"}, "guided_regex": "a"}, "guided_regex"),
        # a character whose first byte (0xF2) no token of the vocabulary holds (found by the
        # API fuzzer: the grammar then allowed no token mid-output, a 500)
        ({"guided_choice": ["ok", "\U000b51ff"]}, "guided_choice[1]"),
    ],
)
def test_server_refuses_bad_constraints_by_name(server, body, param) -> None:
    for path, base in (
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
        ("/v1/completions", {"prompt": "hi"}),
    ):
        r = httpx.post(
            server.base + path, json={"model": MODEL, "max_tokens": 5, **base, **body}, timeout=30
        )
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == param, r.text


def test_server_metrics_count_grammars_and_masks(server) -> None:
    client = server.client()
    client.completions.create(
        model=MODEL,
        prompt="Pick",
        max_tokens=5,
        temperature=0,
        extra_body={"guided_choice": ["x", "y"]},
    )
    text = httpx.get(server.base + "/metrics", timeout=10).text
    found = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
    assert found.get("chunkserve:structured_output_mask_seconds_count", 0) > 0
    assert found.get("chunkserve:structured_output_grammars_total", 0) > 0
    assert "chunkserve:num_requests_structured" in found
