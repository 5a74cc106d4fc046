"""Model loading: GGUF files (dequantised with the ``gguf`` package) and HF safetensors
directories. Both produce a ``ModelConfig`` and HF-named tensors for the family's model
(``registry``); the loader knows a family's names and config fields, never its maths.

GGUF: how llama.cpp's converter (``convert_hf_to_gguf.py``) wrote a family is declared next to
the family's class, as a ``registry.GGUFSpec`` passed to ``@register(..., gguf=[...])``; this
module applies it generically:

- **Config**: the common ``{arch}.*`` keys (``_COMMON_KEYS``: ``embedding_length``,
  ``attention.head_count``, ``attention.key_length`` for head sizes, ``rope.freq_base``,
  ``rope.dimension_count`` for partial rotary, ``attention.sliding_window``...), the rope
  scaling keys (``rope.scaling.type`` none / linear / yarn with ``original_context_length``
  and ``yarn_*``; a factor without a type is linear, as llama.cpp reads it) and the
  ``rope_freqs`` tensor (Llama 3's scaling as per-frequency divisors) map onto ``ModelConfig``;
  then the spec's ``keys`` (its own keys -> fields), ``config`` (fields llama.cpp hard-codes,
  with no key) and ``derive`` (fields computed from the others, e.g. a layer pattern). **Any
  other ``{arch}.*`` key, and any rope setting we cannot honour, is a ValueError naming it**:
  a key we ignore could change the numbers.
- **Tensors**: the Llama table below (``_GGUF_TOP_NAMES``, ``_GGUF_BLOCK_NAMES``: GGUF name
  -> HF name) updated with the spec's ``tensors``; the spec's ``splits`` cut fused tensors
  into their HF parts; its ``experts`` cut a mixture of experts' stacked tensors
  (``ffn_gate_exps`` ...) into one HF tensor per expert; its ``joins`` make an HF tensor of
  several GGUF ones, or of one changed (MLA's ``kv_b_proj`` from ``attn_k_b`` and
  ``attn_v_b``, GPT-OSS's interleaved ``gate_up_proj`` from ``ffn_gate_exps`` and
  ``ffn_up_exps``); ``permuted_qk`` undoes llama.cpp's
  Q/K row permutation (its ``LlamaModel.permute``, applied by the Llama-derived converters
  only); ``norm_offset``
  undoes a ``w + offset`` the converter stored for every ``*norm.weight`` (Gemma's ``1 + w``).
  A tensor neither table names is a ValueError naming it. Multi-token-prediction blocks
  (``{arch}.nextn_predict_layers``, a family's key: the last blocks, ``blk.N.nextn.*``
  beside a block's tensors) are checked against ``block_count`` and not read.

Adding a family's GGUF support (check llama.cpp's ``convert_hf_to_gguf.py`` for what its
converter class writes and changes, gguf-py's ``constants.py`` ``MODEL_TENSORS`` for its tensor
names and ``Keys`` for its metadata, and ``src/llama-model.cpp`` for what llama.cpp hard-codes)::

    @register("gemma2", hf=("Gemma2ForCausalLM",), gguf=[GGUFSpec(
        "gemma2",
        tensors={"post_attention_norm.weight": "post_attention_layernorm.weight",
                 "ffn_norm.weight": "pre_feedforward_layernorm.weight", ...},
        norm_offset=1.0,
        keys={"attn_logit_softcapping": "attn_softcap", ...},
        config={"hidden_act": "gelu_pytorch_tanh"},
        derive=lambda f: {"window_layers": tuple(range(0, f["num_layers"], 2))},
    )])
    class Gemma2Model(DecoderLM): ...

(the field names in ``keys`` are illustrative: each must be a ``ModelConfig`` field). Phi-3's
fused tensors: map ``attn_qkv.weight`` to the HF fused name its class loads, or cut it with
``splits={"attn_qkv.weight": GGUFSplit((q, k, v names), sizes)}``; its longrope factors:
``config_tensors={"rope_factors_long.weight": <field>}``. ``tests/test_gguf.py`` runs every
family of ``tests/test_model_families.py`` through ``write_gguf`` (gguf-py's own tensor-name
map; add the converter's changes there: the arch name, Q/K permutation, Gemma's ``+ 1``, its
keys): the GGUF must give the directory's logits and greedy tokens.

**Reads**: a tensor-parallel rank reads its share of each tensor, not the whole of it
(``tests/test_lazy_reads.py`` counts the bytes). Float tensors come as ``lazy.LazyTensor``s
(safetensors' ``get_slice``; slices of a GGUF file's memory map, a block tensor dequantized
by whole rows of blocks, Q/K rows through llama.cpp's permutation); a quantized HF
checkpoint's raw tensors the same way, under ``hf_quant.LazyDequant``; a GGUF file's kept
quantized tensors as ``GGUFWeight``s over the map, copied where ``take_quantized`` keeps
their rows or columns; a join with a ``lazy`` form (MLA's ``kv_b_proj`` from ``attn_k_b``
and ``attn_v_b``: a rank's heads; GPT-OSS's interleaved gate/up: a rank's experts' rows of
gate or of up) from boxes of its parts; F32/F16 vectors (biases) by the rank's values.
Whole reads remain where a tensor is needed whole: a join without a ``lazy`` form, norms
with an offset, 1-D block tensors, a permuted Q/K weight kept quantized; a block type's
box reads whole rows of blocks (a column slice, e.g. a tensor-parallel rank's of MXFP4
``ffn_down_exps``, reads every column's blocks of its rows).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from chunkserve.config import ModelConfig
from chunkserve.model.hf_quant import dequantize_stream, quant_method
from chunkserve.model.lazy import LazyTensor, safetensors_tensor
from chunkserve.model.registry import GGUFSpec, family_of_hf, gguf_spec
from chunkserve.model.source import (  # noqa: F401  (the loader's names, as before)
    ModelSource,
    _field,
    embedded_model_path,
    hf_weight_files,
    open_gguf,
    release_gguf_readers,
    resolve_model,
)
from chunkserve.quant.weight import GGUFWeight, QuantizedWeight

logger = logging.getLogger(__name__)


# GGUF tensor name (per block, after "blk.N.") -> HF name (after "model.layers.N.").
_GGUF_BLOCK_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GGUF_TOP_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
# Multi-token-prediction (MTP, "nextn") blocks: llama.cpp's converters write a family's
# ``num_nextn_predict_layers`` MTP layers as the last blocks (``block_count`` counts them,
# ``{arch}.nextn_predict_layers`` says how many), each a decoder block's tensors plus these
# (GGUF name after "blk.N." -> the HF name after "model.layers.N."). They are not part of
# the model's forward: a family that declares the key runs ``block_count -
# nextn_predict_layers`` layers and the loader reads nothing of the MTP blocks.
_GGUF_NEXTN_NAMES = {
    "nextn.eh_proj.weight": "eh_proj.weight",
    "nextn.enorm.weight": "enorm.weight",
    "nextn.hnorm.weight": "hnorm.weight",
    "nextn.embed_tokens.weight": "embed_tokens.weight",
    "nextn.shared_head_head.weight": "shared_head.head.weight",
    "nextn.shared_head_norm.weight": "shared_head.norm.weight",
}
# Those an MTP block must have (llama.cpp requires them; the others are optional).
_GGUF_NEXTN_REQUIRED = ("nextn.eh_proj.weight", "nextn.enorm.weight", "nextn.hnorm.weight")


# ---- GGUF --------------------------------------------------------------------------------
# The common {arch}.* keys -> ModelConfig fields (rope scaling: ``_gguf_rope``).
_COMMON_KEYS = {
    "vocab_size": "vocab_size",
    "context_length": "max_position_embeddings",
    "embedding_length": "hidden_size",
    "feed_forward_length": "intermediate_size",
    "block_count": "num_layers",
    "attention.head_count": "num_heads",
    "attention.head_count_kv": "num_kv_heads",
    "attention.key_length": "head_dim",
    "rope.freq_base": "rope_theta",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "attention.sliding_window": "sliding_window",
    # Mixtures of experts (a spec's ``experts`` names their stacked tensors).
    "expert_count": "num_experts",
    "expert_used_count": "num_experts_per_tok",
    "expert_feed_forward_length": "moe_intermediate_size",
    "expert_shared_feed_forward_length": "shared_expert_intermediate_size",
    "expert_weights_norm": "norm_topk_prob",
}
# Read elsewhere in this module, or informational only.
_OTHER_KEYS = {
    "attention.value_length",
    "rope.dimension_count",
    "rope.scaling.type",
    "rope.scaling.factor",
    "rope.scaling.original_context_length",
    "rope.scaling.attn_factor",
    "rope.scaling.finetuned",
    "rope.scaling.yarn_ext_factor",
    "rope.scaling.yarn_attn_factor",
    "rope.scaling.yarn_beta_fast",
    "rope.scaling.yarn_beta_slow",
    "rope.scaling.yarn_log_multiplier",
}
# Small tensors that are config, not weights: GGUF name -> ModelConfig field (a tuple).
_CONFIG_TENSORS = {"rope_freqs.weight": "rope_freq_factors"}
# Tensors llama.cpp derives again and we do not need (old files' rotary caches).
_IGNORED_BLOCK_TENSORS = {"attn_rot_embd.weight"}


def _refuse(what: str, why: str) -> ValueError:
    return ValueError(f"model: GGUF {what}: {why}")


def gguf_model_config(reader: Any) -> ModelConfig:
    """The ``ModelConfig`` of a GGUF file (see the module docstring)."""
    arch = _field(reader, "general.architecture")
    family, spec = gguf_spec(arch)
    prefix = f"{arch}."
    values = {
        k[len(prefix) :]: f.contents() for k, f in reader.fields.items() if k.startswith(prefix)
    }
    fields: dict[str, Any] = {"architecture": family}
    fields.update(_gguf_rope(prefix, {k: v for k, v in values.items() if k not in spec.keys}))
    for name, value in values.items():
        if name in spec.keys:
            target = spec.keys[name]
            field_name, convert = (target, None) if isinstance(target, str) else target
            fields[field_name] = value if convert is None else convert(value)
        elif name in _COMMON_KEYS:
            if isinstance(value, list):
                raise _refuse(f"key {prefix + name!r}", "per-layer values are not supported")
            fields[_COMMON_KEYS[name]] = value
        elif name not in _OTHER_KEYS and not (name.startswith("expert_") and not value):
            raise _refuse(
                f"key {prefix + name!r}",
                f"not supported for {arch!r} models (it may change the numbers)",
            )
    for required in (
        "embedding_length",
        "feed_forward_length",
        "block_count",
        "attention.head_count",
    ):
        if required not in values:
            raise _refuse(f"file of {arch!r}", f"key {prefix + required!r} is missing")
    fields.setdefault("num_kv_heads", fields["num_heads"])
    fields.setdefault("head_dim", fields["hidden_size"] // fields["num_heads"])
    if (
        "attention.value_length" not in spec.keys
        and values.get("attention.value_length", fields["head_dim"]) != fields["head_dim"]
    ):
        raise _refuse(
            f"key {prefix}attention.value_length",
            f"{values['attention.value_length']} differs from the key length "
            f"{fields['head_dim']} (not supported)",
        )
    if "rope.dimension_count" in values and "rope.dimension_count" not in spec.keys:
        fields["partial_rotary_factor"] = values["rope.dimension_count"] / fields["head_dim"]
    tokens = _field(reader, "tokenizer.ggml.tokens")
    fields.setdefault("vocab_size", len(tokens) if tokens is not None else 0)
    fields.setdefault("rope_theta", 10000.0)
    fields.setdefault("rms_norm_eps", 1e-5)
    fields.setdefault("max_position_embeddings", 2048)
    tensors = {t.name: t for t in reader.tensors}
    fields["tie_word_embeddings"] = "output.weight" not in tensors
    fields["attention_bias"] = "blk.0.attn_q.bias" in tensors
    bos = _field(reader, "tokenizer.ggml.bos_token_id")
    fields["bos_token_id"] = None if bos is None else int(bos)
    eos, eot = (
        _field(reader, "tokenizer.ggml.eos_token_id"),
        _field(reader, "tokenizer.ggml.eot_token_id"),
    )
    fields["eos_token_ids"] = tuple(sorted({int(t) for t in (eos, eot) if t is not None}))
    for name, field_name in {**_CONFIG_TENSORS, **spec.config_tensors}.items():
        if name in tensors:
            data = np.asarray(tensors[name].data, dtype=np.float32).ravel()
            fields[field_name] = tuple(float(x) for x in data)
    for name in ("hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads"):
        fields[name] = int(fields[name])
    fields.update(spec.config)
    if spec.derive is not None:
        fields.update(spec.derive(dict(fields)))
    for name in tensors:
        if _gguf_to_hf(name, spec) is None:
            raise _refuse(f"tensor {name!r}", f"not a tensor of {arch!r} models we know")
    _check_blocks(tensors, prefix, fields["num_layers"], fields.get("num_nextn_predict_layers", 0))
    # Fields named "_..." are a spec's scratch values for its ``derive``, not ModelConfig's.
    fields = {k: v for k, v in fields.items() if not k.startswith("_")}
    try:
        return ModelConfig(**fields)
    except TypeError as exc:  # a spec naming a field ModelConfig lacks
        raise _refuse(f"file of {arch!r}", str(exc)) from None


def _check_blocks(tensors: dict[str, Any], prefix: str, layers: int, nextn: int) -> None:
    """Every ``blk.N`` tensor within ``block_count`` (``layers`` decoder blocks, then
    ``nextn`` multi-token-prediction blocks); MTP tensors on MTP blocks only; an MTP block
    in the file with its required tensors (a file whose ``block_count`` left the MTP blocks
    out would otherwise lose its last decoder layer, silently)."""
    blocks: dict[int, set[str]] = {}
    for name in tensors:
        if name.startswith("blk."):
            _, idx, rest = name.split(".", 2)
            blocks.setdefault(int(idx), set()).add(rest)
    key = f"key {prefix}nextn_predict_layers"
    for b, names in sorted(blocks.items()):
        mtp = sorted(n for n in names if n in _GGUF_NEXTN_NAMES)
        if b >= layers + nextn:
            raise _refuse(
                f"tensor 'blk.{b}.{min(names)}'",
                f"block {b} is beyond {prefix}block_count {layers + nextn}",
            )
        if b < layers and mtp:
            raise _refuse(
                f"tensor 'blk.{b}.{mtp[0]}'",
                f"a multi-token-prediction tensor on block {b}, one of the model's "
                f"{layers} decoder blocks ({key}: {nextn}, of {prefix}block_count "
                f"{layers + nextn})",
            )
        missing = [n for n in _GGUF_NEXTN_REQUIRED if n not in names]
        if b >= layers and missing:
            raise _refuse(
                f"tensor 'blk.{b}.{missing[0]}'",
                f"missing: block {b} is a multi-token-prediction block ({key}: {nextn}, of "
                f"{prefix}block_count {layers + nextn})",
            )


def _gguf_rope(prefix: str, values: dict[str, Any]) -> dict[str, Any]:
    """The rope scaling keys -> ``ModelConfig.rope_scaling`` (HF's form); a setting we
    cannot honour is a ValueError naming its key."""

    def neutral(name: str, default: float) -> None:
        if name in values and float(values[name]) != default:
            raise _refuse(f"key {prefix + name!r}", f"{values[name]} is not supported")

    kind = values.get("rope.scaling.type")
    factor = values.get("rope.scaling.factor")
    neutral("rope.scaling.attn_factor", 1.0)
    if kind is None and factor not in (None, 0.0, 1.0):
        kind = "linear"  # llama.cpp's default type when only a factor is given
    if kind in (None, "none"):
        return {}
    if factor is None:
        raise _refuse(f"key {prefix}rope.scaling.type", f"{kind!r} without rope.scaling.factor")
    if kind == "linear":
        return {"rope_scaling": {"rope_type": "linear", "factor": float(factor)}}
    if kind == "yarn":
        neutral("rope.scaling.yarn_ext_factor", 1.0)
        neutral("rope.scaling.yarn_log_multiplier", 0.0)
        scaling: dict[str, Any] = {"rope_type": "yarn", "factor": float(factor)}
        for key, hf in (
            ("rope.scaling.original_context_length", "original_max_position_embeddings"),
            ("rope.scaling.yarn_attn_factor", "attention_factor"),
            ("rope.scaling.yarn_beta_fast", "beta_fast"),
            ("rope.scaling.yarn_beta_slow", "beta_slow"),
        ):
            if key in values:
                scaling[hf] = values[key]
        return {"rope_scaling": scaling}
    raise _refuse(f"key {prefix}rope.scaling.type", f"rope scaling {kind!r} is not supported")


def _gguf_to_hf(name: str, spec: GGUFSpec) -> tuple[str, ...] | None:
    """The HF name(s) of GGUF tensor ``name`` (several for a fused tensor to split; empty
    for one the config consumed), or None for a tensor the family does not have."""
    if name in _GGUF_TOP_NAMES:
        return (_GGUF_TOP_NAMES[name],)
    if name in _CONFIG_TENSORS or name in spec.config_tensors:
        return ()
    if not name.startswith("blk."):
        return None
    _, idx, rest = name.split(".", 2)
    prefix = f"model.layers.{idx}."
    if rest in spec.splits:
        return tuple(prefix + part for part in spec.splits[rest].parts)
    if rest in spec.experts:  # stacked: one name per expert ("{}": its index)
        return (prefix + spec.experts[rest],)
    join = spec.join_of(rest)
    if join is not None:
        return (prefix + join.hf,)
    if rest in _GGUF_NEXTN_NAMES:
        return (prefix + _GGUF_NEXTN_NAMES[rest],)
    hf = spec.tensors.get(rest, _GGUF_BLOCK_NAMES.get(rest))
    if hf is not None:
        return (prefix + hf,)
    return () if rest in _IGNORED_BLOCK_TENSORS else None


def _unpermute_rope(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's interleaved-rope permutation of Q/K rows (the HF layout results)."""
    rows = w.shape[0]
    rest = w.shape[1:]
    return w.reshape(n_head, rows // n_head // 2, 2, *rest).swapaxes(1, 2).reshape(rows, *rest)


def iter_gguf_weights(
    reader: Any, config: ModelConfig, dtype: torch.dtype, quantized: bool = False
) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
    """Yield (HF name, tensor in ``dtype``) one at a time, dequantising as it goes and
    applying the family's ``GGUFSpec`` (splits, Q/K permutation, norm offset).

    ``quantized``: tensors of the block formats ``quant.formats`` keeps (Q8_0, Q4_0, Q4_1,
    Q5_0, Q5_1, Q4_K, Q5_K, Q6_K) come as ``GGUFWeight`` in their own bits instead, with the
    splits, the Q/K row permutation and the experts' stacks applied to the blocks (whole
    rows: nothing is dequantized); tensors of other types are dequantized, with a log line
    naming their types."""
    from gguf import GGMLQuantizationType

    from chunkserve.quant.formats import FORMATS

    _, spec = gguf_spec(_field(reader, "general.architecture"))
    held: dict[tuple[str, str], dict[str, np.ndarray]] = {}  # (block, HF name) -> joins' parts
    # A join's HF tensor may also be in the file as such (converters writing attn_kv_b
    # beside attn_k_b / attn_v_b): the same weights in two layouts, loaded once.
    joined = {j.hf for j in spec.joins}
    loaded: set[str] = set()
    others: dict[str, int] = {}
    for t in reader.tensors:
        if t.name.startswith("blk.") and int(t.name.split(".", 2)[1]) >= config.num_layers:
            continue  # a multi-token-prediction block (``_check_blocks``): not run, not read
        names = _gguf_to_hf(t.name, spec)
        if not names:
            continue  # consumed by the config (rope_freqs), or derived again
        shape = tuple(int(d) for d in reversed(t.shape))  # numpy order: HF's [out, in]
        code = int(t.tensor_type)
        rest = t.name.split(".", 2)[2] if t.name.startswith("blk.") else ""
        join = spec.join_of(rest) if rest else None
        if join is not None:  # parts of one HF tensor (MLA's k_b + v_b, GPT-OSS's gate + up)
            have = held.setdefault((names[0], join.parts[0]), {})
            # A join that reads by boxes (``GGUFJoin.lazy``): its parts as LazyTensors.
            have[rest] = _lazy_part(t, shape) if join.lazy else _float_array(t, shape)
            if len(have) < len(join.parts):
                continue
            del held[(names[0], join.parts[0])]
            try:
                if join.lazy is not None:
                    lazy = join.lazy(config, [have[p] for p in join.parts])
                    parts = iter([(names[0], lazy.to(dtype))])
                else:
                    arr = np.asarray(join.combine(config, [have[p] for p in join.parts]))
                    parts = _float_parts(t, arr, names, spec, config, dtype)
            except ValueError as exc:
                raise _refuse(f"tensor {t.name!r}", str(exc)) from None
        elif quantized and code in FORMATS and len(shape) >= 2:
            parts = _quantized_parts(t, shape, names, spec, config)
        else:
            if quantized and code not in _FLOAT_TYPES:
                kind = GGMLQuantizationType(code).name
                others[kind] = others.get(kind, 0) + 1
            parts = _lazy_float_parts(t, shape, names, spec, config, dtype)
        for name, part in parts:
            if name.startswith("model.layers.") and name.split(".", 3)[3] in joined:
                if name in loaded:
                    continue
                loaded.add(name)
            yield name, part
    if held:
        (name, _), have = sorted(held.items())[0]
        join = spec.join_of(next(iter(have)))
        assert join is not None
        missing = [p for p in join.parts if p not in have]
        raise _refuse(f"tensor {name!r}", f"{', '.join(sorted(have))} without {', '.join(missing)}")
    if others:
        logger.info(
            "model: GGUF tensors of types without quantized kernels dequantized at load: %s",
            ", ".join(f"{n} x{c}" for n, c in sorted(others.items())),
        )


# F32, F16, BF16: float types (dequantized at load, not quantized formats).
_FLOAT_TYPES = {0, 1, 30}


def _split_names(
    t: Any, shape: tuple[int, ...], names: tuple[str, ...], spec: GGUFSpec, config: ModelConfig
) -> tuple[tuple[str, ...], list[tuple[int, int]] | None, bool]:
    """The HF names of tensor ``t``'s parts; for a fused tensor, each part's rows (else
    None); whether it is a stack of experts (one name per expert)."""
    if "{}" in names[0]:  # a mixture of experts' stacked tensor: expert by expert
        if len(shape) != 3 or shape[0] != config.num_experts:
            raise _refuse(
                f"tensor {t.name!r}",
                f"shape {shape}, expected {config.num_experts} stacked experts",
            )
        return tuple(names[0].format(e) for e in range(shape[0])), None, True
    if len(names) > 1:
        sizes = spec.splits[t.name.split(".", 2)[2]].sizes(config)
        if sum(sizes) != shape[0]:
            raise _refuse(f"tensor {t.name!r}", f"{shape[0]} rows, expected {sizes}")
        bounds = np.cumsum([0, *sizes]).tolist()
        return names, list(itertools.pairwise(bounds)), False
    return names, None, False


def _qk_heads(name: str, spec: GGUFSpec, config: ModelConfig) -> int | None:
    """The heads of a Q or K projection whose rows llama.cpp permuted, else None."""
    if spec.permuted_qk and _is_proj(name, "q_proj"):
        return config.num_heads
    if spec.permuted_qk and _is_proj(name, "k_proj"):
        return config.num_kv_heads
    return None


def _float_array(t: Any, shape: tuple[int, ...]) -> np.ndarray:
    """Tensor ``t``'s values as float32, shaped ``shape``: GGUF lists dims fastest-first, so
    numpy's data is already [rows, cols] = HF's [out, in]."""
    from chunkserve.quant.formats import dequantize

    if int(t.tensor_type) in (0, 1):  # F32, F16
        arr = np.asarray(t.data, dtype=np.float32)
    else:
        arr = dequantize(t.data, t.tensor_type)
    return arr.reshape(shape)


def _lazy_part(t: Any, shape: tuple[int, ...]) -> LazyTensor:
    """Tensor ``t`` (a join's part) as a float32 ``LazyTensor`` of ``shape`` (HF's axis
    order) over the file's map."""
    code = int(t.tensor_type)
    data = t.data.reshape(shape) if code in (0, 1) else t.data
    return LazyTensor(shape, torch.float32, _gguf_box_reader(data, code, None))


def _float_parts(
    t: Any,
    arr: np.ndarray,
    names: tuple[str, ...],
    spec: GGUFSpec,
    config: ModelConfig,
    dtype: torch.dtype,
) -> Iterator[tuple[str, torch.Tensor]]:
    """``arr`` (tensor ``t``'s float values, or a join's) as its HF parts in ``dtype``."""
    names, rows, stacked = _split_names(t, arr.shape, names, spec, config)
    if stacked:
        parts = list(arr)
    else:
        parts = [arr] if rows is None else [arr[a:b] for a, b in rows]
    for name, part in zip(names, parts, strict=True):
        heads = _qk_heads(name, spec, config)
        if heads is not None:
            part = _unpermute_rope(part, heads)
        if spec.norm_offset and name.endswith("norm.weight"):
            part = part - np.float32(spec.norm_offset)
        if not part.flags.writeable:
            part = part.copy()  # memory-mapped F32 tensors are read-only
        yield name, torch.from_numpy(np.ascontiguousarray(part)).to(dtype)


def _lazy_float_parts(
    t: Any,
    shape: tuple[int, ...],
    names: tuple[str, ...],
    spec: GGUFSpec,
    config: ModelConfig,
    dtype: torch.dtype,
) -> Iterator[tuple[str, torch.Tensor | LazyTensor]]:
    """Tensor ``t``'s HF parts in ``dtype``, as ``_float_parts`` gives them, but as
    ``LazyTensor``s over the file's memory map: a part's ``[src]`` reads (F32, F16) or
    dequantizes (block types: whole rows of blocks, then the columns cut) only the rows
    ``src`` selects (a Q/K projection's rows through llama.cpp's permutation; a bias its
    rank's values). Norms with the family's offset and 1-D block tensors are read whole."""
    code = int(t.tensor_type)
    if (len(shape) < 2 and code not in (0, 1)) or (
        spec.norm_offset and any(n.endswith("norm.weight") for n in names)
    ):
        yield from _float_parts(t, _float_array(t, shape), names, spec, config, dtype)
        return
    data = t.data  # a view of the map: F32/F16 values, else rows of block bytes
    if code in (0, 1):
        data = data.reshape(shape)
    names, rows, stacked = _split_names(t, shape, names, spec, config)
    if stacked:
        views = [(data[e], shape[1:]) for e in range(shape[0])]
    elif rows is None:
        views = [(data, shape)]
    else:
        views = [(data[a:b], (b - a, *shape[1:])) for a, b in rows]
    for name, (view, part_shape) in zip(names, views, strict=True):
        heads = _qk_heads(name, spec, config)
        order = None
        if heads is not None:  # part row i is the file's row order[i]
            order = _unpermute_rope(np.arange(part_shape[0])[:, None], heads)[:, 0]
        yield (
            name,
            LazyTensor(part_shape, torch.float32, _gguf_box_reader(view, code, order), dtype),
        )


def _gguf_box_reader(view: np.ndarray, code: int, order: np.ndarray | None):
    """``read(box)`` of a ``LazyTensor`` over ``view`` (a part of a GGUF tensor's map: F32 /
    F16 values [rows, ...], or rows of block bytes [rows, ..., bytes] for type ``code``),
    its rows in ``order`` (None: as stored): float32 values of the box, only its rows read."""
    from chunkserve.quant.formats import dequantize

    def read(box: tuple[slice, ...]) -> torch.Tensor:
        first = box[0] if order is None else order[box[0]]
        if code in (0, 1):
            sub = view[first][(slice(None), *box[1:])]
            return torch.from_numpy(np.array(sub, dtype=np.float32))
        sub = np.ascontiguousarray(view[first][(slice(None), *box[1:-1])])
        values = dequantize(sub, code)
        values = values.reshape(*sub.shape[:-1], -1)[..., box[-1]]
        return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32))

    return read


