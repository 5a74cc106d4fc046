"""GGUF files as llama.cpp writes them, for every family on main: the tiny model of
``test_model_families`` (an HF directory) written with gguf-py in llama.cpp's names
(gguf-py's own ``TensorNameMap``) and conventions (``write_gguf`` mirrors the converter),
loaded by chunkserve: the same logits and greedy tokens as the directory. Then what a GGUF
we cannot honour gets: a ValueError naming the key or tensor.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from chunkserve.model.loader import gguf_model_config, hf_model_config, open_gguf
from chunkserve.scheduling.sampling_params import SamplingParams
from tests.test_model_families import (  # noqa: F401 (model_dirs: a fixture)
    FAMILIES,
    FAMILY_OF,
    make_engine,
    model_dirs,
    prompts,
    run_all,
    variant,
)
from tests.test_model_parity import all_row_logits

# HF model_type -> llama.cpp's general.architecture (its converter writes Mistral as llama).
GGUF_ARCH = {
    "mistral": "llama",
    "mixtral": "llama",
    "gemma3_text": "gemma3",
    "qwen2_moe": "qwen2moe",
    "qwen3_moe": "qwen3moe",
    "deepseek_v2": "deepseek2",
    "deepseek_v3": "deepseek2",
    "gpt_oss": "gpt-oss",
}
# The converters derived from llama.cpp's LlamaModel, which permute Q/K rows.
DEEPSEEK = ("deepseek_v2", "deepseek_v3")
PERMUTED = {"llama", "mistral", "mixtral", "granite", "smollm3"}
# One expert's tensor of a mixture of experts: the converters stack them over experts.
EXPERT = re.compile(r"^(model\.layers\.\d+\.\w+\.experts)\.(\d+)\.(\w+)\.weight$")
# A multi-token-prediction layer's own tensors (DeepSeek-V3's).
NEXTN = re.compile(
    r"^model\.layers\.(\d+)\.(eh_proj|enorm|hnorm|embed_tokens|shared_head\.norm|"
    r"shared_head\.head)\.weight$"
)
# llama.cpp's converters of these store every norm as 1 + w.
GEMMA = {"gemma2", "gemma3_text"}
# What a GGUF cannot say, and llama.cpp hard-codes: the directory a family's GGUF is written
# from (and compared with) has it. Gemma 2 below 27B: softmax scale head_dim ** -0.5.
GGUF_SOURCE = {"gemma2": {"query_pre_attn_scalar": 128}}


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's ``LlamaModel.permute``: each head's rows from HF's half-split rotary
    layout to llama.cpp's interleaved pairs."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def _llama3_rope_freqs(cfg: dict, rope: dict) -> np.ndarray:
    """llama.cpp's converter's ``rope_freqs`` for Llama 3 rope scaling."""
    dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    freqs = 1.0 / (rope["rope_theta"] ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old = rope["original_max_position_embeddings"]
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def write_gguf(
    hf_dir: Path,
    out: Path,
    quant: str | None = None,
    extra: dict | None = None,
    edit=None,
    split_kv_b: bool = False,
):
    """The HF directory as llama.cpp's ``convert_hf_to_gguf.py`` writes it (F32, or Q8_0
    matrices, stacked experts' too, with ``quant="Q8_0"``; any type gguf-py quantizes),
    with the embedded model's tokenizer. ``extra``: more metadata (key -> value) to write;
    ``edit``: changes the GGUF-named tensors (a dict). DeepSeek-V2: ``split_kv_b`` as newer
    converters write ``kv_b_proj`` (attn_k_b, attn_v_b). GPT-OSS: experts as the converter
    splits them; a directory with MXFP4 experts (``*_blocks``, ``*_scales``) gives GGUF MXFP4
    tensors of the same codes."""
    import gguf
    from safetensors.torch import load_file

    from chunkserve.model.loader import embedded_model_path

    cfg = json.loads((hf_dir / "config.json").read_text())
    family = cfg["model_type"]
    arch = GGUF_ARCH.get(family, family)
    rope = cfg.get("rope_parameters") or {"rope_theta": cfg["rope_theta"]}
    rope = rope.get("full_attention", rope)  # Gemma 3: the global layers' (the file's)
    n_head, n_kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    w = gguf.GGUFWriter(str(out), arch)
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    # DeepSeek-V3's multi-token-prediction layers: block_count counts them, the key says
    # how many (as llama.cpp's converters write MTP layers: Glm4MoeModel's way).
    nextn = cfg.get("num_nextn_predict_layers") or 0
    w.add_block_count(cfg["num_hidden_layers"] + nextn)
    if nextn:
        w.add_nextn_predict_layers(nextn)
    w.add_head_count(n_head)
    w.add_head_count_kv(1 if family in DEEPSEEK else n_kv)  # MLA written as MQA
    w.add_rope_freq_base(rope["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    if family != "phi3":  # Phi3MiniModel.set_gguf_parameters writes none
        w.add_vocab_size(cfg["vocab_size"])
    # Granite's converter drops head_dim; DeepSeek's writes its own (below).
    if cfg.get("head_dim") and family not in ("granite", *DEEPSEEK):
        w.add_key_length(cfg["head_dim"])
        w.add_value_length(cfg["head_dim"])
    if family in PERMUTED:  # LlamaModel.set_gguf_parameters
        w.add_rope_dimension_count(cfg.get("head_dim") or cfg["hidden_size"] // n_head)
    if family in GEMMA and cfg.get("sliding_window"):
        w.add_sliding_window(cfg["sliding_window"])
    if family == "gemma2":
        w.add_attn_logit_softcapping(cfg["attn_logit_softcapping"])
        w.add_final_logit_softcapping(cfg["final_logit_softcapping"])
    if family == "granite":
        w.add_attention_scale(cfg["attention_multiplier"])
        w.add_embedding_scale(cfg["embedding_multiplier"])
        w.add_residual_scale(cfg["residual_multiplier"])
        w.add_logit_scale(cfg["logits_scaling"])
    if family == "phi3":  # Phi3MiniModel.set_gguf_parameters / generate_extra_tensors
        # (the top-level original length wins over the rope dict's, as in transformers)
        orig = (
            cfg.get("original_max_position_embeddings") or rope["original_max_position_embeddings"]
        )
        w.add_rope_scaling_orig_ctx_len(orig)
        partial = rope.get("partial_rotary_factor", 1.0)
        w.add_rope_dimension_count(int(partial * cfg["hidden_size"]) // n_head)
        w.add_sliding_window(cfg.get("sliding_window") or 0)
        if rope.get("long_factor"):
            scale = cfg["max_position_embeddings"] / orig
            w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(orig)))
            for kind in ("long", "short"):
                factors = np.array(rope[f"{kind}_factor"], dtype=np.float32)
                w.add_tensor(f"rope_factors_{kind}.weight", factors)
    if family in DEEPSEEK:
        _deepseek_keys(w, cfg, rope)
    if family == "gpt_oss":  # GptOssModel.set_gguf_parameters, and the base's YaRN keys
        w.add_sliding_window(cfg["sliding_window"])
        w.add_expert_feed_forward_length(cfg["intermediate_size"])
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rope["factor"])
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    experts = cfg.get("num_local_experts") or cfg.get("num_experts") or cfg.get("n_routed_experts")
    if experts:  # the converters' MoE keys
        w.add_expert_count(experts)
        w.add_expert_used_count(cfg["num_experts_per_tok"])
        if cfg.get("moe_intermediate_size"):
            w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
        if cfg.get("shared_expert_intermediate_size"):
            w.add_expert_shared_feed_forward_length(cfg["shared_expert_intermediate_size"])
    for key, value in (extra or {}).items():
        w.add_key_value(key, value, _value_type(value))
    _copy_tokenizer(w, open_gguf(embedded_model_path()))

    names = gguf.get_tensor_name_map(
        {v: k for k, v in gguf.MODEL_ARCH_NAMES.items()}[arch], cfg["num_hidden_layers"] + nextn
    )
    tensors = {}
    stacked: dict[str, dict[int, np.ndarray]] = {}  # "...experts.gate_proj" -> expert -> tensor
    if rope.get("rope_type") == "llama3":
        tensors["rope_freqs.weight"] = _llama3_rope_freqs(cfg, rope)
    raw: dict[str, tuple[np.ndarray, object]] = {}  # GGUF name -> (bytes, GGML type)
    pending: dict[str, dict[str, torch.Tensor]] = {}  # MXFP4 pairs waiting for their partner
    for name, tensor in load_file(str(hf_dir / "model.safetensors")).items():
        if name == "lm_head.weight" and cfg.get("tie_word_embeddings"):
            continue
        if family == "gpt_oss" and (".experts." in name or name.endswith("sinks")):
            _gpt_oss_tensor(name, tensor, names, tensors, raw, pending)
            continue
        data = tensor.float().numpy()
        if family in GEMMA and name.endswith("norm.weight"):
            data = data + 1.0  # Gemma's converters: norms as 1 + w
        if family in PERMUTED and ".q_proj." in name:
            data = _permute(data, n_head)
        elif family in PERMUTED and ".k_proj." in name:
            data = _permute(data, n_kv)
        mtp = NEXTN.match(name)
        if mtp:  # gguf-py's MODEL_TENSOR.NEXTN_* names
            tensors[f"blk.{mtp[1]}.nextn.{mtp[2].replace('.', '_')}.weight"] = data
            continue
        expert = EXPERT.match(name)
        if expert:
            prefix, index, proj = expert.groups()
            stacked.setdefault(f"{prefix}.{proj}", {})[int(index)] = data
            continue
        if name.endswith("e_score_correction_bias"):  # the converter's rename, then mapped
            name = name.removesuffix("_bias") + ".bias"
        gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        assert gguf_name is not None, name
        tensors[gguf_name] = data
    for name, parts in stacked.items():
        gguf_name = names.get_name(name)
        assert gguf_name is not None, name
        tensors[gguf_name + ".weight"] = np.stack([parts[e] for e in range(len(parts))])
    if family in DEEPSEEK and split_kv_b:
        _split_kv_b(tensors, cfg)
    if edit is not None:
        edit(tensors)
    assert not pending, sorted(pending)
    for gguf_name, (data, qtype) in raw.items():
        w.add_tensor(gguf_name, data, raw_dtype=qtype)
    for gguf_name, data in tensors.items():
        if quant and data.ndim >= 2:  # matrices and stacked experts' matrices
            qtype = gguf.GGMLQuantizationType[quant]
            w.add_tensor(gguf_name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(gguf_name, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def _deepseek_keys(w, cfg: dict, rope: dict) -> None:
    """DeepseekV2Model.set_gguf_parameters: MLA as MQA over the latent, the MoE keys (the
    gating function from ``scoring_func``: sigmoid for V3; the group counts as the base
    converter writes them from ``n_group`` / ``topk_group``), YaRN's mscale_all_dim as
    0.1 x it in yarn_log_multiplier."""
    import gguf

    rank, rope_dim = cfg["kv_lora_rank"], cfg["qk_rope_head_dim"]
    w.add_leading_dense_block_count(cfg["first_k_dense_replace"])
    if cfg.get("q_lora_rank"):
        w.add_q_lora_rank(cfg["q_lora_rank"])
    w.add_kv_lora_rank(rank)
    w.add_key_length(rank + rope_dim)
    w.add_value_length(rank)
    w.add_key_length_mla(cfg["qk_nope_head_dim"] + rope_dim)
    w.add_value_length_mla(cfg["v_head_dim"])
    w.add_expert_shared_count(cfg["n_shared_experts"])
    w.add_expert_weights_scale(cfg["routed_scaling_factor"])
    if cfg.get("norm_topk_prob"):
        w.add_expert_weights_norm(True)
    v3 = cfg["model_type"] == "deepseek_v3"
    if v3 or cfg.get("n_group", 1) > 1:
        w.add_expert_group_count(cfg["n_group"])
        w.add_expert_group_used_count(cfg["topk_group"])
    kind = "SIGMOID" if v3 else "SOFTMAX"
    w.add_expert_gating_func(gguf.ExpertGatingFuncType[kind])
    w.add_rope_dimension_count(rope_dim)
    if rope.get("rope_type") == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rope["factor"])
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        w.add_rope_scaling_yarn_log_mul(0.1 * rope["mscale_all_dim"])


def _split_kv_b(tensors: dict, cfg: dict) -> None:
    """Newer converters' attn_k_b ([H, rank, nope]: W_UK transposed) and attn_v_b
    ([H, v, rank]) in place of attn_kv_b."""
    heads, nope, v = cfg["num_attention_heads"], cfg["qk_nope_head_dim"], cfg["v_head_dim"]
    for name in [n for n in tensors if n.endswith("attn_kv_b.weight")]:
        kv_b = tensors.pop(name)
        per_head = kv_b.reshape(heads, nope + v, kv_b.shape[-1])
        tensors[name.replace("kv_b", "k_b")] = np.ascontiguousarray(
            per_head[:, :nope].transpose(0, 2, 1)
        )
        tensors[name.replace("kv_b", "v_b")] = np.ascontiguousarray(per_head[:, nope:])


def _mxfp4_ggml(blocks: torch.Tensor, scales: torch.Tensor) -> np.ndarray:
    """GGUF MXFP4 bytes [..., G * 17] of the same codes as HF's MXFP4 (``blocks`` [..., G,
    16], the low nibble the even value; ``scales`` [..., G], E8M0): ggml's block is the scale
    byte, then 16 bytes whose low nibbles are values 0-15 and high nibbles values 16-31."""
    codes = torch.stack((blocks & 0x0F, blocks >> 4), dim=-1).flatten(-2)  # [..., G, 32]
    packed = codes[..., :16] | (codes[..., 16:] << 4)
    out = torch.cat((scales[..., None], packed), dim=-1)  # [..., G, 17]
    return out.flatten(-2).numpy()


def _gpt_oss_tensor(
    name: str, tensor: torch.Tensor, names, tensors: dict, raw: dict, pending: dict
) -> None:
    """GptOssModel's experts and sinks: gate_up_proj's interleaved columns split into gate
    and up ([E, I, H] each, as [out, in]), down_proj as [E, H, I], the biases beside them;
    MXFP4 pairs repacked into GGUF MXFP4 (the rows split the same way)."""
    import gguf

    layer = re.match(r"model\.layers\.(\d+)\.", name)
    assert layer is not None, name
    blk = f"blk.{layer.group(1)}"
    if name.endswith("sinks"):
        tensors[f"{blk}.attn_sinks.weight"] = tensor.float().numpy()
        return
    block = name.split(".experts.")[0]
    proj = name.split(".experts.")[1]
    if proj.endswith(("_blocks", "_scales")):
        base, part = proj.rsplit("_", 1)
        pair = pending.setdefault(f"{block}.{base}", {})
        pair[part] = tensor
        if len(pair) < 2:
            return
        del pending[f"{block}.{base}"]
        b, s = pair["blocks"], pair["scales"]  # [E, out, G, 16], [E, out, G]
        if base == "down_proj":
            raw[f"{blk}.ffn_down_exps.weight"] = (
                _mxfp4_ggml(b, s),
                gguf.GGMLQuantizationType.MXFP4,
            )
            return
        for kind, rows in (("gate", slice(0, None, 2)), ("up", slice(1, None, 2))):
            raw[f"{blk}.ffn_{kind}_exps.weight"] = (
                _mxfp4_ggml(b[:, rows].contiguous(), s[:, rows].contiguous()),
                gguf.GGMLQuantizationType.MXFP4,
            )
        return
    data = tensor.float().numpy()
    if proj == "gate_up_proj":  # [E, H, 2I] -> [E, 2I, H], rows interleaved
        t = data.transpose(0, 2, 1)
        tensors[f"{blk}.ffn_gate_exps.weight"] = np.ascontiguousarray(t[:, ::2])
        tensors[f"{blk}.ffn_up_exps.weight"] = np.ascontiguousarray(t[:, 1::2])
    elif proj == "gate_up_proj_bias":
        tensors[f"{blk}.ffn_gate_exps.bias"] = np.ascontiguousarray(data[:, ::2])
        tensors[f"{blk}.ffn_up_exps.bias"] = np.ascontiguousarray(data[:, 1::2])
    elif proj == "down_proj":
        tensors[f"{blk}.ffn_down_exps.weight"] = np.ascontiguousarray(data.transpose(0, 2, 1))
    elif proj == "down_proj_bias":
        tensors[f"{blk}.ffn_down_exps.bias"] = data
    else:
        raise AssertionError(name)


def _value_type(value):
    import gguf

    if isinstance(value, str):
        return gguf.GGUFValueType.STRING
    if isinstance(value, float):
        return gguf.GGUFValueType.FLOAT32
    return gguf.GGUFValueType.UINT32


def _copy_tokenizer(w, reader) -> None:
    import gguf

    for key, field in reader.fields.items():
        if key.startswith("tokenizer."):
            value = field.contents()
            vtype = field.types[0]
            if vtype == gguf.GGUFValueType.ARRAY:
                w.add_key_value(key, value, vtype, sub_type=field.types[-1])
            else:
                w.add_key_value(key, value, vtype)


@pytest.fixture(scope="module")
def gguf_sources(model_dirs, tmp_path_factory) -> dict[str, Path]:  # noqa: F811
    """Each family's directory, changed where a GGUF cannot say what it has."""
    root = tmp_path_factory.mktemp("gguf_sources")
    out = dict(model_dirs)
    for family, changes in GGUF_SOURCE.items():
        out[family] = variant(model_dirs[family], root / family, **changes)
    return out


