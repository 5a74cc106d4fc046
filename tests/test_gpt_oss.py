"""GPT-OSS against HF transformers (a tiny random ``GptOssConfig`` model, fp32): logits within
1e-4 (relative), greedy tokens identical, the experts each token picks identical to
transformers' router's; chunked = unchunked = prefix-cached = preempted on prompts longer
than the window; tensor parallel 2 and expert parallel 2 = one process. The checkpoint
formats the published models ship in, written here from the formats' definitions: MXFP4
experts (GPT-OSS) and block FP8 weights (a tiny Qwen3-MoE, as Qwen3-FP8 / DeepSeek-V3), each
loading as the directory of its dequantized float weights does.
"""

from __future__ import annotations

import json
import logging
import math
import random
import shutil
from pathlib import Path

import pytest
import torch

from chunkserve.model.hf_quant import E2M1, dequantize_fp8_blocks, dequantize_mxfp4
from chunkserve.scheduling.sampling_params import SamplingParams
from tests.conftest import assert_no_blocks_in_use, random_prompt
from tests.test_invariance import run_staggered
from tests.test_model_families import (
    CHUNK_TOKENS,
    CHUNK_WORK,
    SMALL,
    VOCAB,
    assert_preempted_matches,
    make_engine,
    prompts,
    reference,
    run_all,
    variant,
    write_model,
)
from tests.test_model_parity import all_row_logits
from tests.test_moe import moe_hf_config, rewrite
from tests.test_tensor_parallel import record_logits

WINDOW = 20
# openai/gpt-oss-20b: 32 experts top 4 of 2880 columns (here 8 top 4 of 32), head_dim 64
# (here 16), the window (128, here 20: shorter than the prompts) on every other layer, YaRN
# factor 32 over 4096 positions (here over 64), sinks, biases. swiglu_limit 7.0 is shrunk to
# 0.5 so that the tiny model's gate and up values reach the clamp.
GPT_OSS = dict(
    num_local_experts=8,
    num_experts_per_tok=4,
    intermediate_size=32,
    head_dim=16,
    sliding_window=WINDOW,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
    max_position_embeddings=2048,
    swiglu_limit=0.5,
    rope_parameters=dict(
        rope_type="yarn",
        rope_theta=150000.0,
        factor=32.0,
        beta_fast=32.0,
        beta_slow=1.0,
        truncate=False,
        original_max_position_embeddings=64,
    ),
)


def gpt_oss_config(**changes):
    import transformers

    return transformers.GptOssConfig(**{**SMALL, **GPT_OSS, **changes})


@pytest.fixture(scope="module")
def gpt_oss_dir(tmp_path_factory, hf_dir: Path) -> Path:
    path = write_model(tmp_path_factory.mktemp("gpt_oss") / "m", gpt_oss_config(), hf_dir)

    def edit(t):
        out = {}
        for k, v in t.items():
            if k.endswith("router.weight"):  # no near-ties among the top k (see test_moe)
                out[k] = v * 20
            elif k.endswith("sinks"):  # sinks that matter: about the scores' size
                out[k] = torch.randn_like(v)
            elif k.endswith(("gate_up_proj", "down_proj")):  # past the clamp at 0.5
                out[k] = v * 10
        return out

    rewrite(path, edit)
    return path


# ---- against transformers ------------------------------------------------------------------
def test_logits_greedy_tokens_and_experts_match_transformers(gpt_oss_dir) -> None:
    ref = reference(gpt_oss_dir)
    engine = make_engine(gpt_oss_dir)
    assert engine.core.worker.model_config.architecture == "gpt_oss"
    model = engine.core.worker.model
    assert [layer.attn.spec.sliding_window for layer in model.layers] == [WINDOW, None]
    # The experts transformers' router picks for each token of each layer, and the layer's
    # input there: our router's picks from the same input.
    seen: list[tuple[int, torch.Tensor, torch.Tensor]] = []
    hooks = []
    for i, layer in enumerate(ref.model.layers):
        hooks.append(
            layer.mlp.router.register_forward_hook(
                lambda mod, args, out, i=i: seen.append((i, args[0].detach(), out[2]))
            )
        )
    worst, clamped = 0.0, False
    for ids in prompts():
        seen.clear()
        with torch.no_grad():
            want = ref(torch.tensor([ids])).logits[0].float()
        for i, x, hf_ids in seen:
            _, ours = model.layers[i].mlp.select(x)
            assert ours.tolist() == hf_ids.tolist(), f"layer {i}: experts differ"
            gate_up = x @ ref.model.layers[i].mlp.experts.gate_up_proj[0]
            clamped |= bool((gate_up.abs() > 0.5).any())
        for chunk in (10_000, 7):
            got = all_row_logits(engine, ids, chunk)
            assert got.shape == want.shape
            rel = ((got - want).norm(dim=-1) / want.norm(dim=-1)).max().item()
            worst = max(worst, rel)
    for h in hooks:
        h.remove()
    assert clamped  # the clamp is exercised
    assert worst < 1e-4, f"gpt_oss: worst relative error {worst:.2e}"
    print(f"gpt_oss: worst relative logit error {worst:.2e}")
    params = SamplingParams(max_tokens=8, min_tokens=8, temperature=0.0)
    for ids in prompts():
        with torch.no_grad():
            out = ref.generate(
                torch.tensor([ids]), max_new_tokens=8, do_sample=False, eos_token_id=None
            )
        assert run_all(engine, [ids], params) == [out[0, len(ids) :].tolist()]
    assert_no_blocks_in_use(engine)