def _quantized_parts(
    t: Any, shape: tuple[int, ...], names: tuple[str, ...], spec: GGUFSpec, config: ModelConfig
) -> Iterator[tuple[str, QuantizedWeight]]:
    raw = t.data  # uint8 [..., rows, row bytes]: a view of the map
    code = int(t.tensor_type)
    names, rows, stacked = _split_names(t, shape, names, spec, config)
    # Views of the file's map: a rank's ``take_quantized`` copies (reads) only its share.
    if stacked:  # experts: one weight of each expert's block rows
        weights = [
            GGUFWeight.from_gguf(raw[e], code, name, copy=False) for e, name in enumerate(names)
        ]
    else:
        whole = GGUFWeight.from_gguf(raw.reshape(-1, raw.shape[-1]), code, t.name, copy=False)
        weights = [whole] if rows is None else [whole.rows(a, b) for a, b in rows]
    for name, weight in zip(names, weights, strict=True):
        heads = _qk_heads(name, spec, config)
        if heads is not None:
            index = _unpermute_rope(np.arange(weight.shape[0])[:, None], heads)[:, 0]
            weight = weight.permute_rows(index)
        yield name, weight


def _is_proj(name: str, proj: str) -> bool:
    return name.endswith((f"self_attn.{proj}.weight", f"self_attn.{proj}.bias"))


