"""Llama 1-3.x and Mistral: pre-norm blocks of grouped-query attention (rotary, optional
Q/K/V biases) and a SwiGLU MLP; tied or separate LM head; ``llama3`` / linear / dynamic /
yarn rope scaling. Everything is ``DecoderLM``'s defaults (see ``decoder``); Mistral's
sliding window is the attention backend's (``AttentionSpec``), checked by
``registry.check_attention``.
"""

from __future__ import annotations

from typing import Any

from chunkserve.model.decoder import DecoderLM
from chunkserve.model.layers import MLP_SLICE_ROWS, apply_rope, rms_norm  # noqa: F401
from chunkserve.model.mixtral import MIXTRAL_NAMES
from chunkserve.model.moe import gguf_moe_names
from chunkserve.model.registry import GGUFSpec, register


def _mixtral_if_experts(fields: dict[str, Any]) -> dict[str, Any]:
    """A "llama" GGUF with experts is Mixtral (llama.cpp's converter writes it so)."""
    return {"architecture": "mixtral"} if fields.get("num_experts") else {}


_MOE_TENSORS, _MOE_EXPERTS = gguf_moe_names(MIXTRAL_NAMES)
# llama.cpp's LlamaModel converter (HF Mistral and Mixtral too: it writes "llama") permutes
# Q/K rows; Llama 3's rope scaling becomes the rope_freqs tensor (read by the loader);
# Mixtral's experts are stacked (ffn_*_exps), its router ffn_gate_inp.
LLAMA_GGUF = GGUFSpec(
    "llama",
    permuted_qk=True,
    tensors=_MOE_TENSORS,
    experts=_MOE_EXPERTS,
    derive=_mixtral_if_experts,
)


@register("llama", hf=("LlamaForCausalLM",), gguf=[LLAMA_GGUF])
class LlamaModel(DecoderLM):
    pass


@register("mistral", hf=("MistralForCausalLM",), gguf=[GGUFSpec("mistral", permuted_qk=True)])
class MistralModel(DecoderLM):
    pass
