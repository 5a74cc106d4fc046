"""The worker: everything on the device, and one step's forward pass and sampling.

Device and dtype, the KV cache's size and tensors, the model's weights, the attention
backend, the sampler, the model runner, CUDA graphs and the warm-up steps. The engine core
(``core.EngineCore``) hands it a ``SchedulerOutput`` per step and gets sampled token ids back.

Built in two phases so a bad configuration fails before the weights load: the constructor
resolves the device and sizes the KV cache (where that needs no loaded weights), ``load``
reads the weights and allocates the rest.
"""

from __future__ import annotations

import logging
import time

import torch

from chunkserve.attention import get_attention_backend, triton_usable
from chunkserve.config import (
    DEFAULT_CPU_KV_CACHE_MEMORY,
    DEFAULT_GPU_MEMORY_UTILIZATION,
    EngineConfig,
    ModelConfig,
)
from chunkserve.draft import DraftModel
from chunkserve.kv_cache import NULL_BLOCK
from chunkserve.model.llama import LlamaModel
from chunkserve.model.loader import ModelSource, iter_weights, load_model_config, resolve_model
from chunkserve.platform import configure_cpu_runtime, resolve_device, resolve_dtype
from chunkserve.request import Request, SamplingParams
from chunkserve.runner import ModelRunner, RunnerOutput, allocate_kv_caches
from chunkserve.sampler import Sampler
from chunkserve.scheduler import ScheduledChunk, SchedulerOutput

logger = logging.getLogger("chunkserve")

# Decode-only steps with more requests than this run eagerly (graph memory grows with size).
MAX_GRAPH_BATCH_SIZE = 256

# Messages of errors after which the device's state cannot be trusted (a CUDA context after a
# device-side assert fails every later call): the engine is dead, not the step.
FATAL_DEVICE_ERRORS = (
    "CUDA error",
    "device-side assert",
    "illegal memory access",
    "unspecified launch failure",
    "NCCL error",
    "CUBLAS_STATUS_",
    "cuDNN error",
)


class DeviceError(RuntimeError):
    """The device failed in a way no later step can recover from."""


def is_fatal_device_error(exc: BaseException) -> bool:
    """Whether ``exc`` leaves the device unusable (out of memory does not: it fails its
    step only)."""
    if isinstance(exc, torch.cuda.OutOfMemoryError):
        return False
    accelerator_error = getattr(torch, "AcceleratorError", None)
    if accelerator_error is not None and isinstance(exc, accelerator_error):
        return True
    text = str(exc)
    return any(m in text for m in FATAL_DEVICE_ERRORS)


