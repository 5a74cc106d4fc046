"""GPT-OSS (openai/gpt-oss-20b, -120b): Llama's pre-norm block with biases on Q/K/V and on the
output projection, a learned attention sink per query head (``AttentionSpec.sinks``), a
sliding window on alternate layers (``layer_types``; the first of each pair), YaRN rope, and
RMSNorms whose weight multiplies in fp32 (transformers keeps them fp32), and
a mixture of experts for every MLP (``moe.SparseMoE`` with GPT-OSS's router, top-k of the
biased router logits then a softmax over those k, and its experts: biases, the clamped
SwiGLU, pre-fused stacked tensors ``mlp.experts.gate_up_proj`` / ``down_proj``).

The published checkpoints ship the experts in MXFP4 (``*_blocks`` + ``*_scales``), which the
loader dequantizes to these tensors (``hf_quant``).

GGUF (llama.cpp's ``gpt-oss``): the converter splits ``gate_up_proj`` (its columns
interleave gate and up) into ``ffn_gate_exps`` and ``ffn_up_exps`` ([E, I, H] each, as
[out, in]; newer converters may fuse them as ``ffn_gate_up_exps``, gate rows first), stores
``down_proj`` as ``ffn_down_exps`` [E, H, I], the biases beside them, the router as
``ffn_gate_inp`` (weight and bias), the sinks as ``attn_sinks``, the post-attention norm as
``post_attention_norm``; the experts usually in GGUF type MXFP4 (dequantized at load).
llama.cpp hard-codes what the file does not say: the SwiGLU clamp (7.0) and alpha (1.702),
the window on even layers, the router; and it rotates with YaRN's correction range rounded
(``truncate``), where GPT-OSS (and transformers' config) does not round: the model's own
rope is kept here.
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np
import torch

from chunkserve.config import ModelConfig
from chunkserve.model.decoder import DecoderLM
from chunkserve.model.lazy import LazyTensor
from chunkserve.model.moe import GPT_OSS_NAMES
from chunkserve.model.registry import GGUFJoin, GGUFSpec, register


def _interleave(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    """[..., I] and [..., I] -> [..., 2I] with gate at even and up at odd positions."""
    return np.stack((gate, up), axis=-1).reshape(*gate.shape[:-1], -1)


def _gate_up(config: ModelConfig, arrays: list) -> np.ndarray:
    """gate_up_proj [E, H, 2I] (x @ W, interleaved columns) from [E, I, H] gate and up."""
    gate, up = (a.transpose(0, 2, 1) for a in arrays)
    return _interleave(gate, up)


def _gate_up_fused(config: ModelConfig, arrays: list) -> np.ndarray:
    """gate_up_proj [E, H, 2I] from ffn_gate_up_exps [E, 2I, H] (gate rows, then up rows)."""
    gate, up = np.split(arrays[0].transpose(0, 2, 1), 2, axis=-1)
    return _interleave(gate, up)


def _gate_up_bias(config: ModelConfig, arrays: list) -> np.ndarray:
    return _interleave(*arrays)


def _gate_up_bias_fused(config: ModelConfig, arrays: list) -> np.ndarray:
    return _interleave(*np.split(arrays[0], 2, axis=-1))


def _down(config: ModelConfig, arrays: list) -> np.ndarray:
    """down_proj [E, I, H] (x @ W) from ffn_down_exps [E, H, I] ([out, in])."""
    return arrays[0].transpose(0, 2, 1)


# The same joins over the parts as ``LazyTensor``s (``GGUFJoin.lazy``): a rank's box of
# gate_up_proj reads only its experts' rows of gate (its even columns) or up (odd ones).
def _interleave_lazy(gate: LazyTensor, up: LazyTensor) -> LazyTensor:
    """``_interleave`` of two LazyTensors: a box of columns of one parity reads only that
    part's rows."""
    if tuple(gate.shape) != tuple(up.shape):
        raise ValueError(f"gate {tuple(gate.shape)} and up {tuple(up.shape)} differ in shape")

    def read(box: tuple[slice, ...]) -> torch.Tensor:
        *lead, cols = box
        last = cols.stop - 1
        if cols.step % 2 == 0:  # one part's columns only
            part = gate if cols.start % 2 == 0 else up
            return part[(*lead, slice(cols.start // 2, last // 2 + 1, cols.step // 2))]
        r0, r1 = cols.start // 2, last // 2 + 1
        both = torch.stack((gate[(*lead, slice(r0, r1))], up[(*lead, slice(r0, r1))]), -1)
        return both.flatten(-2)[..., cols.start - 2 * r0 : last - 2 * r0 + 1 : cols.step]

    return LazyTensor((*gate.shape[:-1], 2 * gate.shape[-1]), torch.float32, read)


def _halves(t: LazyTensor) -> tuple[LazyTensor, LazyTensor]:
    half = t.shape[-1] // 2
    return t.narrow(-1, 0, half), t.narrow(-1, half, half)


def _gate_up_lazy(config: ModelConfig, parts: list) -> LazyTensor:
    return _interleave_lazy(*(p.permute(0, 2, 1) for p in parts))


def _gate_up_fused_lazy(config: ModelConfig, parts: list) -> LazyTensor:
    return _interleave_lazy(*_halves(parts[0].permute(0, 2, 1)))


def _gate_up_bias_lazy(config: ModelConfig, parts: list) -> LazyTensor:
    return _interleave_lazy(*parts)


def _gate_up_bias_fused_lazy(config: ModelConfig, parts: list) -> LazyTensor:
    return _interleave_lazy(*_halves(parts[0]))


def _down_lazy(config: ModelConfig, parts: list) -> LazyTensor:
    return parts[0].permute(0, 2, 1)


def _gguf_fields(f: dict) -> dict:
    """The window on even layers; the experts as wide as ``feed_forward_length`` (GPT-OSS's
    one width: ``expert_feed_forward_length`` repeats it); the model's unrounded YaRN."""
    width = f.get("moe_intermediate_size")
    if width is not None and int(width) != f["intermediate_size"]:
        raise ValueError(
            f"model: GGUF key 'gpt-oss.expert_feed_forward_length': {width} differs from "
            f"feed_forward_length {f['intermediate_size']} (GPT-OSS's experts have one width)"
        )
    out: dict = {"moe_intermediate_size": None}
    if f.get("sliding_window"):
        out["window_layers"] = tuple(range(0, f["num_layers"], 2))
    if f.get("rope_scaling"):
        out["rope_scaling"] = {**f["rope_scaling"], "truncate": False}
    return out


_EXPERTS = "mlp.experts."
GPT_OSS_GGUF = GGUFSpec(
    "gpt-oss",
    tensors={
        "post_attention_norm.weight": "post_attention_layernorm.weight",
        "attn_sinks.weight": "self_attn.sinks",
        "attn_output.bias": "self_attn.o_proj.bias",
        "ffn_gate_inp.weight": "mlp.router.weight",
        "ffn_gate_inp.bias": "mlp.router.bias",
        "ffn_down_exps.bias": _EXPERTS + "down_proj_bias",
    },
    joins=(
        GGUFJoin(
            _EXPERTS + "gate_up_proj",
            ("ffn_gate_exps.weight", "ffn_up_exps.weight"),
            _gate_up,
            lazy=_gate_up_lazy,
        ),
        GGUFJoin(
            _EXPERTS + "gate_up_proj",
            ("ffn_gate_up_exps.weight",),
            _gate_up_fused,
            lazy=_gate_up_fused_lazy,
        ),
        GGUFJoin(
            _EXPERTS + "gate_up_proj_bias",
            ("ffn_gate_exps.bias", "ffn_up_exps.bias"),
            _gate_up_bias,
            lazy=_gate_up_bias_lazy,
        ),
        GGUFJoin(
            _EXPERTS + "gate_up_proj_bias",
            ("ffn_gate_up_exps.bias",),
            _gate_up_bias_fused,
            lazy=_gate_up_bias_fused_lazy,
        ),
        GGUFJoin(_EXPERTS + "down_proj", ("ffn_down_exps.weight",), _down, lazy=_down_lazy),
    ),
    config={"attention_sinks": True, "swiglu_limit": 7.0, "swiglu_alpha": 1.702},
    derive=_gguf_fields,
)


@register("gpt_oss", hf=("GptOssForCausalLM",), gguf=[GPT_OSS_GGUF])
class GptOssModel(DecoderLM):
    o_bias = True
    norm_fp32_weight = True
    moe_router = "topk_softmax"
    moe_bias = True
    moe_names: ClassVar[dict[str, str]] = GPT_OSS_NAMES
