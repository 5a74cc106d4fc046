"""Gemma 2 and Gemma 3 (text): "sandwich" blocks (an RMSNorm before and after attention and
before and after the MLP), every RMSNorm ``x * (1 + w)``, embeddings times sqrt(hidden), a
GeLU-tanh MLP, sliding-window layers by the config's layer types (Gemma 2: every other one;
Gemma 3: five of every six). Gemma 2 soft-caps its attention scores and its logits; Gemma 3
has per-head q/k norms and rotates its sliding-window layers with a local rope base. Softmax
scale, caps and the local base come from ``ModelConfig``.

GGUF (llama.cpp's ``Gemma2Model`` / ``Gemma3Model`` converters): Q/K rows as HF's, every
``*norm.weight`` stored as ``1 + w``, the pre-MLP norm named ``ffn_norm``. What the files do
not carry, llama.cpp hard-codes: the activation, the layer pattern (Gemma 3's 5:1 and local
rope base 10000), and the softmax scale (``query_pre_attn_scalar``: ``head_dim`` except for the
27B models, 46 / 62 layers, whose ``hidden / heads``)."""

from __future__ import annotations

from typing import Any, ClassVar

from chunkserve.model.decoder import DecoderLM
from chunkserve.model.registry import GGUFSpec, register

_GGUF_NORMS = {
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
}


def _gguf_derived(every: int, layers_27b: int):
    """The fields llama.cpp derives for a Gemma: window on all layers but every
    ``every``-th; the 27B model's softmax scale (hidden / heads) ** -0.5."""

    def derive(f: dict[str, Any]) -> dict[str, Any]:
        out: dict[str, Any] = {
            "window_layers": tuple(i for i in range(f["num_layers"]) if (i + 1) % every)
        }
        if f["num_layers"] == layers_27b:
            out["attention_multiplier"] = (f["hidden_size"] / f["num_heads"]) ** -0.5
        return out

    return derive


GEMMA2_GGUF = GGUFSpec(
    "gemma2",
    tensors=_GGUF_NORMS,
    norm_offset=1.0,
    keys={
        "attn_logit_softcapping": "attn_logit_softcap",
        "final_logit_softcapping": "final_logit_softcap",
    },
    config={"hidden_act": "gelu_pytorch_tanh"},
    derive=_gguf_derived(2, 46),
)
GEMMA3_GGUF = GGUFSpec(
    "gemma3",
    tensors={
        **_GGUF_NORMS,
        "attn_q_norm.weight": "self_attn.q_norm.weight",
        "attn_k_norm.weight": "self_attn.k_norm.weight",
    },
    norm_offset=1.0,
    config={"hidden_act": "gelu_pytorch_tanh", "rope_local_theta": 10000.0},
    derive=_gguf_derived(6, 62),
)


@register("gemma2", hf=("Gemma2ForCausalLM",), gguf=[GEMMA2_GGUF])
class Gemma2Model(DecoderLM):
    norm_style = "sandwich"
    norm_offset = True
    scale_embeddings = True
    norm_names: ClassVar[dict[str, str]] = {
        "norm1": "input_layernorm.weight",
        "norm2": "post_attention_layernorm.weight",
        "norm3": "pre_feedforward_layernorm.weight",
        "norm4": "post_feedforward_layernorm.weight",
    }


@register("gemma3_text", hf=("Gemma3ForCausalLM",), gguf=[GEMMA3_GGUF])
class Gemma3Model(Gemma2Model):
    qk_norm = "head"
