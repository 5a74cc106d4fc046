"""The worker: everything on the device, and one step's forward pass and sampling.

Device and dtype, the KV cache's size and tensors, the model's weights, the attention
backend, the sampler, the model runner, CUDA graphs and the warm-up steps. The engine core
(``core.EngineCore``) hands it a ``SchedulerOutput`` per step and gets sampled token ids back.

Built in two phases so a bad configuration fails before the weights load: the constructor
resolves the device and sizes the KV cache (where that needs no loaded weights), ``load``
reads the weights and allocates the rest.

Tensor parallel (``tensor_parallel_size`` > 1): the engine core's worker is rank 0; ``load``
starts this node's other ranks (``distributed.launch``), each a ``Worker`` of its own that
holds its shard of the weights and of the KV cache and ``follow``s rank 0's steps. Rank 0
alone samples, runs a draft model and fills grammar masks. A rank that dies or a collective
that fails or times out is a ``DeviceError``: the engine is dead, as with a lost GPU.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
import weakref

import torch

from chunkserve.attention import select_attention_backend, triton_usable
from chunkserve.config import (
    DEFAULT_CPU_KV_CACHE_MEMORY,
    DEFAULT_GPU_MEMORY_UTILIZATION,
    EngineConfig,
    ModelConfig,
)
from chunkserve.distributed.child import ProcessExited
from chunkserve.distributed.group import (
    OP_PING,
    OP_SHUTDOWN,
    OP_STEP,
    OP_ZERO_NULL_BLOCK,
    CollectiveError,
    TPGroup,
)
from chunkserve.distributed.launch import (
    LocalRanks,
    RankSpec,
    connect_store,
    launcher_env,
    start_rank0,
)
from chunkserve.distributed.shard import plan_shards
from chunkserve.memory import release_free_heap
from chunkserve.model.layers import DETERMINISTIC_TILING
from chunkserve.model.loader import (
    ModelSource,
    check_quantization,
    iter_weights,
    keep_quantized,
    load_model_config,
    resolve_model,
    weight_format,
)
from chunkserve.model.registry import (
    CausalLM,
    attention_specs,
    build_model,
    check_attention,
    check_servable,
    kv_layout,
    serving_config,
)
from chunkserve.platform import configure_cpu_runtime, resolve_device, resolve_dtype
from chunkserve.quant.weight import invariant_arithmetic
from chunkserve.scheduling.kv_cache import NULL_BLOCK
from chunkserve.scheduling.request import Request
from chunkserve.scheduling.sampling_params import SamplingParams
from chunkserve.scheduling.scheduler import ScheduledChunk, SchedulerOutput
from chunkserve.worker.draft_model import DraftModel
from chunkserve.worker.errors import DeviceError
from chunkserve.worker.model_runner import ModelRunner, RunnerOutput, StepArrays, allocate_kv_caches
from chunkserve.worker.sampler import Sampler

logger = logging.getLogger("chunkserve")

# Decode-only steps with more requests than this run eagerly (graph memory grows with size).
MAX_GRAPH_BATCH_SIZE = 256

# An idle tensor-parallel rank 0 pings its group this often (seconds), so the other ranks'
# wait for the next step never reaches its timeout.
TP_PING_INTERVAL_S = 600.0

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


def stop_ranks(group: TPGroup, local_ranks: LocalRanks | None) -> None:
    """Rank 0's end of a group: tell the other ranks to stop, and wait for the ones this
    process started (killed if they take over 10 s)."""
    with contextlib.suppress(CollectiveError):  # a rank gone already
        group.send(OP_SHUTDOWN)
    if local_ranks is not None:
        local_ranks.stop(10.0)


class Worker:
    """The device side of one engine core (tensor parallel: of one rank of it)."""

    def __init__(
        self,
        config: EngineConfig,
        model_config: ModelConfig,
        max_model_len: int,
        rank: RankSpec | None = None,
    ):
        """``rank``: a tensor-parallel rank other than 0 (None: the engine core's worker)."""
        self.config = config
        self._keep_quantized: bool | None = None  # ``plan_weights``
        self.weights_format: str | None = None
        self.model_config = model_config
        self.max_model_len = max_model_len
        self.rank_spec = rank
        self.rank = 0 if rank is None else rank.rank
        tp = config.tensor_parallel_size
        # A family we serve (what its attention needs is checked against the backend).
        check_servable(model_config, max_model_len)
        model_config = self.model_config = serving_config(model_config, max_model_len)
        # This rank's share of the model; a model that cannot be split so fails here.
        if config.enable_expert_parallel and model_config.num_experts == 0:
            raise ValueError(
                f"enable_expert_parallel: this {model_config.architecture} model has no "
                f"experts to divide among ranks"
            )
        self.shard = plan_shards(
            model_config, tp, self.rank, expert_parallel=config.enable_expert_parallel
        )
        self.group: TPGroup | None = None
        self.local_ranks: LocalRanks | None = None
        # Rank 0: stops the other ranks once, from ``shutdown`` or else when the worker is
        # collected or the interpreter exits (a script that simply ends).
        self._stop_ranks: weakref.finalize | None = None
        configure_cpu_runtime()
        self.device = resolve_device(config.device)
        num_threads = config.num_threads
        if num_threads is None and tp > 1 and self.device.type == "cpu":
            # The node's cores, shared by its ranks.
            num_threads = max(1, (os.cpu_count() or 1) // (tp // config.nnodes))
        if num_threads is not None:
            torch.set_num_threads(num_threads)
        if self.device.type == "cuda" and rank is not None:
            torch.cuda.set_device(rank.local_rank)
            self.device = torch.device("cuda", rank.local_rank)
        self.dtype = resolve_dtype(config.dtype, self.device)
        self.block_size = config.block_size
        dtype_size = torch.tensor([], dtype=self.dtype).element_size()
        # Every rank's pool has the same blocks, sized by the rank with the most KV heads.
        # A block id holds one KV group's layers (``kv_cache``).
        layout = kv_layout(model_config, self.shard.max_kv_heads)
        self.kv_layout = layout
        self.kv_groups = layout.groups(config.hybrid_kv_cache)
        if layout.latent and config.disaggregation_mode is not None:
            raise ValueError(
                "disaggregation_mode: this model caches a latent per token (multi-head latent "
                "attention), and disaggregated KV transfer moves K and V blocks"
            )
        per_token = layout.bytes_per_token(dtype_size, config.hybrid_kv_cache)
        self._bytes_per_block = per_token * self.block_size
        # A draft model (speculative decoding) is found and checked now; its KV pool shares
        # the target's block ids, so every block costs both.
        self.draft: DraftModel | None = None
        # What the deterministic mode's products of the model's GGUF weights run on
        # (``quant.weight.invariant_arithmetic``; "": no such weights, or the plain mode): a
        # prefill/decode pair must agree on it.
        self.invariant_products = ""
        self._draft_source = self._draft_config = self._draft_reader = None
        spec = config.speculative_config
        if spec is not None and spec.method == "draft_model":
            self._open_draft(spec.model, spec.revision)
            assert self._draft_config is not None
            draft_layout = kv_layout(self._draft_config)
            if draft_layout.latent:
                raise ValueError(
                    "speculative_config.model: a draft model with multi-head latent "
                    "attention (a latent KV cache) is not supported"
                )
            self._check_draft_window(draft_layout.layer_windows)
            per_token = draft_layout.bytes_per_token(dtype_size, hybrid=False)
            self._bytes_per_block += per_token * self.block_size
        # On a GPU without a given size the cache takes what the weights leave free: sized
        # in ``load``. Everywhere else now, so a cache too small fails before the weights load.
        self._sized_by_free_memory = self.device.type == "cuda" and config.kv_cache_memory is None
        if not self._sized_by_free_memory:
            self._size_kv_cache()
        self.model: CausalLM | None = None
        self.runner: ModelRunner | None = None
        self.cuda_graphs = False
        self.load_time = 0.0

    def _open_draft(self, path: str | None, revision: str | None = None) -> None:
        name = "speculative_config.model"
        try:
            source = resolve_model(
                path,
                weights=self.config.load_format != "dummy",
                revision=revision,
                download_dir=self.config.download_dir,
            )
            draft_config, reader = load_model_config(source)
        except ValueError as exc:
            raise ValueError(f"{name}: {exc}") from None
        check_servable(draft_config, self.max_model_len, name)
        draft_config = serving_config(draft_config, self.max_model_len)
        if draft_config.vocab_size != self.model_config.vocab_size:
            raise ValueError(
                f"{name}: the draft model's vocabulary ({draft_config.vocab_size} tokens) "
                f"is not the target's ({self.model_config.vocab_size})"
            )
        self._draft_source, self._draft_config, self._draft_reader = source, draft_config, reader

    def _check_draft_window(self, draft_windows: tuple[int | None, ...]) -> None:
        """The draft model's cache follows the target's first KV group's table: where that
        group gives blocks back (a window W), the draft may not look further back than W."""
        window = self.kv_groups.windows[0]
        if window is None:
            return
        if any(w is None or w > window for w in draft_windows):
            raise ValueError(
                f"speculative_config.model: the target's KV cache gives back blocks older "
                f"than its sliding window ({window} tokens) and the draft model attends "
                f"further back; pass --no-hybrid-kv-cache or a draft model with a window of "
                f"at most {window}"
            )

    @property
    def num_threads(self) -> int:
        return torch.get_num_threads()

    @property
    def tp_pids(self) -> list[int]:
        """PIDs of the tensor-parallel rank processes this worker started."""
        return [] if self.local_ranks is None else self.local_ranks.pids

    def _join_group(self) -> None:
        """Tensor parallel: start this node's other ranks (rank 0) and join the group."""
        tp = self.config.tensor_parallel_size
        if tp == 1:
            return
        if self.rank_spec is None:
            store, self.local_ranks = start_rank0(self.config)
        else:
            store = connect_store(self.rank_spec)
        try:
            self.group = TPGroup.join(
                store, self.rank, tp, self.device, shm_alive=self._shm_liveness(),
                ordered_sums=self.config.deterministic,
            )  # fmt: skip
        except BaseException:
            self.shutdown()
            raise
        if self.rank == 0:
            self._stop_ranks = weakref.finalize(self, stop_ranks, self.group, self.local_ranks)
        logger.info(
            "tensor-parallel rank %d of %d: %d query / %d KV heads, %d MLP columns, "
            "vocabulary rows %d..%d, sums over %s%s",
            self.rank,
            tp,
            self.shard.num_heads,
            self.shard.num_kv_heads,
            self.shard.intermediate_size,
            *self.shard.vocab,
            "shared memory" if self.group.shm is not None else "gloo",
            f", rank processes {self.tp_pids}" if self.tp_pids else "",
        )

    def _shm_liveness(self):
        """With every rank a process of this host started by rank 0 (and shared memory
        allowed): what a rank waiting in a shared-memory sum checks, else None."""
        config = self.config
        if not config.tensor_parallel_shm or config.nnodes > 1 or launcher_env() is not None:
            return None
        if self.rank == 0:
            return None if self.local_ranks is None else self.local_ranks.check
        parent = os.getppid()  # rank 0, which started this rank

        def parent_alive() -> None:
            if os.getppid() != parent:
                raise ProcessExited("tensor-parallel rank 0 is gone")

        return parent_alive

    def plan_weights(self, source: ModelSource, reader) -> bool:
        """Whether a GGUF's quantized weights stay quantized here (``loader.keep_quantized``),
        and ``weights_format``: the quantized types they are held in, or None (the step-time
        profile is kept per format; known before the weights load)."""
        if self._keep_quantized is None:
            check_quantization(source, self.config.quantization, self.device)
            self._keep_quantized = keep_quantized(
                source, self.device, self.config.gguf_dequantize
            ) and (self.config.load_format != "dummy")
            self.weights_format = self.config.quantization or weight_format(
                source, reader, self._keep_quantized
            )
        return self._keep_quantized

    def load(self, source: ModelSource, reader, max_num_seqs: int) -> None:
        """Load the weights and allocate the KV cache, sampler and runner (tensor parallel:
        this rank's share, the other ranks loading theirs at the same time)."""
        config, model_config = self.config, self.model_config
        self._join_group()
        # The backend first: what the model's attention needs is checked before weights load.
        # Latent attention: the backend attends over the cached latent, one KV "head" of
        # the latent's width (queries absorbed into it by the model).
        latent = self.kv_layout.latent
        kv_heads = self.kv_layout.num_kv_heads if latent else self.shard.num_kv_heads
        head_dim = self.kv_layout.head_dim if latent else model_config.head_dim
        try:
            self.attention = select_attention_backend(
                config.attention_backend,
                self.device,
                self.shard.num_heads,
                kv_heads,
                head_dim,
                self.dtype,
                self.block_size,
                deterministic=config.deterministic,
                specs=attention_specs(model_config),
            )
        except ValueError as exc:
            if not latent:
                raise
            raise ValueError(
                f"{exc} (this model's multi-head latent attention attends over one latent "
                f"of {self.kv_layout.head_dim} values: kv_lora_rank + qk_rope_head_dim; "
                f"the torch attention backend serves it)"
            ) from None
        check_attention(self.attention, model_config)
        t0 = time.perf_counter()
        # Rotary tables for the positions served (a request's tokens, drafts included, stay
        # under max_model_len), not the model's max_position_embeddings: Gemma 3 270M's
        # four fp32 tables at 32,768 positions were 128 MiB resident, 4 MiB at 1,024.
        # (Dynamic NTK scaling reads the same frequencies either way: HF's defaults up to
        # max_position_embeddings.)
        self.model = build_model(
            model_config,
            self.dtype,
            self.device,
            max_positions=self.max_model_len,
            shard=self.shard,
            group=self.group,
        )
        quantized = self.plan_weights(source, reader)
        if config.load_format == "dummy":
            self.model.init_dummy_weights(config.seed)
            if config.quantization:
                self.model.quantize_linear(config.quantization)
        else:
            self.model.load_weights(
                iter_weights(source, model_config, reader, self.dtype, quantized),
                quantization=config.quantization,
            )
        self.load_time = time.perf_counter() - t0
        if config.deterministic:
            kernel = config.deterministic_quant_kernel
            if self.model.set_row_tiling(DETERMINISTIC_TILING, kernel):
                self.invariant_products = invariant_arithmetic(kernel, self.dtype, self.device)
        if self.device.type == "cpu":
            released = release_free_heap()  # the loader's freed buffers
            logger.debug("released %.0f MiB of free heap after loading", released / 2**20)
        if self._sized_by_free_memory:  # what the weights left free
            self._size_kv_cache()
            if self.group is not None:  # the block tables are shared: the least of the ranks
                self.num_blocks = self.group.min_int(self.num_blocks)
                self.kv_cache_memory = (self.num_blocks + 1) * self._bytes_per_block
        on_cuda = self.device.type == "cuda"
        kv_caches = allocate_kv_caches(
            model_config.num_layers,
            self.num_blocks,
            self.block_size,
            self.kv_layout.num_kv_heads if latent else self.shard.num_kv_heads,
            self.kv_layout.head_dim if latent else model_config.head_dim,
            self.dtype,
            self.device,
            self.kv_groups.layer_slot,
            latent=latent,
        )
        if config.disaggregation_mode == "decode" and not on_cuda:
            # Blocks arrive from another instance into any block of the pool: touch its pages
            # now, not as page faults inside the steps that copy them in (measured: a fresh
            # pool took 2 ms per MiB copied, a stall beside 60 ms decode steps).
            for k_cache, v_cache in kv_caches:
                k_cache.zero_()
                v_cache.zero_()
        self.model.fused_ops = (
            config.fused_ops
            and on_cuda
            and self.model.supports_fused_ops
            and triton_usable(self.device)
        )
        leader = self.rank == 0  # samples; the other ranks only compute their shares
        self.sampler = (
            Sampler(model_config.vocab_size, self.device, seed=config.seed) if leader else None
        )
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
            group=self.group if leader else None,
            kv_groups=self.kv_groups if self.kv_groups.num_groups > 1 else None,
        )
        if not leader:
            return  # a rank other than 0 follows rank 0's steps (``follow``)
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
                quantized=keep_quantized(self._draft_source, self.device, config.gguf_dequantize),
                deterministic=config.deterministic,
                quant_kernel=config.deterministic_quant_kernel,
            )
            self._draft_reader = None
        hybrid = self.kv_groups.num_groups > 1
        model_graphs = getattr(self.model, "supports_cuda_graphs", True)
        graphs_ok = (
            self.attention.supports_cuda_graphs
            and self.group is None
            and not hybrid
            and model_graphs
        )
        self.cuda_graphs = on_cuda and not config.enforce_eager and graphs_ok
        if on_cuda and not config.enforce_eager and not graphs_ok:
            logger.info(
                "CUDA graphs off: %s",
                "tensor-parallel steps run eagerly"
                if self.group is not None
                else "a hybrid KV cache's steps run eagerly"
                if hybrid
                else "the model's steps cannot be captured"
                if not model_graphs
                else f"the {self.attention.name} attention backend cannot be captured",
            )
        if self.cuda_graphs:
            self.runner.enable_decode_graphs(
                min(max_num_seqs, MAX_GRAPH_BATCH_SIZE), self.max_model_len
            )
        if on_cuda:
            self._warm_up()

    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        """Forward and sample one step. Raises ``DeviceError`` when the device (or a
        tensor-parallel rank) is lost; other exceptions fail the step's requests only."""
        assert self.runner is not None, "Worker.load first"
        try:
            if self.local_ranks is not None:
                self.local_ranks.check()
            if self.draft is None:
                result = self.runner.execute(out)
            else:
                result = self.runner.execute(out, self.draft.probs)
                self.draft.follow(out)
            if self.group is not None:
                result.comm_time = self.group.take_comm_time()
            return result
        except (CollectiveError, ProcessExited) as exc:
            raise DeviceError(str(exc)) from exc
        except Exception as exc:
            if is_fatal_device_error(exc):
                raise DeviceError(f"{type(exc).__name__}: {exc}") from exc
            raise

    def follow(self) -> None:
        """A tensor-parallel rank other than 0: run rank 0's steps until it says stop (or
        the group breaks: a ``CollectiveError`` ends the process)."""
        assert self.group is not None and self.runner is not None and self.rank != 0
        while True:
            op, payload = self.group.recv()
            if op == OP_STEP:
                self.runner.follow(StepArrays.decode(payload))
            elif op == OP_ZERO_NULL_BLOCK:
                self.runner.zero_null_block()
            elif op == OP_SHUTDOWN:
                logger.info("tensor-parallel rank %d: stopping", self.rank)
                return

    def keepalive(self) -> None:
        """Called while the engine idles: ping the other ranks now and then, and see that
        the ones it started live."""
        group = self.group
        try:
            if group is not None and time.monotonic() - group.last_send > TP_PING_INTERVAL_S:
                group.send(OP_PING)
            if self.local_ranks is not None:
                self.local_ranks.check()
        except (CollectiveError, ProcessExited) as exc:
            raise DeviceError(str(exc)) from exc

    def shutdown(self) -> None:
        """Rank 0: tell the other ranks to stop and wait for the ones it started."""
        if self._stop_ranks is not None:
            self._stop_ranks()  # runs once
            self._stop_ranks = None
        elif self.local_ranks is not None:  # started, but the group never formed
            self.local_ranks.stop(10.0)
        if self.rank == 0:
            self.group = None
        self.local_ranks = None

    def propose_drafts(self, wanted: list[tuple[Request, int]]) -> None:
        """The draft model's tokens for these decodes (speculative decoding)."""
        assert self.draft is not None, "no draft model"
        try:
            self.draft.propose(wanted)
        except Exception as exc:
            if is_fatal_device_error(exc):
                raise DeviceError(f"{type(exc).__name__}: {exc}") from exc
            raise

    # ---- KV blocks in and out (prefill/decode disaggregation) ----------------------------
    def kv_block_layout(self) -> tuple[tuple[int, int, int, int, int], str]:
        """One KV block as ``read_kv_blocks`` gives it: ``(layers, 2, block_size,
        num_kv_heads, head_dim)`` (layers: one KV group's, all of them without a hybrid
        cache), and the dtype's name."""
        mc = self.model_config
        layers = self.kv_groups.num_slots
        layout = (layers, 2, self.block_size, self.shard.num_kv_heads, mc.head_dim)
        return layout, str(self.dtype).removeprefix("torch.")

    @property
    def kv_group_windows(self) -> tuple[int | None, ...]:
        """The KV groups' windows (None: full attention), in block-table order."""
        return tuple(self.kv_groups.windows)

    def read_kv_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """A copy of these blocks: ``[len(block_ids), layers, 2, block_size, num_kv_heads,
        head_dim]`` (a block id holds one KV group's layers)."""
        assert self.runner is not None, "Worker.load first"
        idx = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        layers = [torch.stack((k[idx], v[idx]), 1) for k, v in self._slot_caches()]
        return torch.stack(layers, 1)

    def _slot_caches(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The K and V pools of each layer slot, in slot order (the runner's list is per
        layer: a hybrid cache's layers of one slot share their slot's pools)."""
        assert self.runner is not None
        slots = self.kv_groups.layer_slot
        return [self.runner.kv_caches[slots.index(j)] for j in range(self.kv_groups.num_slots)]

    def write_kv_blocks(self, block_ids: list[int], blocks: torch.Tensor) -> None:
        """Put ``blocks`` (as ``read_kv_blocks`` gives them, on any device) into these
        blocks."""
        assert self.runner is not None, "Worker.load first"
        idx = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        blocks = blocks.to(self.device)
        for i, (k, v) in enumerate(self._slot_caches()):
            k.index_copy_(0, idx, blocks[:, i, 0])
            v.index_copy_(0, idx, blocks[:, i, 1])

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
            r.block_tables = [[NULL_BLOCK, NULL_BLOCK] for _ in self.kv_groups.windows]
        t0 = time.perf_counter()
        self.runner.execute(SchedulerOutput(prefills=[ScheduledChunk(prompt, 0, 2 * bs)]))
        self.runner.execute(
            SchedulerOutput(
                prefills=[ScheduledChunk(prompt, 0, 2 * bs)],
                decodes=[ScheduledChunk(decode, bs, 1)],
            )
        )
        self.runner.zero_null_block()
        if self.group is not None:
            self.group.send(OP_ZERO_NULL_BLOCK)
        torch.cuda.synchronize(self.device)
        logger.info("warm-up steps: %.1fs", time.perf_counter() - t0)

    def _size_kv_cache(self) -> None:
        """``num_blocks`` from the KV memory; a cache that cannot hold one sequence of
        ``max_model_len`` tokens is a configuration error."""
        kv_memory = self._kv_cache_memory()
        num_blocks = kv_memory // self._bytes_per_block - 1  # one more is the null block
        # A prompt computed in one step fills every KV group's table before any window
        # moves on: one sequence of max_model_len tokens needs that many blocks per group.
        groups = self.kv_groups.num_groups
        capacity = num_blocks // groups * self.block_size
        if capacity < self.max_model_len:
            needed = groups * -(-self.max_model_len // self.block_size) + 1
            raise ValueError(
                f"kv_cache_memory: {kv_memory} bytes hold {capacity} tokens, fewer than "
                f"max_model_len ({self.max_model_len}); raise kv_cache_memory to at least "
                f"{needed * self._bytes_per_block} or lower max_model_len"
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
