"""Llama 1-3.x and Mistral: pre-norm blocks of grouped-query attention (rotary, optional
Q/K/V biases) and a SwiGLU MLP; tied or separate LM head; ``llama3`` / linear / dynamic /
yarn rope scaling. Everything is ``DecoderLM``'s defaults (see ``decoder``); Mistral's
sliding window is the attention backend's (``AttentionSpec``), checked by
``registry.check_attention``.
"""

from __future__ import annotations

from chunkserve.model.decoder import DecoderLM
from chunkserve.model.layers import MLP_SLICE_ROWS, apply_rope, rms_norm  # noqa: F401
from chunkserve.model.registry import GGUFSpec, register

# llama.cpp's LlamaModel converter (HF Mistral too: it writes "llama") permutes Q/K rows;
# Llama 3's rope scaling becomes the rope_freqs tensor (read by the loader).
LLAMA_GGUF = GGUFSpec("llama", permuted_qk=True)


@register("llama", hf=("LlamaForCausalLM",), gguf=[LLAMA_GGUF])
class LlamaModel(DecoderLM):
    pass


@register("mistral", hf=("MistralForCausalLM",), gguf=[GGUFSpec("mistral", permuted_qk=True)])
class MistralModel(DecoderLM):
    pass
