"""Phi-3 / 3.5 / 4 (mini): Llama's block with Q/K/V and gate/up stored fused in the
checkpoint (``qkv_proj`` = [q; k; v] rows, ``gate_up_proj`` = [gate; up] rows; each
tensor-parallel rank takes its heads and columns of each part, see
``layers.ColumnParallelLinear.fused_targets``). From ``ModelConfig``: ``longrope`` rope
scaling (``su`` in older configs; short or long factors chosen by max_model_len, see
``registry.serving_config``), partial rotary (Phi-4-mini: 0.75), the window of every layer
(Phi-3-mini-4k: ``sliding_window`` 2047, which transformers' Phi3 applies)."""

from __future__ import annotations

from typing import Any, ClassVar

from chunkserve.model.decoder import DecoderLM
from chunkserve.model.registry import GGUFSpec, register


def _gguf_longrope(fields: dict[str, Any]) -> dict[str, Any]:
    """llama.cpp's form of LongRoPE as HF's rope dict: the ``rope_factors_long`` /
    ``rope_factors_short`` tensors, ``rope.scaling.original_context_length`` and the
    attention factor the converter computed (``rope.scaling.attn_factor``). (llama.cpp, too,
    picks long or short once, by its context size against the original length.)"""
    if "_long_factor" not in fields and "_short_factor" not in fields:
        return {}
    for name, what in (
        ("_long_factor", "tensor 'rope_factors_long.weight'"),
        ("_short_factor", "tensor 'rope_factors_short.weight'"),
        ("_original", "key 'phi3.rope.scaling.original_context_length'"),
    ):
        if name not in fields:
            raise ValueError(f"model: GGUF file of 'phi3' with rope factors: {what} is missing")
    return {
        "rope_scaling": {
            "rope_type": "longrope",
            "long_factor": list(fields["_long_factor"]),
            "short_factor": list(fields["_short_factor"]),
            "original_max_position_embeddings": int(fields["_original"]),
            "attention_factor": float(fields.get("_attn_factor", 1.0)),
        }
    }


# llama.cpp's Phi3MiniModel converter: HF's fused tensors under its names (attn_qkv; ffn_up
# holds [gate; up]), no Q/K permutation, rope.dimension_count for partial rotary, and
# sliding_window 0 for none. (llama.cpp itself ignores Phi-3's window, "Phi SWA is currently
# disabled"; we apply it, as transformers does.)
PHI3_GGUF = GGUFSpec(
    "phi3",
    tensors={
        "attn_qkv.weight": "self_attn.qkv_proj.weight",
        "ffn_up.weight": "mlp.gate_up_proj.weight",
    },
    keys={
        "attention.sliding_window": ("sliding_window", lambda v: int(v) or None),
        "rope.scaling.attn_factor": ("_attn_factor", float),
        "rope.scaling.original_context_length": ("_original", int),
    },
    config_tensors={
        "rope_factors_long.weight": "_long_factor",
        "rope_factors_short.weight": "_short_factor",
    },
    derive=_gguf_longrope,
)


@register("phi3", hf=("Phi3ForCausalLM",), gguf=[PHI3_GGUF])
class Phi3Model(DecoderLM):
    fused_names: ClassVar[dict[str, str]] = {"qkv": "qkv_proj", "gate_up": "gate_up_proj"}
