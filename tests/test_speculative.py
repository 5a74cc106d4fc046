"""Speculative decoding in decode-first mixed batches: exact greedy tokens, the target's
distribution when sampling, budget accounting of draft tokens, requests that end mid-draft,
and the configuration's errors."""

from __future__ import annotations

import json
import math
import random
from collections import Counter

import pytest
import torch

from chunkserve.config import BudgetPolicy, EngineConfig, SchedulerConfig, SpeculativeConfig
from chunkserve.engine.engine import Engine
from chunkserve.model.loader import embedded_model_path
from chunkserve.scheduling.budget import BudgetController
from chunkserve.scheduling.costmodel import OnlineCostModel
from chunkserve.scheduling.kv_cache import KVCacheManager
from chunkserve.scheduling.request import Request
from chunkserve.scheduling.sampling_params import SamplingParams
from chunkserve.scheduling.scheduler import Scheduler
from chunkserve.worker.sampler import Sampler
from chunkserve.worker.speculative import Speculator, ngram_propose
from tests.conftest import (
    NATURAL_PROMPTS,
    assert_no_blocks_in_use,
    pin_step_times,
    random_prompt,
)
from tests.test_invariance import (
    BYTES_PER_BLOCK,
    PREEMPT_TOKENS,
    make_engine,
    preemption_workload,
    run_staggered,
    workload,
)

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "min_acceptance_rate": 0.0}


def spec_engine(**kwargs) -> Engine:
    """``make_engine`` with its steps timed on a fake clock: how many drafts pay
    (``Speculator.paying``) and the adaptive budget's draft share, both decided from measured
    step times, are the same on any machine (a loaded one measured otherwise)."""
    engine = make_engine(**kwargs)
    pin_step_times(engine)
    return engine


def repetitive_prompts(engine: Engine) -> list[list[int]]:
    """Prompts asking to copy a passage: the outputs repeat the prompt, drafts are accepted."""
    passages = [
        "The quick brown fox jumps over the lazy dog. The quick brown fox jumps again.",
        "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n",
    ]
    return [
        engine.tokenizer.encode(f"Copy this exactly:\n{p}\nCopy:\n{p[: len(p) // 3]}")
        for p in passages
    ]


def spec_counts(engine: Engine) -> tuple[int, int]:
    s = engine.core.speculator
    assert s is not None
    return s.num_draft_tokens, s.num_accepted_tokens


# ---- greedy: the tokens of decoding without drafts -------------------------------------------


# Output tokens per request in the greedy tests: drafts are accepted and rejected, and verified
# beside prefill chunks, well within these (the prompts' prefill dominates the cost).
GREEDY_TOKENS = 16


@pytest.fixture(scope="module")
def greedy_reference() -> tuple[list[list[int]], list[list[int]]]:
    engine = make_engine(enable_chunked_prefill=False, max_num_batched_tokens=2048)
    prompts = workload() + repetitive_prompts(engine)
    return prompts, run_staggered(engine, prompts, GREEDY_TOKENS)


@pytest.mark.parametrize(
    "kwargs",
    [
        {},  # the adaptive default
        {"max_num_batched_tokens": 64},
        {"enable_chunked_prefill": False, "max_num_batched_tokens": 2048},
    ],
    ids=["adaptive", "static64", "unchunked"],
)
def test_ngram_greedy_matches_no_speculation(greedy_reference, kwargs) -> None:
    prompts, expected = greedy_reference
    engine = spec_engine(speculative_config=NGRAM, **kwargs)
    steps = []
    engine.step_listeners.append(steps.append)
    assert run_staggered(engine, prompts, GREEDY_TOKENS) == expected
    drafts, accepted = spec_counts(engine)
    assert drafts > 0 and 0 < accepted < drafts  # drafts were accepted and rejected
    # Drafts were verified in the same steps as prefill chunks.
    if kwargs.get("enable_chunked_prefill", True):
        assert any(s.num_draft_tokens and s.num_prefill_tokens for s in steps)
    budget = kwargs.get("max_num_batched_tokens")
    if budget and kwargs.get("enable_chunked_prefill", True):
        assert all(s.num_batched_tokens <= budget for s in steps)
    assert_no_blocks_in_use(engine)


