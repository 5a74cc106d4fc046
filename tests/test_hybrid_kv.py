"""The hybrid KV cache on tiny random models with sliding windows (Gemma 3: 2 full and 10
sliding layers -> 6 KV groups of 2 layers; Gemma 2: 1 and 1 -> 2 groups of 1; Mistral: a
window on every layer -> 1 group), prompts 5-7.5x the window: greedy tokens are
transformers' (fp32) chunked at budgets 16 and 256, unchunked, prefix-cached with hits
longer than the window, preempted and speculative, while the sliding groups give their
out-of-window blocks back; a given-back block is never read again (poisoned with NaN)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from chunkserve.engine.engine import Engine
from chunkserve.scheduling.kv_cache import NULL_BLOCK, cdiv
from chunkserve.scheduling.sampling_params import SamplingParams
from tests.conftest import assert_no_blocks_in_use, random_prompt
from tests.test_model_families import BLOCK, hf_config, reference, write_model
from tests.test_model_families import make_engine as family_engine

WINDOW = 20  # not a multiple of the block size (16)
MODELS = {
    "gemma3": ("gemma3_text", dict(num_hidden_layers=12, sliding_window=WINDOW)),
    "gemma2": ("gemma2", dict(sliding_window=WINDOW)),
    "mistral": ("mistral", dict(sliding_window=WINDOW)),
}
GROUPS = {"gemma3": (None, 20, 20, 20, 20, 20), "gemma2": (None, 20), "mistral": (20,)}
PROMPT_LENS = (100, 130, 150)
MAX_TOKENS = 6
LONG_TOKENS = 40  # past the tight pool of the preemption run


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory, hf_dir: Path) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hybrid")
    return {
        name: write_model(root / name, hf_config(family, **changes), hf_dir)
        for name, (family, changes) in MODELS.items()
    }


@pytest.fixture(scope="module")
def work() -> list[list[int]]:
    rng = random.Random(40)
    return [random_prompt(rng, n) for n in PROMPT_LENS]


@pytest.fixture(scope="module")
def expected(model_dirs, work) -> dict[str, list[list[int]]]:
    """transformers' greedy tokens (eager attention, fp32)."""
    out = {}
    for name, path in model_dirs.items():
        ref = reference(path)
        rows = []
        for ids in work:
            with torch.no_grad():
                gen = ref.generate(
                    torch.tensor([ids]), max_new_tokens=MAX_TOKENS, do_sample=False,
                    eos_token_id=None,
                )  # fmt: skip
            rows.append(gen[0, len(ids) :].tolist())
        out[name] = rows
    return out


def make_engine(path: Path, **kwargs) -> Engine:
    return family_engine(path, **{"kv_cache_memory": 32 << 20, **kwargs})


def run(
    engine: Engine, prompts: list[list[int]], after_step=None, max_tokens: int = MAX_TOKENS
) -> list[list[int]]:
    params = SamplingParams(max_tokens=max_tokens, min_tokens=max_tokens, temperature=0.0)
    ids = [engine.add_request(p, params) for p in prompts]
    done: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.token_ids
        if after_step is not None:
            after_step(engine)
    return [done[i] for i in ids]


def check_window_blocks(engine: Engine, budget: int) -> None:
    """Each running request's sliding tables hold live blocks only from the first block
    its window reached at its last step on, at most the window and a chunk."""
    kv = engine.core.kv
    for r in engine.core.scheduler.running:
        # The blocks given back when this step was scheduled: the window of its first row.
        start = r.num_computed_tokens - r.num_computed_tokens % BLOCK - budget
        for g, w in enumerate(kv.group_windows):
            table = r.block_tables[g]
            live = [i for i, b in enumerate(table) if b != NULL_BLOCK]
            if w is None:
                assert len(live) == len(table)
                continue
            assert len(live) <= cdiv(w - 1 + budget, BLOCK) + 1, (g, table)
            assert not live or live[0] >= max(0, start - w + 1) // BLOCK, (g, table)


