"""CUDA graphs for decode-only steps.

A decode step of a small model on a GPU is mostly kernel-launch overhead: ~15 launches per
layer, each a few microseconds of CPU, against microseconds of GPU work. The forward pass of a
decode-only step is captured once per padded batch size and replayed, so a step costs one
launch. Captured at start for sizes 1, 2, 4, 8, then every 8 up to the largest batch (vLLM's
ladder); a step of D decodes replays the smallest size >= D, its extra rows being padding.

Static inputs (one set, the largest size; graph n reads the first n rows)::

    input_ids, positions, slot_mapping, seq_lens_k   [N]      padding: token 0, position 0,
    cu_seqlens_q                                     [N + 1]  the null block's slot 0,
    block_tables                                     [N, W]   seq_len 1, null blocks
    W = ceil(max_model_len / block_size)

Per step the runner packs the real rows plus padding into one int64 host array, makes one
host-to-device copy, and scatters it into the static inputs on the device before replay. Only
a backend that launches fixed-shape work for a decode-only layout and never reads past a
sequence's length (``supports_cuda_graphs``) can be captured; padding rows then write their
K/V into the null block and attend to it, harmlessly. Mixed and prefill steps run eagerly.
"""

from __future__ import annotations

import logging
import time
from typing import Protocol

import numpy as np
import torch

from chunkserve.attention.base import AttentionBackend, BatchLayout
from chunkserve.model.registry import CausalLM
from chunkserve.scheduling.kv_cache import NULL_BLOCK
from chunkserve.scheduling.request import Request
from chunkserve.scheduling.scheduler import SchedulerOutput

logger = logging.getLogger("chunkserve")


class GraphRunner(Protocol):
    """What ``DecodeGraphs`` uses of the model runner (``model_runner.ModelRunner`` has it): the
    runner imports this module, never the other way round."""

    model: CausalLM
    attn: AttentionBackend
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]
    block_size: int
    device: torch.device

    def transfer(self, host: np.ndarray) -> torch.Tensor:
        """One int64 host array to the device."""
        ...


def capture_sizes(max_batch_size: int) -> list[int]:
    """1, 2, 4, 8, 16, 24, ... up to ``max_batch_size`` (which is always included)."""
    sizes = [n for n in (1, 2, 4) if n < max_batch_size]
    sizes += list(range(8, max_batch_size, 8))
    sizes.append(max_batch_size)
    return sorted(set(sizes))


class DecodeGraphs:
    def __init__(self, runner: GraphRunner, max_batch_size: int, max_model_len: int) -> None:
        if runner.device.type != "cuda":
            raise ValueError("enforce_eager: CUDA graphs need a CUDA device")
        if not runner.attn.supports_cuda_graphs:
            raise ValueError(
                f"enforce_eager: the {runner.attn.name} attention backend cannot be captured "
                f"in CUDA graphs; use attention_backend='triton' or enforce_eager=True"
            )
        self.runner = runner
        self.sizes = capture_sizes(max_batch_size)
        self.block_size = runner.block_size
        self.width = -(-max_model_len // self.block_size)
        n, dev = self.sizes[-1], runner.device
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(n, dtype=torch.int64, device=dev)
        self.slot_mapping = torch.full((n,), NULL_BLOCK * self.block_size, device=dev)
        self.seq_lens_k = torch.ones(n, dtype=torch.int64, device=dev)
        self.cu_seqlens_q = torch.arange(n + 1, dtype=torch.int64, device=dev)
        self.block_tables = torch.full((n, self.width), NULL_BLOCK, device=dev)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = None
        self.last_layout_time = 0.0

    def _layout(self, n: int) -> BatchLayout:
        """The static decode-only layout of graph size ``n``."""
        empty = self.input_ids[:0]
        return BatchLayout(
            input_ids=self.input_ids[:n],
            positions=self.positions[:n],
            slot_mapping=self.slot_mapping[:n],
            fresh_block_ids=empty,
            cu_seqlens_q=self.cu_seqlens_q[: n + 1],
            seq_lens_k=self.seq_lens_k[:n],
            block_tables=self.block_tables[:n],
            logits_indices=self.cu_seqlens_q[:n],
            num_prefill_seqs=0,
            num_prefill_tokens=0,
            num_decode_tokens=n,
            query_start_host=list(range(n + 1)),
            context_start_host=[0] * n,
            seq_lens_k_host=[1] * n,
            block_tables_host=[[NULL_BLOCK]] * n,
            block_size=self.block_size,
        )

    @torch.inference_mode()
    def capture(self) -> None:
        r = self.runner
        t0 = time.perf_counter()
        free_before = torch.cuda.mem_get_info(r.device)[0]
        self.pool = torch.cuda.graph_pool_handle()
        for n in reversed(self.sizes):  # largest first: later graphs reuse its memory
            layout = self._layout(n)
            meta = r.attn.prepare(layout)
            r.model(layout, r.kv_caches, r.attn, meta)  # warm-up: compile kernels, init handles
            torch.cuda.synchronize(r.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                hidden = r.model(layout, r.kv_caches, r.attn, meta)
            self.graphs[n] = (graph, hidden)
        torch.cuda.synchronize(r.device)
        used = free_before - torch.cuda.mem_get_info(r.device)[0]
        logger.info(
            "CUDA graphs: %d decode batch sizes (1..%d) captured in %.1fs, %.0f MiB",
            len(self.sizes),
            self.sizes[-1],
            time.perf_counter() - t0,
            used / 2**20,
        )

    def size_for(self, num_decodes: int) -> int | None:
        for n in self.sizes:
            if n >= num_decodes:
                return n
        return None

    def fits(self, out: SchedulerOutput) -> bool:
        """Decode-only steps with at most the largest captured batch replay a graph."""
        return (
            not out.prefills and not out.num_draft_tokens and 0 < len(out.decodes) <= self.sizes[-1]
        )

    def run(self, out: SchedulerOutput) -> tuple[torch.Tensor, list[Request]]:
        """Replay the graph for this decode-only step; return hidden states [D, hidden] of
        the real rows and their requests (every decode samples)."""
        t0 = time.perf_counter()
        bs = self.block_size
        d = len(out.decodes)
        n = self.size_for(d)
        assert n is not None  # fits() was checked
        requests = [c.request for c in out.decodes]
        width = max(len(r.block_ids) for r in requests)
        # [ids | positions | slots | seq_lens] each [n], then block tables [n, width].
        host = np.zeros(4 * n + n * width, dtype=np.int64)
        ids, pos, slots, lens = (host[i * n : (i + 1) * n] for i in range(4))
        tables = host[4 * n :].reshape(n, width)
        slots[:] = NULL_BLOCK * bs
        lens[:] = 1
        tables[:] = NULL_BLOCK
        for i, c in enumerate(out.decodes):
            r, s = c.request, c.start
            ids[i] = r.token_ids[s]
            pos[i] = s
            slots[i] = r.block_ids[s // bs] * bs + s % bs
            lens[i] = s + 1
            tables[i, : len(r.block_ids)] = r.block_ids
        dev = self.runner.transfer(host)
        self.input_ids[:n].copy_(dev[:n])
        self.positions[:n].copy_(dev[n : 2 * n])
        self.slot_mapping[:n].copy_(dev[2 * n : 3 * n])
        self.seq_lens_k[:n].copy_(dev[3 * n : 4 * n])
        self.block_tables[:n, :width].copy_(dev[4 * n :].view(n, width))
        self.last_layout_time = time.perf_counter() - t0
        graph, hidden = self.graphs[n]
        graph.replay()
        return hidden[:d], requests