# ---- HF safetensors directories ------------------------------------------------------------
# Fields of HF config classes whose defaults are not "absent" (a config.json without them
# means these values to transformers).
_HF_DEFAULTS = {
    "gemma2": dict(
        query_pre_attn_scalar=256,
        sliding_window=4096,
        final_logit_softcapping=30.0,
        attn_logit_softcapping=50.0,
    ),
    "gemma3_text": dict(query_pre_attn_scalar=256, sliding_window=4096, rope_theta=1_000_000.0),
    # DeepseekV3Config's router (transformers writes neither key; DeepSeek's config.json
    # does).
    "deepseek_v3": dict(topk_method="noaux_tc", scoring_func="sigmoid"),
    # Qwen2-MoE's Q/K/V biases are its config's ``qkv_bias`` (true by default).
    "qwen2_moe": dict(qkv_bias=True),
    # GptOssConfig's: biases, the clamped SwiGLU, YaRN (factor 32 over 4096 positions).
    "gpt_oss": dict(
        attention_bias=True,
        swiglu_limit=7.0,
        swiglu_alpha=1.702,
        sliding_window=128,
        rope_parameters=dict(
            rope_theta=150000.0,
            rope_type="yarn",
            factor=32.0,
            beta_fast=32.0,
            beta_slow=1.0,
            truncate=False,
            original_max_position_embeddings=4096,
        ),
    ),
}
# Families whose every layer has attention sinks (a learned logit per query head).
_SINK_FAMILIES = {"gpt_oss"}
# Families whose layer types, when a config does not list them, follow a pattern: every
# ``n``-th layer (1-based) has full attention, the others the window (HF's derivation;
# Gemma 3 configs may name n ``sliding_window_pattern``).
_WINDOW_PATTERN = {"gemma2": 2, "gemma3_text": 6, "gpt_oss": 2}


