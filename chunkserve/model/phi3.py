"""Phi-3 / 3.5 / 4 (mini): Llama's block with Q/K/V and gate/up stored fused in the
checkpoint (``qkv_proj`` = [q; k; v] rows, ``gate_up_proj`` = [gate; up] rows; each
tensor-parallel rank takes its heads and columns of each part, see
``layers.ColumnParallelLinear.fused_targets``). From ``ModelConfig``: ``longrope`` rope
scaling (``su`` in older configs; short or long factors chosen by max_model_len, see
``registry.serving_config``), partial rotary (Phi-4-mini: 0.75), the window of every layer
(Phi-3-mini-4k: ``sliding_window`` 2047, which transformers' Phi3 applies)."""

from __future__ import annotations

from typing import ClassVar

from chunkserve.model.decoder import DecoderLM
from chunkserve.model.registry import register


@register("phi3", hf=("Phi3ForCausalLM",))
class Phi3Model(DecoderLM):
    fused_names: ClassVar[dict[str, str]] = {"qkv": "qkv_proj", "gate_up": "gate_up_proj"}
