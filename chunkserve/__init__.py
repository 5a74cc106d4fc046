"""chunkserve: an LLM serving engine built around chunked prefill and stall-free batching.

The public names load on first use, so ``chunkserve --help`` (and any module that needs only
a part of the package) does not import torch."""

from __future__ import annotations

import importlib
import os
from typing import TYPE_CHECKING, Any

# MKL's own memory manager keeps the buffers of every GEMM shape it has seen (43 MiB on the
# fp32 offline benchmark, measured with glibc's mallinfo2); without it MKL's buffers come
# from the heap, which keeps freed blocks for reuse anyway (``platform.configure_cpu_
# runtime``): peak RSS 2,108 -> 2,056 MiB at the same speed. MKL reads this when torch is
# imported, so it is set here, before any of the package imports torch. A user's own
# setting wins.
os.environ.setdefault("MKL_DISABLE_FAST_MM", "1")

if TYPE_CHECKING:
    from chunkserve.config import EngineConfig
    from chunkserve.engine.engine import Engine
    from chunkserve.engine.output_processor import RequestOutput
    from chunkserve.entrypoints.llm import LLM
    from chunkserve.scheduling.sampling_params import SamplingParams

from chunkserve.version import __version__

_PUBLIC = {
    "EngineConfig": "chunkserve.config",
    "Engine": "chunkserve.engine.engine",
    "LLM": "chunkserve.entrypoints.llm",
    "RequestOutput": "chunkserve.engine.output_processor",
    "SamplingParams": "chunkserve.scheduling.sampling_params",
}

__all__ = ["LLM", "Engine", "EngineConfig", "RequestOutput", "SamplingParams", "__version__"]


def __getattr__(name: str) -> Any:
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module 'chunkserve' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