@pytest.fixture(scope="module")
def gguf_files(gguf_sources, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("gguf")
    return {f: write_gguf(gguf_sources[f], root / f"{f}.gguf") for f in FAMILIES}


def _compare(hf_path: Path, gguf_path: Path, tol: float, **gguf_kwargs) -> None:
    want_engine, got_engine = make_engine(hf_path), make_engine(gguf_path, **gguf_kwargs)
    worst = 0.0
    for ids in prompts():
        want = all_row_logits(want_engine, ids, 10_000)
        got = all_row_logits(got_engine, ids, 10_000)
        worst = max(worst, ((got - want).norm(dim=-1) / want.norm(dim=-1)).max().item())
    assert worst < tol, f"worst relative logit error {worst:.2e}"
    params = SamplingParams(max_tokens=8, min_tokens=8, temperature=0.0)
    assert run_all(got_engine, prompts(), params) == run_all(want_engine, prompts(), params)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_gguf_matches_the_directory(gguf_sources, gguf_files, family) -> None:
    config = gguf_model_config(open_gguf(gguf_files[family]))
    arch = FAMILY_OF.get(family, family)
    assert config.architecture == ("llama" if arch == "mistral" else arch)  # as llama.cpp
    _compare(gguf_sources[family], gguf_files[family], 1e-5)


def test_q8_0_gguf_matches_its_dequantised_directory(model_dirs, tmp_path) -> None:  # noqa: F811
    """Quantised matrices (Q8_0, Q/K permuted): the directory holds the same values
    dequantised, so the GGUF path's dequantisation, reshaping and un-permuting are exact
    (dequantized at load, for the bits of the dequantized directory; the weights kept
    quantized: tests/test_quant_model.py)."""
    import gguf
    from safetensors.torch import load_file, save_file

    src = model_dirs["granite"]
    quantised = write_gguf(src, tmp_path / "q8.gguf", quant="Q8_0")
    ref = tmp_path / "ref"
    ref.mkdir()
    for f in src.iterdir():
        if f.name != "model.safetensors":
            (ref / f.name).write_bytes(f.read_bytes())
    q8 = gguf.GGMLQuantizationType.Q8_0
    tensors = {
        name: torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(t.numpy(), q8), q8))
        if t.dim() == 2
        else t
        for name, t in load_file(str(src / "model.safetensors")).items()
    }
    save_file(tensors, str(ref / "model.safetensors"), metadata={"format": "pt"})
    _compare(ref, quantised, 1e-5, gguf_dequantize=True)


