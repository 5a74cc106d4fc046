"""Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B): Qwen2's block (Q/K/V biases unless the config's
``qkv_bias`` says otherwise) with a mixture of experts plus a shared expert gated by
sigmoid(x . w) on the layers the config makes sparse (``mlp_only_layers``,
``decoder_sparse_step``; the others a dense MLP). Qwen3-MoE: Qwen3's block (per-head q/k
norms, no biases) with routed experts only. Both renormalise the chosen experts' weights
by ``norm_topk_prob``."""

from __future__ import annotations

from chunkserve.model.decoder import DecoderLM
from chunkserve.model.registry import register


@register("qwen2_moe", hf=("Qwen2MoeForCausalLM",))
class Qwen2MoeModel(DecoderLM):
    pass  # Q/K/V biases: ``attention_bias`` from the config's ``qkv_bias`` (default true)


@register("qwen3_moe", hf=("Qwen3MoeForCausalLM",))
class Qwen3MoeModel(DecoderLM):
    qk_norm = "head"
