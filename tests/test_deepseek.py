"""DeepSeek-V2: multi-head latent attention over a latent KV cache and DeepSeek's router,
against transformers' DeepseekV2 (tiny random models from its config class with a published
checkpoint's fields, shrunk): fp32 logits of prompt rows (whole and chunked) and of decode
rows (the absorbed path) within 1e-4 relative, greedy tokens and the experts each token
picks identical; chunked = unchunked = prefix-cached = preempted; the pool holds
kv_lora_rank + qk_rope_head_dim values per token per layer; tensor parallel 2 = 1; options
we do not serve are a ValueError naming them.
"""

from __future__ import annotations

import importlib.util
import random
from pathlib import Path

import pytest
import torch

from chunkserve.model.layers import DETERMINISTIC_TILING
from chunkserve.model.moe import route_grouped, route_noaux_tc
from chunkserve.scheduling.sampling_params import SamplingParams
from tests.conftest import assert_no_blocks_in_use, random_prompt
from tests.test_invariance import run_staggered
from tests.test_model_families import (
    BLOCK,
    CHUNK_TOKENS,
    CHUNK_WORK,
    SMALL,
    assert_matches_transformers,
    assert_preempted_matches,
    make_engine,
    prompts,
    reference,
    run_all,
    variant,
    write_model,
)
from tests.test_moe import rewrite
from tests.test_tensor_parallel import record_logits

DEEPSEEK = "deepseek_v2"
FAMILY = {"v3": "deepseek_v3"}
# deepseek-ai/DeepSeek-V2-Lite: latent 512 + rope 64 (here 32 + 8), no q bottleneck, heads
# of 128 no-rope + 64 rope query/key dims and 128 value dims (here 16 + 8, 16), 64 experts
# top 6 of 1408 columns (here 8 top 2 of 32) and 2 shared, the first layer dense, greedy
# routing, YaRN x40 from 4096 positions (here from 128) with mscale 0.707 on both.
LITE = dict(
    num_key_value_heads=4,
    kv_lora_rank=32,
    q_lora_rank=None,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
    n_routed_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    n_shared_experts=2,
    first_k_dense_replace=1,
    n_group=1,
    topk_group=1,
    topk_method="greedy",
    norm_topk_prob=False,
    routed_scaling_factor=1.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    max_position_embeddings=5120,
    rope_parameters=dict(
        rope_type="yarn",
        rope_theta=10000.0,
        factor=40.0,
        original_max_position_embeddings=128,
        mscale=0.707,
        mscale_all_dim=0.707,
        beta_fast=32,
        beta_slow=1,
    ),
)
# deepseek-ai/DeepSeek-V2: a q bottleneck of 1536 (here 48), 160 experts in 8 groups, the
# top 6 from the best 3 groups (here 16 in 4, top 4 from the best 2), weights x16.
MODELS = {
    "lite": LITE,
    "v2": {
        **LITE,
        "q_lora_rank": 48,
        "n_routed_experts": 16,
        "num_experts_per_tok": 4,
        "n_group": 4,
        "topk_group": 2,
        "topk_method": "group_limited_greedy",
        "routed_scaling_factor": 16.0,
    },
    # deepseek-ai/DeepSeek-V3 (transformers' DeepseekV3Config; its router "noaux_tc"):
    # 256 experts in 8 groups, the top 8 from the best 4 groups by sigmoid score plus the
    # correction bias, renormalised, x2.5 (here 16 in 4, top 4 from the best 2); a q
    # bottleneck; YaRN x40 from 4096 positions with mscale 1.0 on both (here from 128).
    "v3": {
        **{k: v for k, v in LITE.items() if k != "topk_method"},
        "q_lora_rank": 48,
        "n_routed_experts": 16,
        "num_experts_per_tok": 4,
        "n_shared_experts": 1,
        "n_group": 4,
        "topk_group": 2,
        "norm_topk_prob": True,
        "routed_scaling_factor": 2.5,
        "rope_parameters": {**LITE["rope_parameters"], "mscale": 1.0, "mscale_all_dim": 1.0},
    },
}
RANK, ROPE = LITE["kv_lora_rank"], LITE["qk_rope_head_dim"]


def hf_config(name: str, **changes):
    import transformers

    cls = transformers.DeepseekV3Config if name == "v3" else transformers.DeepseekV2Config
    return cls(**{**SMALL, **MODELS[name], **changes})


