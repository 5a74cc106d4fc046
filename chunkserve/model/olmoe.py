"""OLMoE: Llama's pre-norm block with RMSNorms over all heads' q and over all heads' k
(OLMo 2's, before rotary) and a mixture of experts for every MLP (softmax top-k, weights
renormalised by ``norm_topk_prob``; OLMoE-1B-7B does not). ``clip_qkv`` is refused by the
loader."""

from __future__ import annotations

from chunkserve.model.decoder import DecoderLM
from chunkserve.model.moe import gguf_moe_names
from chunkserve.model.registry import GGUFSpec, register

# llama.cpp's OlmoeModel converter: experts stacked, q/k norms by name; llama.cpp hard-codes
# the router without renormalisation.
_TENSORS, _EXPERTS = gguf_moe_names()
_TENSORS.update(
    {
        "attn_q_norm.weight": "self_attn.q_norm.weight",
        "attn_k_norm.weight": "self_attn.k_norm.weight",
    }
)


@register(
    "olmoe",
    hf=("OlmoeForCausalLM",),
    gguf=[GGUFSpec("olmoe", tensors=_TENSORS, experts=_EXPERTS, config={"norm_topk_prob": False})],
)
class OlmoeModel(DecoderLM):
    qk_norm = "all"