def test_draft_model_drafting_for_itself_is_always_accepted(greedy_reference, engines) -> None:
    """The target as its own draft model: every draft token is accepted, and the tokens are
    those of decoding without drafts (its KV cache follows the target's chunks)."""
    prompts, expected = greedy_reference
    spec = {
        "method": "draft_model",
        "model": str(embedded_model_path()),
        "num_speculative_tokens": 3,
    }
    engine = spec_engine(
        speculative_config=spec, max_num_batched_tokens=64, kv_cache_memory=192 << 20
    )
    assert engine.core.worker.draft is not None
    assert run_staggered(engine, prompts[-4:], GREEDY_TOKENS) == expected[-4:]
    drafts, accepted = spec_counts(engine)
    assert drafts > 0 and accepted == drafts
    # Seeded sampling: the draft samples with the target's keyed noise at each position
    # (coupled draws), so drafting for itself it is still always accepted, and the tokens
    # are those of sampling without drafts.
    params = SamplingParams(max_tokens=12, temperature=0.9, seed=77)
    off, _ = engines  # seeded draws do not depend on the budget (the module's plain engine)
    want = _generate(off, prompts[-2:], params)
    got = _generate(engine, prompts[-2:], params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert spec_counts(engine)[1] - accepted == spec_counts(engine)[0] - drafts > 0
    assert_no_blocks_in_use(engine)


def test_draft_model_of_another_family(tmp_path, hf_dir) -> None:
    """A Qwen2 target (Q/K/V biases) drafted for by a Llama model with the same tokenizer:
    the target's weights without its biases, so some drafts are accepted and some are not;
    the tokens are those of decoding without drafts."""
    from safetensors.torch import load_file, save_file

    from tests.test_model_families import hf_config, make_engine, write_model

    target = write_model(tmp_path / "qwen2", hf_config("qwen2"), hf_dir)
    draft = tmp_path / "llama"
    draft.mkdir()
    cfg = json.loads((target / "config.json").read_text())
    cfg.update(architectures=["LlamaForCausalLM"], model_type="llama", sliding_window=None)
    (draft / "config.json").write_text(json.dumps(cfg))
    tensors = load_file(str(target / "model.safetensors"))
    save_file({k: v for k, v in tensors.items() if not k.endswith(".bias")},
              str(draft / "model.safetensors"), metadata={"format": "pt"})  # fmt: skip
    rng = random.Random(5)
    prompts = [random_prompt(rng, n) for n in (30, 60, 9)]
    expected = run_staggered(make_engine(target, max_num_batched_tokens=64), prompts, 16)
    spec = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 3}
    engine = make_engine(target, max_num_batched_tokens=64, speculative_config=spec)
    pin_step_times(engine)
    assert engine.core.worker.model_config.architecture == "qwen2"
    assert engine.core.worker.draft.model_config.architecture == "llama"
    assert run_staggered(engine, prompts, 16) == expected
    drafts, accepted = spec_counts(engine)
    assert drafts > 0 and 0 < accepted < drafts, (drafts, accepted)
    assert_no_blocks_in_use(engine)


SPEC_PREEMPT_TOKENS = 30
assert SPEC_PREEMPT_TOKENS < PREEMPT_TOKENS


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_speculation_with_preemption_matches(preemption_reference, method: str) -> None:
    """The pool runs dry: requests with drafts are preempted and recomputed, and the greedy
    tokens stay those of a run without preemption or drafts."""
    # 20 blocks of 16 = 320 slots (the longest prompt and its outputs fit alone) for 7
    # requests admitted as soon as their prompts fit (conservativeness 0): the pool runs dry
    # within SPEC_PREEMPT_TOKENS outputs each, and requests are preempted and recomputed.
    spec = dict(NGRAM)
    blocks = 21 * BYTES_PER_BLOCK
    if method == "draft_model":
        spec = {"method": "draft_model", "model": str(embedded_model_path())}
        blocks *= 2  # both models' KV per block
    engine = spec_engine(
        speculative_config=spec,
        schedule_conservativeness=0.0,
        max_num_batched_tokens=128,
        kv_cache_memory=blocks,
        max_model_len=320,
    )
    assert engine.core.worker.num_blocks == 20
    # Greedy: the first SPEC_PREEMPT_TOKENS of the session's reference (PREEMPT_TOKENS each).
    expected = [t[:SPEC_PREEMPT_TOKENS] for t in preemption_reference]
    assert run_staggered(engine, preemption_workload(), SPEC_PREEMPT_TOKENS) == expected
    assert engine.core.scheduler.num_preemptions > 0
    assert spec_counts(engine)[1] > 0
    assert_no_blocks_in_use(engine)