def _wider_routers(tensors: dict) -> dict:
    """Routers drawn wider than HF's N(0, 0.02): top-k choices (and groups) without
    near-ties; V3's correction biases (zeros from HF) drawn to change some choices."""
    gen = torch.Generator().manual_seed(5)
    out = {k: v * 20 for k, v in tensors.items() if k.endswith("gate.weight")}
    for k, v in tensors.items():
        if k.endswith("e_score_correction_bias"):
            out[k] = 0.3 * torch.randn(v.shape, generator=gen)
    return out


@pytest.fixture(scope="module")
def dirs(tmp_path_factory, hf_dir: Path) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("deepseek")
    out = {name: write_model(root / name, hf_config(name), hf_dir) for name in MODELS}
    for path in out.values():
        rewrite(path, _wider_routers)
    return out


@pytest.fixture(scope="module")
def refs(dirs) -> dict:
    return {name: reference(path) for name, path in dirs.items()}


def decode_logits(ref, ids: list[int], n: int) -> list[torch.Tensor]:
    with torch.no_grad():
        out = ref.generate(
            torch.tensor([ids]),
            max_new_tokens=n,
            do_sample=False,
            eos_token_id=None,
            output_logits=True,
            return_dict_in_generate=True,
        )
    return [x[0].float() for x in out.logits]


# ---- against transformers ------------------------------------------------------------------
# The decode rows through each backend: torch, the C kernel, Triton (interpreted on a CPU,
# TRITON_INTERPRET=1 as conftest sets it; skipped without the triton package).
TRITON = pytest.param(
    "triton",
    marks=pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="no triton"),
)


@pytest.mark.parametrize("backend", ["torch", "cpu", TRITON])
@pytest.mark.parametrize("name", list(MODELS))
def test_logits_and_greedy_tokens_match_transformers(dirs, refs, name, backend) -> None:
    """Prompt rows (chunks: keys and values expanded from the latents) and decode rows
    (queries absorbed into the latent: the backend attends over the cached latents)."""
    engine = make_engine(dirs[name], attention_backend=backend)
    assert engine.core.worker.model_config.architecture == FAMILY.get(name, DEEPSEEK)
    assert engine.core.worker.attention.name == backend
    assert_matches_transformers(engine, refs[name], name)
    seen = record_logits(engine)
    params = SamplingParams(max_tokens=6, min_tokens=6, temperature=0.0)
    for ids in prompts():
        seen.clear()
        run_all(engine, [ids], params)
        want = decode_logits(refs[name], ids, 6)
        assert len(seen) == len(want)
        for got, exp in zip(seen, want, strict=True):  # the first: the prompt's last row
            rel = ((got[0] - exp).norm() / exp.norm()).item()
            assert rel < 1e-4, f"{name}: decode row relative error {rel:.2e}"


@pytest.mark.parametrize("name", list(MODELS))
def test_experts_each_token_picks_match_transformers(dirs, refs, name) -> None:
    """The MoE layer's input as transformers computes it, routed by its router and ours."""
    ref = refs[name]
    engine = make_engine(dirs[name])
    ours = engine.core.worker.model.layers[1].mlp
    inputs: list[torch.Tensor] = []
    gate = ref.model.layers[1].mlp.gate
    hook = gate.register_forward_hook(lambda m, args, out: inputs.append((args[0], out)))
    try:
        with torch.no_grad():
            ref(torch.tensor([prompts()[2]]))
    finally:
        hook.remove()
    ((x, (_, want_w, want_ids)),) = inputs
    x = x.reshape(-1, x.shape[-1])
    got_w, got_ids = ours.select(x)
    assert [sorted(r) for r in got_ids.tolist()] == [sorted(r) for r in want_ids.tolist()]
    # Each pick's weight (transformers' order is not sorted).
    order_got, order_want = got_ids.argsort(-1), want_ids.argsort(-1)
    torch.testing.assert_close(
        got_w.gather(1, order_got), want_w.float().gather(1, order_want), rtol=1e-5, atol=1e-6
    )
    logits = x.float() @ ours.router.float().T
    if name == "v3":  # the correction bias, and the groups, mattered for some token
        scores = torch.sigmoid(logits)
        for plain in (scores, scores + ours.score_bias):
            plain = torch.topk(plain, 4).indices
            assert any(sorted(a) != sorted(b) for a, b in zip(plain.tolist(), got_ids.tolist()))
    elif MODELS[name]["n_group"] > 1:  # the groups' restriction mattered for some token
        plain = torch.topk(torch.softmax(logits, -1), 4).indices
        assert any(sorted(a) != sorted(b) for a, b in zip(plain.tolist(), got_ids.tolist()))


