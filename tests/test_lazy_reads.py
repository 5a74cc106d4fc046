"""A tensor-parallel rank reads its share of each checkpoint tensor, not the whole of it
(``model.lazy``): the bytes a rank's load takes out of safetensors files (counted by a
wrapper of ``safe_open``) and out of a GGUF file's memory map (a wrapper of each tensor's
data), for float tensors, for a quantized HF checkpoint's (MXFP4, block FP8) and a GGUF
file's quantized tensors, kept quantized or dequantized at load. Whole reads count every
byte (the wrappers' ``get_tensor`` / ``__array__``), so a loader that read a tensor whole
and sliced it afterwards fails these tests."""

from __future__ import annotations

import json
import types
from pathlib import Path

import numpy as np
import pytest
import torch

from chunkserve.distributed.shard import plan_shards
from chunkserve.model.hf_quant import dequantize_fp8_blocks, dequantize_mxfp4
from chunkserve.model.loader import (
    gguf_model_config,
    hf_model_config,
    iter_gguf_weights,
    iter_hf_weights,
    open_gguf,
)
from chunkserve.model.registry import build_model
from tests.test_model_families import SMALL, write_model


class _CountedSlice:
    def __init__(self, part, seen: list[int]) -> None:
        self.part, self.seen = part, seen

    def get_shape(self):
        return self.part.get_shape()

    def get_dtype(self):
        return self.part.get_dtype()

    def __getitem__(self, box):
        t = self.part[box]
        self.seen.append(t.numel() * t.element_size())
        return t


class _CountedFile:
    """A ``safe_open`` handle counting the bytes its tensors and slices materialise."""

    def __init__(self, handle, seen: list[int]) -> None:
        self.handle, self.seen = handle, seen

    def __enter__(self):
        self.handle.__enter__()
        return self

    def __exit__(self, *exc):
        return self.handle.__exit__(*exc)

    def keys(self):
        return self.handle.keys()

    def get_tensor(self, name):
        t = self.handle.get_tensor(name)
        self.seen.append(t.numel() * t.element_size())
        return t

    def get_slice(self, name):
        return _CountedSlice(self.handle.get_slice(name), self.seen)


@pytest.fixture
def counted_safetensors(monkeypatch) -> list[int]:
    import safetensors

    seen: list[int] = []
    real = safetensors.safe_open
    monkeypatch.setattr(safetensors, "safe_open", lambda *a, **k: _CountedFile(real(*a, **k), seen))
    return seen


class _CountedArray:
    """A GGUF tensor's data (a view of the file's map) counting the bytes read out of it:
    views are free, ``__array__`` (a copy, a conversion) counts its bytes."""

    def __init__(self, a: np.ndarray, seen: list[int]) -> None:
        self.a, self.seen = a, seen
        self.shape, self.dtype, self.ndim = a.shape, a.dtype, a.ndim

    def reshape(self, *shape):
        return _CountedArray(self.a.reshape(*shape), self.seen)

    def __getitem__(self, index):
        return _CountedArray(self.a[index], self.seen)

    def __array__(self, dtype=None, copy=None):
        self.seen.append(self.a.nbytes)
        return np.array(self.a, dtype=dtype) if copy else np.asarray(self.a, dtype=dtype)


def _counted_reader(reader, seen: list[int]):
    tensors = [t._replace(data=_CountedArray(t.data, seen)) for t in reader.tensors]
    return types.SimpleNamespace(fields=reader.fields, tensors=tensors)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory, hf_dir: Path) -> Path:
    """A tiny Llama whose embedding and head (vocabulary-parallel) are most of its bytes."""
    import transformers

    root = tmp_path_factory.mktemp("lazy")
    return write_model(root / "llama", transformers.LlamaConfig(**SMALL), hf_dir)


def _load(config, weights, rank: int, size: int = 2, ep: bool = False):
    shard = plan_shards(config, size, rank, expert_parallel=ep)
    model = build_model(config, torch.float32, torch.device("cpu"), 64, shard=shard)
    model.load_weights(weights)
    return model