# ---- chunked, prefix-cached, preempted -----------------------------------------------------
def test_bf16_logits_are_as_close_to_fp32_as_transformers_bf16(gpt_oss_dir) -> None:
    """bf16 parity: the engine in bf16 errs from transformers' fp32 logits no more than
    transformers' own bf16 model does, and is as close to that model as either is to fp32:
    the bf16 numerics (norm weights in fp32, sinks, clamped SwiGLU, YaRN) follow
    transformers'."""
    from transformers import AutoModelForCausalLM

    def hf(dtype):
        model = AutoModelForCausalLM.from_pretrained(
            str(gpt_oss_dir), dtype=dtype, attn_implementation="eager"
        )
        return model.eval()

    ref32, ref16 = hf(torch.float32), hf(torch.bfloat16)
    engine = make_engine(gpt_oss_dir, dtype="bfloat16")
    assert engine.core.worker.dtype == torch.bfloat16

    def rel(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:  # per position
        return (a - b).norm(dim=-1) / b.norm(dim=-1)

    theirs, ours, between = [], [], []
    for ids in prompts():
        with torch.no_grad():
            want32 = ref32(torch.tensor([ids])).logits[0].float()
            want16 = ref16(torch.tensor([ids])).logits[0].float()
        got = all_row_logits(engine, ids, 10_000)
        theirs.append(rel(want16, want32))
        ours.append(rel(got, want32))
        between.append(rel(got, want16))
    # bf16 rounding makes single positions' errors noisy (one of 130 may be 1.5x another
    # model's worst): compared by the mean over positions, the worst within 2x. (Measured:
    # means 0.0161 ours, 0.0162 transformers' bf16, 0.0115 between; a smaller deviation such
    # as norm weights multiplied after the cast is test_norms_multiply_..._fp32's to catch.)
    t, o, b = torch.cat(theirs), torch.cat(ours), torch.cat(between)
    assert o.mean() <= 1.1 * t.mean(), (o.mean().item(), t.mean().item())
    assert b.mean() <= t.mean(), (b.mean().item(), t.mean().item())
    assert o.max() <= 2 * t.max(), (o.max().item(), t.max().item())


def test_chunked_prefix_cached_and_preempted_match_unchunked(gpt_oss_dir) -> None:
    rng = random.Random(21)
    work = [random_prompt(rng, n) for n in CHUNK_WORK]
    assert max(CHUNK_WORK) > WINDOW
    base = make_engine(gpt_oss_dir, enable_chunked_prefill=False, max_num_batched_tokens=2048)
    expected = run_staggered(base, work, CHUNK_TOKENS)
    assert base.core.scheduler.num_preemptions == 0
    chunked = make_engine(gpt_oss_dir, max_num_batched_tokens=16)
    steps = []
    chunked.step_listeners.append(steps.append)
    assert run_staggered(chunked, work, CHUNK_TOKENS) == expected
    assert any(s.kind == "mixed" for s in steps)
    hits = chunked.core.kv.num_hit_tokens
    assert run_staggered(chunked, work, CHUNK_TOKENS) == expected
    assert chunked.core.kv.num_hit_tokens > hits
    assert_no_blocks_in_use(chunked)
    assert chunked.core.kv.num_groups == 2  # a full-attention and a sliding-window group
    assert_preempted_matches(gpt_oss_dir, chunked, work, expected)


# ---- tensor and expert parallel ------------------------------------------------------------
def test_tensor_and_expert_parallel_match_one_process(gpt_oss_dir) -> None:
    """Tensor parallel: each rank its query heads' sinks and its columns of every expert
    (gate and up de-interleaved from the fused tensor), the down bias on rank 0 only; expert
    parallel: its 4 experts whole, their down biases."""
    tp1 = make_engine(gpt_oss_dir, max_num_batched_tokens=64)
    work = [*prompts(), random_prompt(random.Random(3), 100)]
    params = SamplingParams(max_tokens=8, min_tokens=8, temperature=0.0)
    ref = record_logits(tp1)
    want = run_all(tp1, work, params)
    for ep in (False, True):
        tp2 = make_engine(
            gpt_oss_dir,
            max_num_batched_tokens=64,
            tensor_parallel_size=2,
            enable_expert_parallel=ep,
        )
        try:
            assert tp2.core.worker.shard.size == 2
            mlp = tp2.core.worker.model.layers[0].mlp
            assert mlp.w13.shape[0] == (4 if ep else 8)
            got = record_logits(tp2)
            assert run_all(tp2, work, params) == want
            assert len(got) == len(ref) > 0
            for a, b in zip(got, ref, strict=True):
                assert a.shape == b.shape and a.shape[1] == VOCAB
                assert ((a - b).abs().max() / b.abs().max()).item() < 1e-4
            assert_no_blocks_in_use(tp2)
        finally:
            tp2.shutdown()


# ---- MXFP4 ---------------------------------------------------------------------------------
def mxfp4_quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """MXFP4 by its definition, rows of ``w`` [..., K] (K a multiple of 32) in groups of 32:
    each group's scale 2 ** e (e the least with every |v| / 2 ** e <= 6, the largest E2M1),
    each value the nearest E2M1 code; two codes a byte, the first in the low nibble.
    (blocks [..., K / 32, 16], scales [..., K / 32], the values the codes stand for)."""
    *lead, k = w.shape
    groups = w.reshape(*lead, k // 32, 32)
    amax = groups.abs().amax(-1).clamp(min=1e-30)
    exps = torch.ceil(torch.log2(amax / 6.0))
    scaled = groups / torch.exp2(exps)[..., None]
    mags = torch.tensor(E2M1[:8])
    codes = (scaled.abs()[..., None] - mags).abs().argmin(-1)  # nearest magnitude
    codes = codes + 8 * (scaled < 0)
    values = torch.tensor(E2M1)[codes] * torch.exp2(exps)[..., None]
    pairs = codes.reshape(*lead, k // 32, 16, 2)
    blocks = (pairs[..., 0] | (pairs[..., 1] << 4)).to(torch.uint8)
    scales = (exps + 127).to(torch.uint8)
    return blocks, scales, values.reshape(*lead, k)


def test_mxfp4_dequantizes_to_the_values_its_codes_stand_for() -> None:
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(3, 5, 64, generator=gen) * torch.exp2(torch.randint(-6, 6, (3, 5, 1)))
    blocks, scales, values = mxfp4_quantize(w)
    got = dequantize_mxfp4(blocks, scales)
    assert torch.equal(got, values)
    # A group's values are within half a step of the largest code's spacing (2 * 2 ** e).
    assert (got - w).abs().max() <= (w.abs().amax() / 6.0) * 2
    # The nibble order matters: the high nibble first would differ.
    swapped = ((blocks & 0x0F) << 4) | (blocks >> 4)
    assert not torch.equal(dequantize_mxfp4(swapped, scales), values)


@pytest.fixture(scope="module")
def mxfp4_dirs(gpt_oss_dir, tmp_path_factory) -> tuple[Path, Path]:
    """The GPT-OSS model with its experts in MXFP4 (``*_blocks`` + ``*_scales``, as the
    published checkpoints), and the same model with the float values those codes stand
    for."""
    from safetensors.torch import load_file, save_file

    root = tmp_path_factory.mktemp("mxfp4")
    quant, floats = root / "mxfp4", root / "float"
    shutil.copytree(gpt_oss_dir, quant)
    shutil.copytree(gpt_oss_dir, floats)
    tensors = load_file(str(gpt_oss_dir / "model.safetensors"))
    q_tensors, f_tensors = {}, {}
    for name, t in tensors.items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            # The blocks hold each expert's [out, in]; the HF parameter is [in, out].
            blocks, scales, values = mxfp4_quantize(t.transpose(1, 2).contiguous())
            q_tensors[name + "_blocks"], q_tensors[name + "_scales"] = blocks, scales
            f_tensors[name] = values.transpose(1, 2).contiguous()
        else:
            q_tensors[name] = f_tensors[name] = t
    save_file(q_tensors, str(quant / "model.safetensors"), metadata={"format": "pt"})
    save_file(f_tensors, str(floats / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((quant / "config.json").read_text())
    cfg["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": [
            "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens",
            "lm_head",
        ],
    }  # fmt: skip
    (quant / "config.json").write_text(json.dumps(cfg))
    return quant, floats


def test_mxfp4_experts_load_as_their_float_values(mxfp4_dirs, caplog) -> None:
    quant, floats = mxfp4_dirs
    with caplog.at_level(logging.INFO):
        q_engine = make_engine(quant)
    assert any("mxfp4" in r.message and "dequantized" in r.message for r in caplog.records)
    f_engine = make_engine(floats)
    q_model, f_model = q_engine.core.worker.model, f_engine.core.worker.model
    for a, b in zip(q_model.layers, f_model.layers, strict=True):
        assert torch.equal(a.mlp.w13, b.mlp.w13) and torch.equal(a.mlp.w2, b.mlp.w2)
    for ids in prompts(2):
        torch.testing.assert_close(
            all_row_logits(q_engine, ids, 10_000), all_row_logits(f_engine, ids, 10_000)
        )
    params = SamplingParams(max_tokens=8, min_tokens=8, temperature=0.0)
    assert run_all(q_engine, prompts(), params) == run_all(f_engine, prompts(), params)


def test_mxfp4_without_its_scales_is_refused(mxfp4_dirs, tmp_path) -> None:
    from safetensors.torch import load_file, save_file

    path = tmp_path / "m"
    shutil.copytree(mxfp4_dirs[0], path)
    tensors = load_file(str(path / "model.safetensors"))
    del tensors["model.layers.1.mlp.experts.down_proj_scales"]
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"model.layers.1.mlp.experts.down_proj.*only its blocks"):
        make_engine(path)


# ---- block FP8 -----------------------------------------------------------------------------
FP8_BLOCK = (24, 40)  # DeepSeek-V3 / Qwen3-FP8 ship [128, 128]; here partial edge blocks


def fp8_quantize(
    w: torch.Tensor, block: tuple[int, int]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Block FP8 by its definition: each bm x bn block of ``w`` scaled by amax / 448 (e4m3's
    largest) into float8; (the float8 weight, the scales [ceil(M / bm), ceil(N / bn)], the
    values it stands for: float8 times its block's scale)."""
    bm, bn = block
    m, n = w.shape
    scales = torch.empty(math.ceil(m / bm), math.ceil(n / bn))
    q = torch.empty(m, n, dtype=torch.float8_e4m3fn)
    values = torch.empty(m, n)
    for i in range(scales.shape[0]):
        for j in range(scales.shape[1]):
            part = w[i * bm : (i + 1) * bm, j * bn : (j + 1) * bn]
            s = part.abs().amax().clamp(min=1e-12) / 448.0
            scales[i, j] = s
            qp = (part / s).to(torch.float8_e4m3fn)
            q[i * bm : (i + 1) * bm, j * bn : (j + 1) * bn] = qp
            values[i * bm : (i + 1) * bm, j * bn : (j + 1) * bn] = qp.float() * s
    return q, scales, values


def test_fp8_blocks_dequantize_to_their_values() -> None:
    w = torch.randn(50, 90, generator=torch.Generator().manual_seed(0))
    q, scales, values = fp8_quantize(w, FP8_BLOCK)
    assert scales.shape == (3, 3)
    got = dequantize_fp8_blocks(q, scales, FP8_BLOCK)
    assert torch.equal(got, values)
    assert ((got - w).norm() / w.norm()).item() < 0.05  # e4m3: 3 mantissa bits
    with pytest.raises(ValueError, match="scales"):
        dequantize_fp8_blocks(q, scales[:2], FP8_BLOCK)


@pytest.fixture(scope="module")
def fp8_dirs(tmp_path_factory, hf_dir: Path) -> tuple[Path, Path]:
    """A tiny Qwen3-MoE with every projection of its layers in block FP8 (the embeddings,
    norms, routers and head unquantized, as Qwen3-FP8 ships), and the same model with the
    values the float8 weights stand for."""
    from safetensors.torch import load_file, save_file

    root = tmp_path_factory.mktemp("fp8")
    src = write_model(root / "src", moe_hf_config("qwen3_moe"), hf_dir)
    quant, floats = root / "fp8", root / "float"
    shutil.copytree(src, quant)
    shutil.copytree(src, floats)
    tensors = load_file(str(src / "model.safetensors"))
    q_tensors, f_tensors = {}, {}
    for name, t in tensors.items():
        if name.endswith("mlp.gate.weight"):
            t = t * 20  # no near-ties among the top k (see test_moe)
        if name.startswith("model.layers.") and name.endswith("_proj.weight"):
            q, scales, values = fp8_quantize(t, FP8_BLOCK)
            q_tensors[name], q_tensors[name[: -len("weight")] + "weight_scale_inv"] = q, scales
            f_tensors[name] = values
        else:
            q_tensors[name] = f_tensors[name] = t
    save_file(q_tensors, str(quant / "model.safetensors"), metadata={"format": "pt"})
    save_file(f_tensors, str(floats / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((quant / "config.json").read_text())
    cfg["quantization_config"] = {
        "quant_method": "fp8",
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "weight_block_size": list(FP8_BLOCK),
    }
    (quant / "config.json").write_text(json.dumps(cfg))
    return quant, floats


def test_fp8_checkpoint_loads_as_its_float_values(fp8_dirs, caplog) -> None:
    quant, floats = fp8_dirs
    with caplog.at_level(logging.INFO):
        q_engine = make_engine(quant)
    assert any("fp8" in r.message and "dequantized" in r.message for r in caplog.records)
    f_engine = make_engine(floats)
    for ids in prompts(2):
        torch.testing.assert_close(
            all_row_logits(q_engine, ids, 10_000), all_row_logits(f_engine, ids, 10_000)
        )
    params = SamplingParams(max_tokens=8, min_tokens=8, temperature=0.0)
    assert run_all(q_engine, prompts(), params) == run_all(f_engine, prompts(), params)


# ---- what we do not serve ------------------------------------------------------------------
@pytest.mark.parametrize(
    "quant, field",
    [
        ({"quant_method": "gptq", "bits": 4}, "quant_method 'gptq'"),
        ({"quant_method": "fp8", "activation_scheme": "dynamic"}, "weight_block_size"),
        (
            {"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "static"},
            "activation_scheme",
        ),
    ],
)
def test_quantization_we_do_not_load_is_refused_naming_it(
    fp8_dirs, tmp_path, quant, field, no_weight_loading
) -> None:
    path = variant(fp8_dirs[0], tmp_path / "m", quantization_config=quant)
    with pytest.raises(ValueError, match=field):
        make_engine(path)


def _fuse_gate_up(tensors: dict) -> None:
    """Newer converters' fused ffn_gate_up_exps (gate rows, then up rows) and its bias."""
    import numpy as np

    for name in [n for n in tensors if ".ffn_gate_exps." in n]:
        up = tensors.pop(name.replace("gate_exps", "up_exps"))
        fused = np.concatenate((tensors.pop(name), up), axis=-2 if name.endswith("weight") else -1)
        tensors[name.replace("gate_exps", "gate_up_exps")] = fused


@pytest.mark.parametrize("experts", ["mxfp4", "f32", "f32-fused"])
def test_gguf_matches_the_directory(mxfp4_dirs, tmp_path, experts: str) -> None:
    """Written as llama.cpp's converter writes GPT-OSS (gate_up_proj's interleaved columns
    split into ffn_gate_exps / ffn_up_exps, or fused gate-then-up; down_proj as [E, H, I];
    sinks, router bias; the experts in GGUF MXFP4 of the checkpoint's own codes, or F32): the
    logits and greedy tokens of the directory of the float values. llama.cpp hard-codes
    the SwiGLU clamp at 7.0, so the directory compared has that."""
    import gguf

    from chunkserve.model.loader import gguf_model_config, hf_model_config, open_gguf
    from tests.test_gguf import _compare, write_gguf

    quant, floats = mxfp4_dirs
    ref = variant(floats, tmp_path / "ref", swiglu_limit=7.0)
    src = quant if experts == "mxfp4" else ref
    edit = _fuse_gate_up if experts == "f32-fused" else None
    path = write_gguf(src, tmp_path / "m.gguf", edit=edit)
    reader = open_gguf(path)
    types = {t.name: t.tensor_type for t in reader.tensors}
    if experts == "mxfp4":
        assert types["blk.0.ffn_gate_exps.weight"] == gguf.GGMLQuantizationType.MXFP4
        assert types["blk.1.ffn_down_exps.weight"] == gguf.GGMLQuantizationType.MXFP4
    got, want = gguf_model_config(reader), hf_model_config(ref)
    for field in (
        "architecture", "attention_sinks", "sliding_window", "window_layers", "swiglu_limit",
        "swiglu_alpha", "rope_scaling", "num_experts", "num_experts_per_tok", "head_dim",
        "attention_bias",
    ):  # fmt: skip
        g, w = getattr(got, field), getattr(want, field)
        if field == "rope_scaling":  # the keys the file has (the others: their defaults)
            w = {k: v for k, v in w.items() if k in g}
            g = {k: v for k, v in g.items() if k in w}
        assert g == w, (field, g, w)
    _compare(ref, path, 1e-5)


def test_sinks_pick_a_backend_with_them_or_are_refused_by_name(
    gpt_oss_dir, caplog, monkeypatch
) -> None:
    """``auto`` on a CPU picks the C kernel's backend, which has the sink term; a backend
    without sinks (the C kernel's, given the base class's ``supports``) makes ``auto`` take
    the torch backend instead (a log line), and naming it is refused."""
    from chunkserve.attention import cpu_kernels
    from chunkserve.attention.base import AttentionBackend
    from chunkserve.attention.cpu_paged import CpuAttentionBackend
    from chunkserve.attention.torch_ref import TorchAttentionBackend

    if cpu_kernels.load() is None:
        pytest.skip("the C attention kernel does not build here")
    assert type(make_engine(gpt_oss_dir).core.worker.attention) is CpuAttentionBackend
    monkeypatch.setattr(CpuAttentionBackend, "supports", AttentionBackend.supports)
    with caplog.at_level(logging.INFO):
        engine = make_engine(gpt_oss_dir)
    assert type(engine.core.worker.attention) is TorchAttentionBackend
    assert any("using torch" in r.message for r in caplog.records)
    with pytest.raises(ValueError, match="attention sinks.*choose another --attention-backend"):
        make_engine(gpt_oss_dir, attention_backend="cpu")


def test_a_draft_model_chooses_its_backend_as_the_target_does(gpt_oss_dir, monkeypatch) -> None:
    """The draft model's ``auto`` is the target's (one function): where the C kernel's
    backend lacks sinks, both take the torch backend (not a refusal of the draft); where the
    kernel does not build, both take the torch backend; otherwise both the C kernel's."""
    from chunkserve.attention import cpu_kernels
    from chunkserve.attention.base import AttentionBackend
    from chunkserve.attention.cpu_paged import CpuAttentionBackend
    from chunkserve.attention.torch_ref import TorchAttentionBackend

    spec = {"method": "draft_model", "model": str(gpt_oss_dir), "num_speculative_tokens": 2}

    def backends() -> tuple[type, type]:
        worker = make_engine(gpt_oss_dir, speculative_config=spec, load_format="dummy").core.worker
        return type(worker.attention), type(worker.draft.attention)

    if cpu_kernels.load() is not None:
        assert backends() == (CpuAttentionBackend, CpuAttentionBackend)
    with monkeypatch.context() as m:  # the kernel's backend without sinks
        m.setattr(CpuAttentionBackend, "supports", AttentionBackend.supports)
        assert backends() == (TorchAttentionBackend, TorchAttentionBackend)
    with monkeypatch.context() as m:  # the kernel does not build
        m.setattr(cpu_kernels, "load", lambda: None)
        assert backends() == (TorchAttentionBackend, TorchAttentionBackend)


def test_norms_multiply_by_their_weight_in_fp32_as_transformers() -> None:
    """bf16: transformers' GPT-OSS norm (weight kept fp32) multiplies the fp32 normed values
    and casts once; ours the same (Llama's casts first, then multiplies: other roundings)."""
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRMSNorm

    from chunkserve.model.gpt_oss import GptOssModel
    from chunkserve.model.layers import RMSNorm

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64, 256, generator=gen).to(torch.bfloat16)
    w = (1 + 0.3 * torch.randn(256, generator=gen)).to(torch.bfloat16)
    hf = GptOssRMSNorm(256, eps=1e-5)
    with torch.no_grad():
        hf.weight.copy_(w.float())
        want = hf(x)
    ours = RMSNorm(256, 1e-5, torch.bfloat16, torch.device("cpu"), fp32_weight=True)
    llama = RMSNorm(256, 1e-5, torch.bfloat16, torch.device("cpu"))
    with torch.no_grad():
        ours.weight.copy_(w)
        llama.weight.copy_(w)
    assert GptOssModel.norm_fp32_weight
    assert torch.equal(ours(x), want)
    assert not torch.equal(llama(x), want)


def test_sinks_are_kept_in_fp32_so_the_triton_kernel_reads_them_without_a_copy(
    gpt_oss_dir,
) -> None:
    """A bf16 model's sink logits load into fp32 parameters (exactly: bf16 values are fp32
    values) and the Triton backend hands that very tensor to its kernel; a bf16 copy would
    be converted in every layer of every step."""
    from safetensors import safe_open

    from chunkserve.attention.triton_paged import _fp32
    from chunkserve.model.loader import hf_model_config, iter_hf_weights
    from chunkserve.model.registry import build_model

    config = hf_model_config(gpt_oss_dir)
    model = build_model(config, torch.bfloat16, torch.device("cpu"), max_positions=64)
    model.load_weights(iter_hf_weights(gpt_oss_dir, torch.bfloat16))
    sinks = [m.sinks for m in model.modules() if getattr(m, "sinks", None) is not None]
    assert len(sinks) == config.num_layers
    with safe_open(gpt_oss_dir / "model.safetensors", "pt") as f:
        want = f.get_tensor("model.layers.0.self_attn.sinks").to(torch.bfloat16).float()
    assert all(s.dtype == torch.float32 for s in sinks)
    assert torch.equal(sinks[0], want)
    assert _fp32(sinks[0]) is sinks[0]
    assert torch.equal(_fp32(sinks[0].to(torch.bfloat16)), want)


# openai/gpt-oss-20b's config.json as published (transformers 4.55: rope_scaling beside
# rope_theta, no rope_parameters; MXFP4 experts).
GPT_OSS_20B = {
    "architectures": ["GptOssForCausalLM"],
    "attention_bias": True,
    "attention_dropout": 0.0,
    "eos_token_id": 200002,
    "experts_per_token": 4,
    "head_dim": 64,
    "hidden_act": "silu",
    "hidden_size": 2880,
    "initial_context_length": 4096,
    "initializer_range": 0.02,
    "intermediate_size": 2880,
    "layer_types": ["sliding_attention", "full_attention"] * 12,
    "max_position_embeddings": 131072,
    "model_type": "gpt_oss",
    "num_attention_heads": 64,
    "num_experts_per_tok": 4,
    "num_hidden_layers": 24,
    "num_key_value_heads": 8,
    "num_local_experts": 32,
    "output_router_logits": False,
    "pad_token_id": 199999,
    "quantization_config": {
        "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router"]
        + ["model.embed_tokens", "lm_head"],
        "quant_method": "mxfp4",
    },
    "rms_norm_eps": 1e-05,
    "rope_scaling": {
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "factor": 32.0,
        "original_max_position_embeddings": 4096,
        "rope_type": "yarn",
        "truncate": False,
    },
    "rope_theta": 150000,
    "router_aux_loss_coef": 0.9,
    "sliding_window": 128,
    "swiglu_limit": 7.0,
    "tie_word_embeddings": False,
    "use_cache": True,
    "vocab_size": 201088,
}


def test_the_published_config_reads_as_transformers_reads_it(tmp_path) -> None:
    import transformers
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from chunkserve.model.layers import rope_inv_freq
    from chunkserve.model.loader import hf_model_config
    from chunkserve.model.registry import layer_spec

    (tmp_path / "config.json").write_text(json.dumps(GPT_OSS_20B))
    config = hf_model_config(tmp_path)
    assert config.architecture == "gpt_oss"
    assert (config.num_experts, config.num_experts_per_tok) == (32, 4)
    assert config.expert_intermediate_size == 2880
    assert config.window_layers == tuple(range(0, 24, 2)) and config.sliding_window == 128
    assert config.attention_sinks and config.attention_bias
    assert (config.swiglu_limit, config.swiglu_alpha) == (7.0, 1.702)
    spec0, spec1 = layer_spec(config, 0), layer_spec(config, 1)
    assert spec0.sliding_window == 128 and spec0.sinks
    assert spec1.sliding_window is None and spec1.sinks
    hf = transformers.GptOssConfig(**GPT_OSS_20B)
    want, want_factor = ROPE_INIT_FUNCTIONS["yarn"](hf, "cpu")
    got, factor = rope_inv_freq(config, config.max_position_embeddings)
    torch.testing.assert_close(got, want.float(), rtol=1e-6, atol=0)
    assert factor == pytest.approx(want_factor)


def test_a_slice_dequantizes_as_the_whole_tensor_does() -> None:
    """``LazyDequant[src]`` (what a tensor-parallel rank reads) equals the whole tensor's
    dequantized values there, for slices that start and end inside MXFP4's 32-value groups
    and FP8's blocks, with steps (GPT-OSS's interleaved gate/up columns) and empty ones."""
    from chunkserve.model.hf_quant import LazyDequant

    gen = torch.Generator().manual_seed(0)
    w = torch.randn(3, 24, 96, generator=gen)  # [E, out, in]: in is 3 groups of 32
    blocks, scales, values = mxfp4_quantize(w)
    whole = values.transpose(1, 2)  # the HF parameter [E, in, out]
    lazy = LazyDequant("mxfp4", {"blocks": blocks, "scales": scales}, torch.float32)
    assert lazy.shape == whole.shape
    f8 = (torch.randn(50, 70, generator=gen) * 4).to(torch.float8_e4m3fn)
    scale = torch.rand(3, 4, generator=gen) + 0.5  # 24 x 20 blocks, partial at the edges
    fp8 = LazyDequant("fp8", {"weight": f8, "scale": scale}, torch.float32, (24, 20))
    fp8_whole = dequantize_fp8_blocks(f8, scale, (24, 20))
    cases = [
        (lazy, whole, (slice(None),)),
        (lazy, whole, (slice(1, 3), slice(40, 70))),  # rows inside groups 1 and 2
        (lazy, whole, (slice(None), slice(None), slice(5, 21, 2))),  # interleaved columns
        (lazy, whole, (slice(0, 2), slice(33, 34), slice(1, None, 2))),
        (lazy, whole, (slice(0, 0),)),
        (fp8, fp8_whole, (slice(10, 45), slice(None))),
        (fp8, fp8_whole, (slice(None), slice(19, 61))),
        (fp8, fp8_whole, (slice(23, 25), slice(1, 70, 3))),
    ]
    for t, full, src in cases:
        got = t[src]
        assert got.shape == full[src].shape, src
        assert torch.equal(got, full[src]), src


def test_tensor_parallel_ranks_of_quantized_checkpoints_match_one_process(
    mxfp4_dirs, fp8_dirs
) -> None:
    """Each rank dequantizes only its share (its experts' columns; its rows or columns of
    the FP8 projections): tensor parallel 2 of the quantized checkpoint gives one process's
    logits of the float values."""
    work = [*prompts(), random_prompt(random.Random(3), 100)]
    params = SamplingParams(max_tokens=6, min_tokens=6, temperature=0.0)
    for quant, floats in (mxfp4_dirs, fp8_dirs):
        tp1 = make_engine(floats, max_num_batched_tokens=64)
        ref = record_logits(tp1)
        want = run_all(tp1, work, params)
        tp2 = make_engine(quant, max_num_batched_tokens=64, tensor_parallel_size=2)
        try:
            got = record_logits(tp2)
            assert run_all(tp2, work, params) == want
            assert len(got) == len(ref) > 0
            for a, b in zip(got, ref, strict=True):
                assert ((a - b).abs().max() / b.abs().max()).item() < 1e-4
        finally:
            tp2.shutdown()


def test_fp8_tensors_without_their_pair_or_of_another_kind_are_refused() -> None:
    from chunkserve.model.hf_quant import dequantize_stream

    cfg = {"quantization_config": {"quant_method": "fp8", "weight_block_size": [2, 2]}}
    w = torch.ones(4, 4).to(torch.float8_e4m3fn)

    def run(items):
        return dict(dequantize_stream(iter(items), "fp8", torch.float32, cfg))

    # Either order; unquantized tensors pass through.
    got = run([("a.weight_scale_inv", torch.full((2, 2), 0.5)), ("a.weight", w), ("n", w.float())])
    assert torch.equal(got["a.weight"], torch.full((4, 4), 0.5)) and "n" in got
    with pytest.raises(ValueError, match="'a.weight' has only its weight"):
        run([("a.weight", w)])
    with pytest.raises(ValueError, match="float8_e5m2"):
        run([("b.weight", torch.ones(4, 4).to(torch.float8_e5m2))])


def test_expert_biases_only_load_from_the_stacked_tensors() -> None:
    """Biased experts with per-expert names would leave the biases unloaded: refused."""
    from chunkserve.distributed.shard import plan_shards
    from chunkserve.model.moe import GPT_OSS_NAMES, MOE_NAMES, SparseMoE
    from tests.test_moe import moe_config

    config = moe_config()
    cpu = torch.device("cpu")
    biased = SparseMoE(config, plan_shards(config, 1, 0), torch.float32, cpu, None, bias=True)
    assert "mlp.experts.gate_up_proj_bias" in biased.targets("", GPT_OSS_NAMES)
    with pytest.raises(ValueError, match="expert biases"):
        biased.targets("", MOE_NAMES)
    shared = moe_config(shared_expert_intermediate_size=8)
    with pytest.raises(ValueError, match="no shared expert"):
        SparseMoE(shared, plan_shards(shared, 1, 0), torch.float32, cpu, None, bias=True).targets(
            "", GPT_OSS_NAMES
        )
