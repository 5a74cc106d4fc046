"""Sampler semantics on crafted logits, and sampling/stop behaviour through the engine."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from chunkserve.engine.engine import Engine
from chunkserve.scheduling.request import Request
from chunkserve.scheduling.sampling_params import SamplingParams
from chunkserve.worker.sampler import Sampler
from tests.conftest import NATURAL_PROMPTS, assert_no_blocks_in_use

V = 8
PROBS = torch.tensor([0.5, 0.3, 0.15, 0.05, 0.0, 0.0, 0.0, 0.0])
LOGITS = torch.log(PROBS.clamp(min=1e-30))


def req(rid: str, **kw) -> Request:
    return Request(rid, [1, 2, 3], SamplingParams(**kw), max_tokens=100)


def draw(params: dict, n: int = 3000, logits: torch.Tensor = LOGITS) -> Counter:
    sampler = Sampler(V, torch.device("cpu"), seed=0)
    rows = [req(f"r{i}", **params) for i in range(n)]
    tokens = sampler(logits.expand(n, V).clone(), rows).token_ids
    return Counter(tokens)


def test_greedy_is_argmax() -> None:
    assert draw({"temperature": 0.0}, n=50) == Counter({0: 50})


def test_tiny_temperatures_are_greedy() -> None:
    """Below 1e-5 a temperature samples greedily (logits / 1e-40 would overflow: NaN)."""
    assert draw({"temperature": 1e-40}, n=50) == Counter({0: 50})
    mixed = [req("a", temperature=1e-40), req("b", temperature=1.0, seed=1)]
    out = Sampler(V, torch.device("cpu"))(LOGITS.expand(2, V).clone(), mixed).token_ids
    assert out[0] == 0 and 0 <= out[1] < 4


def test_logit_bias_shifts_the_logits_not_the_logprobs() -> None:
    """OpenAI's logit_bias: +100 all but forces a token, -100 bans one; the logprobs stay
    the model's. Rows without a bias in the same batch are untouched."""
    sampler = Sampler(V, torch.device("cpu"))
    rows = [
        req("forced", temperature=0.0, logit_bias={6: 100.0}, logprobs=1),
        req("banned", temperature=0.0, logit_bias={0: -100.0}),
        req("plain", temperature=0.0),
    ]
    logits = LOGITS.expand(3, V).clone()
    result = sampler(logits, rows)
    assert result.token_ids == [6, 1, 0]
    assert torch.equal(logits, LOGITS.expand(3, V))  # the caller's logits are not modified
    logprob, _ = result.logprobs[0]
    assert logprob == pytest.approx(torch.log_softmax(LOGITS, -1)[6].item())
    assert set(draw({"temperature": 1.0, "logit_bias": {0: -100.0, 1: -100.0}})) == {2, 3}


def test_temperature_one_follows_the_distribution() -> None:
    """8000 seeded draws: each token's count within 4.5 standard deviations of n * p (about
    20% of a p = 0.05 token's count; an absolute tolerance let a 50% error through), and the
    counts together pass a chi-square test at p = 0.001."""
    n = 8000
    counts = draw({"temperature": 1.0}, n=n)
    for tok, p in enumerate(PROBS.tolist()):
        if p > 0:
            assert abs(counts[tok] - n * p) < 4.5 * math.sqrt(n * p * (1 - p)), (tok, counts)
    chi2 = sum((counts[t] - n * p) ** 2 / (n * p) for t, p in enumerate(PROBS.tolist()) if p)
    assert chi2 < 16.3, counts  # 3 degrees of freedom
    assert set(counts) <= {0, 1, 2, 3}


def test_high_temperature_flattens() -> None:
    counts = draw({"temperature": 5.0}, n=8000)
    assert counts[3] / 8000 > 0.1  # 0.05 at T=1


def test_top_k() -> None:
    assert set(draw({"top_k": 1})) == {0}
    assert set(draw({"top_k": 2})) == {0, 1}
    assert set(draw({"top_k": 3})) == {0, 1, 2}


def test_top_p_keeps_smallest_prefix_reaching_p() -> None:
    assert set(draw({"top_p": 0.5})) == {0}
    assert set(draw({"top_p": 0.8})) == {0, 1}
    assert set(draw({"top_p": 0.81})) == {0, 1, 2}