def test_grouped_router_against_a_naive_reference() -> None:
    """Per token: the groups ranked by their best score, experts outside the best
    ``topk_group`` dropped, top-k of the rest; renormalised (then not scaled, as DeepSeek's
    V2 code) or scaled."""
    gen = torch.Generator().manual_seed(0)
    logits = 3 * torch.randn(50, 12, generator=gen)
    for renorm in (False, True):
        w, ids = route_grouped(logits, 3, 4, 2, 2.5, renorm)
        for t in range(50):
            p = torch.softmax(logits[t], -1).tolist()
            groups = sorted(range(4), key=lambda g: -max(p[3 * g : 3 * g + 3]))[:2]
            allowed = [e for g in groups for e in range(3 * g, 3 * g + 3)]
            chosen = sorted(allowed, key=lambda e: -p[e])[:3]
            assert sorted(ids[t].tolist()) == sorted(chosen)
            total = sum(p[e] for e in chosen)
            want = [p[e] / total if renorm else 2.5 * p[e] for e in ids[t].tolist()]
            torch.testing.assert_close(w[t], torch.tensor(want), rtol=1e-5, atol=1e-6)


def test_noaux_tc_router_is_batch_invariant_in_the_deterministic_mode() -> None:
    """A token's routing weights and experts alone equal those it gets among 299 others when
    the mode's tiling is on. Without it (checked by hand, torch 2.13 on an AVX512 Xeon) 13
    of the 300 rows differ: the sigmoid's scalar tail (T x E mod 32 elements, 16 experts)
    gives them other last bits (AVX2 CPUs may not show it: their tails fall otherwise)."""
    gen = torch.Generator().manual_seed(0)
    logits, bias = 3 * torch.randn(300, 16, generator=gen), 0.1 * torch.randn(16, generator=gen)

    def rows_differing(tiling) -> int:
        w, ids = route_noaux_tc(logits, bias, 4, 4, 2, 2.5, True, tiling)
        alone = [
            route_noaux_tc(logits[t : t + 1], bias, 4, 4, 2, 2.5, True, tiling) for t in range(300)
        ]
        return sum(
            not (torch.equal(a[0][0], w[t]) and torch.equal(a[1][0], ids[t]))
            for t, a in enumerate(alone)
        )

    assert rows_differing(DETERMINISTIC_TILING) == 0


def test_noaux_tc_router_against_a_naive_reference() -> None:
    """DeepSeek-V3's: per token, sigmoid scores; the groups ranked by the sum of their best
    two biased scores, experts outside the best ``topk_group`` dropped, the top-k biased
    scores of the rest; weights the unbiased scores, renormalised or not, times the
    scaling."""
    gen = torch.Generator().manual_seed(0)
    logits, bias = 3 * torch.randn(50, 12, generator=gen), torch.randn(12, generator=gen)
    for renorm in (False, True):
        w, ids = route_noaux_tc(logits, bias, 3, 4, 2, 2.5, renorm)
        for t in range(50):
            p = torch.sigmoid(logits[t]).tolist()
            b = [p[e] + bias[e].item() for e in range(12)]
            top2 = [sum(sorted(b[3 * g : 3 * g + 3])[-2:]) for g in range(4)]
            groups = sorted(range(4), key=lambda g: -top2[g])[:2]
            allowed = [e for g in groups for e in range(3 * g, 3 * g + 3)]
            chosen = sorted(allowed, key=lambda e: -b[e])[:3]
            assert sorted(ids[t].tolist()) == sorted(chosen)
            total = sum(p[e] for e in chosen) if renorm else 1.0
            want = [2.5 * p[e] / total for e in ids[t].tolist()]
            torch.testing.assert_close(w[t], torch.tensor(want), rtol=1e-5, atol=1e-6)


