"""OLMo 2: norms after attention and after the MLP (before each residual add, none before),
and RMSNorms over all heads' q and over all heads' k before rotary."""

from __future__ import annotations

from typing import ClassVar

from chunkserve.model.decoder import DecoderLM
from chunkserve.model.registry import GGUFSpec, register

# llama.cpp's Olmo2Model converter: Q/K rows as HF's; the post norms and q/k norms by name.
OLMO2_GGUF = GGUFSpec(
    "olmo2",
    tensors={
        "post_attention_norm.weight": "post_attention_layernorm.weight",
        "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
        "attn_q_norm.weight": "self_attn.q_norm.weight",
        "attn_k_norm.weight": "self_attn.k_norm.weight",
    },
)


@register("olmo2", hf=("Olmo2ForCausalLM",), gguf=[OLMO2_GGUF])
class Olmo2Model(DecoderLM):
    qk_norm = "all"
    norm_style = "post"
    norm_names: ClassVar[dict[str, str]] = {
        "norm1": "post_attention_layernorm.weight",
        "norm2": "post_feedforward_layernorm.weight",
    }
