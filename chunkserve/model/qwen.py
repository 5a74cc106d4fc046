"""Qwen2 / Qwen2.5 (Llama's block with Q/K/V biases) and Qwen3 (no biases; an RMSNorm over
each head's q and k before rotary)."""

from __future__ import annotations

from chunkserve.model.decoder import DecoderLM
from chunkserve.model.registry import register


@register("qwen2", hf=("Qwen2ForCausalLM",))
class Qwen2Model(DecoderLM):
    qkv_bias = True


@register("qwen3", hf=("Qwen3ForCausalLM",))
class Qwen3Model(DecoderLM):
    qk_norm = "head"
