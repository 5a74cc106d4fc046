"""Every family the registry serves, against HF transformers' eager implementation.

Each family is a tiny random model built by transformers from its own config class with the
config fields of a published checkpoint of that family, shrunk only in width and depth (tied
heads where the checkpoint ties them), saved as an HF directory (safetensors, the embedded
model's tokenizer). fp32 logits at every position within 1e-4 (relative) of transformers',
greedy tokens identical; chunked at budget 16 = unchunked = prefix-cached = preempted;
tensor parallel 2 = 1 for two families; the errors a bad checkpoint gets before serving.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
import torch

from chunkserve.config import ModelConfig
from chunkserve.engine.engine import Engine
from chunkserve.model.registry import supported_families
from chunkserve.scheduling.sampling_params import SamplingParams
from tests.conftest import assert_no_blocks_in_use, random_prompt
from tests.test_invariance import run_staggered
from tests.test_model_parity import all_row_logits
from tests.test_tensor_parallel import record_logits

VOCAB = 49152  # the embedded model's tokenizer's
# Shrunk: hidden 64, 4 query heads, 2 KV heads of 16 dims (Qwen3: 32, its head_dim is not
# hidden / heads), MLP 128, 2 layers (SmolLM3: 4, so one has no rope).
SMALL = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=None,
)

# microsoft/Phi-3.5-mini-instruct's longrope factors (48 rotary pairs; 2 decimals).
PHI35_SHORT = [
    1.0, 1.02, 1.03, 1.03, *[1.05] * 5, 1.07, 1.1, 1.11, 1.16, 1.16, 1.17, 1.29, 1.34, 1.68,
    1.79, 1.82, 1.85, 1.88, 1.91, 1.94, 1.99, *[2.02] * 6, *[2.03] * 9, 2.08, 2.09, 2.19, 2.22,
    2.59, 2.73, 2.75, 2.84,
]  # fmt: skip
PHI35_LONG = [
    1.08, 1.11, 1.14, 1.34, 1.59, 1.6, 1.62, 2.62, 3.23, 3.23, 4.79, 7.4, 7.7, 9.09, 12.2,
    17.67, 24.46, 28.57, 30.42, 30.84, 32.59, 32.93, 42.32, 44.96, 50.34, 50.45, 57.55, 57.93,
    58.21, 60.14, 62.61, 62.62, 62.71, 63.14, 63.14, 63.77, 63.93, 63.96, 63.97, 64.03, 64.07,
    64.08, 64.12, 64.41, 64.48, 64.51, 64.53, 64.84,
]  # fmt: skip
# Phi-4-mini-instruct's factors: 1 growing ~1.118x a pair to 32, then slowly to 48.
PHI4_FACTORS = [1.118**i for i in range(31)] + [32.0 + 0.3 * i for i in range(15)] + [44.2, 47.8]
assert len(PHI35_SHORT) == len(PHI35_LONG) == len(PHI4_FACTORS) == 48

# family -> (transformers config class, fields of the published checkpoint named).
FAMILIES: dict[str, tuple[str, dict]] = {
    # meta-llama/Llama-3.2-1B-Instruct
    "llama": (
        "LlamaConfig",
        dict(
            rms_norm_eps=1e-5,
            tie_word_embeddings=True,
            max_position_embeddings=131072,
            rope_parameters=dict(
                rope_type="llama3",
                rope_theta=500000.0,
                factor=32.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=8192,
            ),
        ),
    ),
    # mistralai/Mistral-7B-Instruct-v0.3 (no window)
    "mistral": (
        "MistralConfig",
        dict(
            rms_norm_eps=1e-5,
            tie_word_embeddings=False,
            max_position_embeddings=32768,
            sliding_window=None,
            rope_parameters=dict(rope_type="default", rope_theta=1000000.0),
        ),
    ),
    # Qwen/Qwen2.5-0.5B-Instruct: its inert sliding_window (use_sliding_window false), here
    # shorter than the prompts so that honouring it would change the logits.
    "qwen2": (
        "Qwen2Config",
        dict(
            rms_norm_eps=1e-6,
            tie_word_embeddings=True,
            max_position_embeddings=32768,
            use_sliding_window=False,
            sliding_window=24,
            max_window_layers=1,
            rope_parameters=dict(rope_type="default", rope_theta=1000000.0),
        ),
    ),
    # Qwen/Qwen3-0.6B: head_dim 128 with hidden 1024 / 16 heads (here 32 with 64 / 4).
    "qwen3": (
        "Qwen3Config",
        dict(
            head_dim=32,
            rms_norm_eps=1e-6,
            tie_word_embeddings=True,
            max_position_embeddings=40960,
            use_sliding_window=False,
            rope_parameters=dict(rope_type="default", rope_theta=1000000.0),
        ),
    ),
    # ibm-granite/granite-3.0-2b-instruct
    "granite": (
        "GraniteConfig",
        dict(
            rms_norm_eps=1e-5,
            tie_word_embeddings=True,
            max_position_embeddings=4096,
            embedding_multiplier=12.0,
            attention_multiplier=0.015625,
            residual_multiplier=0.22,
            logits_scaling=8.0,
            rope_parameters=dict(rope_type="default", rope_theta=10000.0),
        ),
    ),
    # allenai/OLMo-2-1124-7B-Instruct (as many KV heads as query heads)
    "olmo2": (
        "Olmo2Config",
        dict(
            num_key_value_heads=4,
            rms_norm_eps=1e-6,
            tie_word_embeddings=False,
            max_position_embeddings=4096,
            rope_parameters=dict(rope_type="default", rope_theta=500000.0),
        ),
    ),
    # HuggingFaceTB/SmolLM3-3B: no rope on every 4th layer
    "smollm3": (
        "SmolLM3Config",
        dict(
            num_hidden_layers=4,
            rms_norm_eps=1e-6,
            tie_word_embeddings=True,
            max_position_embeddings=65536,
            no_rope_layer_interval=4,
            use_sliding_window=False,
            rope_parameters=dict(rope_type="default", rope_theta=5000000.0),
        ),
    ),
    # microsoft/Phi-3.5-mini-instruct: fused qkv_proj / gate_up_proj, longrope (its short and
    # long factors, every 6th of 48 for 8 rotary pairs), as many KV heads as query heads;
    # original_max_position_embeddings 4096 of 131072 shrunk to 512 of 16384 (the same 32x,
    # so the same attention factor): above MAX_LEN, the short factors (the long ones:
    # "phi3-long" below).
    "phi3": (
        "Phi3Config",
        dict(
            num_key_value_heads=4,
            rms_norm_eps=1e-5,
            tie_word_embeddings=False,
            max_position_embeddings=16384,
            original_max_position_embeddings=512,
            sliding_window=262144,
            rope_parameters=dict(
                rope_type="longrope",
                rope_theta=10000.0,
                short_factor=PHI35_SHORT[::6],
                long_factor=PHI35_LONG[::6],
            ),
        ),
    ),
    # microsoft/Phi-4-mini-instruct: 0.75 of each head rotates (12 of 16 dims here), tied
    # embeddings, 3 query heads per KV head (here 2); longrope over 6 rotary pairs (long
    # factors twice the short ones here, so which set is used shows).
    "phi4": (
        "Phi3Config",
        dict(
            rms_norm_eps=1e-5,
            tie_word_embeddings=True,
            max_position_embeddings=16384,
            original_max_position_embeddings=512,
            partial_rotary_factor=0.75,
            sliding_window=262144,
            rope_parameters=dict(
                rope_type="longrope",
                rope_theta=10000.0,
                partial_rotary_factor=0.75,
                short_factor=PHI4_FACTORS[::8],
                long_factor=[2 * f for f in PHI4_FACTORS[::8]],
            ),
        ),
    ),
    # google/gemma-2-27b-it: softmax scale 144 ** -0.5 with head_dim 128 (not 128 ** -0.5),
    # scores capped at 50 and logits at 30, the window (4096, here 20: shorter than the
    # prompts) on every other layer. Weights drawn 5x HF's scale so that scores and logits
    # reach the caps.
    "gemma2": (
        "Gemma2Config",
        dict(
            head_dim=128,
            query_pre_attn_scalar=144,
            attn_logit_softcapping=50.0,
            final_logit_softcapping=30.0,
            sliding_window=20,
            rms_norm_eps=1e-6,
            hidden_activation="gelu_pytorch_tanh",
            tie_word_embeddings=True,
            max_position_embeddings=8192,
            rope_parameters=dict(rope_type="default", rope_theta=10000.0),
            initializer_range=0.1,
        ),
    ),
    # google/gemma-3-270m: 5 window layers (512, here 24) to 1 global, head_dim 256 with one
    # KV head, per-head q/k norms, rope base 1e6 on the global layers and 10000 on the others.
    "gemma3_text": (
        "Gemma3TextConfig",
        dict(
            num_hidden_layers=6,
            num_key_value_heads=1,
            head_dim=256,
            query_pre_attn_scalar=256,
            sliding_window=24,
            sliding_window_pattern=6,
            rms_norm_eps=1e-6,
            hidden_activation="gelu_pytorch_tanh",
            tie_word_embeddings=True,
            max_position_embeddings=32768,
            rope_theta=1000000.0,
            rope_local_base_freq=10000.0,
            initializer_range=0.05,
        ),
    ),
}
# Test entries that are not a family's name: their family.
FAMILY_OF = {"phi4": "phi3"}

SHIPPED_JSON = {"qwen2": {"sliding_window": 24}}
MAX_LEN = 480
BLOCK = 16


def hf_config(family: str, **changes):
    import transformers

    cls_name, fields = FAMILIES[family]
    kwargs = {**SMALL, **fields, **changes}
    return getattr(transformers, cls_name)(**kwargs)


def write_model(out: Path, config, tokenizer_dir: Path, seed: int = 0) -> Path:
    """A random transformers model of ``config`` saved as an HF directory with the embedded
    model's tokenizer."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # HF initialises norms to 1 (0 for OLMo's?): random ones test the norm weights too.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))
    model.save_pretrained(str(out), safe_serialization=True)
    # What the published config.json has that transformers does not write back: Qwen2.5's
    # inert window (transformers writes null when use_sliding_window is false).
    shipped = SHIPPED_JSON.get(config.model_type)
    if shipped:
        cfg = json.loads((out / "config.json").read_text())
        (out / "config.json").write_text(json.dumps({**cfg, **shipped}, indent=2))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / name, out / name)
    return out


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory, hf_dir: Path) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("families")
    return {f: write_model(root / f, hf_config(f), hf_dir) for f in FAMILIES}