# ---- the latent cache ----------------------------------------------------------------------
def test_the_cache_holds_one_latent_per_token_and_layer(dirs) -> None:
    engine = make_engine(dirs["lite"])
    worker = engine.core.worker
    layers = worker.model_config.num_layers
    assert worker.model_config.kv_bytes_per_token(4) == layers * (RANK + ROPE) * 4
    # A block: every layer's latents of BLOCK tokens (one KV group of every layer).
    assert worker._bytes_per_block == BLOCK * layers * (RANK + ROPE) * 4
    caches = worker.runner.kv_caches
    # The layer's (k, v) pair is one view of its latent pool, twice.
    assert all(k.data_ptr() == v.data_ptr() and k.shape == v.shape for k, v in caches)
    assert len({k.data_ptr() for k, _ in caches}) == layers
    assert caches[0][0].shape == (worker.num_blocks + 1, BLOCK, 1, RANK + ROPE)
    # Every layer's pool in one allocation of exactly the latents' bytes.
    assert len({k.untyped_storage().data_ptr() for k, _ in caches}) == 1
    nbytes = caches[0][0].untyped_storage().nbytes()
    assert nbytes == layers * (worker.num_blocks + 1) * BLOCK * (RANK + ROPE) * 4


# ---- chunking, prefix cache, preemption, tensor parallel -----------------------------------
# V2's grouped softmax router and V3's noaux_tc (sigmoid, correction bias, groups ranked by
# their best two), both over the latent cache.
INVARIANT = ["v2", "v3"]


@pytest.fixture(scope="module")
def unchunked(dirs):
    """Per model: the work (prompts) and its tokens unchunked, computed once."""
    done: dict[str, tuple[list[list[int]], list[list[int]]]] = {}

    def get(name: str) -> tuple[list[list[int]], list[list[int]]]:
        if name not in done:
            rng = random.Random(21)
            work = [random_prompt(rng, n) for n in CHUNK_WORK]
            base = make_engine(
                dirs[name], enable_chunked_prefill=False, max_num_batched_tokens=2048
            )
            expected = run_staggered(base, work, CHUNK_TOKENS)
            assert base.core.scheduler.num_preemptions == 0
            done[name] = work, expected
        return done[name]

    return get