class Worker:
    """The device side of one engine core."""

    def __init__(self, config: EngineConfig, model_config: ModelConfig, max_model_len: int):
        self.config = config
        self.model_config = model_config
        self.max_model_len = max_model_len
        configure_cpu_runtime()
        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        self.block_size = config.block_size
        dtype_size = torch.tensor([], dtype=self.dtype).element_size()
        self._bytes_per_block = model_config.kv_bytes_per_token(dtype_size) * self.block_size
        # A draft model (speculative decoding) is found and checked now; its KV pool shares
        # the target's block ids, so every block costs both.
        self.draft: DraftModel | None = None
        self._draft_source = self._draft_config = self._draft_reader = None
        spec = config.speculative_config
        if spec is not None and spec.method == "draft_model":
            self._open_draft(spec.model)
            assert self._draft_config is not None
            per_token = self._draft_config.kv_bytes_per_token(dtype_size)
            self._bytes_per_block += per_token * self.block_size
        # On a GPU without a given size the cache takes what the weights leave free: sized
        # in ``load``. Everywhere else now, so a cache too small fails before the weights load.
        self._sized_by_free_memory = self.device.type == "cuda" and config.kv_cache_memory is None
        if not self._sized_by_free_memory:
            self._size_kv_cache()
        self.model: LlamaModel | None = None
        self.runner: ModelRunner | None = None
        self.cuda_graphs = False
        self.load_time = 0.0

    def _open_draft(self, path: str | None) -> None:
        name = "speculative_config.model"
        try:
            source = resolve_model(path, weights=self.config.load_format != "dummy")
            draft_config, reader = load_model_config(source)
        except ValueError as exc:
            raise ValueError(f"{name}: {exc}") from None
        if draft_config.vocab_size != self.model_config.vocab_size:
            raise ValueError(
                f"{name}: the draft model's vocabulary ({draft_config.vocab_size} tokens) "
                f"is not the target's ({self.model_config.vocab_size})"
            )
        self._draft_source, self._draft_config, self._draft_reader = source, draft_config, reader

    @property
    def num_threads(self) -> int:
        return torch.get_num_threads()

    def load(self, source: ModelSource, reader, max_num_seqs: int) -> None:
        """Load the weights and allocate the KV cache, sampler and runner."""
        config, model_config = self.config, self.model_config
        t0 = time.perf_counter()
        self.model = LlamaModel(
            model_config,
            self.dtype,
            self.device,
            max_positions=max(self.max_model_len, model_config.max_position_embeddings),
        )
        if config.load_format == "dummy":
            self.model.init_dummy_weights(config.seed)
        else:
            self.model.load_weights(iter_weights(source, model_config, reader, self.dtype))
        self.load_time = time.perf_counter() - t0
        if self._sized_by_free_memory:  # what the weights left free
            self._size_kv_cache()
        on_cuda = self.device.type == "cuda"
        self.attention = get_attention_backend(
            config.attention_backend,
            self.device,
            model_config.num_heads,
            model_config.num_kv_heads,
            model_config.head_dim,
        )
        kv_caches = allocate_kv_caches(
            model_config.num_layers,
            self.num_blocks,
            self.block_size,
            model_config.num_kv_heads,
            model_config.head_dim,
            self.dtype,
            self.device,
        )
        self.sampler = Sampler(model_config.vocab_size, self.device, seed=config.seed)
        self.model.fused_ops = config.fused_ops and on_cuda and triton_usable(self.device)
        # Padding token counts to a few sizes helps oneDNN's caches on a CPU; on a GPU
        # eager steps run at their exact size and decode-only steps replay CUDA graphs.
        self.runner = ModelRunner(
            self.model,
            self.attention,
            self.sampler,
            kv_caches,
            self.block_size,
            self.device,
            pad_batches=not on_cuda,
        )
        if self._draft_config is not None:
            assert self._draft_source is not None
            self.draft = DraftModel(
                self._draft_source,
                self._draft_config,
                self._draft_reader,
                dtype=self.dtype,
                device=self.device,
                num_blocks=self.num_blocks,
                block_size=self.block_size,
                max_model_len=self.max_model_len,
                attention_backend=config.attention_backend,
                seed=config.seed,
                dummy_weights=config.load_format == "dummy",
            )
            self._draft_reader = None
        graphs_ok = self.attention.supports_cuda_graphs
        self.cuda_graphs = on_cuda and not config.enforce_eager and graphs_ok
        if on_cuda and not config.enforce_eager and not graphs_ok:
            logger.info(
                "CUDA graphs off: the %s attention backend cannot be captured",
                self.attention.name,
            )
        if self.cuda_graphs:
            self.runner.enable_decode_graphs(
                min(max_num_seqs, MAX_GRAPH_BATCH_SIZE), self.max_model_len
            )
        if on_cuda:
            self._warm_up()

    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        """Forward and sample one step. Raises ``DeviceError`` when the device is lost;
        other exceptions fail the step's requests only."""
        assert self.runner is not None, "Worker.load first"
        try:
            if self.draft is None:
                return self.runner.execute(out)
            result = self.runner.execute(out, self.draft.probs)
            self.draft.follow(out)
            return result
        except Exception as exc:
            if is_fatal_device_error(exc):
                raise DeviceError(f"{type(exc).__name__}: {exc}") from exc
            raise

    def propose_drafts(self, wanted: list[tuple[Request, int]]) -> None:
        """The draft model's tokens for these decodes (speculative decoding)."""
        assert self.draft is not None, "no draft model"
        try:
            self.draft.propose(wanted)
        except Exception as exc:
            if is_fatal_device_error(exc):
                raise DeviceError(f"{type(exc).__name__}: {exc}") from exc
            raise

    def forget(self, request_id: str) -> None:
        """A request ended: drop its per-request sampling state."""
        self.sampler.forget(request_id)
        if self.draft is not None:
            self.draft.forget(request_id)

    def _warm_up(self) -> None:
        """Run a prefill step and a mixed step (a two-block chunk beside a decode) over the
        null block, so GPU kernels compile and libraries initialise before the first request
        pays for it. Allocates no block; the null block is zeroed again after."""
        assert self.runner is not None
        bs = self.block_size
        params = SamplingParams(max_tokens=1, temperature=0.0)
        prompt = Request("warm-up-0", [0] * (2 * bs), params, max_tokens=1)
        decode = Request("warm-up-1", [0] * (bs + 1), params, max_tokens=1)
        for r in (prompt, decode):
            r.block_ids = [NULL_BLOCK, NULL_BLOCK]
        t0 = time.perf_counter()
        self.runner.execute(SchedulerOutput(prefills=[ScheduledChunk(prompt, 0, 2 * bs)]))
        self.runner.execute(
            SchedulerOutput(
                prefills=[ScheduledChunk(prompt, 0, 2 * bs)],
                decodes=[ScheduledChunk(decode, bs, 1)],
            )
        )
        for k_cache, v_cache in self.runner.kv_caches:
            k_cache[NULL_BLOCK].zero_()
            v_cache[NULL_BLOCK].zero_()
        torch.cuda.synchronize(self.device)
        logger.info("warm-up steps: %.1fs", time.perf_counter() - t0)

    def _size_kv_cache(self) -> None:
        """``num_blocks`` from the KV memory; a cache that cannot hold one sequence of
        ``max_model_len`` tokens is a configuration error."""
        kv_memory = self._kv_cache_memory()
        num_blocks = kv_memory // self._bytes_per_block - 1  # one more is the null block
        capacity = num_blocks * self.block_size
        if capacity < self.max_model_len:
            raise ValueError(
                f"kv_cache_memory: {kv_memory} bytes hold {capacity} tokens, fewer than "
                f"max_model_len ({self.max_model_len}); raise kv_cache_memory to at least "
                f"{-(-self.max_model_len // self.block_size) * self._bytes_per_block} or "
                f"lower max_model_len"
            )
        self.num_blocks = num_blocks
        self.kv_cache_memory = (num_blocks + 1) * self._bytes_per_block

    def _kv_cache_memory(self) -> int:
        if self.config.kv_cache_memory is not None:
            return self.config.kv_cache_memory
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            return int(free * DEFAULT_GPU_MEMORY_UTILIZATION)
        return DEFAULT_CPU_KV_CACHE_MEMORY
