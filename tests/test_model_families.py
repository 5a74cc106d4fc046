"""Every family the registry serves, against HF transformers' eager implementation.

Each family is a tiny random model built by transformers from its own config class with the
config fields of a published checkpoint of that family, shrunk only in width and depth (tied
heads where the checkpoint ties them), saved as an HF directory (safetensors, the embedded
model's tokenizer). fp32 logits at every position within 1e-4 (relative) of transformers',
greedy tokens identical; chunked at budget 16 = unchunked = prefix-cached = preempted;
tensor parallel 2 = 1 for two families; the errors a bad checkpoint gets before serving.
"""

from __future__ import annotations

import random
import shutil
from pathlib import Path

import pytest
import torch

from chunkserve.engine.engine import Engine
from chunkserve.model.registry import supported_families
from chunkserve.scheduling.sampling_params import SamplingParams
from tests.conftest import assert_no_blocks_in_use, random_prompt
from tests.test_model_parity import all_row_logits

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
}

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
    assert set(supported_families()) == set(FAMILIES)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_logits_and_greedy_tokens_match_transformers(model_dirs, family: str) -> None:
    path = model_dirs[family]
    ref = reference(path)
    engine = make_engine(path)
    assert engine.core.worker.model_config.architecture == family
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
    assert worst < 1e-4, f"{family}: worst relative error {worst:.2e}"
    params = SamplingParams(max_tokens=12, min_tokens=12, temperature=0.0)
    for ids in prompts():
        with torch.no_grad():
            out = ref.generate(
                torch.tensor([ids]), max_new_tokens=12, do_sample=False, eos_token_id=None
            )
        expected = out[0, len(ids) :].tolist()
        assert run_all(engine, [ids], params) == [expected]
    assert_no_blocks_in_use(engine)
    print(f"{family}: worst relative logit error {worst:.2e}")
