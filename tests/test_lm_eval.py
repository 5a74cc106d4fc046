"""lm-eval-harness (issue 44): its ``local-completions`` model against a real server on the
embedded model, on two tasks defined from local files (no hub download, offline): a
multiple-choice task (loglikelihood requests: ``echo`` + ``logprobs`` on token prompts) and a
generate-until task (greedy completions with stop strings), each run to a score. The scores
are checked against the server's own answers to plain requests: every choice's
loglikelihood, the accuracy they give, the greedy generations the exact-match targets are."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.test_router import ServerThread

pytest.importorskip("lm_eval", reason="lm_eval (the test extra) is not installed")

# Multiple choice: (question, choices, index of the answer). The answers are what a reader
# would pick; the test does not need the model to be right, only lm_eval's scores to be the
# ones the model's own logprobs give.
MC_DOCS = [
    ("The capital of France is", ["Paris", "London", "Berlin"], 0),
    ("Two plus two equals", ["four", "seven", "blue"], 0),
    ("The opposite of hot is", ["loud", "cold", "tall"], 1),
    ("Water freezes at zero degrees", ["Celsius", "Pascal", "Newton"], 0),
    ("The sun rises in the", ["north", "west", "east"], 2),
    ("A cat says", ["moo", "meow", "quack"], 1),
]
GEN_PROMPTS = ["The capital of France is", "My favourite colour is", "Once upon a time"]
MAX_GEN_TOKS = 6
UNTIL = "\n"
MODEL = "smollm2"


@pytest.fixture(scope="module")
def server(shared_engine) -> Iterator[ServerThread]:
    """The OpenAI server on the embedded model (the session's fp32 engine), served by uvicorn
    on a thread of this process (lm_eval talks to it over HTTP; a subprocess server took 4x
    longer to start)."""
    from chunkserve.engine.async_engine import AsyncEngine
    from chunkserve.entrypoints.openai.api_server import build_app

    s = ServerThread(build_app(AsyncEngine(shared_engine), served_model_name=MODEL))
    yield s
    s.stop()


def completions(server: ServerThread, **body) -> list[dict]:
    r = httpx.post(
        server.url + "/v1/completions", json={"model": MODEL, "temperature": 0, **body}, timeout=60
    )
    assert r.status_code == 200, r.text
    return sorted(r.json()["choices"], key=lambda c: c["index"])


def loglikelihoods(server: ServerThread, pairs: list[tuple[list[int], list[int]]]) -> list[float]:
    """Each continuation's logprob given its context, from the server's prompt logprobs
    (one request, a prompt per pair)."""
    prompts = [context + continuation for context, continuation in pairs]
    choices = completions(server, prompt=prompts, echo=True, logprobs=0, max_tokens=0)
    return [
        sum(c["logprobs"]["token_logprobs"][len(context) :])
        for c, (context, _) in zip(choices, pairs, strict=True)
    ]


@pytest.fixture(scope="module")
def tasks(tmp_path_factory, server: ServerThread) -> tuple[Path, list[str]]:
    """The two tasks' YAML and JSONL in a temporary folder. The generate-until targets are
    the server's greedy continuations (cut at the stop string) of the first and last prompt
    and a sentence the model does not write for the middle one: exact match must be 2/3."""
    root = tmp_path_factory.mktemp("lm_eval_tasks")
    with open(root / "mc.jsonl", "w") as f:
        for question, choices, answer in MC_DOCS:
            f.write(json.dumps({"question": question, "choices": choices, "answer": answer}))
            f.write("\n")
    targets = [
        c["text"]
        for c in completions(server, prompt=GEN_PROMPTS, max_tokens=MAX_GEN_TOKS, stop=[UNTIL])
    ]
    assert all(targets), targets  # a stop string the model writes first would make it ""
    targets[1] = " zebra zebra zebra zebra zebra zebra"
    with open(root / "gen.jsonl", "w") as f:
        for prompt, target in zip(GEN_PROMPTS, targets, strict=True):
            f.write(json.dumps({"prompt": prompt, "target": target}) + "\n")
    common = (
        "dataset_path: json\ntest_split: test\ndataset_kwargs:\n  data_files:\n    test: {path}\n"
    )
    (root / "chunkserve_mc.yaml").write_text(
        "task: chunkserve_mc\n"
        + common.format(path=root / "mc.jsonl")
        + "output_type: multiple_choice\n"
        'doc_to_text: "{{question}}"\n'
        'doc_to_choice: "{{choices}}"\n'
        'doc_to_target: "{{answer}}"\n'
        "metric_list:\n"
        "  - metric: acc\n"
    )
    (root / "chunkserve_gen.yaml").write_text(
        "task: chunkserve_gen\n"
        + common.format(path=root / "gen.jsonl")
        + "output_type: generate_until\n"
        'doc_to_text: "{{prompt}}"\n'
        'doc_to_target: "{{target}}"\n'
        'target_delimiter: ""\n'
        "generation_kwargs:\n"
        f"  until: [{json.dumps(UNTIL)}]\n"
        f"  max_gen_toks: {MAX_GEN_TOKS}\n"
        "  do_sample: false\n"
        "metric_list:\n"
        "  - metric: exact_match\n"
    )
    return root, targets


@pytest.fixture(scope="module")
def results(server: ServerThread, tasks, hf_dir: Path, tmp_path_factory) -> dict:
    mp = pytest.MonkeyPatch()
    cache = tmp_path_factory.mktemp("hf_datasets")
    for name, value in (
        ("HF_DATASETS_OFFLINE", "1"),
        ("HF_HUB_OFFLINE", "1"),
        ("HF_DATASETS_CACHE", str(cache)),
    ):
        mp.setenv(name, value)
    try:
        from lm_eval import simple_evaluate
        from lm_eval.tasks import TaskManager

        root, _ = tasks
        model_args = ",".join(
            [
                f"model={MODEL}",
                f"base_url={server.url}/v1/completions",
                "tokenizer_backend=huggingface",
                f"tokenizer={hf_dir}",
                "num_concurrent=1",
                "batch_size=8",
                "max_retries=1",
                "max_length=512",
            ]
        )
        return simple_evaluate(
            model="local-completions",
            model_args=model_args,
            tasks=["chunkserve_mc", "chunkserve_gen"],
            task_manager=TaskManager(include_path=str(root), include_defaults=False),
            log_samples=True,
        )
    finally:
        mp.undo()


def test_loglikelihood_task_scores_what_the_model_gives(results, server, shared_engine):
    """Every choice's loglikelihood lm_eval got (its token prompts, echo and logprobs, its
    split of context and continuation) equals the sum of the continuation's prompt logprobs
    (checked against transformers in test_prompt_logprobs), and the accuracy is the one
    those give."""
    tokenizer = shared_engine.tokenizer
    acc = results["results"]["chunkserve_mc"]["acc,none"]
    assert isinstance(acc, float) and 0.0 <= acc <= 1.0
    samples = sorted(results["samples"]["chunkserve_mc"], key=lambda s: s["doc_id"])
    assert len(samples) == len(MC_DOCS)
    pairs = []
    for question, choices, _ in MC_DOCS:
        context = tokenizer.encode(question)
        for choice in choices:
            whole = tokenizer.encode(question + " " + choice)
            assert whole[: len(context)] == context
            pairs.append((context, whole[len(context) :]))
    scores = iter(loglikelihoods(server, pairs))
    right = 0
    for sample, (question, choices, answer) in zip(samples, MC_DOCS, strict=True):
        want = [next(scores) for _ in choices]
        got = [resp[0][0] for resp in sample["resps"]]
        assert len(got) == len(choices)
        for g, w in zip(got, want, strict=True):
            assert math.isfinite(g) and abs(g - w) < 1e-4, (question, got, want)
        right += max(range(len(want)), key=want.__getitem__) == answer
    assert acc == pytest.approx(right / len(MC_DOCS))


def test_generate_until_task_scores_the_greedy_generations(results, tasks):
    """The generations lm_eval got (greedy, its stop strings and max_gen_toks) are the
    server's: two targets are those, one is not, so exact match is 2/3."""
    _, targets = tasks
    score = results["results"]["chunkserve_gen"]["exact_match,none"]
    samples = sorted(results["samples"]["chunkserve_gen"], key=lambda s: s["doc_id"])
    generated = [s["resps"][0][0] for s in samples]
    assert generated[0] == targets[0] and generated[2] == targets[2]
    assert generated[1] != targets[1]
    assert score == pytest.approx(2 / 3)