def test_config_from_llama_cpp_keys(gguf_files) -> None:
    granite = gguf_model_config(open_gguf(gguf_files["granite"]))
    assert (granite.embedding_multiplier, granite.attention_multiplier) == (12.0, 0.015625)
    assert (granite.residual_multiplier, granite.logits_scaling) == (
        pytest.approx(0.22),
        8.0,
    )
    assert gguf_model_config(open_gguf(gguf_files["smollm3"])).no_rope_layers == (3,)
    qwen3 = gguf_model_config(open_gguf(gguf_files["qwen3"]))
    assert (qwen3.head_dim, qwen3.num_kv_heads) == (32, 2)
    llama = gguf_model_config(open_gguf(gguf_files["llama"]))
    assert llama.rope_freq_factors is not None and max(llama.rope_freq_factors) == 32.0


def test_yarn_keys_map_onto_hf_rope_scaling(model_dirs, tmp_path) -> None:  # noqa: F811
    path = write_gguf(
        model_dirs["qwen2"],
        tmp_path / "yarn.gguf",
        extra={
            "qwen2.rope.scaling.type": "yarn",
            "qwen2.rope.scaling.factor": 4.0,
            "qwen2.rope.scaling.original_context_length": 32768,
            "qwen2.rope.scaling.yarn_beta_fast": 16.0,
        },
    )
    config = gguf_model_config(open_gguf(path))
    assert config.rope_scaling == {
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 32768,
        "beta_fast": 16.0,
    }


