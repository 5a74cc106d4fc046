"""Prompt logprobs (issue 44): every prompt token's logprob, rank and top-n from each prefill
chunk's rows, against HF transformers in fp32, chunked and not; a request asking for them
bypasses the prefix cache (a hit has no logits) and leaves it usable for the others."""

from __future__ import annotations

import pytest
import torch

from chunkserve.engine.engine import Engine
from chunkserve.scheduling.sampling_params import SamplingParams
from tests.conftest import NATURAL_PROMPTS, assert_no_blocks_in_use

TOP = 3


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine(
        dtype="float32", max_model_len=512, kv_cache_memory=32 << 20, max_num_batched_tokens=512
    )


@pytest.fixture(scope="module")
def prompt(engine: Engine) -> list[int]:
    return engine.tokenizer.encode(" ".join(NATURAL_PROMPTS) * 3)[:150]


@pytest.fixture(scope="module")
def reference(hf_model, prompt: list[int]) -> torch.Tensor:
    """transformers' fp32 log-softmax of every prompt row: row i scores token i + 1."""
    with torch.no_grad():
        logits = hf_model(torch.tensor([prompt])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def run(engine: Engine, prompt: list[int], params: SamplingParams, budget: int):
    rid = engine.add_request(prompt, params)
    first, final = None, None
    while engine.has_unfinished():
        for out in engine.step(budget):
            if out.request_id == rid and first is None:
                first = out
            if out.request_id == rid and out.finished:
                final = out
    assert first is not None and final is not None
    return first, final


def check(scored, prompt: list[int], reference: torch.Tensor) -> None:
    assert scored is not None and len(scored) == len(prompt) and scored[0] is None
    for i in range(1, len(prompt)):
        e, ref = scored[i], reference[i - 1]
        assert e.token_id == prompt[i]
        assert abs(e.logprob - ref[prompt[i]].item()) < 1e-4, i
        assert (
            e.rank == int((ref > ref[prompt[i]]).sum()) + 1
            or abs(ref.sort(descending=True).values[e.rank - 1] - ref[prompt[i]]) < 1e-4
        )  # (a tie at the 1e-4 level may swap ranks)
        values, ids = ref.topk(TOP)
        assert [t for t, _ in e.top] == ids.tolist() or torch.allclose(
            torch.tensor([lp for _, lp in e.top]), values, atol=1e-4
        )
        assert torch.allclose(torch.tensor([lp for _, lp in e.top]), values, atol=1e-4)


@pytest.mark.parametrize("budget", [16, 512, 37])
def test_prompt_logprobs_match_transformers(engine, prompt, reference, budget):
    params = SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=TOP)
    first, final = run(engine, prompt, params, budget)
    check(first.prompt_logprobs, prompt, reference)
    assert final.prompt_logprobs is None or final is first  # sent once, with the first
    assert_no_blocks_in_use(engine)


def test_a_prefix_hit_is_bypassed_and_the_cache_still_serves_others(engine, prompt, reference):
    plain = SamplingParams(max_tokens=1, temperature=0.0)
    run(engine, prompt, plain, 512)  # the prompt's blocks are cached now
    _, again = run(engine, prompt, plain, 512)
    assert again.num_cached_tokens > 100  # a hit for a request without prompt logprobs
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    first, final = run(engine, prompt, params, 16)
    assert final.num_cached_tokens == 0  # computed whole, not served from the cache
    assert all(e is None or e.top == [] for e in first.prompt_logprobs)
    for i in range(1, len(prompt)):
        want = reference[i - 1][prompt[i]].item()
        assert abs(first.prompt_logprobs[i].logprob - want) < 1e-4
    assert_no_blocks_in_use(engine)


def test_chunked_unchunked_and_cached_are_identical_when_deterministic(prompt):
    """With --deterministic (batch-invariant kernels) the chunking changes no bit: the
    prompt's logprobs (its first 70 tokens: 5 chunks of 16) at budget 16, 512 and after a
    cached run are equal."""
    engine = Engine(
        dtype="float32",
        max_model_len=128,
        kv_cache_memory=8 << 20,
        max_num_batched_tokens=512,
        deterministic=True,
    )
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=2)
    runs = []
    for budget in (512, 16, 512):
        first, _ = run(engine, prompt[:70], params, budget)
        runs.append([(e.logprob, e.top, e.rank) if e else None for e in first.prompt_logprobs])
    assert runs[0] == runs[1] == runs[2]


@pytest.mark.parametrize("value", [-1, 21, 1.5, True])
def test_bad_prompt_logprobs_name_the_field(value):
    with pytest.raises(ValueError, match="^prompt_logprobs"):
        SamplingParams(prompt_logprobs=value).validate()
    SamplingParams(prompt_logprobs=5).validate()