def _params(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_safetensors_rank_reads_its_share(llama_dir, counted_safetensors) -> None:
    """Each rank of 2 reads about half of the file's bytes (the replicated norms twice);
    together they load what one process loads."""
    seen = counted_safetensors
    config = hf_model_config(llama_dir)
    total = (llama_dir / "model.safetensors").stat().st_size
    one = _params(_load(config, iter_hf_weights(llama_dir, torch.float32), 0, 1))
    assert 0.99 * total < sum(seen) <= total
    for rank in (0, 1):
        seen.clear()
        model = _load(config, iter_hf_weights(llama_dir, torch.float32), rank)
        assert 0.4 * total < sum(seen) < 0.6 * total, (rank, sum(seen), total)
        vocab = config.vocab_size // 2
        rows = slice(rank * vocab, (rank + 1) * vocab)
        got = _params(model)
        torch.testing.assert_close(got["embed_tokens.weight"], one["embed_tokens.weight"][rows])
        torch.testing.assert_close(got["norm.weight"], one["norm.weight"])


@pytest.mark.parametrize(
    "quant, keep",
    [(None, False), ("Q8_0", False), ("Q8_0", True)],
    ids=["F32", "Q8_0-dequantized", "Q8_0-kept-quantized"],
)
def test_gguf_rank_reads_its_share(llama_dir, tmp_path, quant, keep) -> None:
    """F32 tensors read by rows out of the map; Q8_0 ones by block rows (dequantized at
    load, or kept quantized: only the rank's rows copied); Q/K rows through llama.cpp's
    permutation."""
    from tests.test_gguf import write_gguf

    reader = open_gguf(write_gguf(llama_dir, tmp_path / "m.gguf", quant=quant))
    config = gguf_model_config(reader)
    total = sum(t.data.nbytes for t in reader.tensors)
    seen: list[int] = []
    counted = _counted_reader(reader, seen)
    one = _params(_load(config, iter_gguf_weights(counted, config, torch.float32, keep), 0, 1))
    assert 0.99 * total < sum(seen) <= 1.01 * total
    for rank in (0, 1):
        seen.clear()
        model = _load(config, iter_gguf_weights(counted, config, torch.float32, keep), rank)
        assert 0.4 * total < sum(seen) < 0.6 * total, (rank, sum(seen), total)
        if not keep:
            got = _params(model)
            heads = config.num_heads // 2
            rows = slice(rank * heads * config.head_dim, (rank + 1) * heads * config.head_dim)
            q = "layers.0.attn.qkv.weight"
            torch.testing.assert_close(got[q][: rows.stop - rows.start], one[q][rows])


def _quantized_dir(tmp_path: Path, method: str) -> tuple[Path, dict[str, torch.Tensor]]:
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(0)
    if method == "mxfp4":  # 4 experts' [out 64, in 128] as blocks [E, out, G, 16]
        tensors = {
            "w_blocks": torch.randint(0, 256, (4, 64, 4, 16), generator=gen, dtype=torch.uint8),
            "w_scales": torch.randint(120, 130, (4, 64, 4), generator=gen, dtype=torch.uint8),
        }
        q = {"quant_method": "mxfp4"}
    else:  # a [512, 384] weight in 128 x 128 blocks
        weight = torch.randn(512, 384, generator=gen).to(torch.float8_e4m3fn)
        tensors = {"w.weight": weight, "w.weight_scale_inv": torch.rand(4, 3, generator=gen)}
        q = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": q}))
    return tmp_path, tensors


@pytest.mark.parametrize("method", ["mxfp4", "fp8"])
def test_quantized_safetensors_rank_reads_its_blocks(tmp_path, counted_safetensors, method):
    """``LazyDequant`` over lazily read parts: half the output columns of MXFP4 experts (a
    row-parallel rank's) or half the rows of an FP8 weight read half the raw bytes, and
    dequantize to the whole tensor's slice."""
    seen = counted_safetensors
    path, raw = _quantized_dir(tmp_path, method)
    total = sum(t.numel() * t.element_size() for t in raw.values())
    weights = iter_hf_weights(path, torch.float32)
    _, lazy = next(weights)  # read while the file is open, as the weight loaders read
    assert sum(seen) == 0  # nothing read until sliced
    if method == "mxfp4":
        src = (slice(None), slice(None), slice(0, 32))  # [E, in, out]: half of out
        whole = dequantize_mxfp4(raw["w_blocks"], raw["w_scales"]).transpose(-1, -2)
    else:
        src = (slice(0, 256), slice(None))
        whole = dequantize_fp8_blocks(raw["w.weight"], raw["w.weight_scale_inv"], (128, 128))
    got = lazy[src]
    assert next(weights, None) is None
    assert 0.45 * total < sum(seen) < 0.55 * total, (sum(seen), total)
    torch.testing.assert_close(got, whole[src])


def _counted_by_tensor(reader) -> tuple[types.SimpleNamespace, dict[str, list[int]]]:
    """``_counted_reader`` with the bytes read counted per GGUF tensor."""
    seen: dict[str, list[int]] = {t.name: [] for t in reader.tensors}
    tensors = [t._replace(data=_CountedArray(t.data, seen[t.name])) for t in reader.tensors]
    return types.SimpleNamespace(fields=reader.fields, tensors=tensors), seen


def _read(seen: dict[str, list[int]], suffix: str) -> int:
    return sum(sum(v) for k, v in seen.items() if k.endswith(suffix))


_GPT_OSS_EXPERTS = (
    "ffn_gate_exps.weight",
    "ffn_up_exps.weight",
    "ffn_down_exps.weight",
    "ffn_gate_exps.bias",
    "ffn_up_exps.bias",
)


@pytest.mark.parametrize(
    "family, suffixes, ep",
    [
        # MLA's kv_b_proj joined from attn_k_b and attn_v_b: a rank's heads of each.
        ("deepseek", ("attn_k_b.weight", "attn_v_b.weight"), False),
        # F32 vectors: Q/K/V biases, a rank's heads' values.
        ("qwen2", ("attn_q.bias", "attn_k.bias", "attn_v.bias"), False),
        # GPT-OSS's interleaved gate_up_proj (and its bias) joined from gate and up, its
        # down_proj transposed: tensor parallel, a rank's rows of every expert's gate and up
        # (its even / odd columns) and columns of down; expert parallel, its experts.
        ("gpt_oss", _GPT_OSS_EXPERTS, False),
        ("gpt_oss", _GPT_OSS_EXPERTS, True),
    ],
    ids=["deepseek-kv_b", "qwen2-biases", "gpt_oss-tp", "gpt_oss-ep"],
)
def test_gguf_joins_and_vectors_rank_reads_its_share(
    tmp_path, hf_dir: Path, family: str, suffixes: tuple[str, ...], ep: bool
) -> None:
    """Each rank of 2 reads half the bytes of those tensors (TP=1 all of them), and loads
    what it loads from the directory the file was written from."""
    from tests.test_gguf import write_gguf

    if family == "deepseek":
        from tests.test_deepseek import hf_config as make_config

        hf = make_config("lite")
    elif family == "gpt_oss":
        from tests.test_gpt_oss import gpt_oss_config

        hf = gpt_oss_config()
    else:
        from tests.test_model_families import hf_config

        hf = hf_config(family)
    src = write_model(tmp_path / family, hf, hf_dir)
    reader = open_gguf(write_gguf(src, tmp_path / "m.gguf", split_kv_b=True))
    config = gguf_model_config(reader)
    counted, seen = _counted_by_tensor(reader)
    total = {s: sum(t.data.nbytes for t in reader.tensors if t.name.endswith(s)) for s in suffixes}
    assert all(total.values())
    _load(config, iter_gguf_weights(counted, config, torch.float32), 0, 1)
    assert {s: _read(seen, s) for s in suffixes} == total
    for rank in (0, 1):
        for v in seen.values():
            v.clear()
        weights = iter_gguf_weights(counted, config, torch.float32)
        got = _params(_load(config, weights, rank, ep=ep))
        assert {s: 2 * _read(seen, s) for s in suffixes} == total, rank
        want = _params(_load(config, iter_hf_weights(src, torch.float32), rank, ep=ep))
        assert got.keys() == want.keys()
        for name, value in want.items():
            torch.testing.assert_close(got[name], value, msg=name)
