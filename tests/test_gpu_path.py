"""The GPU path through the same interface: the Triton backend end to end (on CUDA when
present, else under Triton's interpreter), CUDA graphs against eager steps (CUDA only), the
one-transfer batch metadata, random (dummy) weights.

A tiny random Llama (2 layers, word-level tokenizer) keeps the interpreter runs short; greedy
tokens must not depend on the backend, the chunking or the graphs."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from chunkserve.attention import get_attention_backend, triton_usable
from chunkserve.engine.engine import Engine
from chunkserve.scheduling.sampling_params import SamplingParams
from chunkserve.worker.cuda_graphs import capture_sizes

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_triton = pytest.mark.skipif(
    not triton_usable(torch.device(DEVICE)), reason="triton not installed"
)
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
VOCAB = 512


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """config.json + a word-level tokenizer.json; no weights (load_format='dummy')."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    d = tmp_path_factory.mktemp("tiny-llama")
    config = {
        "model_type": "llama",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": VOCAB,
        "max_position_embeddings": 1024,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "eos_token_id": 1,
    }
    (d / "config.json").write_text(json.dumps(config))
    vocab = {"<unk>": 0, "</s>": 1} | {f"w{i}": i for i in range(2, VOCAB)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(d / "tokenizer.json"))
    return d


def _greedy(model_dir: Path, prompts: list[list[int]], max_tokens: int, **kwargs) -> list:
    engine = Engine(
        model=str(model_dir),
        load_format="dummy",
        device=DEVICE,
        dtype="float32",
        kv_cache_memory=8 << 20,
        max_model_len=512,
        seed=0,
        **kwargs,
    )
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    ids = [engine.add_request(prompt_token_ids=p, sampling_params=params) for p in prompts]
    done = {}
    while engine.has_unfinished():
        for o in engine.step():
            if o.finished:
                done[o.request_id] = o.token_ids
    assert engine.core.kv.num_free_blocks == engine.core.worker.num_blocks  # nothing leaked
    return [done[i] for i in ids]


def _prompts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(2, VOCAB) for _ in range(n)] for n in (37, 5, 70, 16)]


@needs_triton
def test_triton_engine_matches_torch_and_chunking(tiny_model_dir: Path) -> None:
    prompts = _prompts(1)
    want = _greedy(tiny_model_dir, prompts, 6, attention_backend="torch", enforce_eager=True)
    for budget in (16, 40):
        got = _greedy(
            tiny_model_dir,
            prompts,
            6,
            attention_backend="triton",
            max_num_batched_tokens=budget,
            enforce_eager=True,
        )
        assert got == want, f"budget {budget}"
    unchunked = _greedy(
        tiny_model_dir, prompts, 6, attention_backend="triton", enable_chunked_prefill=False
    )
    assert unchunked == want


@needs_cuda
def test_cuda_graphs_match_eager(tiny_model_dir: Path) -> None:
    prompts = _prompts(2) * 3  # 12 requests: graph batch sizes 16, then smaller as they end
    prompts = [p[: 5 + 7 * i] for i, p in enumerate(prompts)]
    eager = _greedy(tiny_model_dir, prompts, 24, attention_backend="triton", enforce_eager=True)
    graphs = _greedy(tiny_model_dir, prompts, 24, attention_backend="triton")
    assert graphs == eager


@needs_cuda
def test_cuda_graph_engine_replays_decode_steps(tiny_model_dir: Path) -> None:
    engine = Engine(
        model=str(tiny_model_dir), load_format="dummy", device="cuda", kv_cache_memory=8 << 20
    )
    assert engine.core.worker.cuda_graphs and engine.core.worker.runner.graphs is not None
    replays = []
    graphs = engine.core.worker.runner.graphs
    original = graphs.run

    def counting_run(out):  # type: ignore[no-untyped-def]
        replays.append(len(out.decodes))
        return original(out)

    graphs.run = counting_run
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    for p in _prompts(3):
        engine.add_request(prompt_token_ids=p, sampling_params=params)
    while engine.has_unfinished():
        engine.step()
    assert replays and max(replays) == 4


def test_cuda_graphs_need_cuda_and_a_capturable_backend(tiny_model_dir: Path) -> None:
    if torch.cuda.is_available():
        with pytest.raises(ValueError, match="enforce_eager"):
            engine = Engine(
                model=str(tiny_model_dir),
                load_format="dummy",
                device="cuda",
                attention_backend="torch",
                kv_cache_memory=8 << 20,
            )
            engine.core.worker.runner.enable_decode_graphs(4, 64)
    engine = Engine(
        model=str(tiny_model_dir), load_format="dummy", device="cpu", kv_cache_memory=8 << 20
    )
    assert not engine.core.worker.cuda_graphs  # CPU: nothing to capture
    with pytest.raises(ValueError, match="enforce_eager"):
        engine.core.worker.runner.enable_decode_graphs(4, 64)


def test_capture_sizes() -> None:
    assert capture_sizes(1) == [1]
    assert capture_sizes(6) == [1, 2, 4, 6]
    assert capture_sizes(40) == [1, 2, 4, 8, 16, 24, 32, 40]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]


def test_batch_metadata_is_one_buffer(tiny_model_dir: Path) -> None:
    """Every index tensor of a step is a view of one buffer (one host-to-device copy)."""
    engine = Engine(
        model=str(tiny_model_dir), load_format="dummy", device="cpu", kv_cache_memory=8 << 20
    )
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    for p in _prompts(4):
        engine.add_request(prompt_token_ids=p, sampling_params=params)
    engine.step()
    out = engine.core.scheduler.schedule()
    layout, _ = engine.core.worker.runner.build_layout(out)
    from chunkserve.worker.model_runner import GROUP_SECTIONS, SECTIONS

    storages = {getattr(layout, n).untyped_storage().data_ptr() for n in SECTIONS + GROUP_SECTIONS}
    assert len(storages) == 1
    assert all(getattr(layout, n).dtype == torch.int64 for n in SECTIONS + GROUP_SECTIONS)
    assert layout.block_tables.shape[0] == layout.num_seqs


def test_dummy_weights_need_only_a_config(tiny_model_dir: Path) -> None:
    with pytest.raises(ValueError, match="model"):
        Engine(model=str(tiny_model_dir), device="cpu")  # no *.safetensors to load
    with pytest.raises(ValueError, match="load_format"):
        Engine(model=str(tiny_model_dir), load_format="random", device="cpu")


def test_triton_backend_needs_cuda_or_the_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="attention_backend"):
        get_attention_backend("triton", torch.device("cpu"), 4, 2, 16)
    assert get_attention_backend("auto", torch.device("cpu"), 4, 2, 16).name in ("cpu", "torch")
