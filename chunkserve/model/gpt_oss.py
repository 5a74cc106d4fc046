"""GPT-OSS (openai/gpt-oss-20b, -120b): Llama's pre-norm block with biases on Q/K/V and on the
output projection, a learned attention sink per query head (``AttentionSpec.sinks``), a
sliding window on alternate layers (``layer_types``; the first of each pair), YaRN rope, and
RMSNorms whose weight multiplies in fp32 (transformers keeps them fp32), and
a mixture of experts for every MLP (``moe.SparseMoE`` with GPT-OSS's router, top-k of the
biased router logits then a softmax over those k, and its experts: biases, the clamped
SwiGLU, pre-fused stacked tensors ``mlp.experts.gate_up_proj`` / ``down_proj``).

The published checkpoints ship the experts in MXFP4 (``*_blocks`` + ``*_scales``), which the
loader dequantizes to these tensors (``loader.dequantize_hf``).

GGUF (llama.cpp's ``gpt-oss``) is not loaded: refused by its architecture name."""

from __future__ import annotations

from typing import ClassVar

from chunkserve.model.decoder import DecoderLM
from chunkserve.model.moe import GPT_OSS_NAMES
from chunkserve.model.registry import GGUF_REFUSED, register

GGUF_REFUSED["gpt-oss"] = (
    "GPT-OSS from GGUF is not supported yet (llama.cpp's MXFP4 expert tensors, sinks and "
    "biased router are not mapped); serve the HF directory (openai/gpt-oss-20b), whose MXFP4 "
    "experts are dequantized at load"
)


@register("gpt_oss", hf=("GptOssForCausalLM",))
class GptOssModel(DecoderLM):
    o_bias = True
    norm_fp32_weight = True
    moe_router = "topk_softmax"
    moe_bias = True
    moe_names: ClassVar[dict[str, str]] = GPT_OSS_NAMES