@pytest.mark.parametrize("name", list(MODELS))
def test_greedy_tokens_match_transformers_in_every_mode(
    model_dirs, work, expected, name: str
) -> None:
    path, want = model_dirs[name], expected[name]
    unchunked = make_engine(path, enable_chunked_prefill=False, max_num_batched_tokens=2048)
    assert unchunked.core.kv.group_windows == GROUPS[name]
    assert run(unchunked, work) == want
    assert_no_blocks_in_use(unchunked)
    for budget in (16, 256):
        chunked = make_engine(path, max_num_batched_tokens=budget)
        assert run(chunked, work, lambda e, b=budget: check_window_blocks(e, b)) == want
        # Again: prefix hits far longer than the window, the sliding groups' tables null
        # before their window.
        hits = chunked.core.kv.num_hit_tokens
        assert run(chunked, work) == want
        assert chunked.core.kv.num_hit_tokens - hits >= sum(
            (n - 1) // BLOCK * BLOCK for n in PROMPT_LENS
        )
        assert_no_blocks_in_use(chunked)
    # The smallest pool that can hold a max_model_len sequence, requests that grow past
    # it: preempted and recomputed (the same tokens as unchunked, transformers' first).
    longer = run(unchunked, work, max_tokens=LONG_TOKENS)
    assert [t[:MAX_TOKENS] for t in longer] == want
    per_block = chunked.core.worker._bytes_per_block
    groups = chunked.core.kv.num_groups
    tight = make_engine(
        path,
        schedule_conservativeness=0.0,
        max_num_batched_tokens=64,
        kv_cache_memory=(12 * groups + 1) * per_block,
        max_model_len=12 * BLOCK,
    )
    assert run(tight, work, max_tokens=LONG_TOKENS) == longer
    # A model with a full group preempts; a window-only one holds a bounded number of
    # blocks per request (admission reserves that much), so its pool never runs dry here.
    assert (tight.core.scheduler.num_preemptions > 0) == (None in GROUPS[name])
    assert_no_blocks_in_use(tight)


def test_hybrid_holds_fewer_blocks_than_full_attention_on_every_layer(model_dirs, work) -> None:
    """Same tokens with ``hybrid_kv_cache`` off; the peak KV memory held is smaller on."""
    peaks = {}
    tokens = {}
    for hybrid in (True, False):
        engine = make_engine(
            model_dirs["gemma3"], max_num_batched_tokens=32, hybrid_kv_cache=hybrid
        )
        peak = [0]

        def track(e: Engine, peak=peak) -> None:
            used = e.core.kv.num_blocks - e.core.kv.num_free_blocks
            peak[0] = max(peak[0], used * e.core.worker._bytes_per_block)

        tokens[hybrid] = run(engine, work, track)
        peaks[hybrid] = peak[0]
        assert engine.core.kv.num_groups == (6 if hybrid else 1)
    assert tokens[True] == tokens[False]
    # 2 of 12 layers keep every block; 10 only ~window + chunk.
    assert peaks[True] < 0.5 * peaks[False], peaks


@pytest.mark.parametrize("name", ["gemma3", "mistral"])
def test_a_given_back_block_is_never_read_again(model_dirs, work, expected, name: str) -> None:
    """Every free block is filled with NaN after each step (prefix caching off, so none
    holds content anyone may reuse): a block read after it was given back would turn the
    logits to NaN; the tokens stay transformers'."""
    engine = make_engine(model_dirs[name], max_num_batched_tokens=16, enable_prefix_caching=False)
    pool = engine.core.kv.pool
    caches = engine.core.worker.runner.kv_caches
    poisoned = [0]

    def poison(e: Engine) -> None:
        free = [b for b in range(1, pool.num_blocks + 1) if pool.ref_cnt[b] == 0]
        idx = torch.tensor(free, dtype=torch.long)
        for k, v in caches:
            k.index_fill_(0, idx, float("nan"))
            v.index_fill_(0, idx, float("nan"))
        poisoned[0] += len(free)

    poison(engine)
    assert run(engine, work, poison) == expected[name]
    assert poisoned[0] > 0
    assert_no_blocks_in_use(engine)


def test_speculative_decoding_with_windows_matches(model_dirs, work, expected) -> None:
    """n-gram drafts verified over the sliding groups' windows."""
    spec = {"method": "ngram", "num_speculative_tokens": 3, "min_acceptance_rate": 0.0}
    engine = make_engine(model_dirs["gemma3"], max_num_batched_tokens=64, speculative_config=spec)
    assert run(engine, work) == expected["gemma3"]
    assert_no_blocks_in_use(engine)


def test_what_a_hybrid_cache_cannot_serve_is_refused(model_dirs, tmp_path, no_weight_loading):
    # A draft model that sees further back than the only (sliding) group keeps.
    from tests.test_model_families import variant

    draft = variant(model_dirs["mistral"], tmp_path / "draft", sliding_window=None)
    spec = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 2}
    with pytest.raises(ValueError, match="speculative_config.model.*window.*--no-hybrid"):
        make_engine(model_dirs["mistral"], speculative_config=spec)


