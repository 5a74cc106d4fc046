"""SmolLM3: Llama's block, with no rotary embeddings on the layers ``no_rope_layers`` names
(every 4th in the published checkpoints; from ``ModelConfig``)."""

from __future__ import annotations

from typing import Any

from chunkserve.model.decoder import DecoderLM
from chunkserve.model.registry import GGUFSpec, register


def _no_rope_every_4th(fields: dict[str, Any]) -> dict[str, Any]:
    # No GGUF key: llama.cpp hard-codes n_no_rope_layer_step = 4 for smollm3 (layer i has
    # no rope where (i + 1) % 4 == 0), as HF's no_rope_layer_interval 4 does.
    return {"no_rope_layers": tuple(i for i in range(fields["num_layers"]) if (i + 1) % 4 == 0)}


# llama.cpp's SmolLM3Model converter is a LlamaModel: Q/K rows permuted.
SMOLLM3_GGUF = GGUFSpec("smollm3", permuted_qk=True, derive=_no_rope_every_4th)


@register("smollm3", hf=("SmolLM3ForCausalLM",), gguf=[SMOLLM3_GGUF])
class SmolLM3Model(DecoderLM):
    pass
