"""Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B): Qwen2's block (Q/K/V biases unless the config's
``qkv_bias`` says otherwise) with a mixture of experts plus a shared expert gated by
sigmoid(x . w) on the layers the config makes sparse (``mlp_only_layers``,
``decoder_sparse_step``; the others a dense MLP). Qwen3-MoE: Qwen3's block (per-head q/k
norms, no biases) with routed experts only. Both renormalise the chosen experts' weights
by ``norm_topk_prob``."""

from __future__ import annotations

from chunkserve.model.decoder import DecoderLM
from chunkserve.model.moe import gguf_moe_names
from chunkserve.model.registry import GGUFSpec, register

# llama.cpp's Qwen2MoeModel converter: experts stacked (ffn_*_exps), the shared expert as
# ffn_*_shexp and its gate ffn_gate_inp_shexp; llama.cpp hard-codes the routers'
# renormalisation (Qwen2-MoE: off, Qwen3-MoE: on) and every layer sparse.
_QWEN2_TENSORS, _EXPERTS = gguf_moe_names(shared=True)
_QWEN3_TENSORS, _ = gguf_moe_names()
_QWEN3_TENSORS.update(
    {
        "attn_q_norm.weight": "self_attn.q_norm.weight",
        "attn_k_norm.weight": "self_attn.k_norm.weight",
    }
)


@register(
    "qwen2_moe",
    hf=("Qwen2MoeForCausalLM",),
    gguf=[
        GGUFSpec(
            "qwen2moe",
            tensors=_QWEN2_TENSORS,
            experts=_EXPERTS,
            config={"norm_topk_prob": False},
        )
    ],
)
class Qwen2MoeModel(DecoderLM):
    pass  # Q/K/V biases: ``attention_bias`` from the config's ``qkv_bias`` (default true)


@register(
    "qwen3_moe",
    hf=("Qwen3MoeForCausalLM",),
    gguf=[
        GGUFSpec(
            "qwen3moe",
            tensors=_QWEN3_TENSORS,
            experts=_EXPERTS,
            config={"norm_topk_prob": True},
        )
    ],
)
class Qwen3MoeModel(DecoderLM):
    qk_norm = "head"