@pytest.mark.parametrize(
    "extra, named",
    [
        ({"qwen2.rope.scaling.type": "longrope", "qwen2.rope.scaling.factor": 2.0}, "longrope"),
        (
            {
                "qwen2.rope.scaling.type": "yarn",
                "qwen2.rope.scaling.factor": 2.0,
                "qwen2.rope.scaling.yarn_log_multiplier": 0.1,
            },
            "yarn_log_multiplier",
        ),
        ({"qwen2.attn_logit_softcapping": 50.0}, "qwen2.attn_logit_softcapping"),
        ({"qwen2.logit_scale": 2.0}, "qwen2.logit_scale"),
    ],
)
def test_what_we_cannot_honour_is_refused_naming_it(model_dirs, tmp_path, extra, named) -> None:  # noqa: F811
    path = write_gguf(model_dirs["qwen2"], tmp_path / "bad.gguf", extra=extra)
    with pytest.raises(ValueError, match=named):
        gguf_model_config(open_gguf(path))


def test_a_tensor_the_family_lacks_is_refused(model_dirs, tmp_path) -> None:  # noqa: F811
    # OLMo 2's post norms in a file claiming to be Llama: never silently dropped.
    path = tmp_path / "olmo-as-llama.gguf"
    write_gguf(model_dirs["olmo2"], path)
    data = path.read_bytes().replace(b"olmo2", b"llama")  # general.architecture and keys
    path.write_bytes(data)
    with pytest.raises(ValueError, match=r"post_attention_norm"):
        gguf_model_config(open_gguf(path))