def hf_model_config(path: Path) -> ModelConfig:
    try:
        cfg = json.loads((path / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"model: cannot read {path / 'config.json'}: {exc}") from exc
    if "Gemma3ForConditionalGeneration" in (cfg.get("architectures") or []):
        raise ValueError(
            "model: Gemma3ForConditionalGeneration (Gemma 3 with its vision tower) is not "
            "supported; serve a text-only Gemma 3 checkpoint (Gemma3ForCausalLM, model_type "
            "gemma3_text, e.g. gemma-3-270m or gemma-3-1b)"
        )
    family = family_of_hf(cfg)
    quant_method(cfg)  # a format we cannot dequantize: refused before anything loads
    try:
        return _hf_fields(cfg, family)
    except (KeyError, TypeError) as exc:
        raise ValueError(f"model: config.json: missing or malformed field {exc}") from None


def _hf_fields(cfg: dict[str, Any], family: str) -> ModelConfig:
    cfg = {**_HF_DEFAULTS.get(family, {}), **cfg}
    heads = _cfg_int(cfg, "num_attention_heads", minimum=1)
    hidden = _cfg_int(cfg, "hidden_size", minimum=1)
    num_layers = _cfg_int(cfg, "num_hidden_layers", minimum=1)
    eos = cfg.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
    rope = cfg.get("rope_scaling") or None
    params = cfg.get("rope_parameters") or {}
    theta = cfg.get("rope_theta") if "full_attention" not in params else None
    # Gemma 3 (transformers 5): one set of rope parameters per layer type; the sliding
    # layers' is the local rope (older configs: ``rope_local_base_freq``).
    local_params = params.get("sliding_attention") or {}
    params = params.get("full_attention", params)
    local_theta = None
    if family == "gemma3_text":
        local_theta = float(
            local_params.get("rope_theta") or cfg.get("rope_local_base_freq") or 10000.0
        )
        if local_params.get("rope_type", "default") != "default":
            raise ValueError(
                f"model: config.json: rope_parameters.sliding_attention rope type "
                f"{local_params['rope_type']!r} is not supported (the local rope is unscaled)"
            )
    if cfg.get("use_bidirectional_attention"):
        raise ValueError(
            "model: config.json: use_bidirectional_attention is not supported (an encoder: "
            "chunkserve serves causal decoders)"
        )
    if theta is None:
        theta = params.get("rope_theta", 10000.0)
    if rope is None and params.get("rope_type", "default") != "default":
        rope = params
    if rope is not None:
        rope = _longrope_fields(cfg, family, dict(rope))
    partial = cfg.get("partial_rotary_factor", params.get("partial_rotary_factor", 1.0))
    # A window counts unless the config turns it off (Qwen2.5 ships a value with
    # use_sliding_window false); a config that names the layers' types decides by them.
    window = cfg.get("sliding_window")
    if cfg.get("use_sliding_window") is False:
        window = None
    layer_types = cfg.get("layer_types")
    if not layer_types and family in _WINDOW_PATTERN:
        n = int(cfg.get("sliding_window_pattern") or _WINDOW_PATTERN[family])
        layer_types = [
            "full_attention" if (i + 1) % n == 0 else "sliding_attention" for i in range(num_layers)
        ]
    if window is not None and layer_types and "sliding_attention" not in layer_types:
        window = None
    # Qwen2 without layer types: the layers from max_window_layers on have the window.
    if window is not None and not layer_types and cfg.get("max_window_layers", 0) >= num_layers:
        window = None
    window_layers = None
    if window is not None and layer_types:
        window_layers = tuple(i for i, t in enumerate(layer_types) if t == "sliding_attention")
    elif window is not None and "max_window_layers" in cfg:
        window_layers = tuple(range(int(cfg["max_window_layers"]), num_layers))
    # SmolLM3: no_rope_layers[i] is 1 where layer i uses rope, 0 where it does not.
    no_rope = cfg.get("no_rope_layers") or []
    attn_mult = cfg.get("attention_multiplier")
    if "query_pre_attn_scalar" in cfg:  # Gemma: the softmax scale
        attn_mult = float(cfg["query_pre_attn_scalar"]) ** -0.5
    attn_cap, final_cap = cfg.get("attn_logit_softcapping"), cfg.get("final_logit_softcapping")
    if cfg.get("clip_qkv") is not None:  # OLMo / OLMoE: q, k, v clamped to +-clip_qkv
        raise ValueError(
            f"model: config.json: clip_qkv {cfg['clip_qkv']!r} is not supported (only null: "
            f"no clamping of q, k and v)"
        )
    fields = dict(
        **_moe_fields(cfg, num_layers),
        architecture=family,
        vocab_size=_cfg_int(cfg, "vocab_size", minimum=1),
        hidden_size=hidden,
        intermediate_size=_cfg_int(cfg, "intermediate_size", minimum=1),
        num_layers=num_layers,
        num_heads=heads,
        num_kv_heads=_cfg_int(cfg, "num_key_value_heads", 0, minimum=0) or heads,
        head_dim=_cfg_int(cfg, "head_dim", 0, minimum=0) or hidden // heads,
        rope_theta=float(theta),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=eos_ids,
        rope_scaling=rope,
        attention_bias=bool(cfg.get("attention_bias", cfg.get("qkv_bias", False))),
        # Gemma's configs carry both; its models use ``hidden_activation``.
        hidden_act=str(cfg.get("hidden_activation") or cfg.get("hidden_act", "silu")),
        partial_rotary_factor=float(partial),
        sliding_window=None if window is None else int(window),
        window_layers=window_layers,
        mlp_bias=bool(cfg.get("mlp_bias", False)),
        embedding_multiplier=float(cfg.get("embedding_multiplier", 1.0)),
        attention_multiplier=None if attn_mult is None else float(attn_mult),
        residual_multiplier=float(cfg.get("residual_multiplier", 1.0)),
        logits_scaling=float(cfg.get("logits_scaling", 1.0)),
        no_rope_layers=tuple(i for i, use in enumerate(no_rope) if not use),
        attn_logit_softcap=None if attn_cap is None else float(attn_cap),
        final_logit_softcap=None if final_cap is None else float(final_cap),
        rope_local_theta=local_theta,
        attention_sinks=family in _SINK_FAMILIES,
        swiglu_limit=None if cfg.get("swiglu_limit") is None else float(cfg["swiglu_limit"]),
        swiglu_alpha=float(cfg.get("swiglu_alpha", 1.702)),
    )
    fields.update(_mla_fields(cfg))
    return ModelConfig(**fields)


_REQUIRED = object()


def _cfg_int(
    cfg: dict[str, Any], name: str, default: Any = _REQUIRED, *, minimum: int | None = None
) -> Any:
    """``cfg[name]`` as an int (``default`` where it is absent or null; a required one
    absent or null, a non-integer, or one below ``minimum``: a ValueError naming it)."""
    value = cfg.get(name)
    if value is None:
        if default is _REQUIRED:
            state = "null" if name in cfg else "missing"
            raise ValueError(f"model: config.json: {name} is {state} (an integer is required)")
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != int(value):
        raise ValueError(f"model: config.json: {name} {value!r} must be an integer")
    if minimum is not None and value < minimum:
        raise ValueError(f"model: config.json: {name} {value!r} must be >= {minimum}")
    return int(value)


def _cfg_float(cfg: dict[str, Any], name: str, default: float) -> float:
    """``cfg[name]`` as a float (``default`` where absent; null or not a number: a
    ValueError naming it)."""
    value = cfg.get(name, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"model: config.json: {name} {value!r} must be a number")
    return float(value)


def _moe_fields(cfg: dict[str, Any], num_layers: int) -> dict[str, Any]:
    """A mixture of experts' fields (``ModelConfig``; none for a dense model): the number
    of experts (``num_local_experts`` as Mixtral and transformers 5's Qwen3-MoE name it, or
    ``num_experts``), the layers with experts from ``mlp_only_layers`` and
    ``decoder_sparse_step`` as transformers' Qwen2/3-MoE derive them (layer i is sparse
    unless listed, when (i + 1) is a multiple of the step). A field null, missing where
    required, or not an integer is a ValueError naming it."""
    experts = 0
    for name in ("num_local_experts", "num_experts", "n_routed_experts"):
        experts = experts or _cfg_int(cfg, name, 0, minimum=0)
    if experts == 0:
        return {}
    if "n_routed_experts" in cfg:
        return _deepseek_moe_fields(cfg, num_layers, experts)
    step = cfg.get("decoder_sparse_step", 1)
    if not isinstance(step, int) or step < 1:
        raise ValueError(
            f"model: config.json: decoder_sparse_step {step!r} must be an integer >= 1"
        )
    dense = set(cfg.get("mlp_only_layers") or ())
    layers = tuple(i for i in range(num_layers) if i not in dense and (i + 1) % step == 0)
    return dict(
        num_experts=experts,
        num_experts_per_tok=_cfg_int(cfg, "num_experts_per_tok", minimum=1),
        moe_intermediate_size=_cfg_int(cfg, "moe_intermediate_size", None, minimum=1),
        norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
        shared_expert_intermediate_size=_cfg_int(
            cfg, "shared_expert_intermediate_size", 0, minimum=0
        ),
        moe_layers=None if len(layers) == num_layers else layers,
    )


def _deepseek_moe_fields(cfg: dict[str, Any], num_layers: int, experts: int) -> dict[str, Any]:
    """DeepSeek's MoE fields (``n_routed_experts``): experts on layer i from
    ``first_k_dense_replace`` on where i is a multiple of ``moe_layer_freq`` (DeepSeek's
    rule; transformers' DeepseekV2 reads no ``moe_layer_freq``, as if it were 1), its router
    (``topk_method``, ``n_group``, ``topk_group``, ``routed_scaling_factor``; V2's softmax
    scores, or V3's sigmoid ones with "noaux_tc"), ``n_shared_experts`` experts' width as
    one ungated shared expert; V3's multi-token-prediction layers
    (``num_nextn_predict_layers``, stored after the decoder's) are skipped at load."""
    freq = cfg.get("moe_layer_freq", 1)
    if not isinstance(freq, int) or freq < 1:
        raise ValueError(f"model: config.json: moe_layer_freq {freq!r} must be an integer >= 1")
    method = str(cfg.get("topk_method") or "greedy")
    scoring = cfg.get("scoring_func", "softmax")
    want = "sigmoid" if method == "noaux_tc" else "softmax"
    if scoring != want:
        raise ValueError(
            f"model: config.json: scoring_func {scoring!r} is not supported with topk_method "
            f"{method!r} (only {want!r})"
        )
    first = _cfg_int(cfg, "first_k_dense_replace", 0, minimum=0)
    layers = tuple(i for i in range(num_layers) if i >= first and i % freq == 0)
    moe_inter = _cfg_int(cfg, "moe_intermediate_size", minimum=1)
    return dict(
        num_experts=experts,
        num_experts_per_tok=_cfg_int(cfg, "num_experts_per_tok", minimum=1),
        moe_intermediate_size=moe_inter,
        norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
        shared_expert_intermediate_size=_cfg_int(cfg, "n_shared_experts", 0, minimum=0) * moe_inter,
        shared_expert_gate=False,
        moe_layers=None if len(layers) == num_layers else layers,
        topk_method=method,
        n_group=_cfg_int(cfg, "n_group", 1, minimum=1),
        topk_group=_cfg_int(cfg, "topk_group", 1, minimum=1),
        routed_scaling_factor=_cfg_float(cfg, "routed_scaling_factor", 1.0),
        num_nextn_predict_layers=_cfg_int(cfg, "num_nextn_predict_layers", 0, minimum=0),
    )


def _mla_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """Multi-head latent attention's fields (``kv_lora_rank``; none without): ``head_dim``
    is the rope part of a head (``qk_rope_head_dim``, as transformers sets it)."""
    if cfg.get("kv_lora_rank") is None:
        return {}
    if cfg.get("rope_interleave", True) is not True:
        raise ValueError(
            f"model: config.json: rope_interleave {cfg['rope_interleave']!r} is not supported "
            f"(only true: DeepSeek's rope rotates interleaved pairs)"
        )
    return dict(
        kv_lora_rank=_cfg_int(cfg, "kv_lora_rank", minimum=1),
        q_lora_rank=_cfg_int(cfg, "q_lora_rank", None, minimum=1),
        qk_nope_head_dim=_cfg_int(cfg, "qk_nope_head_dim", minimum=1),
        v_head_dim=_cfg_int(cfg, "v_head_dim", minimum=1),
        head_dim=_cfg_int(cfg, "qk_rope_head_dim", minimum=1),
    )


def _longrope_fields(cfg: dict[str, Any], family: str, rope: dict[str, Any]) -> dict[str, Any]:
    """LongRoPE's fields as transformers reads them: its old name ``su`` (and, for Phi-3,
    ``yarn``, which transformers' Phi3 config also renames) is ``longrope``; Phi-3's
    configs keep ``original_max_position_embeddings`` beside the rope dict, and that value
    wins over one inside it."""
    kind = rope.get("rope_type", rope.get("type"))
    if kind == "su" or (family == "phi3" and kind == "yarn"):
        kind = "longrope"
    if kind != "longrope":
        return rope
    rope["rope_type"] = "longrope"
    rope.pop("type", None)
    if cfg.get("original_max_position_embeddings") is not None:
        rope["original_max_position_embeddings"] = int(cfg["original_max_position_embeddings"])
    return rope


def iter_hf_weights(path: Path, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """The directory's tensors in ``dtype``; a quantized checkpoint's (``hf_quant``: MXFP4,
    block FP8) as ``hf_quant.LazyDequant``s, dequantized where the model's weight loader
    reads them (``tensor[src]``: a tensor-parallel rank only its share)."""
    try:
        cfg = json.loads((path / "config.json").read_text())
    except (OSError, json.JSONDecodeError):
        cfg = {}
    method = quant_method(cfg)
    if method is None:
        for name, t in _iter_safetensors(path):
            yield name, t.to(dtype)
        return
    yield from dequantize_stream(_iter_safetensors(path), method, dtype, cfg, lazy=True)


def _iter_safetensors(path: Path) -> Iterator[tuple[str, LazyTensor]]:
    """The directory's tensors as ``lazy.LazyTensor``s (read where a rank slices them); the
    files stay open until the last is read (a quantized pair's tensors may be in two)."""
    from safetensors import safe_open

    with contextlib.ExitStack() as stack:
        for file in hf_weight_files(path):
            f = stack.enter_context(safe_open(str(file), framework="pt"))
            for name in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
                yield name, safetensors_tensor(f, name)


def load_model_config(source: ModelSource) -> tuple[ModelConfig, Any]:
    """Return the model's config and, for GGUF, the open reader (reused by the tokenizer)."""
    if source.kind == "gguf":
        reader = open_gguf(source.path)
        return gguf_model_config(reader), reader
    return hf_model_config(source.path), None


def keep_quantized(source: ModelSource, device: torch.device, dequantize: bool) -> bool:
    """Whether a GGUF file's quantized tensors stay in their bits (``iter_gguf_weights``):
    on a CPU unless ``dequantize`` (``--gguf-dequantize``); on other devices never (the
    quantized kernels are CPU ones), with a log line."""
    if source.kind != "gguf" or dequantize:
        return False
    if device.type != "cpu":
        logger.info(
            "model: GGUF weights dequantized at load on %s (quantized kernels run on CPUs)",
            device.type,
        )
        return False
    return True


def check_quantization(source: ModelSource, method: str | None, device: torch.device) -> None:
    """``--quantization`` (weight-only int8/int4 at load) is for float checkpoints on a CPU:
    a GGUF file (quantized already) or an HF checkpoint with its own
    ``quantization_config`` is a ValueError naming the flag, as vLLM refuses a
    ``--quantization`` that differs from the checkpoint's; so is a CUDA device."""
    if method is None:
        return
    if source.kind == "gguf":
        raise ValueError(
            f"quantization: {method} quantizes float (HF safetensors) checkpoints at load; "
            f"{source.name} is a GGUF file, already quantized (its weights stay in their own "
            f"bits on a CPU; --gguf-dequantize loads them as floats)"
        )
    try:
        cfg = json.loads((source.path / "config.json").read_text())
    except (OSError, ValueError):
        cfg = {}
    own = quant_method(cfg) if isinstance(cfg, dict) else None
    if own is not None:
        raise ValueError(
            f"quantization: {method} differs from the checkpoint's own quantization "
            f"({own}, in config.json's quantization_config); drop --quantization"
        )
    if device.type != "cpu":
        raise ValueError(
            f"quantization: {method} weight-only kernels run on CPUs, not {device.type}"
        )


def weight_format(source: ModelSource, reader: Any, quantized: bool) -> str | None:
    """The quantized types a model's weights are held in ("Q4_1+Q8_0": the block formats of
    the file's matrices, when ``quantized``), or None for float weights; known before the
    weights load (the step-time profile is looked up by it)."""
    if not quantized or source.kind != "gguf":
        return None
    from chunkserve.quant.formats import FORMATS

    reader = reader if reader is not None else open_gguf(source.path)
    kinds = {
        FORMATS[int(t.tensor_type)].name
        for t in reader.tensors
        if int(t.tensor_type) in FORMATS and len(t.shape) >= 2
    }
    return "+".join(sorted(kinds)) or None


def iter_weights(
    source: ModelSource,
    config: ModelConfig,
    reader: Any,
    dtype: torch.dtype,
    quantized: bool = False,
) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
    """The model's named tensors; ``quantized``: a GGUF file's quantized tensors as
    ``QuantizedWeight`` (``keep_quantized``)."""
    if source.kind == "gguf":
        return iter_gguf_weights(reader, config, dtype, quantized)
    return iter_hf_weights(source.path, dtype)
