"""Mixtral: Mistral's block with a mixture of experts for its MLP (``moe.SparseMoE``): a
softmax top-k router whose chosen weights are always renormalised, experts stored as
``block_sparse_moe.experts.N.w1`` (gate), ``w3`` (up) and ``w2`` (down)."""

from __future__ import annotations

from typing import ClassVar

from chunkserve.model.decoder import DecoderLM
from chunkserve.model.moe import MOE_NAMES
from chunkserve.model.registry import register

MIXTRAL_NAMES = {**MOE_NAMES, "block": "block_sparse_moe", "gate": "w1", "up": "w3", "down": "w2"}


# GGUF: llama.cpp writes Mixtral as "llama" with experts (``llama.LLAMA_GGUF``).
@register("mixtral", hf=("MixtralForCausalLM",))
class MixtralModel(DecoderLM):
    moe_renormalize = True
    moe_names: ClassVar[dict[str, str]] = MIXTRAL_NAMES
