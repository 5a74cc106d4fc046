"""OLMoE: Llama's pre-norm block with RMSNorms over all heads' q and over all heads' k
(OLMo 2's, before rotary) and a mixture of experts for every MLP (softmax top-k, weights
renormalised by ``norm_topk_prob``; OLMoE-1B-7B does not). ``clip_qkv`` is refused by the
loader."""

from __future__ import annotations

from chunkserve.model.decoder import DecoderLM
from chunkserve.model.registry import register


@register("olmoe", hf=("OlmoeForCausalLM",))
class OlmoeModel(DecoderLM):
    qk_norm = "all"