def test_a_spec_splits_fused_tensors_and_removes_a_norm_offset(
    model_dirs,  # noqa: F811
    tmp_path,
    monkeypatch,
) -> None:
    """What Phi-3 (fused attn_qkv, gate and up in ffn_up) and Gemma (norms stored as
    ``1 + w``) GGUFs need, on the Llama model: a spec with ``splits`` and ``norm_offset``
    gives the directory's numbers."""
    from chunkserve.model import registry
    from chunkserve.model.registry import GGUFSpec, GGUFSplit

    def fuse(t: dict) -> None:
        for i in range(2):
            b = f"blk.{i}."
            t[b + "attn_qkv.weight"] = np.concatenate(
                [t.pop(b + f"attn_{x}.weight") for x in "qkv"]
            )
            t[b + "ffn_up.weight"] = np.concatenate(
                [t.pop(b + "ffn_gate.weight"), t.pop(b + "ffn_up.weight")]
            )
        for name in t:
            if name.endswith("norm.weight"):
                t[name] = t[name] + 1.0

    path = write_gguf(model_dirs["llama"], tmp_path / "fused.gguf", edit=fuse)
    spec = GGUFSpec(
        "llama",
        permuted_qk=True,
        norm_offset=1.0,
        splits={
            "attn_qkv.weight": GGUFSplit(
                ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
                lambda c: (c.num_heads * c.head_dim, *[c.num_kv_heads * c.head_dim] * 2),
            ),
            "ffn_up.weight": GGUFSplit(
                ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
                lambda c: (c.intermediate_size, c.intermediate_size),
            ),
        },
    )
    registry._load()
    monkeypatch.setitem(registry._GGUF_SPECS, "llama", ("llama", spec))
    _compare(model_dirs["llama"], path, 1e-5)