@pytest.mark.parametrize("name", INVARIANT)
@pytest.mark.parametrize("budget", [16, 256])
def test_chunked_and_prefix_cached_match_unchunked(dirs, unchunked, budget, name) -> None:
    work, expected = unchunked(name)
    chunked = make_engine(dirs[name], max_num_batched_tokens=budget)
    steps = []
    chunked.step_listeners.append(steps.append)
    assert run_staggered(chunked, work, CHUNK_TOKENS) == expected
    assert any(s.kind == "mixed" for s in steps)  # chunks beside decodes in one step
    hits = chunked.core.kv.num_hit_tokens
    assert run_staggered(chunked, work, CHUNK_TOKENS) == expected
    assert chunked.core.kv.num_hit_tokens - hits >= sum(len(p) // BLOCK - 1 for p in work) * BLOCK
    assert_no_blocks_in_use(chunked)


@pytest.mark.parametrize("name", INVARIANT)
def test_preempted_matches_unchunked(dirs, unchunked, name) -> None:
    work, expected = unchunked(name)
    assert_preempted_matches(dirs[name], make_engine(dirs[name]), work, expected)


TP_WORK = [*prompts(), random_prompt(random.Random(3), 100)]
TP_PARAMS = SamplingParams(max_tokens=8, min_tokens=8, temperature=0.0)


@pytest.fixture(scope="module")
def one_process(dirs):
    """Per model: the tokens and logits of ``TP_WORK`` in one process, computed once."""
    done: dict[str, tuple[list[list[int]], list[torch.Tensor]]] = {}

    def get(name: str) -> tuple[list[list[int]], list[torch.Tensor]]:
        if name not in done:
            tp1 = make_engine(dirs[name], max_num_batched_tokens=64)
            ref = record_logits(tp1)
            done[name] = run_all(tp1, TP_WORK, TP_PARAMS), ref
        return done[name]

    return get


@pytest.mark.parametrize("name", INVARIANT)
@pytest.mark.parametrize("ep", [False, True], ids=["tensor-parallel", "expert-parallel"])
def test_tensor_and_expert_parallel_match_one_process(
    dirs, one_process, ep: bool, name: str
) -> None:
    """Each rank its half of the heads (q, kv_b rows; o columns) over the whole latent
    cache, and its columns of every expert (expert parallel: half the experts, whole; V3:
    every rank routes over all experts with the whole correction bias): tokens and logits
    of one process."""
    path = dirs[name]
    work, params = TP_WORK, TP_PARAMS
    want, ref = one_process(name)
    tp2 = make_engine(
        path, max_num_batched_tokens=64, tensor_parallel_size=2, enable_expert_parallel=ep
    )
    try:
        model = tp2.core.worker.model
        assert model.layers[0].attn.num_heads == 2
        assert model.layers[1].mlp.w13.shape[0] == (8 if ep else 16)
        got = record_logits(tp2)
        assert run_all(tp2, work, params) == want
        assert len(got) == len(ref) > 0
        for a, b in zip(got, ref, strict=True):
            assert ((a - b).abs().max() / b.abs().max()).item() < 1e-4
        assert_no_blocks_in_use(tp2)
    finally:
        tp2.shutdown()


@pytest.mark.parametrize("name", INVARIANT)
def test_speculative_decoding_matches(dirs, unchunked, name) -> None:
    """n-gram drafts verified as short chunks over the cached latents (expanded)."""
    work, expected = unchunked(name)
    spec = {"method": "ngram", "num_speculative_tokens": 3, "min_acceptance_rate": 0.0}
    engine = make_engine(dirs[name], max_num_batched_tokens=64, speculative_config=spec)
    assert run_staggered(engine, work, CHUNK_TOKENS) == expected
    assert_no_blocks_in_use(engine)


# ---- the config ----------------------------------------------------------------------------
def test_moe_layer_freq_and_first_dense_layers(dirs, tmp_path, no_weight_loading) -> None:
    """DeepSeek's rule: experts on layer i >= first_k_dense_replace with i % moe_layer_freq
    == 0 (transformers' DeepseekV2 has no moe_layer_freq: 1)."""
    from chunkserve.model.loader import hf_model_config

    path = variant(dirs["lite"], tmp_path / "m", num_hidden_layers=6, moe_layer_freq=2)
    assert hf_model_config(path).moe_layers == (2, 4)
    path = variant(dirs["lite"], tmp_path / "n", num_hidden_layers=4, first_k_dense_replace=2)
    assert hf_model_config(path).moe_layers == (2, 3)


def test_what_the_latent_cache_cannot_serve_is_refused(dirs, tmp_path, no_weight_loading):
    # The C kernel's head size limit (DeepSeek-V2's latent: 512 + 64 values).
    wide = variant(dirs["lite"], tmp_path / "wide", kv_lora_rank=512)
    with pytest.raises(ValueError, match="'cpu' is not usable.*latent attention.*520 values"):
        make_engine(wide, attention_backend="cpu")
    with pytest.raises(ValueError, match="disaggregation_mode.*latent"):
        make_engine(dirs["lite"], disaggregation_mode="prefill")
    spec = {"method": "draft_model", "model": str(dirs["lite"]), "num_speculative_tokens": 2}
    with pytest.raises(ValueError, match="speculative_config.model.*latent"):
        make_engine(dirs["lite"], speculative_config=spec)


@pytest.mark.parametrize(
    "name, changes, field",
    [
        ("lite", {"topk_method": "noaux_tc"}, "scoring_func 'softmax'.*noaux_tc"),
        ("lite", {"scoring_func": "sigmoid"}, "scoring_func 'sigmoid'.*greedy"),
        ("lite", {"topk_method": "aux_free"}, "topk_method"),
        ("lite", {"n_group": 3}, "n_group"),  # does not divide 8 experts
        ("lite", {"topk_group": 2}, "topk_group"),  # more groups than n_group (1)
        ("lite", {"moe_layer_freq": 0}, "moe_layer_freq"),
        ("v3", {"n_group": 16, "topk_group": 4}, "n_group"),  # groups of one: no best two
        ("v3", {"rope_interleave": False}, "rope_interleave"),
    ],
)
def test_unsupported_options_are_refused_naming_them(
    dirs, tmp_path, name, changes, field, no_weight_loading
) -> None:
    path = variant(dirs[name], tmp_path / "m", **changes)
    with pytest.raises(ValueError, match=field):
        make_engine(path)


def test_a_published_config_json_reads(dirs, tmp_path) -> None:
    """DeepSeek-V2-Lite's config.json as published (remote-code era): ``rope_scaling`` with
    ``type``, no ``head_dim`` (the rope part is ``qk_rope_head_dim``), ``moe_layer_freq``,
    ``scoring_func``, ``ep_size``."""
    from chunkserve.model.loader import hf_model_config

    rope = {k: v for k, v in LITE["rope_parameters"].items() if k not in ("rope_type",)}
    rope.pop("rope_theta")
    path = variant(
        dirs["lite"],
        tmp_path / "m",
        head_dim=None,
        qk_head_dim=None,
        rope_parameters=None,
        rope_theta=10000,
        rope_scaling={"type": "yarn", **rope},
        moe_layer_freq=1,
        scoring_func="softmax",
        ep_size=1,
        aux_loss_alpha=0.001,
    )
    config = hf_model_config(path)
    assert (config.head_dim, config.kv_lora_rank, config.qk_nope_head_dim) == (8, 32, 16)
    assert (config.q_lora_rank, config.v_head_dim, config.num_experts) == (None, 16, 8)
    assert config.rope_scaling["factor"] == 40.0 and config.rope_theta == 10000
    assert config.moe_layers == (1,) and config.topk_method == "greedy"
    assert config.shared_expert_intermediate_size == 2 * 32 and not config.shared_expert_gate


@pytest.fixture(scope="module")
def mtp_dir(dirs, tmp_path_factory) -> Path:
    """V3 with one multi-token-prediction layer as DeepSeek-V3's checkpoints carry them
    (``num_nextn_predict_layers``, ``model.layers.{num_hidden_layers}.*``: a decoder layer's
    tensors, here a copy of the last one's, and its own ``enorm``, ``hnorm``, ``eh_proj``,
    ``embed_tokens``, ``shared_head.norm`` / ``shared_head.head``)."""
    layers = hf_config("v3").num_hidden_layers

    def mtp_layer(tensors: dict) -> dict:
        mtp = f"model.layers.{layers}."
        out = {
            k.replace(f"model.layers.{layers - 1}.", mtp): v.clone()
            for k, v in tensors.items()
            if k.startswith(f"model.layers.{layers - 1}.")
        }
        h = tensors["model.norm.weight"]
        out.update({mtp + "enorm.weight": h.clone(), mtp + "hnorm.weight": h.clone()})
        out[mtp + "eh_proj.weight"] = torch.randn(h.shape[0], 2 * h.shape[0])
        out[mtp + "shared_head.norm.weight"] = h.clone()
        out[mtp + "embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()
        out[mtp + "shared_head.head.weight"] = tensors["lm_head.weight"].clone()
        return out

    path = variant(dirs["v3"], tmp_path_factory.mktemp("mtp") / "m", num_nextn_predict_layers=1)
    rewrite(path, mtp_layer)
    return path


def test_v3_multi_token_prediction_layers_are_skipped(dirs, mtp_dir, tmp_path) -> None:
    """The MTP layers (after the decoder's) are not run, skipped at load; with the key 0
    they are unexpected weights, named."""
    layers = hf_config("v3").num_hidden_layers
    params = SamplingParams(max_tokens=4, min_tokens=4, temperature=0.0)
    want = run_all(make_engine(dirs["v3"]), prompts(1), params)
    assert run_all(make_engine(mtp_dir), prompts(1), params) == want
    bad = variant(mtp_dir, tmp_path / "no-key", num_nextn_predict_layers=0)
    with pytest.raises(ValueError, match=f"unexpected weight 'model.layers.{layers}."):
        make_engine(bad)


# ---- GGUF (llama.cpp's deepseek2) ----------------------------------------------------------
def _kv_b_beside_its_split(tensors: dict) -> None:
    """attn_kv_b written beside attn_k_b and attn_v_b (converters that keep both)."""
    import numpy as np

    for name in [n for n in tensors if n.endswith("attn_k_b.weight")]:
        k_b, v_b = tensors[name], tensors[name.replace("k_b", "v_b")]
        kv = np.concatenate((k_b.transpose(0, 2, 1), v_b), axis=1)
        tensors[name.replace("k_b", "kv_b")] = kv.reshape(-1, kv.shape[-1])


@pytest.mark.parametrize(
    "name, split_kv_b",
    [("lite", False), ("lite", True), ("lite", "both"), ("v2-greedy", True), ("v2", True),
     ("v3", True)],
)  # fmt: skip
def test_gguf_matches_the_directory(dirs, tmp_path, name, split_kv_b) -> None:
    """Written as llama.cpp's converter writes DeepSeek-V2 (MLA as MQA over the latent:
    head_count_kv 1, key_length kv_lora_rank + rope dims; kv_b_proj whole, or split into
    attn_k_b / attn_v_b as newer converters write it; experts stacked, shared experts as
    ffn_*_shexp; mscale_all_dim in yarn_log_multiplier): the directory's logits and greedy
    tokens. V2's q bottleneck and routed scaling factor with greedy routing, and with its
    group_limited_greedy (the group keys newer converters write); V3's noaux_tc router
    (sigmoid gating, exp_probs_b its correction bias, the group keys, expert_weights_norm)."""
    from chunkserve.model.loader import gguf_model_config, hf_model_config, open_gguf
    from tests.test_gguf import _compare, write_gguf

    src = dirs["lite" if name == "lite" else name.removesuffix("-greedy")]
    if name == "v2-greedy":
        src = variant(dirs["v2"], tmp_path / "v2", topk_method="greedy", n_group=1, topk_group=1)
    both = _kv_b_beside_its_split if split_kv_b == "both" else None
    path = write_gguf(src, tmp_path / "m.gguf", split_kv_b=bool(split_kv_b), edit=both)
    reader = open_gguf(path)
    names = {t.name for t in reader.tensors}
    assert ("blk.0.attn_k_b.weight" in names) == bool(split_kv_b)
    assert ("blk.0.attn_kv_b.weight" in names) == (split_kv_b is not True)
    got, want = gguf_model_config(reader), hf_model_config(src)
    for field in (
        "architecture", "kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "v_head_dim",
        "head_dim", "num_experts", "num_experts_per_tok", "moe_intermediate_size",
        "shared_expert_intermediate_size", "moe_layers", "routed_scaling_factor",
        "num_kv_heads", "topk_method", "n_group", "topk_group", "norm_topk_prob",
    ):  # fmt: skip
        assert getattr(got, field) == getattr(want, field), field
    _compare(src, path, 1e-5)


def _drop_correction_biases(tensors: dict) -> None:
    for name in [n for n in tensors if n.endswith("exp_probs_b.bias")]:
        tensors.pop(name)


@pytest.mark.parametrize(
    "name, extra, edit, named",
    [
        ("lite", {"deepseek2.expert_gating_func": 3}, None, "deepseek2.expert_gating_func: 3"),
        ("lite", {"deepseek2.expert_group_used_count": 2}, None, "expert_group_used_count"),
        ("lite", None, lambda t: t.pop("blk.1.attn_v_b.weight"),
         "attn_k_b.weight without attn_v_b"),
        # V2's softmax router with V3's expert bias: llama.cpp would add it to the choice.
        ("lite", None,
         lambda t: t.update({"blk.1.exp_probs_b.bias": t["blk.1.ffn_norm.weight"][:8]}),
         "model.layers.1.mlp.gate.e_score_correction_bias"),
        ("v3", None, _drop_correction_biases, "missing.*e_score_correction_bias"),
    ],
)  # fmt: skip
def test_gguf_what_we_cannot_honour_is_refused_naming_it(dirs, tmp_path, name, extra, edit, named):
    """Gating other than softmax / sigmoid, a group count without groups, a half of a split
    kv_b, V3's expert bias beside V2's router, V3's router without its bias."""
    from tests.test_gguf import write_gguf

    path = write_gguf(dirs[name], tmp_path / "m.gguf", extra=extra, edit=edit, split_kv_b=True)
    with pytest.raises(ValueError, match=named):
        make_engine(path)


@pytest.fixture(scope="module")
def mtp_ggufs(dirs, mtp_dir, tmp_path_factory) -> tuple[Path, Path]:
    """The V3 with its MTP layer as a GGUF, and the same model without it (transformers'
    DeepseekV3Config defaults num_nextn_predict_layers to 1: "v3" has the key and no MTP
    layer, as a checkpoint stripped of it; here the key is 0)."""
    from tests.test_gguf import write_gguf

    root = tmp_path_factory.mktemp("mtp-gguf")
    with_mtp = write_gguf(mtp_dir, root / "mtp.gguf", split_kv_b=True)
    plain = variant(dirs["v3"], root / "plain", num_nextn_predict_layers=0)
    return with_mtp, write_gguf(plain, root / "plain.gguf", split_kv_b=True)


def test_gguf_multi_token_prediction_blocks_are_skipped(mtp_dir, mtp_ggufs) -> None:
    """A V3 / R1 GGUF with ``deepseek2.nextn_predict_layers`` (block_count counts the MTP
    block, the last: a decoder block's tensors plus ``blk.N.nextn.*``): the model runs
    block_count - 1 layers, as the directory with the MTP layer does, and gives the tokens
    of the same file without it."""
    from chunkserve.model.loader import (
        _field,
        gguf_model_config,
        hf_model_config,
        iter_gguf_weights,
        open_gguf,
    )

    layers = hf_config("v3").num_hidden_layers
    path, without = mtp_ggufs
    reader = open_gguf(path)
    assert _field(reader, "deepseek2.block_count") == layers + 1
    names = {t.name for t in reader.tensors}
    assert f"blk.{layers}.nextn.eh_proj.weight" in names
    assert f"blk.{layers}.attn_k_b.weight" in names
    config = gguf_model_config(reader)
    assert (config.num_layers, config.num_nextn_predict_layers) == (layers, 1)
    assert config.moe_layers == hf_model_config(mtp_dir).moe_layers
    # The loader yields nothing of the MTP block (so reads nothing of it).
    got = {name for name, _ in iter_gguf_weights(reader, config, torch.float32)}
    assert f"model.layers.{layers - 1}.self_attn.kv_b_proj.weight" in got
    assert not [n for n in got if n.startswith(f"model.layers.{layers}.")]
    engine = make_engine(path)
    assert len(engine.core.worker.model.layers) == layers
    assert _field(open_gguf(without), "deepseek2.block_count") == layers
    plain = make_engine(without)
    params = SamplingParams(max_tokens=6, min_tokens=6, temperature=0.0)
    assert run_all(engine, prompts(), params) == run_all(plain, prompts(), params)


class _Field:
    def __init__(self, value: int) -> None:
        self.value = value

    def contents(self) -> int:
        return self.value


def _edited(reader, nextn: int | None = None, nextn_on: int | None = None):
    """``reader`` with the key ``deepseek2.nextn_predict_layers`` set (``nextn``) or its
    MTP block's eh_proj moved to block ``nextn_on``: a file's metadata, as written."""
    import types

    fields = dict(reader.fields)
    if nextn is not None:
        fields["deepseek2.nextn_predict_layers"] = _Field(nextn)
    tensors = list(reader.tensors)
    if nextn_on is not None:
        tensors = [
            t._replace(name=f"blk.{nextn_on}.nextn.eh_proj.weight")
            if t.name.endswith("nextn.eh_proj.weight")
            else t
            for t in tensors
        ]
    return types.SimpleNamespace(fields=fields, tensors=tensors)


@pytest.mark.parametrize(
    "src, nextn, nextn_on, named",
    [
        # As many MTP blocks as blocks.
        ("plain", 2, None,
         r"deepseek2.nextn_predict_layers: 2, expected 0 to deepseek2.block_count - 1 \(1\)"),
        # The key without the MTP block counted (block_count the decoder's): the last
        # decoder block would be dropped.
        ("plain", 1, None,
         r"'blk.1.nextn.eh_proj.weight': missing: block 1 is a multi-token-prediction block"),
        # An MTP tensor on a decoder block.
        ("mtp", None, 1,
         r"'blk.1.nextn.eh_proj.weight': a multi-token-prediction tensor on block 1.*"
         r"nextn_predict_layers: 1"),
        # MTP tensors with the key 0: on a decoder block.
        ("mtp", 0, None,
         r"'blk.2.nextn.eh_proj.weight': a multi-token-prediction tensor on block 2, one of "
         r"the model's 3 decoder blocks \(key deepseek2.nextn_predict_layers: 0"),
    ],
)  # fmt: skip
def test_gguf_inconsistent_multi_token_prediction_is_refused(
    mtp_ggufs, src, nextn, nextn_on, named
) -> None:
    from chunkserve.model.loader import gguf_model_config, open_gguf

    reader = open_gguf(mtp_ggufs[0 if src == "mtp" else 1])
    gguf_model_config(reader)  # as written: consistent
    with pytest.raises(ValueError, match=named):
        gguf_model_config(_edited(reader, nextn, nextn_on))
