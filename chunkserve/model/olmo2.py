"""OLMo 2: norms after attention and after the MLP (before each residual add, none before),
and RMSNorms over all heads' q and over all heads' k before rotary."""

from __future__ import annotations

from typing import ClassVar

from chunkserve.model.decoder import DecoderLM
from chunkserve.model.registry import register


@register("olmo2", hf=("Olmo2ForCausalLM",))
class Olmo2Model(DecoderLM):
    qk_norm = "all"
    norm_style = "post"
    norm_names: ClassVar[dict[str, str]] = {
        "norm1": "post_attention_layernorm.weight",
        "norm2": "post_feedforward_layernorm.weight",
    }
