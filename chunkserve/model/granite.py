"""Granite 3: Llama's block; embeddings times ``embedding_multiplier``, softmax scale
``attention_multiplier``, residual branches times ``residual_multiplier``, logits divided by
``logits_scaling`` (all from ``ModelConfig``)."""

from __future__ import annotations

from chunkserve.model.decoder import DecoderLM
from chunkserve.model.registry import register


@register("granite", hf=("GraniteForCausalLM",))
class GraniteModel(DecoderLM):
    pass