def reference(path: Path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(path), dtype=torch.float32, attn_implementation="eager"
    )
    return model.eval()


def make_engine(path: Path, **kwargs) -> Engine:
    base = dict(
        model=str(path),
        dtype="float32",
        max_model_len=MAX_LEN,
        kv_cache_memory=8 << 20,
        block_size=BLOCK,
        num_threads=1,  # tiny matmuls: threads only wait for each other
    )
    base.update(kwargs)
    return Engine(**base)


def prompts(n: int = 3) -> list[list[int]]:
    rng = random.Random(11)
    return [random_prompt(rng, length) for length in (5, 37, 130)[:n]]


def run_all(engine: Engine, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
    ids = [engine.add_request(p, params) for p in prompts]
    done: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.token_ids
    return [done[i] for i in ids]


def test_every_family_is_tested() -> None:
    from tests.test_deepseek import DEEPSEEK, FAMILY  # latent attention: tested there
    from tests.test_moe import MOE_FAMILIES  # mixtures of experts: tested there

    # DeepSeek-V2 and V3: tests/test_deepseek.py; GPT-OSS: tests/test_gpt_oss.py
    tested = {FAMILY_OF.get(name, name) for name in FAMILIES} | set(MOE_FAMILIES)
    assert set(supported_families()) == tested | {DEEPSEEK, *FAMILY.values(), "gpt_oss"}


# Variants of the families' models (config.json edited). Sliding windows (shorter than the
# prompts, crossing block boundaries): Mistral's on every layer; Qwen2 turned on, from
# max_window_layers (1) on (a config that lists the layers' types decides by them: the list
# is removed so transformers derives it as Qwen2 did); Phi-3's (Phi-3-mini-4k ships 2047),
# which transformers' Phi3 applies on every layer. Phi-3.5 with longrope's original length
# below every prompt (4): transformers rotates all of them with the long factors, as we do
# when max_model_len exceeds it (the top-level field wins over the rope dict's copy).
WINDOWED = {
    "mistral-window": ("mistral", dict(sliding_window=20)),
    "qwen2-window": ("qwen2", dict(use_sliding_window=True, sliding_window=24, layer_types=None)),
    "phi3-window": ("phi3", dict(sliding_window=20)),
    "phi3-long": ("phi3", dict(original_max_position_embeddings=4)),
}


@pytest.fixture(scope="module")
def windowed_dirs(model_dirs, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("windowed")
    return {
        name: variant(model_dirs[family], root / name, **changes)
        for name, (family, changes) in WINDOWED.items()
    }


# Variants checked against transformers only: Gemma 3's global layers with gemma-3-4b's
# linear rope scaling (factor 8; the local rope stays unscaled).
PARITY_ONLY = {
    "gemma3-linear": (
        "gemma3_text",
        dict(
            rope_parameters={
                "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
            }
        ),
    ),
}


@pytest.fixture(scope="module")
def parity_only_dirs(model_dirs, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("parity_only")
    return {
        name: variant(model_dirs[family], root / name, **changes)
        for name, (family, changes) in PARITY_ONLY.items()
    }


def model_path(model_dirs, windowed_dirs, name: str) -> tuple[Path, str]:
    if name in WINDOWED:
        return windowed_dirs[name], WINDOWED[name][0]
    return model_dirs[name], FAMILY_OF.get(name, name)


@pytest.mark.parametrize("name", [*FAMILIES, *WINDOWED, *PARITY_ONLY])
def test_logits_and_greedy_tokens_match_transformers(
    model_dirs, windowed_dirs, request, name
) -> None:
    if name in PARITY_ONLY:
        path, family = request.getfixturevalue("parity_only_dirs")[name], PARITY_ONLY[name][0]
    else:
        path, family = model_path(model_dirs, windowed_dirs, name)
    engine = make_engine(path)
    assert engine.core.worker.model_config.architecture == family
    worst = assert_matches_transformers(engine, reference(path), family)
    print(f"{family}: worst relative logit error {worst:.2e}")


def assert_matches_transformers(engine: Engine, ref, name: str) -> float:
    """The engine's fp32 logits of every prompt row (whole, and in chunks of 7 over the
    cached earlier ones) within 1e-4 (relative) of transformers' ``ref``; its greedy tokens
    transformers'. Returns the worst relative error."""
    worst = 0.0
    for ids in prompts():
        with torch.no_grad():
            want = ref(torch.tensor([ids])).logits[0].float()
        for chunk in (10_000, 7):
            got = all_row_logits(engine, ids, chunk)
            assert got.shape == want.shape
            # Relative error of each position's logits.
            rel = ((got - want).norm(dim=-1) / want.norm(dim=-1)).max().item()
            worst = max(worst, rel)
    assert worst < 1e-4, f"{name}: worst relative error {worst:.2e}"
    params = SamplingParams(max_tokens=8, min_tokens=8, temperature=0.0)
    for ids in prompts():
        with torch.no_grad():
            out = ref.generate(
                torch.tensor([ids]), max_new_tokens=8, do_sample=False, eos_token_id=None
            )
        expected = out[0, len(ids) :].tolist()
        assert run_all(engine, [ids], params) == [expected]
    assert_no_blocks_in_use(engine)
    return worst


# Prompts and output lengths for the chunked / prefix-cached / preempted runs: small, so a
# run is a few dozen steps.
CHUNK_WORK = (40, 70, 100, 25)
CHUNK_TOKENS = 24


@pytest.mark.parametrize("name", [*FAMILIES, *WINDOWED])
def test_chunked_prefix_cached_and_preempted_match_unchunked(
    model_dirs, windowed_dirs, name: str
) -> None:
    path, _ = model_path(model_dirs, windowed_dirs, name)
    rng = random.Random(21)
    work = [random_prompt(rng, n) for n in CHUNK_WORK]
    base = make_engine(path, enable_chunked_prefill=False, max_num_batched_tokens=2048)
    expected = run_staggered(base, work, CHUNK_TOKENS)
    assert base.core.scheduler.num_preemptions == 0
    # Chunked at a budget of 16 tokens a step, prompts beside decodes.
    chunked = make_engine(path, max_num_batched_tokens=16)
    steps = []
    chunked.step_listeners.append(steps.append)
    assert run_staggered(chunked, work, CHUNK_TOKENS) == expected
    assert any(s.kind == "mixed" for s in steps)
    # Again: every prompt's full blocks but the last come from the prefix cache.
    hits = chunked.core.kv.num_hit_tokens
    assert run_staggered(chunked, work, CHUNK_TOKENS) == expected
    assert chunked.core.kv.num_hit_tokens - hits >= sum(len(p) // BLOCK - 1 for p in work) * BLOCK
    assert_no_blocks_in_use(chunked)
    assert_preempted_matches(path, chunked, work, expected)


def assert_preempted_matches(
    path: Path, like: Engine, work: list[list[int]], expected: list[list[int]], **engine_args
) -> None:
    """10 blocks per KV group (the bytes of ``like``'s blocks) and a context that long, for
    requests that grow past them: preempted and recomputed, the tokens of ``expected``
    (``engine_args``: more arguments of the engine, e.g. ``deterministic``)."""
    per_block = like.core.worker._bytes_per_block
    groups = like.core.kv.num_groups
    tight = make_engine(
        path,
        schedule_conservativeness=0.0,
        max_num_batched_tokens=64,
        kv_cache_memory=(10 * groups + 1) * per_block,
        max_model_len=10 * BLOCK,
        **engine_args,
    )
    assert tight.core.worker.num_blocks == 10 * groups
    assert run_staggered(tight, work, CHUNK_TOKENS) == expected
    assert tight.core.scheduler.num_preemptions > 0
    assert_no_blocks_in_use(tight)


# Every family, e.g. Qwen2: sharded Q/K/V biases; Qwen3 / Gemma 3: per-head q/k norms (Gemma
# 3's one KV head on both ranks); OLMo 2: a q/k norm over all heads, summed over the ranks;
# Phi-3 / 4: each rank's q heads, KV heads, gate and up columns from the fused tensors;
# Gemma 2: sandwich norms, capped scores and logits over a vocabulary split in two.
@pytest.mark.parametrize("family", list(FAMILIES))
def test_tensor_parallel_matches_one_process(model_dirs, family: str) -> None:
    path = model_dirs[family]
    tp1 = make_engine(path, max_num_batched_tokens=64)
    tp2 = make_engine(path, max_num_batched_tokens=64, tensor_parallel_size=2)
    try:
        assert tp2.core.worker.shard.size == 2
        work = [*prompts(), random_prompt(random.Random(3), 100)]
        params = SamplingParams(max_tokens=8, min_tokens=8, temperature=0.0)
        ref, got = record_logits(tp1), record_logits(tp2)
        assert run_all(tp2, work, params) == run_all(tp1, work, params)
        assert len(ref) == len(got) > 0
        for a, b in zip(got, ref, strict=True):
            assert a.shape == b.shape and a.shape[1] == VOCAB
            assert ((a - b).abs().max() / b.abs().max()).item() < 1e-4
        assert_no_blocks_in_use(tp2)
    finally:
        tp2.shutdown()


# ---- errors before serving -----------------------------------------------------------------
def variant(src: Path, dst: Path, **config_changes) -> Path:
    """A copy of the model directory ``src`` with fields of its config.json changed (None
    removes one)."""
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    for key, value in config_changes.items():
        if value is None:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def test_unknown_architecture_names_itself_and_the_supported(model_dirs, tmp_path) -> None:
    path = variant(
        model_dirs["llama"], tmp_path / "m", architectures=["FooForCausalLM"], model_type="foo"
    )
    with pytest.raises(ValueError, match="FooForCausalLM") as err:
        make_engine(path)
    for name in ("LlamaForCausalLM", "Qwen3ForCausalLM", "Olmo2ForCausalLM"):
        assert name in str(err.value)


@pytest.mark.parametrize(
    "changes, field",
    [
        ({"rope_parameters": {"rope_type": "proportional", "rope_theta": 1e4}}, "proportional"),
        ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4}}, "short_factor"),
        (
            {
                "rope_parameters": {
                    "rope_type": "su",
                    "rope_theta": 1e4,
                    "short_factor": [1.0] * 16,
                    "long_factor": [1.0] * 15,
                    "original_max_position_embeddings": 8,
                }
            },
            "'long_factor' must be 16",
        ),
        ({"rope_parameters": {"rope_type": "linear", "rope_theta": 1e4}}, "factor"),
        ({"hidden_act": "relu2"}, "relu2"),
    ],
)
def test_unimplemented_numerics_are_refused(
    model_dirs, tmp_path, changes, field, no_weight_loading
) -> None:
    path = variant(model_dirs["qwen3"], tmp_path / "m", **changes)
    with pytest.raises(ValueError, match=field):
        make_engine(path)


def rewrite_weights(path: Path, edit) -> None:
    from safetensors.torch import load_file, save_file

    file = path / "model.safetensors"
    tensors = load_file(str(file))
    edit(tensors)
    save_file(tensors, str(file), metadata={"format": "pt"})


def test_missing_and_misshapen_tensors_are_named(model_dirs, tmp_path) -> None:
    name = "model.layers.1.self_attn.q_norm.weight"
    missing = variant(model_dirs["qwen3"], tmp_path / "missing")
    rewrite_weights(missing, lambda t: t.pop(name))
    with pytest.raises(ValueError, match=r"missing.*q_norm"):
        make_engine(missing)
    bad = variant(model_dirs["qwen3"], tmp_path / "bad")
    rewrite_weights(bad, lambda t: t.__setitem__(name, torch.ones(16)))
    with pytest.raises(ValueError, match=rf"{name}.*shape \(16,\), expected \(32,\)"):
        make_engine(bad)


def test_window_layers_follow_the_config(windowed_dirs) -> None:
    from chunkserve.model.loader import hf_model_config

    mistral = hf_model_config(windowed_dirs["mistral-window"])
    assert [mistral.layer_window(i) for i in range(2)] == [20, 20]
    qwen2 = hf_model_config(windowed_dirs["qwen2-window"])
    assert [qwen2.layer_window(i) for i in range(2)] == [None, 24]


def test_longrope_factors_are_chosen_by_max_model_len(model_dirs, caplog) -> None:
    """Short factors up to the original length (transformers' choice for every sequence
    that fits); long factors beyond it, never silently: a warning names the difference."""
    import logging

    from chunkserve.model.loader import hf_model_config
    from chunkserve.model.registry import serving_config

    config = hf_model_config(model_dirs["phi3"])
    assert config.rope_scaling["original_max_position_embeddings"] == 512
    with caplog.at_level(logging.WARNING, logger="chunkserve.model.registry"):
        assert not serving_config(config, 512).longrope_long
        assert not caplog.records
        assert serving_config(config, 513).longrope_long
    assert "short_factor" in caplog.text and "--max-model-len 512" in caplog.text


def test_published_phi3_rope_config_reads_as_transformers_does(model_dirs, tmp_path) -> None:
    """Phi-3.5's config.json as published: ``rope_scaling`` with ``type``, ``rope_theta``
    and ``original_max_position_embeddings`` beside it: the rope dict transformers derives
    from it. The old name ``su`` reads the same (transformers 5.24 itself fails on it: it
    renames su after filling in the original length, which it does for longrope only)."""
    from transformers import AutoConfig

    from chunkserve.model.loader import hf_model_config

    rope = FAMILIES["phi3"][1]["rope_parameters"]
    configs = {}
    for kind in ("longrope", "su"):
        path = variant(
            model_dirs["phi3"], tmp_path / kind, rope_parameters=None, rope_theta=10000.0,
            rope_scaling={"type": kind, "short_factor": rope["short_factor"],
                          "long_factor": rope["long_factor"]},
        )  # fmt: skip
        configs[kind] = hf_model_config(path)
    ours = configs["longrope"]
    theirs = AutoConfig.from_pretrained(str(tmp_path / "longrope")).rope_parameters
    assert theirs["rope_type"] == ours.rope_scaling["rope_type"] == "longrope"
    for key in ("short_factor", "long_factor", "original_max_position_embeddings"):
        assert ours.rope_scaling[key] == theirs[key]
    assert ours.rope_theta == theirs["rope_theta"] and ours.rotary_dim == 16
    assert configs["su"].rope_scaling == ours.rope_scaling


@pytest.fixture
def triton_without_specs(monkeypatch) -> None:
    """Triton's backend as one without windows, caps or sinks (every backend now has them
    all): the base class's ``supports``, which takes a scale only."""
    from chunkserve.attention.base import AttentionBackend
    from chunkserve.attention.triton_paged import TritonAttentionBackend

    monkeypatch.setattr(TritonAttentionBackend, "supports", AttentionBackend.supports)


def test_a_backend_without_windows_is_refused_naming_the_window(
    windowed_dirs, no_weight_loading, triton_without_specs
) -> None:
    # Refused before the weights load, never served with every key attended.
    with pytest.raises(ValueError, match=r"sliding window.*triton.*sliding_window"):
        make_engine(windowed_dirs["mistral-window"], attention_backend="triton")


def test_a_backend_without_soft_capping_is_refused_naming_it(
    model_dirs, tmp_path, no_weight_loading, triton_without_specs
) -> None:
    with pytest.raises(ValueError, match=r"window.*attn_logit_softcapping=50.*triton") as err:
        make_engine(model_dirs["gemma2"], attention_backend="triton")
    assert "max-model-len" not in str(err.value)  # a shorter context leaves the cap
    # Without a reachable window (gemma-2's 4096 by default): the cap alone.
    no_window = variant(model_dirs["gemma2"], tmp_path / "m", sliding_window=None)
    with pytest.raises(ValueError, match=r"uses soft-capped.*triton.*logit_softcap"):
        make_engine(no_window, attention_backend="triton")


# Published config.json files as their checkpoints ship them (older transformers: no
# layer_types, Gemma 3's local base and pattern as their own fields, rope_scaling).
PUBLISHED = {
    "google/gemma-2-9b-it": dict(
        architectures=["Gemma2ForCausalLM"],
        model_type="gemma2",
        hidden_size=3584,
        intermediate_size=14336,
        num_hidden_layers=42,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=256,
        query_pre_attn_scalar=256,
        sliding_window=4096,
        attn_logit_softcapping=50.0,
        final_logit_softcapping=30.0,
        rope_theta=10000.0,
        hidden_act="gelu_pytorch_tanh",
        hidden_activation="gelu_pytorch_tanh",
        max_position_embeddings=8192,
        rms_norm_eps=1e-6,
        vocab_size=256000,
    ),
    "google/gemma-3-4b (text)": dict(
        architectures=["Gemma3ForCausalLM"],
        model_type="gemma3_text",
        hidden_size=2560,
        intermediate_size=10240,
        num_hidden_layers=34,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=256,
        query_pre_attn_scalar=256,
        sliding_window=1024,
        sliding_window_pattern=6,
        rope_theta=1000000.0,
        rope_local_base_freq=10000.0,
        rope_scaling={"rope_type": "linear", "factor": 8.0},
        final_logit_softcapping=None,
        attn_logit_softcapping=None,
        hidden_activation="gelu_pytorch_tanh",
        max_position_embeddings=131072,
        rms_norm_eps=1e-6,
        vocab_size=262208,
    ),
}


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_published_gemma_configs_read_as_transformers_reads_them(tmp_path, name) -> None:
    import transformers

    from chunkserve.model.loader import hf_model_config

    cfg = PUBLISHED[name]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    ours = hf_model_config(tmp_path)
    hf = transformers.AutoConfig.for_model(**cfg)
    windowed = [i for i, t in enumerate(hf.layer_types) if t == "sliding_attention"]
    assert [ours.layer_window(i) for i in range(ours.num_layers)] == [
        hf.sliding_window if i in windowed else None for i in range(ours.num_layers)
    ]
    assert ours.attention_multiplier == hf.query_pre_attn_scalar**-0.5
    assert ours.attn_logit_softcap == hf.attn_logit_softcapping
    assert ours.final_logit_softcap == hf.final_logit_softcapping
    assert ours.hidden_act == hf.hidden_activation
    rope = hf.rope_parameters
    if "full_attention" in rope:  # Gemma 3: a local and a global rope
        assert ours.rope_local_theta == rope["sliding_attention"]["rope_theta"]
        rope = rope["full_attention"]
    assert ours.rope_theta == rope["rope_theta"]
    assert (ours.rope_scaling or {}).get("factor") == rope.get("factor")


def test_gemma_variants_we_do_not_serve_are_refused(model_dirs, tmp_path) -> None:
    from chunkserve.model.loader import hf_model_config

    vision = variant(
        model_dirs["gemma3_text"], tmp_path / "vision",
        architectures=["Gemma3ForConditionalGeneration"], model_type="gemma3",
    )  # fmt: skip
    with pytest.raises(ValueError, match="Gemma3ForConditionalGeneration.*Gemma3ForCausalLM"):
        hf_model_config(vision)
    encoder = variant(
        model_dirs["gemma3_text"], tmp_path / "encoder", use_bidirectional_attention=True
    )
    with pytest.raises(ValueError, match="use_bidirectional_attention"):
        hf_model_config(encoder)


def test_a_window_longer_than_every_sequence_serves(model_dirs, tmp_path) -> None:
    mistral = variant(model_dirs["mistral"], tmp_path / "mistral", sliding_window=MAX_LEN)
    # Nothing to compute: any backend serves it (triton included).
    engine = make_engine(mistral, attention_backend="triton")
    assert engine.core.worker.model_config.sliding_window is None
    params = SamplingParams(max_tokens=4, min_tokens=4, temperature=0.0)
    assert len(run_all(engine, prompts(1), params)[0]) == 4


# ---- rope variants against transformers' ---------------------------------------------------
LONGROPE = {
    "rope_type": "longrope",
    "original_max_position_embeddings": 1024,
    "short_factor": "ramp",  # filled in per rotary dimension: 1, 1.1, 1.2, ...
    "long_factor": "ramp",
}


@pytest.mark.parametrize(
    "rope, long",
    [
        ({"rope_type": "default"}, False),
        ({"rope_type": "linear", "factor": 4.0}, False),
        ({"rope_type": "dynamic", "factor": 2.0}, False),
        (
            {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 1024,
            },
            False,
        ),
        ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024}, False),
        (
            {"rope_type": "yarn", "factor": 4.0, "beta_fast": 16, "beta_slow": 2}
            | {"truncate": False},
            False,
        ),
        ({"rope_type": "yarn", "factor": 4.0, "mscale": 2.0, "mscale_all_dim": 1.0}, False),
        # Short and long factors; the attention factor from max / original (4), from a
        # given factor, or given itself.
        (LONGROPE, False),
        (LONGROPE, True),
        ({**LONGROPE, "factor": 8.0}, True),
        ({**LONGROPE, "attention_factor": 1.5}, False),
    ],
)
@pytest.mark.parametrize("partial", [1.0, 0.5])
def test_rope_frequencies_match_transformers(rope: dict, long: bool, partial: float) -> None:
    """Inverse frequencies and the cos/sin scale of every rope type against transformers'
    own init functions (longrope's long factors: transformers' for a sequence one past the
    original length)."""
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from chunkserve.model.layers import rope_inv_freq

    params = {**rope, "rope_theta": 50000.0, "partial_rotary_factor": partial}
    pairs = int(128 * partial) // 2
    for key in ("short_factor", "long_factor"):
        if params.get(key) == "ramp":
            params[key] = [1.0 + (0.1 if key == "short_factor" else 0.7) * i for i in range(pairs)]
    hf = LlamaConfig(
        hidden_size=512, num_attention_heads=4, max_position_embeddings=4096,
        rope_parameters=dict(params), partial_rotary_factor=partial,
    )  # fmt: skip
    if rope["rope_type"] == "default":  # not in the table: each model's own (Phi-3's rotates
        from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding  # partially)

        want, want_factor = Phi3RotaryEmbedding.compute_default_rope_parameters(hf)
    else:
        kwargs = {"seq_len": params["original_max_position_embeddings"] + 1} if long else {}
        init = ROPE_INIT_FUNCTIONS[rope["rope_type"]]
        want, want_factor = init(hf, torch.device("cpu"), **kwargs)
    ours = ModelConfig(
        architecture="llama", vocab_size=10, hidden_size=512, intermediate_size=8,
        num_layers=1, num_heads=4, num_kv_heads=4, head_dim=128, rope_theta=50000.0,
        rms_norm_eps=1e-6, max_position_embeddings=4096, tie_word_embeddings=True,
        rope_scaling=params, partial_rotary_factor=partial, longrope_long=long,
    )  # fmt: skip
    got, factor = rope_inv_freq(ours, 4096)
    assert got.shape == (pairs,)
    torch.testing.assert_close(got, want.float(), rtol=1e-6, atol=0)
    assert factor == pytest.approx(float(want_factor), rel=1e-12)
    if rope["rope_type"] in ("yarn", "longrope"):
        assert factor != 1.0  # the attention factor is exercised


