"""Gemma 2 and Gemma 3 (text): "sandwich" blocks (an RMSNorm before and after attention and
before and after the MLP), every RMSNorm ``x * (1 + w)``, embeddings times sqrt(hidden), a
GeLU-tanh MLP, sliding-window layers by the config's layer types (Gemma 2: every other one;
Gemma 3: five of every six). Gemma 2 soft-caps its attention scores and its logits; Gemma 3
has per-head q/k norms and rotates its sliding-window layers with a local rope base. Softmax
scale, caps and the local base come from ``ModelConfig``."""

from __future__ import annotations

from typing import ClassVar

from chunkserve.model.decoder import DecoderLM
from chunkserve.model.registry import register


@register("gemma2", hf=("Gemma2ForCausalLM",), gguf=("gemma2",))
class Gemma2Model(DecoderLM):
    norm_style = "sandwich"
    norm_offset = True
    scale_embeddings = True
    norm_names: ClassVar[dict[str, str]] = {
        "norm1": "input_layernorm.weight",
        "norm2": "post_attention_layernorm.weight",
        "norm3": "pre_feedforward_layernorm.weight",
        "norm4": "post_feedforward_layernorm.weight",
    }


@register("gemma3_text", hf=("Gemma3ForCausalLM",), gguf=("gemma3",))
class Gemma3Model(Gemma2Model):
    qk_norm = "head"