def test_min_p_relative_to_top_token() -> None:
    assert set(draw({"min_p": 0.5})) == {0, 1}  # threshold 0.25
    assert set(draw({"min_p": 0.2})) == {0, 1, 2}  # threshold 0.1


def test_mixed_rows_in_one_batch() -> None:
    sampler = Sampler(V, torch.device("cpu"))
    rows = [req("a", temperature=0.0), req("b", top_k=2), req("c", top_p=0.5), req("d", min_p=0.5)]
    for _ in range(200):
        toks = sampler(LOGITS.expand(4, V).clone(), rows).token_ids
        assert toks[0] == 0 and toks[1] in (0, 1) and toks[2] == 0 and toks[3] in (0, 1)


def test_seeded_rows_do_not_depend_on_batch_mix() -> None:
    logits = torch.randn(1, 100)
    alone = Sampler(100, torch.device("cpu"), seed=1)
    mixed = Sampler(100, torch.device("cpu"), seed=2)
    a = req("s", seed=42, temperature=1.0)
    b = req("s", seed=42, temperature=1.0)
    others = [req(f"o{i}", temperature=1.0) for i in range(5)]
    seq_alone, seq_mixed = [], []
    for step in range(30):  # each step samples the request's next position
        seq_alone.append(alone(logits.clone(), [a]).token_ids[0])
        a.append_output_token(seq_alone[-1])
        batch = [*others[: step % 5], b, *others[step % 5 :]]
        big = torch.randn(len(batch), 100)
        pos = batch.index(b)
        big[pos] = logits[0]
        seq_mixed.append(mixed(big, batch).token_ids[pos])
        b.append_output_token(seq_mixed[-1])
    assert seq_alone == seq_mixed
    assert len(set(seq_alone)) > 3  # actually random


def test_penalties() -> None:
    sampler = Sampler(V, torch.device("cpu"))
    logits = torch.tensor([[2.0, 1.9, -1.0, 0.5, 0, 0, 0, 0]])
    r = Request("p", [3], SamplingParams(temperature=0.0, repetition_penalty=2.0), max_tokens=10)
    r.append_output_token(0)
    # token 0 seen: 2.0 / 2 = 1.0 < 1.9 -> token 1 wins
    assert sampler(logits.clone(), [r]).token_ids == [1]
    r2 = Request("q", [3], SamplingParams(temperature=0.0, presence_penalty=0.2), max_tokens=10)
    r2.append_output_token(0)
    assert sampler(logits.clone(), [r2]).token_ids == [1]


def test_frequency_penalty_counts() -> None:
    sampler = Sampler(V, torch.device("cpu"))
    logits = torch.tensor([[2.0, 1.9, -1.0, 0.5, 0, 0, 0, 0]])
    r = Request("f", [3], SamplingParams(temperature=0.0, frequency_penalty=0.04), max_tokens=10)
    r.append_output_token(0)
    assert sampler(logits.clone(), [r]).token_ids == [0]  # 1.96 > 1.9
    r.append_output_token(0)
    r.append_output_token(0)
    assert sampler(logits.clone(), [r]).token_ids == [1]  # 1.88 < 1.9


def test_logprobs_are_raw_log_softmax() -> None:
    sampler = Sampler(V, torch.device("cpu"))
    logits = torch.randn(2, V)
    rows = [req("a", temperature=0.0, logprobs=3), req("b", temperature=0.0)]
    res = sampler(logits.clone(), rows)
    lp = torch.log_softmax(logits, -1)
    sampled_lp, top = res.logprobs[0]
    assert math.isclose(sampled_lp, lp[0].max().item(), rel_tol=1e-5)
    assert [t for t, _ in top] == lp[0].topk(3).indices.tolist()
    assert res.logprobs[1] is None


def test_min_tokens_bans_eos() -> None:
    sampler = Sampler(V, torch.device("cpu"))
    logits = torch.tensor([[0.0, 5.0, 1.0, 0, 0, 0, 0, 0]])
    r = Request(
        "m", [3], SamplingParams(temperature=0.0, min_tokens=2), max_tokens=5, eos_token_ids=[1]
    )
    assert sampler(logits.clone(), [r]).token_ids == [2]


# ---- through the engine --------------------------------------------------------------------
@pytest.fixture
def engine(shared_engine) -> Engine:
    return shared_engine


