"""SmolLM3: Llama's block, with no rotary embeddings on the layers ``no_rope_layers`` names
(every 4th in the published checkpoints; from ``ModelConfig``)."""

from __future__ import annotations

from chunkserve.model.decoder import DecoderLM
from chunkserve.model.registry import register


@register("smollm3", hf=("SmolLM3ForCausalLM",))
class SmolLM3Model(DecoderLM):
    pass