def test_prompt_logprobs_refused_for_a_remotely_prefilled_prompt():
    remote = {"prefill_url": "http://127.0.0.1:1"}
    with pytest.raises(ValueError, match="^prompt_logprobs: not available"):
        SamplingParams(prompt_logprobs=0, kv_transfer_params=remote).validate()
    SamplingParams(kv_transfer_params=remote).validate()


# ---- served ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def client(engine: Engine):
    from fastapi.testclient import TestClient

    from chunkserve.engine.async_engine import AsyncEngine
    from chunkserve.entrypoints.openai.api_server import build_app

    with TestClient(build_app(AsyncEngine(engine), served_model_name="m")) as c:
        yield c


def sse(r) -> list[dict]:
    import json

    return [json.loads(x[6:]) for x in r.text.splitlines() if x.startswith("data: {")]


def test_echo_logprobs_score_the_prompt(client, engine, prompt, reference):
    """OpenAI's legacy scoring (lm-eval-harness's loglikelihood): echo, logprobs and
    max_tokens 0 give the prompt's tokens with their logprobs (the first null) and nothing
    generated; streamed, the same."""
    body = {"prompt": prompt, "echo": True, "logprobs": 2, "max_tokens": 0, "temperature": 0}
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    lp = choice["logprobs"]
    text = engine.tokenizer.decode(prompt)
    assert choice["text"] == text and r.json()["usage"]["completion_tokens"] == 0
    assert len(lp["tokens"]) == len(prompt) and lp["token_logprobs"][0] is None
    assert lp["top_logprobs"][0] is None and lp["text_offset"][0] == 0
    assert "".join(lp["tokens"]) == text
    assert lp["text_offset"] == [len("".join(lp["tokens"][:i])) for i in range(len(prompt))]
    for i in range(1, len(prompt)):
        assert abs(lp["token_logprobs"][i] - reference[i - 1][prompt[i]].item()) < 1e-4
        assert len(lp["top_logprobs"][i]) <= 2
    chunks = sse(client.post("/v1/completions", json={**body, "stream": True}))
    streamed = [c["choices"][0] for c in chunks if c["choices"]]
    assert "".join(c["text"] for c in streamed) == text
    got = [x for c in streamed if c["logprobs"] for x in c["logprobs"]["token_logprobs"]]
    assert got == lp["token_logprobs"]
    # With generated tokens after the prompt: their logprobs follow the prompt's.
    r = client.post("/v1/completions", json={**body, "max_tokens": 3})
    lp3 = r.json()["choices"][0]["logprobs"]
    assert lp3["token_logprobs"][: len(prompt)] == lp["token_logprobs"]
    assert len(lp3["tokens"]) == len(prompt) + 3
    assert lp3["text_offset"][len(prompt)] == len(text)


def test_vllm_prompt_logprobs_field(client, prompt, reference):
    for path, extra in (
        ("/v1/completions", {"prompt": prompt}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]}),
    ):
        body = {**extra, "prompt_logprobs": 1, "max_tokens": 1, "temperature": 0}
        choice = client.post(path, json=body).json()["choices"][0]
        scored = choice["prompt_logprobs"]
        assert scored[0] is None and all(isinstance(x, dict) for x in scored[1:])
        if path == "/v1/completions":
            assert len(scored) == len(prompt)
            for i in (1, 50, len(prompt) - 1):
                mine = scored[i][str(prompt[i])]
                assert abs(mine["logprob"] - reference[i - 1][prompt[i]].item()) < 1e-4
                assert mine["rank"] >= 1 and isinstance(mine["decoded_token"], str)
        streamed = sse(client.post(path, json={**body, "stream": True}))
        got = [
            c["choices"][0]["prompt_logprobs"]
            for c in streamed
            if c["choices"] and "prompt_logprobs" in c["choices"][0]
        ]
        assert got == [scored]  # streamed: once, on the first chunk that has it


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": "Hi", "max_tokens": 0}, "max_tokens"),
        ({"prompt": "Hi", "prompt_logprobs": 21}, "prompt_logprobs"),
        ({"prompt": "Hi", "prompt_logprobs": -1}, "prompt_logprobs"),
        ({"prompt": "Hi", "prompt_logprobs": "all"}, "prompt_logprobs"),
        ({"prompt": "Hi", "echo": True, "logprobs": 30, "max_tokens": 0}, "logprobs"),
    ],
)
def test_bad_scoring_requests_are_400(client, body, param):
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()