def test_prefix_cache_hits_with_speculation() -> None:
    rng = random.Random(5)
    shared = random_prompt(rng, 96)
    prompts = [shared + random_prompt(rng, 20) for _ in range(3)]
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    off = make_engine()
    expected = [o.token_ids for o in _generate(off, prompts, params)]
    engine = spec_engine(speculative_config=NGRAM)
    got = [o.token_ids for o in _generate(engine, prompts, params, one_by_one=True)]
    assert got == expected
    assert engine.core.kv.num_hit_tokens >= 2 * 96
    assert spec_counts(engine)[0] > 0
    assert_no_blocks_in_use(engine)


def _generate(engine: Engine, prompts, params, one_by_one: bool = False):
    """Outputs in the prompts' order; ``params`` one for all or one per prompt."""
    outs: dict[str, object] = {}
    ids = []
    per_prompt = params if isinstance(params, list) else [params] * len(prompts)
    for p, sp in zip(prompts, per_prompt):
        ids.append(engine.add_request(p, sp))
        while one_by_one and engine.has_unfinished():
            outs.update((o.request_id, o) for o in engine.step() if o.finished)
    while engine.has_unfinished():
        outs.update((o.request_id, o) for o in engine.step() if o.finished)
    return [outs[i] for i in ids]


# ---- requests that end mid-draft -------------------------------------------------------------


@pytest.fixture(scope="module")
def engines() -> tuple[Engine, Engine]:
    off = make_engine()
    on = spec_engine(speculative_config=NGRAM)
    return off, on


def test_max_tokens_mid_draft_and_logprobs(engines) -> None:
    off, on = engines
    prompts = repetitive_prompts(off)
    for max_tokens in (1, 2, 5, 13):
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=2)
        a = _generate(off, prompts, params)
        b = _generate(on, prompts, params)
        for x, y in zip(a, b):
            assert y.token_ids == x.token_ids and len(y.token_ids) == max_tokens
            assert y.finish_reason == x.finish_reason == "length"
            assert [t.token_id for t in y.logprobs] == y.token_ids
            for lx, ly in zip(x.logprobs, y.logprobs):
                assert math.isclose(lx.logprob, ly.logprob, abs_tol=1e-3)
                assert [t for t, _ in lx.top] == [t for t, _ in ly.top]
    assert spec_counts(on)[1] > 0
    assert_no_blocks_in_use(on)


def test_stop_token_and_stop_string_mid_draft(engines) -> None:
    off, on = engines
    prompt = repetitive_prompts(off)[1]
    free = _generate(off, [prompt], SamplingParams(max_tokens=40, temperature=0.0))[0]
    # A token (and a piece of text) from the middle of the greedy output: with drafts it
    # arrives inside a run of accepted tokens.
    stop_id = free.token_ids[17]
    first = free.token_ids.index(stop_id)
    stop_text = off.tokenizer.decode(free.token_ids[20:22]).strip()
    assert stop_text and stop_text in free.text
    for params in (
        SamplingParams(max_tokens=40, temperature=0.0, stop_token_ids=[stop_id]),
        SamplingParams(max_tokens=40, temperature=0.0, stop=[stop_text]),
        SamplingParams(max_tokens=40, temperature=0.0, stop=[stop_text], logprobs=0),
    ):
        a = _generate(off, [prompt], params)[0]
        b = _generate(on, [prompt], params)[0]
        assert (b.text, b.token_ids, b.finish_reason, b.stop_reason) == (
            a.text,
            a.token_ids,
            a.finish_reason,
            a.stop_reason,
        )
        if params.stop_token_ids:
            assert b.token_ids == free.token_ids[: first + 1]
        if params.logprobs is not None:
            assert len(b.logprobs) == len(b.token_ids)
        assert len(b.metrics.token_times) == len(b.token_ids)
    assert_no_blocks_in_use(on)


# ---- sampling: the target's distribution -----------------------------------------------------

V = 6


def _chi2(counts: Counter, probs: list[float], n: int) -> float:
    return sum((counts[i] - n * p) ** 2 / (n * p) for i, p in enumerate(probs) if p > 0)


