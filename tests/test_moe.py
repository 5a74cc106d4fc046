"""Mixture-of-experts models: the MoE layer against a naive per-token reference (the experts
each token picks included), and every MoE family against HF transformers as
``test_model_families`` checks the dense ones: tiny random models from transformers' own
config classes with a published checkpoint's MoE fields (experts and widths shrunk), fp32
logits within 1e-4 (relative) and greedy tokens identical; chunked (budgets 16 and 256) =
unchunked = prefix-cached = preempted; tensor parallel 2 = 1; options we do not serve are a
ValueError naming them.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from chunkserve.config import ModelConfig
from chunkserve.distributed.shard import plan_shards
from chunkserve.model.moe import MOE_NAMES, SparseMoE, grouped_experts, route
from chunkserve.scheduling.sampling_params import SamplingParams
from tests.conftest import assert_no_blocks_in_use, random_prompt
from tests.test_invariance import run_staggered
from tests.test_model_families import (
    BLOCK,
    CHUNK_TOKENS,
    CHUNK_WORK,
    SMALL,
    VOCAB,
    assert_matches_transformers,
    assert_preempted_matches,
    make_engine,
    prompts,
    reference,
    run_all,
    variant,
    write_model,
)
from tests.test_tensor_parallel import record_logits

# family -> (transformers config class, fields of the published checkpoint named, experts
# and their widths shrunk).
MOE_FAMILIES: dict[str, tuple[str, dict]] = {
    # mistralai/Mixtral-8x7B-Instruct-v0.1: 8 experts, top 2 (renormalised), experts as
    # wide as intermediate_size.
    "mixtral": (
        "MixtralConfig",
        dict(
            num_local_experts=8,
            num_experts_per_tok=2,
            rms_norm_eps=1e-5,
            tie_word_embeddings=False,
            max_position_embeddings=32768,
            sliding_window=None,
            rope_parameters=dict(rope_type="default", rope_theta=1000000.0),
        ),
    ),
    # Qwen/Qwen1.5-MoE-A2.7B: 60 experts top 4 of 1408 columns, not renormalised, a shared
    # expert of 5632 columns (here 8 experts of 32, a shared expert of 96), Q/K/V biases.
    "qwen2_moe": (
        "Qwen2MoeConfig",
        dict(
            num_experts=8,
            num_experts_per_tok=4,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=96,
            norm_topk_prob=False,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            rms_norm_eps=1e-6,
            tie_word_embeddings=False,
            max_position_embeddings=8192,
            use_sliding_window=False,
            rope_parameters=dict(rope_type="default", rope_theta=1000000.0),
        ),
    ),
    # Qwen/Qwen3-30B-A3B: 128 experts top 8 of 768 columns, renormalised, per-head q/k
    # norms, head_dim 128 (here 16 experts top 4 of 32 columns, head_dim 32).
    "qwen3_moe": (
        "Qwen3MoeConfig",
        dict(
            num_experts=16,
            num_experts_per_tok=4,
            moe_intermediate_size=32,
            norm_topk_prob=True,
            head_dim=32,
            rms_norm_eps=1e-6,
            tie_word_embeddings=False,
            max_position_embeddings=40960,
            use_sliding_window=False,
            rope_parameters=dict(rope_type="default", rope_theta=1000000.0),
        ),
    ),
    # allenai/OLMoE-1B-7B-0924: 64 experts top 8 of 1024 columns (here 16 top 4 of 32), not
    # renormalised, q/k norms over all heads' projections.
    "olmoe": (
        "OlmoeConfig",
        dict(
            num_experts=16,
            num_experts_per_tok=4,
            intermediate_size=32,
            norm_topk_prob=False,
            clip_qkv=None,
            rms_norm_eps=1e-5,
            tie_word_embeddings=False,
            max_position_embeddings=4096,
            pad_token_id=1,
            rope_parameters=dict(rope_type="default", rope_theta=10000.0),
        ),
    ),
}
# Variants, checked against transformers: Qwen2-MoE with a dense
# first layer (mlp_only_layers; its MLP intermediate_size wide) and with the experts on
# every second layer only (decoder_sparse_step 2: layer 1); OLMoE renormalised.
MOE_VARIANTS = {
    "qwen2_moe-mlp-only": ("qwen2_moe", dict(mlp_only_layers=[0])),
    "qwen2_moe-sparse-step": ("qwen2_moe", dict(decoder_sparse_step=2)),
    "olmoe-renormalised": ("olmoe", dict(norm_topk_prob=True)),
}


def moe_hf_config(family: str, **changes):
    import transformers

    cls_name, fields = MOE_FAMILIES[family]
    return getattr(transformers, cls_name)(**{**SMALL, **fields, **changes})


@pytest.fixture(scope="module")
def moe_dirs(tmp_path_factory, hf_dir: Path) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("moe")
    configs = {f: moe_hf_config(f) for f in MOE_FAMILIES}
    configs.update({name: moe_hf_config(f, **c) for name, (f, c) in MOE_VARIANTS.items()})
    dirs = {name: write_model(root / name, config, hf_dir) for name, config in configs.items()}
    # Routers drawn wider than HF's N(0, 0.02) so the top-k choices are not near-ties (a
    # near-tie decided differently by rounding would be a different model, not an error).
    for path in dirs.values():
        rewrite(path, lambda t: {k: v * 20 for k, v in t.items() if k.endswith("gate.weight")})
    return dirs


def rewrite(path: Path, edit) -> None:
    from safetensors.torch import load_file, save_file

    file = path / "model.safetensors"
    tensors = load_file(str(file))
    tensors.update(edit(tensors))
    save_file(tensors, str(file), metadata={"format": "pt"})


def family_of(name: str) -> str:
    return MOE_VARIANTS[name][0] if name in MOE_VARIANTS else name


# ---- the layer -----------------------------------------------------------------------------
def moe_config(**changes) -> ModelConfig:
    fields = dict(
        architecture="qwen2_moe", vocab_size=32, hidden_size=24, intermediate_size=40,
        num_layers=1, num_heads=4, num_kv_heads=4, head_dim=6, rope_theta=1e4,
        rms_norm_eps=1e-6, max_position_embeddings=64, tie_word_embeddings=False,
        num_experts=6, num_experts_per_tok=2, moe_intermediate_size=20,
    )  # fmt: skip
    return ModelConfig(**{**fields, **changes})


def checkpoint(config: ModelConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """A layer's HF-named tensors (Qwen2-MoE's names), random."""
    gen = torch.Generator().manual_seed(seed)
    h, i, e = config.hidden_size, config.expert_intermediate_size, config.num_experts
    out = {"mlp.gate.weight": torch.randn(e, h, generator=gen)}
    for n in range(e):
        out[f"mlp.experts.{n}.gate_proj.weight"] = 0.3 * torch.randn(i, h, generator=gen)
        out[f"mlp.experts.{n}.up_proj.weight"] = 0.3 * torch.randn(i, h, generator=gen)
        out[f"mlp.experts.{n}.down_proj.weight"] = 0.3 * torch.randn(h, i, generator=gen)
    s = config.shared_expert_intermediate_size
    if s:
        for name, shape in (("gate_proj", (s, h)), ("up_proj", (s, h)), ("down_proj", (h, s))):
            out[f"mlp.shared_expert.{name}.weight"] = 0.3 * torch.randn(*shape, generator=gen)
        out["mlp.shared_expert_gate.weight"] = torch.randn(1, h, generator=gen)
    return out


def build_layer(config: ModelConfig, weights, size: int = 1, rank: int = 0, ep: bool = False):
    shard = plan_shards(config, size, rank, expert_parallel=ep)
    layer = SparseMoE(config, shard, torch.float32, torch.device("cpu"), None)
    targets = layer.targets("", MOE_NAMES)
    assert set(targets) == set(weights)  # another rank's experts' too (checked, not kept)
    for name, target in targets.items():
        assert tuple(weights[name].shape) == target.shape
        target.take(weights[name])
    return layer


def naive(config: ModelConfig, w: dict[str, torch.Tensor], x: torch.Tensor):
    """Token by token, expert by expert: (output [T, H], each token's experts by weight)."""
    out, picks = [], []
    for row in x:
        probs = torch.softmax(w["mlp.gate.weight"] @ row, dim=-1).tolist()
        chosen = sorted(range(config.num_experts), key=lambda e: -probs[e])
        chosen = chosen[: config.num_experts_per_tok]
        total = sum(probs[e] for e in chosen) if config.norm_topk_prob else 1.0
        y = torch.zeros_like(row)
        for e in chosen:
            p = f"mlp.experts.{e}."
            h = F.silu(w[p + "gate_proj.weight"] @ row) * (w[p + "up_proj.weight"] @ row)
            y += probs[e] / total * (w[p + "down_proj.weight"] @ h)
        if config.shared_expert_intermediate_size:
            p = "mlp.shared_expert."
            h = F.silu(w[p + "gate_proj.weight"] @ row) * (w[p + "up_proj.weight"] @ row)
            gate = torch.sigmoid(w["mlp.shared_expert_gate.weight"] @ row)
            y += gate * (w[p + "down_proj.weight"] @ h)
        out.append(y)
        picks.append(chosen)
    return torch.stack(out), picks


@pytest.mark.parametrize(
    "changes",
    [
        {},  # Qwen2/3-MoE, OLMoE as published: not renormalised
        {"norm_topk_prob": True},  # Mixtral, Qwen3-MoE
        {"shared_expert_intermediate_size": 28},  # Qwen2-MoE
        {"num_experts_per_tok": 6},  # every expert
        {"num_experts_per_tok": 1},
    ],
)
def test_moe_layer_matches_a_naive_per_token_reference(changes) -> None:
    config = moe_config(**changes)
    w = checkpoint(config)
    layer = build_layer(config, w)
    x = torch.randn(37, config.hidden_size, generator=torch.Generator().manual_seed(1))
    want, picks = naive(config, w, x)
    _, ids = route(F.linear(x, layer.router), config.num_experts_per_tok, layer.renormalize)
    assert ids.tolist() == picks
    torch.testing.assert_close(layer(x), want, rtol=1e-5, atol=1e-5)
    # One token, and none (a decode step; an empty one).
    torch.testing.assert_close(layer(x[:1]), want[:1], rtol=1e-5, atol=1e-5)
    assert layer(x[:0]).shape == (0, config.hidden_size)


def test_grouped_experts_skips_experts_no_token_picks() -> None:
    """A decode batch touching two of six experts: only those run (the others' weights are
    NaN here, so touching one would show)."""
    config = moe_config()
    layer = build_layer(config, checkpoint(config))
    w13, w2 = layer.w13.clone(), layer.w2.clone()
    w13[[0, 2, 3, 5]] = float("nan")
    x = torch.randn(3, config.hidden_size)
    ids = torch.tensor([[1, 4], [4, 1], [4, 1]])
    weights = torch.tensor([[0.7, 0.3], [0.6, 0.4], [0.5, 0.5]])
    got = grouped_experts(x, w13, w2, weights, ids, F.silu)
    assert torch.isfinite(got).all()
    full = grouped_experts(x, layer.w13, layer.w2, weights, ids, F.silu)
    torch.testing.assert_close(got, full)


@pytest.mark.parametrize("ep", [False, True], ids=["tensor-parallel", "expert-parallel"])
@pytest.mark.parametrize("size", [2, 4])
def test_ranks_partial_sums_add_up_to_the_layer(ep: bool, size: int) -> None:
    """Each rank's share (its columns of every expert, or its whole experts; its columns of
    the shared expert) loaded from the same checkpoint: the ranks' outputs sum to the
    layer's (the all-reduce's sum)."""
    config = moe_config(shared_expert_intermediate_size=28, norm_topk_prob=True)
    w = checkpoint(config)
    x = torch.randn(29, config.hidden_size, generator=torch.Generator().manual_seed(2))
    want = build_layer(config, w)(x)
    parts = [build_layer(config, w, size, r, ep) for r in range(size)]
    if ep:  # whole experts: all columns, the six experts divided
        assert all(p.w13.shape[1] == 2 * 20 and p.w13.shape[0] >= 1 for p in parts)
        assert sum(p.w13.shape[0] for p in parts) == 6
    else:  # every expert: the columns divided
        assert all(p.w13.shape[0] == 6 for p in parts)
        assert sum(p.w2.shape[2] for p in parts) == 20
    torch.testing.assert_close(sum(p(x) for p in parts), want, rtol=1e-5, atol=1e-5)


def test_more_expert_parallel_ranks_than_experts_are_refused() -> None:
    config = moe_config(num_experts=3)
    with pytest.raises(ValueError, match="enable_expert_parallel: 4 ranks.*3 experts"):
        build_layer(config, checkpoint(config), size=4, rank=0, ep=True)


# ---- families against transformers ---------------------------------------------------------
@pytest.mark.parametrize("name", [*MOE_FAMILIES, *MOE_VARIANTS])
def test_logits_and_greedy_tokens_match_transformers(moe_dirs, name: str) -> None:
    path = moe_dirs[name]
    engine = make_engine(path)
    assert engine.core.worker.model_config.architecture == family_of(name)
    assert_matches_transformers(engine, reference(path), name)


def test_the_layers_the_config_makes_sparse_have_experts(moe_dirs) -> None:
    from chunkserve.model.moe import SparseMoE

    layers = {}
    for name in ("qwen2_moe", "qwen2_moe-mlp-only", "qwen2_moe-sparse-step"):
        model = make_engine(moe_dirs[name]).core.worker.model
        layers[name] = [isinstance(layer.mlp, SparseMoE) for layer in model.layers]
    assert layers == {
        "qwen2_moe": [True, True],
        "qwen2_moe-mlp-only": [False, True],
        "qwen2_moe-sparse-step": [False, True],
    }


@pytest.fixture(scope="module")
def unchunked(moe_dirs) -> dict[str, tuple[list[list[int]], list[list[int]]]]:
    """Each family's work and its tokens, whole prompts a step (computed once)."""
    out = {}
    for family in MOE_FAMILIES:
        rng = random.Random(21)
        work = [random_prompt(rng, n) for n in CHUNK_WORK]
        base = make_engine(
            moe_dirs[family], enable_chunked_prefill=False, max_num_batched_tokens=2048
        )
        out[family] = (work, run_staggered(base, work, CHUNK_TOKENS))
        assert base.core.scheduler.num_preemptions == 0
    return out


@pytest.mark.parametrize("budget", [16, 256])
@pytest.mark.parametrize("family", list(MOE_FAMILIES))
def test_chunked_and_prefix_cached_match_unchunked(moe_dirs, unchunked, family, budget) -> None:
    work, expected = unchunked[family]
    chunked = make_engine(moe_dirs[family], max_num_batched_tokens=budget)
    steps = []
    chunked.step_listeners.append(steps.append)
    assert run_staggered(chunked, work, CHUNK_TOKENS) == expected
    assert any(s.kind == "mixed" for s in steps)
    hits = chunked.core.kv.num_hit_tokens
    assert run_staggered(chunked, work, CHUNK_TOKENS) == expected
    assert chunked.core.kv.num_hit_tokens - hits >= sum(len(p) // BLOCK - 1 for p in work) * BLOCK
    assert_no_blocks_in_use(chunked)


@pytest.mark.parametrize("family", list(MOE_FAMILIES))
def test_preempted_matches_unchunked(moe_dirs, unchunked, family) -> None:
    work, expected = unchunked[family]
    path = moe_dirs[family]
    assert_preempted_matches(path, make_engine(path), work, expected)


# Tensor parallel: each rank holds its columns of every expert (and of Qwen2-MoE's shared
# expert); expert parallel: its half of the experts, whole. The router is replicated; one
# all-reduce sums the ranks' parts. EP 2 = TP 2 = TP 1, tokens and logits.
@pytest.mark.parametrize("family", list(MOE_FAMILIES))
def test_tensor_and_expert_parallel_match_one_process(moe_dirs, family: str) -> None:
    path = moe_dirs[family]
    experts = MOE_FAMILIES[family][1].get("num_local_experts") or MOE_FAMILIES[family][1].get(
        "num_experts"
    )
    tp1 = make_engine(path, max_num_batched_tokens=64)
    work = [*prompts(), random_prompt(random.Random(3), 100)]
    params = SamplingParams(max_tokens=8, min_tokens=8, temperature=0.0)
    ref = record_logits(tp1)
    want = run_all(tp1, work, params)
    assert len(ref) > 0
    for ep in (False, True):
        tp2 = make_engine(
            path, max_num_batched_tokens=64, tensor_parallel_size=2, enable_expert_parallel=ep
        )
        try:
            assert tp2.core.worker.shard.size == 2
            mlp = tp2.core.worker.model.layers[0].mlp
            assert mlp.w13.shape[0] == (experts // 2 if ep else experts)
            got = record_logits(tp2)
            assert run_all(tp2, work, params) == want
            assert len(got) == len(ref)
            for a, b in zip(got, ref, strict=True):
                assert a.shape == b.shape and a.shape[1] == VOCAB
                assert ((a - b).abs().max() / b.abs().max()).item() < 1e-4
            assert_no_blocks_in_use(tp2)
        finally:
            tp2.shutdown()


# ---- GGUF ----------------------------------------------------------------------------------
@pytest.mark.parametrize("family", list(MOE_FAMILIES))
def test_gguf_matches_the_directory(moe_dirs, tmp_path, family: str) -> None:
    """Written as llama.cpp's converters write them (experts stacked as ffn_*_exps, the
    router ffn_gate_inp, Qwen2-MoE's shared expert ffn_*_shexp; Mixtral as "llama"): the
    directory's logits and greedy tokens."""
    from chunkserve.model.loader import gguf_model_config, open_gguf
    from tests.test_gguf import _compare, write_gguf

    path = write_gguf(moe_dirs[family], tmp_path / f"{family}.gguf")
    config = gguf_model_config(open_gguf(path))
    assert config.architecture == family
    assert config.num_experts == MOE_FAMILIES[family][1].get(
        "num_local_experts", MOE_FAMILIES[family][1].get("num_experts")
    )
    _compare(moe_dirs[family], path, 1e-5)


def test_gguf_expert_options_we_do_not_honour_are_refused(moe_dirs, tmp_path) -> None:
    """A scale llama.cpp applies to the routing weights (DeepSeek's): refused by its key."""
    from chunkserve.model.loader import gguf_model_config, open_gguf
    from tests.test_gguf import write_gguf

    path = write_gguf(
        moe_dirs["qwen3_moe"], tmp_path / "m.gguf", extra={"qwen3moe.expert_weights_scale": 2.5}
    )
    with pytest.raises(ValueError, match="qwen3moe.expert_weights_scale"):
        gguf_model_config(open_gguf(path))


# ---- what we do not serve ------------------------------------------------------------------
@pytest.mark.parametrize(
    "family, changes, field",
    [
        ("olmoe", {"clip_qkv": 8.0}, "clip_qkv"),
        ("qwen2_moe", {"decoder_sparse_step": 0}, "decoder_sparse_step"),
        ("qwen3_moe", {"num_experts_per_tok": 17}, "num_experts_per_tok"),
        ("mixtral", {"num_experts_per_tok": None}, "num_experts_per_tok"),
    ],
)
def test_unsupported_moe_options_are_refused_naming_them(
    moe_dirs, tmp_path, family, changes, field, no_weight_loading
) -> None:
    path = variant(moe_dirs[family], tmp_path / "m", **changes)
    with pytest.raises(ValueError, match=field):
        make_engine(path)


# A minimal config.json of each kind of MoE config (Mixtral's names, DeepSeek's with latent
# attention): every numeric field below, null or of the wrong type, is a ValueError naming it.
_MIXTRAL_JSON = dict(
    architectures=["MixtralForCausalLM"],
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_local_experts=4,
    num_experts_per_tok=2,
)
_DEEPSEEK_JSON = dict(
    _MIXTRAL_JSON,
    architectures=["DeepseekV2ForCausalLM"],
    num_local_experts=None,
    n_routed_experts=4,
    moe_intermediate_size=16,
    n_shared_experts=1,
    first_k_dense_replace=1,
    n_group=1,
    topk_group=1,
    routed_scaling_factor=1.0,
    kv_lora_rank=16,
    qk_nope_head_dim=8,
    qk_rope_head_dim=8,
    v_head_dim=8,
)
_NUMERIC_FIELDS = [
    (_MIXTRAL_JSON, f)
    for f in ("num_experts_per_tok", "num_local_experts", "vocab_size", "num_hidden_layers")
] + [
    (_DEEPSEEK_JSON, f)
    for f in (
        "num_experts_per_tok",
        "n_routed_experts",
        "moe_intermediate_size",
        "n_group",
        "topk_group",
        "routed_scaling_factor",
        "qk_nope_head_dim",
        "qk_rope_head_dim",
        "v_head_dim",
    )
]


@pytest.mark.parametrize("value", [None, "2", 1.5])
@pytest.mark.parametrize(
    "base, field", _NUMERIC_FIELDS, ids=[f"{b['architectures'][0]}-{f}" for b, f in _NUMERIC_FIELDS]
)
def test_null_or_non_integer_config_fields_are_refused_naming_them(
    tmp_path, base, field, value
) -> None:
    import json

    from chunkserve.model.loader import hf_model_config

    (tmp_path / "config.json").write_text(json.dumps(base))
    hf_model_config(tmp_path)  # the base reads
    if field == "routed_scaling_factor" and value == 1.5:
        return  # a number: fine
    if field in ("num_local_experts", "n_routed_experts", "n_group", "topk_group") and (
        value is None
    ):
        return  # null: no experts (transformers' DeepseekV2: every MLP dense), one group
    (tmp_path / "config.json").write_text(json.dumps({**base, field: value}))
    with pytest.raises(ValueError, match=field):
        hf_model_config(tmp_path)


def test_expert_parallel_without_experts_is_refused(hf_dir, tmp_path, no_weight_loading) -> None:
    from tests.test_model_families import hf_config

    dense = write_model(tmp_path / "llama", hf_config("llama"), hf_dir)
    with pytest.raises(ValueError, match="enable_expert_parallel.*no experts"):
        make_engine(dense, tensor_parallel_size=2, enable_expert_parallel=True)