def generate(engine: Engine, prompts, params_list) -> list:
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params_list)]
    outs = {}
    while engine.has_unfinished():
        for o in engine.step():
            if o.finished:
                outs[o.request_id] = o
    return [outs[i] for i in ids]


def test_seeded_generation_same_alone_and_in_a_batch(engine: Engine) -> None:
    seeded = SamplingParams(max_tokens=12, temperature=0.9, seed=7)
    alone = generate(engine, [NATURAL_PROMPTS[0]], [seeded])[0].token_ids
    others = [SamplingParams(max_tokens=8, temperature=1.0) for _ in NATURAL_PROMPTS[1:]]
    mixed = generate(
        engine,
        [*NATURAL_PROMPTS[1:3], NATURAL_PROMPTS[0], *NATURAL_PROMPTS[3:]],
        [*others[:2], seeded, *others[2:]],
    )
    assert mixed[2].token_ids == alone
    assert_no_blocks_in_use(engine)


def test_stop_string_trims_text(engine: Engine) -> None:
    greedy = SamplingParams(max_tokens=24, temperature=0.0)
    full = generate(engine, [NATURAL_PROMPTS[1]], [greedy])[0].text
    stop = full[8:12]
    assert stop.strip() and stop in full
    out = generate(
        engine, [NATURAL_PROMPTS[1]], [SamplingParams(max_tokens=24, temperature=0.0, stop=[stop])]
    )[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == full[: full.index(stop)]
    out = generate(
        engine,
        [NATURAL_PROMPTS[1]],
        [
            SamplingParams(
                max_tokens=24, temperature=0.0, stop=stop, include_stop_str_in_output=True
            )
        ],
    )[0]
    assert out.text == full[: full.index(stop) + len(stop)]
    assert_no_blocks_in_use(engine)


def test_stream_deltas_concatenate_to_text_with_stop_strings(engine: Engine) -> None:
    greedy = SamplingParams(max_tokens=30, temperature=0.0)
    full = generate(engine, [NATURAL_PROMPTS[2]], [greedy])[0].text
    stop = full[15:19]
    rid = engine.add_request(
        NATURAL_PROMPTS[2], SamplingParams(max_tokens=30, temperature=0.0, stop=[stop, "zzzzzz"])
    )
    deltas, final = [], None
    while engine.has_unfinished():
        for o in engine.step():
            assert o.request_id == rid
            deltas.append(o.delta_text)
            final = o
    assert "".join(deltas) == final.text == full[: full.index(stop)]


def test_ignore_eos_generates_past_eos(engine: Engine) -> None:
    """Greedy, this prompt's answer ends with EOS well before max_tokens; with ignore_eos the
    same tokens, the EOS among them, and generation goes on to max_tokens."""
    (eos,) = engine.eos_token_ids
    prompt = NATURAL_PROMPTS[0]
    ended, ignored = generate(
        engine,
        [prompt, prompt],
        [
            SamplingParams(max_tokens=48, temperature=0.0),
            SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True),
        ],
    )
    k = len(ended.token_ids)
    assert ended.finish_reason == "stop" and ended.stop_reason is None
    assert k < 48 and ended.token_ids[-1] == eos
    assert ignored.finish_reason == "length" and len(ignored.token_ids) == 48
    assert ignored.token_ids[:k] == ended.token_ids


def test_stop_token_ids_and_ignore_eos(engine: Engine) -> None:
    greedy = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    base = generate(engine, [NATURAL_PROMPTS[3]], [greedy])[0]
    assert len(base.token_ids) == 16 and base.finish_reason == "length"
    stop_id = base.token_ids[5]
    first = base.token_ids.index(stop_id)
    out = generate(
        engine,
        [NATURAL_PROMPTS[3]],
        [SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, stop_token_ids=[stop_id])],
    )[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop_id
    assert out.token_ids == base.token_ids[: first + 1]


def test_logprobs_through_engine(engine: Engine) -> None:
    out = generate(
        engine, [NATURAL_PROMPTS[0]], [SamplingParams(max_tokens=5, temperature=0.0, logprobs=2)]
    )[0]
    assert len(out.logprobs) == 5
    for tok, lp in zip(out.token_ids, out.logprobs):
        assert lp.token_id == tok and lp.top[0][0] == tok  # greedy: sampled is the top
        assert lp.logprob <= 0 and math.isclose(lp.logprob, lp.top[0][1], rel_tol=1e-6)