@pytest.mark.parametrize("draft", ["one-hot", "distribution"])
def test_rejection_sampling_keeps_the_target_distribution(draft: str) -> None:
    """Two drafts per trial: the first emitted token follows p0, and the second (emitted
    after the first draft was accepted) follows p1, whatever the drafts' distribution."""
    gen = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(3, V, generator=gen) * 1.5, dim=-1)
    q = torch.softmax(torch.randn(2, V, generator=gen), dim=-1)
    sampler = Sampler(V, torch.device("cpu"), seed=1)
    logits = torch.log(p)
    n = 6000
    first, second = Counter(), Counter()
    n_second = 0
    for i in range(n):
        r = Request(f"r{i}", [1, 2], SamplingParams(temperature=1.0), max_tokens=10)
        if draft == "one-hot":
            drafts, probs = [2, 4], None
        else:
            drafts = [int(torch.multinomial(q[j], 1, generator=gen)) for j in range(2)]
            probs = [q]
        tokens = sampler.verify(logits, [r], [drafts], probs).token_ids[0]
        assert 1 <= len(tokens) <= 3 and tokens[: len(tokens) - 1] == drafts[: len(tokens) - 1]
        first[tokens[0]] += 1
        if tokens[0] == drafts[0]:
            n_second += 1
            second[tokens[1]] += 1
    # chi-square, 5 degrees of freedom: 20.5 at p = 0.001
    assert _chi2(first, p[0].tolist(), n) < 20.5
    assert n_second > 300 and _chi2(second, p[1].tolist(), n_second) < 20.5


def test_greedy_verification_accepts_exactly_the_argmax() -> None:
    logits = torch.tensor([[0.0, 5, 0, 0], [0, 0, 5, 0], [5.0, 0, 0, 0]])
    sampler = Sampler(4, torch.device("cpu"))
    r = Request("g", [3], SamplingParams(temperature=0.0), max_tokens=10)
    assert sampler.verify(logits, [r], [[1, 2]]).token_ids == [[1, 2, 0]]
    assert sampler.verify(logits, [r], [[1, 3]]).token_ids == [[1, 2]]
    assert sampler.verify(logits, [r], [[3, 2]]).token_ids == [[1]]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory, hf_dir):
    """A random 2-layer model with an 8-token vocabulary (weights made on load), with the
    embedded model's tokenizer: distributions cheap to sample thousands of times."""
    d = tmp_path_factory.mktemp("tiny")
    config = {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 8,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 256,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": True,
        "eos_token_id": 7,
        "bos_token_id": 6,
    }
    (d / "config.json").write_text(json.dumps(config))
    return d


def test_sampled_tokens_follow_the_same_distribution_with_speculation(
    tiny_model, hf_dir, monkeypatch
) -> None:
    """Thousands of seeded 4-token samples of a tiny random model, with n-gram drafts and
    without: each position's token distribution agrees (two-sample chi-square)."""
    # Every proposed draft is verified: whether drafts pay depends on this machine's step
    # times, and the test is about the sampling, not the cost model. For the same reason the
    # budget is static: the adaptive one sizes each step's draft share from measured step
    # times (a full-suite CI run on a loaded machine gave 5 drafts where alone it gives
    # thousands).
    monkeypatch.setattr(Speculator, "paying", lambda self, decodes, available: list(available))
    # Every pair of the 6 ordinary tokens occurs in the prompt: a draft for every step.
    prompt = [x for a in range(6) for b in range(6) for x in (a, b)]
    n = 1500

    def sample(spec) -> list[list[int]]:
        engine = Engine(
            model=str(tiny_model),
            tokenizer=str(hf_dir),
            load_format="dummy",
            dtype="float32",
            seed=3,
            speculative_config=spec,
            max_model_len=256,
            kv_cache_memory=64 << 20,
            max_num_batched_tokens=2048,
        )
        params = SamplingParams(max_tokens=4, temperature=1.0, ignore_eos=True)
        outs = _generate(engine, [prompt] * n, params)
        if spec:
            drafts, accepted = spec_counts(engine)
            assert drafts > 500 and 0 < accepted < drafts, (drafts, accepted)
        assert_no_blocks_in_use(engine)
        return [o.token_ids for o in outs]

    base = sample(None)
    spec = sample({**NGRAM, "num_speculative_tokens": 3})
    for pos in range(1, 4):
        a = Counter(t[pos] for t in base)
        b = Counter(t[pos] for t in spec)
        cats = [c for c in range(8) if a[c] + b[c] >= 10]
        chi2 = sum((a[c] - b[c]) ** 2 / (a[c] + b[c]) for c in cats)
        # df = len(cats) - 1 <= 7: 24.3 at p = 0.001
        assert chi2 < 24.3, (pos, a, b)


# ---- budget accounting (no torch) -------------------------------------------------------------


def _scheduler(budget: int, disable: int = 0, block_size: int = 4) -> Scheduler:
    config = SchedulerConfig(
        max_num_batched_tokens=budget,
        max_num_seqs=min(16, budget),
        max_model_len=4096,
        block_size=block_size,
        spec_disable_by_batch_size=disable,
    )
    return Scheduler(config, KVCacheManager(1000, block_size))


