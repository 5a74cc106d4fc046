"""``--quantization int8|int4`` on a float HF checkpoint (a tiny random Llama): the linear
layers hold GGML Q8_0 / Q4_1 ``GGUFWeight`` blocks (int8 / int4 in groups of 32; the
embedding and the LM head stay float), the
model computes what the same model with those weights dequantized computes, close to the
unquantized model; a GGUF file, an HF checkpoint with its own quantization and a bad value
are refused naming the flag."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from chunkserve.engine.engine import Engine
from chunkserve.quant.weight import GGUFWeight
from chunkserve.quant.weight_only import Int4Weight
from tests.test_model_families import hf_config, write_model
from tests.test_model_parity import all_row_logits

BASE = dict(dtype="float32", max_model_len=256, kv_cache_memory=8 << 20)
PROMPT = [5, 900, 17, 4321, 77, 2000, 31, 12, 600, 41, 9000, 3]


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory, hf_dir: Path) -> Path:
    # hidden 96 = 3 x 32 (q/k/v/gate/up), intermediate 128 (down_proj): int4 takes its
    # default group, 32, on both (128 would fit down_proj only).
    cfg = hf_config("llama", hidden_size=96, num_attention_heads=4, num_key_value_heads=2)
    return write_model(tmp_path_factory.mktemp("wo") / "llama", cfg, hf_dir)


@pytest.fixture(scope="module")
def plain(llama_dir):
    engine = Engine(model=str(llama_dir), **BASE)
    yield engine
    engine.shutdown()


def linear_modules(model) -> list:
    from chunkserve.model.layers import ColumnParallelLinear, RowParallelLinear

    return [m for m in model.modules() if isinstance(m, (ColumnParallelLinear, RowParallelLinear))]


@pytest.mark.parametrize(("method", "qtype", "bits"), [("int8", "Q8_0", 8.5), ("int4", "Q4_1", 5)])
def test_linear_layers_quantized_at_load(llama_dir, plain, method, qtype, bits):
    engine = Engine(model=str(llama_dir), quantization=method, **BASE)
    try:
        model = engine.core.worker.model
        assert engine.core.worker.weights_format == method
        linears = linear_modules(model)
        assert len(linears) == 2 * 4  # qkv, o, gate_up, down
        assert all(isinstance(m.qweight, GGUFWeight) and m.weight is None for m in linears)
        assert {m.qweight.qtype for m in linears} == {qtype}  # blocks of 32
        params = sum(m.qweight.shape[0] * m.qweight.shape[1] for m in linears)
        assert sum(m.qweight.nbytes for m in linears) * 8 == bits * params
        assert model.embed_tokens.qweight is None and model.embed_tokens.weight is not None
        assert model.weight_bytes() < plain.core.worker.model.weight_bytes()
        got = all_row_logits(engine, PROMPT, 5)
        want = all_row_logits(plain, PROMPT, 5)
        rel = float((got - want).norm() / want.norm())
        print(f"{method}: relative logit difference to the unquantized model {rel:.2e}")
        assert 0 < rel < (0.02 if method == "int8" else 0.15)
        if method == "int4":
            # The previous int4 path (Int4Weight, fp32 scales, groups of 32) from the same
            # float weights: the fp16 d / m move ~0.3% of the q's by one step, so the two
            # differ by ~0.2 of the int4 error, and the error itself is the same.
            kept = [m.qweight for m in linears]
            for m, f in zip(linears, linear_modules(plain.core.worker.model), strict=True):
                m.qweight = Int4Weight.quantize(f.weight, 32, m.qweight.name)
            old = all_row_logits(engine, PROMPT, 5)
            old_err = float((old - want).norm())
            diff = float((got - old).norm()) / old_err
            new_err = float((got - want).norm()) / old_err
            print(f"int4: Q4_1 - Int4Weight logits {diff:.3f}, Q4_1's error {new_err:.3f}x")
            assert diff < 0.35 and new_err < 1.1
            for m, q in zip(linears, kept, strict=True):
                m.qweight = q
        # The same model with the quantized weights dequantized into float layers.
        for m in linears:
            m.weight = torch.nn.Parameter(m.qweight.dequantize(torch.float32), False)
            m.qweight = None
        twin = all_row_logits(engine, PROMPT, 5)
        torch.testing.assert_close(got, twin, rtol=1e-4, atol=1e-4)
    finally:
        engine.shutdown()


def test_dummy_weights_are_quantized_too(llama_dir):
    engine = Engine(model=str(llama_dir), quantization="int8", load_format="dummy", **BASE)
    try:
        assert all(
            isinstance(m.qweight, GGUFWeight) and m.qweight.qtype == "Q8_0"
            for m in linear_modules(engine.core.worker.model)
        )
    finally:
        engine.shutdown()


def test_refused_by_name(llama_dir, gguf_path, tmp_path):
    with pytest.raises(ValueError, match="quantization: must be one of"):
        Engine(model=str(llama_dir), quantization="int3", **BASE)
    with pytest.raises(ValueError, match="quantization: int8 .* is a GGUF file"):
        Engine(model=str(gguf_path), quantization="int8", **{**BASE, "kv_cache_memory": 32 << 20})
    own = tmp_path / "fp8"
    own.mkdir()
    for f in llama_dir.iterdir():
        (own / f.name).symlink_to(f)
    cfg = json.loads((llama_dir / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    (own / "config.json").unlink()
    (own / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="quantization: int4 differs .*fp8"):
        Engine(model=str(own), quantization="int4", **BASE)
