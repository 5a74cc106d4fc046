"""Qwen2 / Qwen2.5 (Llama's block with Q/K/V biases) and Qwen3 (no biases; an RMSNorm over
each head's q and k before rotary)."""

from __future__ import annotations

from chunkserve.model.decoder import DecoderLM
from chunkserve.model.registry import GGUFSpec, register


# llama.cpp's Qwen2Model converter: Llama's names (biases included), Q/K rows as HF's.
@register("qwen2", hf=("Qwen2ForCausalLM",), gguf=[GGUFSpec("qwen2")])
class Qwen2Model(DecoderLM):
    qkv_bias = True


@register(
    "qwen3",
    hf=("Qwen3ForCausalLM",),
    gguf=[
        GGUFSpec(
            "qwen3",
            tensors={
                "attn_q_norm.weight": "self_attn.q_norm.weight",
                "attn_k_norm.weight": "self_attn.k_norm.weight",
            },
        )
    ],
)
class Qwen3Model(DecoderLM):
    qk_norm = "head"