def _decoding(sched: Scheduler, n: int, max_tokens: int = 50) -> list[Request]:
    reqs = []
    for i in range(n):
        r = Request(
            f"d{i}", [10 + i] * 5, SamplingParams(max_tokens=max_tokens), max_tokens=max_tokens
        )
        sched.add_request(r)
        reqs.append(r)
    while any(r.is_prefilling for r in reqs):
        out = sched.schedule()
        sched.update(out, {c.request.request_id: 5 for c in out.chunks if c.samples})
    return reqs


def test_draft_tokens_are_charged_and_come_before_prefill() -> None:
    sched = _scheduler(budget=20)
    decodes = _decoding(sched, 3)
    for r in decodes:
        r.draft_token_ids = [7, 7, 7, 7]
    long = Request("long", list(range(100, 200)), SamplingParams(max_tokens=5), max_tokens=5)
    sched.add_request(long)
    out = sched.schedule()
    # 3 decodes x (1 + 4) = 15 tokens first; prefill fills the 5 left (one 4-token block).
    assert [c.num_tokens for c in out.decodes] == [5, 5, 5]
    assert out.num_draft_tokens == 12 and out.num_prefill_tokens == 4
    assert out.num_batched_tokens <= 20
    # Accepted 2 of 4 for each: 3 tokens appended, the rejected slots' blocks given back.
    sched.update(out, {c.request.request_id: [7, 7, 9] for c in out.decodes} | {"long": 5})
    for r in decodes:
        assert r.output_token_ids[-3:] == [7, 7, 9] and r.num_computed_tokens == r.num_tokens - 1
        assert len(r.block_ids) == sched.kv.num_blocks_for(r.num_computed_tokens)
        assert r.draft_token_ids == []


def test_drafts_trimmed_by_budget_max_tokens_and_batch_size() -> None:
    sched = _scheduler(budget=10)
    a, b, c = _decoding(sched, 3, max_tokens=4)
    for r in (a, b, c):
        r.draft_token_ids = [7, 7, 7, 7, 7]
    out = sched.schedule()
    # Up to 2 outputs so far, max 4: at most 4 - outputs - 1 drafts each (the step emits one
    # more of its own); the budget's 7 spare tokens cover them.
    assert [len(x.draft_token_ids) for x in out.decodes] == [
        4 - r.num_output_tokens - 1 for r in (a, b, c)
    ]
    assert out.num_batched_tokens <= 10
    sched2 = _scheduler(budget=64, disable=2)
    for r in _decoding(sched2, 3):
        r.draft_token_ids = [7, 7]
    assert sched2.schedule().num_draft_tokens == 0  # 3 decodes > disable_by_batch_size
    sched3 = _scheduler(budget=5)
    d = _decoding(sched3, 2)
    for r in d:
        r.draft_token_ids = [7, 7, 7]
    assert [len(x.draft_token_ids) for x in sched3.schedule().decodes] == [3, 0]


def test_adaptive_budget_gives_drafts_room_and_prefill_one_block() -> None:
    from tests.test_budget import TRUE

    sched = _scheduler(budget=8192, block_size=16)
    decodes = _decoding(sched, 8)
    for r in decodes:
        r.draft_token_ids = [7] * 4
    sched.add_request(
        Request("p", list(range(100, 4100)), SamplingParams(max_tokens=2), max_tokens=2)
    )
    controller = BudgetController(
        OnlineCostModel(TRUE.weights, prior_weight=1e4), BudgetPolicy("adaptive", 8192, 1.0)
    )
    decision = controller.decide(sched.view())
    # Slowdown 1: no room beside the decodes: one block of prefill, no drafts.
    assert decision.draft_budget == 0 and decision.prefill_room == 16
    out = sched.schedule(decision.token_budget, decision.draft_budget)
    assert out.num_draft_tokens == 0 and out.num_prefill_tokens == 16
    sched.update(out, {c.request.request_id: 5 for c in out.chunks if c.samples})
    for r in decodes:
        r.draft_token_ids = [7] * 4
    roomy = BudgetController(
        OnlineCostModel(TRUE.weights, prior_weight=1e4), BudgetPolicy("adaptive", 8192, 3.0)
    )
    decision = roomy.decide(sched.view())
    assert decision.draft_budget == 32 and decision.prefill_room >= 16
    out = sched.schedule(decision.token_budget, decision.draft_budget)
    assert out.num_draft_tokens == 32 and out.num_prefill_tokens == decision.prefill_room


