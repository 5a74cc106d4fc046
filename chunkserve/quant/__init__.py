"""Quantized weights kept in their bits: GGUF block formats (``formats``), the weight
classes the model's layers hold (``weight``) and the CPU kernels that multiply by them
(``kernels``). Imports torch, numpy and gguf only, never ``chunkserve.model``."""

from chunkserve.quant.weight import GGUFWeight, QuantizedWeight, concat_rows

__all__ = ["GGUFWeight", "QuantizedWeight", "concat_rows"]