def test_phi3_gguf_longrope_partial_rotary_and_window(model_dirs, gguf_files, tmp_path) -> None:  # noqa: F811
    """Phi-3's GGUF (llama.cpp's Phi3MiniModel: fused attn_qkv / ffn_up, rope_factors_long /
    rope_factors_short tensors, the attention factor the converter computed,
    rope.dimension_count): the config transformers reads from the directory. Then the long
    factors (the original length below every prompt) and a window (Phi-3-mini-4k's, shrunk;
    0: none), each giving the directory's logits and tokens."""
    phi4 = gguf_model_config(open_gguf(gguf_files["phi4"]))
    want = hf_model_config(model_dirs["phi4"])
    assert (phi4.rotary_dim, phi4.tie_word_embeddings) == (12, True)
    assert phi4.sliding_window == 262144
    assert phi4.rope_scaling["rope_type"] == "longrope"
    for key in ("long_factor", "short_factor", "original_max_position_embeddings"):
        assert phi4.rope_scaling[key] == pytest.approx(want.rope_scaling[key])
    assert phi4.rope_scaling["attention_factor"] == pytest.approx(
        math.sqrt(1 + math.log(32) / math.log(512))
    )
    long = variant(model_dirs["phi3"], tmp_path / "long", original_max_position_embeddings=4)
    path = write_gguf(long, tmp_path / "long.gguf")
    assert gguf_model_config(open_gguf(path)).rope_scaling["original_max_position_embeddings"] == 4
    _compare(long, path, 1e-5)
    window = variant(model_dirs["phi3"], tmp_path / "window", sliding_window=20)
    path = write_gguf(window, tmp_path / "window.gguf")
    assert gguf_model_config(open_gguf(path)).sliding_window == 20
    _compare(window, path, 1e-5)
    none = variant(model_dirs["phi4"], tmp_path / "none", sliding_window=None)
    assert (
        gguf_model_config(open_gguf(write_gguf(none, tmp_path / "n.gguf"))).sliding_window is None
    )


def test_released_readers_are_dropped_and_read_again(gguf_files) -> None:
    """A server drops its shared GGUF readers once loaded (their parsed header and map stay
    resident otherwise); a later ``open_gguf`` reads the file again."""
    from chunkserve.model import source

    path = next(iter(gguf_files.values()))
    first = open_gguf(path)
    assert open_gguf(path) is first  # shared while cached
    arch = gguf_model_config(first).architecture
    del first
    source.release_gguf_readers()
    assert source._read_gguf.cache_info().currsize == 0
    again = open_gguf(path)
    assert gguf_model_config(again).architecture == arch
