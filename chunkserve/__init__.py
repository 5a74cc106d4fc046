"""chunkserve: an LLM serving engine built around chunked prefill and stall-free batching."""

from chunkserve.config import EngineConfig
from chunkserve.engine import Engine, RequestOutput
from chunkserve.llm import LLM
from chunkserve.request import SamplingParams

__version__ = "0.1.0"

__all__ = ["LLM", "Engine", "EngineConfig", "RequestOutput", "SamplingParams", "__version__"]