def test_blocks_per_group_in_the_startup_line_and_metrics(model_dirs, work, caplog) -> None:
    """The start-up line counts blocks per KV group and the requests the pool holds; the
    pool's per-group counts equal the live blocks of each group's tables after every step
    (prefix caching off: no block shared), and /metrics exports them by group and window."""
    from prometheus_client.parser import text_string_to_metric_families

    from chunkserve.entrypoints.openai.metrics import Metrics

    with caplog.at_level("INFO", logger="chunkserve"):
        engine = make_engine(
            model_dirs["gemma3"], max_num_batched_tokens=32, enable_prefix_caching=False,
            max_model_len=512,
        )  # fmt: skip
    line = next(r.getMessage() for r in caplog.records if "engine core:" in r.getMessage())
    kv = engine.core.kv
    # 512 tokens: 32 blocks in the full group, (20 + 16) / 16 -> 3 in each sliding group.
    assert "6 KV group(s): 1 full, 5 x window 20" in line, line
    assert "for a 512-token request: full: 32, window 20: 3 (47 in all)" in line, line
    assert f"{kv.num_blocks // 47} such requests at once" in line, line
    assert f"{kv.num_blocks // 6 // 32} with full attention on every layer" in line, line
    metrics = Metrics(engine, "m")

    def scrape() -> dict[tuple[str, str], float]:
        return {
            (s.labels["group"], s.labels["window"]): s.value
            for f in text_string_to_metric_families(metrics.render().decode())
            for s in f.samples
            if s.name == "chunkserve:kv_cache_group_blocks_used"
        }

    labels = [("0", "full")] + [(str(g), "20") for g in range(1, 6)]
    assert scrape() == dict.fromkeys(labels, 0.0)
    seen = []

    def check(e: Engine) -> None:
        live = [0] * kv.num_groups
        for r in e.core.scheduler.running:
            for g, table in enumerate(r.block_tables):
                live[g] += sum(b != NULL_BLOCK for b in table)
        assert kv.group_blocks_used == live
        assert sum(live) == kv.num_blocks - kv.num_free_blocks
        kv.pool.check_invariants()
        got = scrape()
        assert [got[k] for k in labels] == live
        seen.append(live)

    run(engine, work, check)
    # The full group kept every block; the sliding ones only their windows.
    assert max(s[0] for s in seen) > 2 * max(max(s[1:]) for s in seen)
    assert scrape() == dict.fromkeys(labels, 0.0)


def test_disaggregated_prefill_sends_only_the_windows_blocks(model_dirs, work) -> None:
    """A prefill and a decode instance of the Gemma 3 model (6 KV groups) behind the router:
    the outputs are the colocated ones, and the bytes that travelled are the full group's
    every block plus each sliding group's blocks in the window of the decode side's first
    token (``transfer_plan``), not every group's every block."""
    import json

    import httpx

    from chunkserve.disagg.connector import transfer_plan
    from tests.test_disaggregation import Router
    from tests.test_server import Server

    path = model_dirs["gemma3"]
    cfg = json.loads((path / "config.json").read_text())
    # A block: one group's 2 layers x K, V x 16 tokens x KV heads x head dim x fp32.
    block_bytes = 2 * 2 * BLOCK * cfg["num_key_value_heads"] * cfg["head_dim"] * 4
    common = ("--model", str(path), "--served-model-name", "m", "--num-threads", "1")
    common += ("--no-enable-prefix-caching",)  # a colocated run's blocks would hit
    prefill = Server("--disaggregation-mode", "prefill", *common)
    try:
        decode = Server("--disaggregation-mode", "decode", *common)
        try:
            router = Router("--prefill", prefill.base, "--decode", decode.base)
            try:
                for prompt in work[:2]:
                    body = {
                        "model": "m", "prompt": prompt, "max_tokens": MAX_TOKENS,
                        "min_tokens": MAX_TOKENS, "temperature": 0.0,
                    }  # fmt: skip
                    before = prefill.metrics().get("chunkserve:kv_transfer_bytes_sum", 0)
                    texts = []
                    for base in (decode.base, router.base):
                        resp = httpx.post(base + "/v1/completions", json=body, timeout=300)
                        assert resp.status_code == 200, resp.text
                        texts.append(resp.json()["choices"][0]["text"])
                    assert texts[0] == texts[1]
                    sent = prefill.metrics()["chunkserve:kv_transfer_bytes_sum"] - before
                    n = len(prompt) - 1  # the decode side computes the last prompt token
                    plan = transfer_plan(0, n, GROUPS["gemma3"], BLOCK)
                    assert sent == len(plan) * block_bytes
                    assert len(plan) < 0.5 * 6 * cdiv(n, BLOCK)
                for side in (prefill, decode):
                    assert side.wait_idle()["chunkserve:kv_cache_blocks_used"] == 0
            finally:
                router.stop()
        finally:
            decode.stop()
    finally:
        prefill.stop()