def test_low_acceptance_pauses_a_request() -> None:
    spec = Speculator(SpeculativeConfig("ngram", 4, min_acceptance_rate=0.5), 4096)
    sched = _scheduler(budget=64)
    (r,) = _decoding(sched, 1, max_tokens=500)
    for _ in range(8):  # 8 x 4 drafts, every one rejected: the window of 32 is judged
        assert spec.num_wanted(r) == 4
        r.draft_token_ids = [1, 1, 1, 1]
        out = sched.schedule()
        assert out.num_draft_tokens == 4
        sched.update(out, {r.request_id: [3]})
        spec.record(out.decodes)
    assert spec.num_draft_tokens == 32 and spec.num_accepted_tokens == 0
    assert r.spec.paused_until == r.num_output_tokens + 64
    assert spec.num_wanted(r) == 0
    r.token_ids[-3:] = r.token_ids[-6:-3]  # repetitive now, but paused: no drafts
    spec.propose_ngram([r])
    assert r.draft_token_ids == []


def _observe(spec: Speculator, steps: int, cost) -> None:
    """Decode-only steps of 1 to 4 decodes and 0 to 8 drafts, timed by ``cost(decodes,
    drafts)`` seconds (a fake clock)."""
    for i in range(steps):
        n, k = 1 + i % 4, (i * 3) % 9
        spec.observe_step("decode", n, k, cost(n, k))


def _requests(*rates: float) -> list[Request]:
    """Decodes whose drafts are each accepted with the given probability."""
    reqs = []
    for i, p in enumerate(rates):
        r = Request(f"r{i}", [1, 2, 3], SamplingParams(max_tokens=50), max_tokens=50)
        r.spec.position_rates[:] = [p] * 4
        reqs.append(r)
    return reqs


def test_decode_cost_fits_a_step_time_model() -> None:
    """``DecodeCost`` fits ``a + b * decodes + c * drafts`` to measured decode steps: the
    fixed cost, and a draft row priced like a decode row when it costs the same, higher when
    it costs more; not ready before ``COST_MIN_STEPS`` steps."""
    from chunkserve.worker.speculative import COST_MIN_STEPS, DecodeCost

    same, dearer = DecodeCost(), DecodeCost()
    for i in range(200):
        n, k = 1 + i % 5, (i * 3) % 9
        assert same.ready == dearer.ready == (i >= COST_MIN_STEPS)
        same.observe(n, k, 0.02 + 1e-3 * (n + k))
        dearer.observe(n, k, 0.02 + 1e-3 * n + 3e-3 * k)
    assert same.a == pytest.approx(0.02, rel=0.1) and dearer.a == pytest.approx(0.02, rel=0.1)
    assert same.c == pytest.approx(same.b, rel=0.25)
    assert same.b == pytest.approx(1e-3, rel=0.25)
    # The prior pulls a draft row toward a decode row's cost: the fit leans that way.
    assert dearer.c > 1.3 * dearer.b and dearer.c == pytest.approx(3e-3, rel=0.25)
    # Nothing measured varies yet: a row is priced at nothing beside the step.
    flat = DecodeCost()
    for _ in range(COST_MIN_STEPS):
        flat.observe(2, 0, 0.02)
    assert flat.a == pytest.approx(0.02) and flat.c < 1e-6


def test_paying_keeps_the_drafts_worth_their_time() -> None:
    """``Speculator.paying`` on fake step times: every draft before the cost is measured; all
    of them when a step's fixed cost dominates; none when a draft row costs as much as the
    tokens it may buy; in between the likeliest drafts first, a request's in order."""
    config = SpeculativeConfig("ngram", 4, min_acceptance_rate=0.0)
    fresh = Speculator(config, 4096)
    reqs = _requests(0.9, 0.3)
    assert fresh.paying(reqs, [4, 2]) == [4, 2]  # nothing measured: try them all
    _observe(fresh, 5, lambda n, k: 1.0 * k)  # drafts look dear, but too few steps to tell
    assert fresh.paying(reqs, [4, 2]) == [4, 2]
    # A step's fixed cost dominates (a CPU at batch 1): every likely draft pays.
    cheap = Speculator(config, 4096)
    _observe(cheap, 100, lambda n, k: 0.05 + 1e-4 * (n + k))
    likely = _requests(0.9, 0.7)
    assert cheap.paying(likely, [4, 4]) == [4, 4]
    assert cheap.paying(likely, [0, 3]) == [0, 3]
    # Rows dominate and a draft row costs three decode rows: a draft buys fewer tokens than
    # its time would: none pays.
    dear = Speculator(config, 4096)
    _observe(dear, 100, lambda n, k: 1e-4 + 0.01 * n + 0.03 * k)
    assert dear.paying(reqs, [4, 4]) == [0, 0]
    # Rows cost about as much as a step's fixed part (step ~ 2 rows at batch 1): drafts
    # with a good chance of acceptance pay, unlikely ones do not.
    mid = Speculator(config, 4096)
    _observe(mid, 200, lambda n, k: 0.01 + 0.01 * (n + k))
    keep = mid.paying(reqs, [4, 4])
    assert keep[0] >= 2 and keep[1] == 0, keep
    assert mid.paying(reqs[:1], [1]) == [1]
    # plan() trims the drafts to what pays.
    for r in reqs:
        r.draft_token_ids = [5, 5, 5, 5]
    dear.plan(reqs)
    assert [r.draft_token_ids for r in reqs] == [[], []]
    # Prefill and mixed steps do not enter the fit.
    other = Speculator(config, 4096)
    for _ in range(20):
        other.observe_step("mixed", 1, 4, 100.0)
        other.observe_step("prefill", 0, 0, 100.0)
    assert other.cost.num_steps == 0 and other.paying(reqs, [4, 4]) == [4, 4]


