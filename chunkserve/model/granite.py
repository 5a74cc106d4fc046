"""Granite 3: Llama's block; embeddings times ``embedding_multiplier``, softmax scale
``attention_multiplier``, residual branches times ``residual_multiplier``, logits divided by
``logits_scaling`` (all from ``ModelConfig``)."""

from __future__ import annotations

from chunkserve.model.decoder import DecoderLM
from chunkserve.model.registry import GGUFSpec, register

# llama.cpp's GraniteModel converter (a LlamaModel: Q/K rows permuted) renames the
# multipliers to *_scale keys; llama.cpp divides the logits by logit_scale, as HF does.
GRANITE_GGUF = GGUFSpec(
    "granite",
    permuted_qk=True,
    keys={
        "embedding_scale": "embedding_multiplier",
        "attention.scale": "attention_multiplier",
        "residual_scale": "residual_multiplier",
        "logit_scale": "logits_scaling",
    },
)


@register("granite", hf=("GraniteForCausalLM",), gguf=[GRANITE_GGUF])
class GraniteModel(DecoderLM):
    pass