def test_gemma_embedding_normalizer_is_rounded_to_the_model_dtype() -> None:
    # HF multiplies Gemma's embeddings by sqrt(hidden) cast to the model's dtype: in bf16,
    # sqrt(640) = 25.298... is 25.25 (gemma-3-270m's hidden size).
    from chunkserve.model.registry import build_model

    config = ModelConfig(
        architecture="gemma3_text", vocab_size=32, hidden_size=640, intermediate_size=8,
        num_layers=1, num_heads=1, num_kv_heads=1, head_dim=16, rope_theta=1e6,
        rms_norm_eps=1e-6, max_position_embeddings=64, tie_word_embeddings=True,
        hidden_act="gelu_pytorch_tanh", rope_local_theta=1e4,
    )  # fmt: skip
    model = build_model(config, torch.bfloat16, torch.device("cpu"), max_positions=64)
    model.init_dummy_weights()
    ids = torch.arange(4)
    want = model.embed_tokens.weight[ids] * torch.tensor(640**0.5).to(torch.bfloat16)
    assert float(torch.tensor(640**0.5).to(torch.bfloat16)) == 25.25
    assert torch.equal(model.embed_tokens.forward(ids) * model.embed_scale, want)
    assert not torch.equal(want, model.embed_tokens.weight[ids] * 640**0.5)