def test_engine_prices_drafts_from_its_step_clock() -> None:
    """The engine times its steps on its clock (``EngineCore.clock``) and the speculator
    prices drafts from those times: with a fake clock on which a step's fixed cost dominates
    every decode step carries drafts; on one where rows dominate drafts stop once the cost
    is measured (``COST_MIN_STEPS`` decode steps)."""
    from chunkserve.worker.speculative import COST_MIN_STEPS

    def decode_steps(fixed: float, per_token: float) -> list:
        engine = make_engine(speculative_config=NGRAM, max_num_batched_tokens=256)
        pin_step_times(engine, fixed, per_token)
        steps = []
        engine.step_listeners.append(steps.append)
        prompt = repetitive_prompts(engine)[0]
        engine.add_request(prompt, SamplingParams(max_tokens=40, temperature=0.0))
        while engine.has_unfinished():
            engine.step()
        assert_no_blocks_in_use(engine)
        return [s for s in steps if s.kind == "decode"]

    cheap = decode_steps(0.05, 1e-5)
    later = [s.num_draft_tokens for s in cheap[COST_MIN_STEPS:]]
    assert sum(1 for k in later if k) >= 3, later
    dear = decode_steps(1e-5, 0.05)
    assert any(s.num_draft_tokens for s in dear[:COST_MIN_STEPS])
    assert not any(s.num_draft_tokens for s in dear[COST_MIN_STEPS + 1 :])


def test_ngram_proposals() -> None:
    assert ngram_propose([1, 2, 3, 4, 1, 2], 3, 2, 4) == [3, 4, 1]
    assert ngram_propose([1, 2, 3, 4, 1, 2], 1, 2, 4) == [3]
    # The longest matching suffix wins, and its latest earlier occurrence.
    assert ngram_propose([9, 1, 2, 5, 8, 1, 2, 6, 9, 1, 2], 2, 1, 3) == [5, 8]
    assert ngram_propose([1, 2, 6, 1, 2], 2, 1, 1) == [6, 1]
    assert ngram_propose([1, 2, 3], 3, 2, 4) == []  # no earlier occurrence
    assert ngram_propose([5, 5], 2, 2, 4) == []  # too short
    # Ids whose bytes straddle: an unaligned byte match is not a token match.
    assert ngram_propose([256, 1, 0, 256, 1], 2, 2, 2) == [0, 256]
    assert ngram_propose([256, 65536, 0, 1, 256], 1, 2, 2) == []


# ---- configuration --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "value, field",
    [
        ("{not json", "speculative_config"),
        ([1, 2], "speculative_config"),
        ({"num_speculative_tokens": 2}, "speculative_config.method"),
        ({"method": "medusa"}, "speculative_config.method"),
        (
            {"method": "ngram", "num_speculative_tokens": 0},
            "speculative_config.num_speculative_tokens",
        ),
        (
            {"method": "ngram", "num_speculative_tokens": 2.5},
            "speculative_config.num_speculative_tokens",
        ),
        ({"method": "ngram", "prompt_lookup_min": 5}, "speculative_config.prompt_lookup_min"),
        ({"method": "ngram", "prompt_lookup_max": 0}, "speculative_config.prompt_lookup_max"),
        ({"method": "ngram", "model": "x.gguf"}, "speculative_config.model"),
        ({"method": "draft_model"}, "speculative_config.model"),
        (
            {"method": "ngram", "disable_by_batch_size": 0},
            "speculative_config.disable_by_batch_size",
        ),
        ({"method": "ngram", "min_acceptance_rate": 1.0}, "speculative_config.min_acceptance_rate"),
        ({"method": "ngram", "typo": 1}, "speculative_config.typo"),
    ],
)
def test_bad_speculative_config_names_the_field(value, field: str) -> None:
    with pytest.raises(ValueError, match=f"^{field.replace('.', '[.]')}: "):
        EngineConfig(speculative_config=value)


def test_config_as_json_text_and_dict() -> None:
    text = json.dumps({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 5})
    cfg = EngineConfig(speculative_config=text).speculative_config
    assert cfg == SpeculativeConfig("ngram", 3, prompt_lookup_max=5)
    assert EngineConfig(speculative_config={"method": "ngram"}).speculative_config == cfg.__class__(
        "ngram"
    )


def test_draft_model_errors_before_weights_load(no_weight_loading, tiny_model) -> None:
    with pytest.raises(ValueError, match="^speculative_config.model: model: no such file"):
        Engine(speculative_config={"method": "draft_model", "model": "/nonexistent/m.gguf"})
    with pytest.raises(ValueError, match="^speculative_config.model: .*vocabulary"):
        Engine(
            load_format="dummy",
            speculative_config={"method": "draft_model", "model": str(tiny_model)},
        )


def test_natural_prompts_stream_several_tokens_per_step(engines) -> None:
    """A step may emit several tokens for one request: the stream's deltas add up to the
    whole output and the metrics count every token."""
    _, on = engines
    prompt = on.tokenizer.encode(NATURAL_PROMPTS[2] + "\n" + NATURAL_PROMPTS[2])
    rid = on.add_request(prompt, SamplingParams(max_tokens=30, temperature=0.0))
    deltas, text, multi = [], "", False
    while on.has_unfinished():
        for o in on.step():
            if o.request_id == rid:
                deltas.extend(o.delta_token_ids)
                text += o.delta_text
                multi |= len(o.delta_token_ids) > 1
                last = o
    assert deltas == last.token_ids and text == last.text and len(deltas) == 30
    assert multi
    assert len(last.metrics.token_times) == 30


def test_seeded_sampling_with_speculation_is_reproducible(engines) -> None:
    """A seeded request's draws are keyed by position and its drafts verified against
    them: the tokens it makes without speculation, alone or beside others, however many
    drafts were accepted."""
    off, on = engines
    prompt = repetitive_prompts(on)[0]
    params = SamplingParams(max_tokens=24, temperature=0.8, seed=1234)
    alone = _generate(on, [prompt], params)[0].token_ids
    assert alone == _generate(off, [prompt], params)[0].token_ids
    rng = random.Random(3)
    crowd = [random_prompt(rng, 30) for _ in range(3)]
    together = _generate(
        on, [*crowd, prompt], [SamplingParams(max_tokens=24, temperature=1.0)] * 3 + [params]
    )
    assert together[-1].token_ids == alone
    assert_no_blocks_in_use(on)


def test_served_with_speculation_streams_and_counts(engines) -> None:
    """``serve --speculative-config``: the core process sends several tokens per step; the
    stream adds up to the non-streamed text, which is the engine's without drafts, and
    ``/metrics`` counts drafts and accepted tokens (per position too)."""
    from tests.test_server import MODEL, Server

    off, _ = engines
    prompt = off.tokenizer.decode(repetitive_prompts(off)[1])
    expected = _generate(
        off, [off.tokenizer.encode(prompt)], SamplingParams(max_tokens=20, temperature=0.0)
    )[0].text
    server = Server("--speculative-config", json.dumps(NGRAM))
    try:
        client = server.client()
        whole = client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=20, temperature=0.0
        )
        assert whole.choices[0].text == expected
        stream = client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=20, temperature=0.0, stream=True
        )
        assert "".join(c.choices[0].text for c in stream if c.choices) == expected
        m = server.wait_idle()
        # Drafts whatever this machine's step times: a static budget, and the first
        # COST_MIN_STEPS decode steps carry every draft (Speculator.paying, tested above).
        assert m["chunkserve:spec_decode_num_draft_tokens_total"] > 0
        assert (
            0
            < m["chunkserve:spec_decode_num_accepted_tokens_total"]
            <= (m["chunkserve:spec_decode_num_draft_tokens_total"])
        )
        assert (
            m["chunkserve:spec_decode_num_accepted_tokens_per_pos_total"]
            == (m["chunkserve:spec_decode_num_accepted_tokens_total"])
        )
        assert m["chunkserve:generation_tokens_total"] == 40
        assert m["chunkserve:kv_cache_blocks_used"] == 0
    finally:
        server.stop()
