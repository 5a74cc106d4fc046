"""The CPU backend: the torch backend with the runs of query rows that continue a cached
sequence (decodes, drafts being verified, the chunks of a long prompt after its first) sent to
the C kernel of ``cpu_kernels``, which reads each sequence's own blocks once, in place.

A prompt's first chunk (position 0) stays on the torch path (PyTorch's fused SDPA in fp32,
the blocked matmuls in bf16): it attends to its own fresh keys, with no cache to read. The
kernel takes chunks of many rows on its tile path (16 rows to a vector, scores built like a
matrix product; bf16 pairs summed by AVX512-BF16 instructions where the CPU has them).
Measured at 2 threads on the 2-core EPYC (avx512_bf16), 30 layers of the embedded model's
shapes, one chunk beside 8 decodes of 300 keys, torch -> kernel: bf16 16 rows after 3,000
keys 56 -> 21 ms, 64 rows there 84 -> 69 ms, 128 rows after 1,000 67 -> 55 ms, but 512 rows
after 256 186 -> 374 ms (hence the bf16 limit); fp32 16 rows after 3,000 159 -> 33 ms, 128
rows there 366 -> 211 ms, 512 rows 1,053 -> 1,012 ms. The row loop alone (before the tile
path) had lost to the matmuls past 4 rows in bf16 and 17 in fp32.

A layer's ``AttentionSpec`` reaches the kernel as its scale, window, soft-cap and attention
sinks (a per-head logit in every row's denominator, added where the kernel merges a row's
key ranges), on every path (rows, tiles, scalar loops); under a window W it reads only the
blocks from the one holding the first row's window start (a decode at 8k keys with W = 512
reads ~33 blocks of 16, not 512). The torch path it keeps for first chunks takes them as
the torch backend does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from chunkserve.attention.base import AttentionSpec, BatchLayout
from chunkserve.attention.cpu_kernels import PagedAttentionKernel
from chunkserve.attention.torch_ref import (
    SHORT_CHUNK_ROWS,
    TorchAttentionBackend,
    _Opts,
    _TorchMetadata,
)
from chunkserve.platform import cpu_has_amx_bf16

# Chunks continuing a cached sequence of at most this many rows go to the kernel (None: any),
# by dtype; longer ones to the torch path (see ``kernel_max_rows``). bf16: torch's matmuls
# run at about twice the fp32 rate; the kernel's bf16 tiles (AVX512-BF16) beat them up to 128
# rows, its fp32 tiles (bf16 widened, on other CPUs) up to 32.
KERNEL_MAX_ROWS: dict[torch.dtype, int | None] = {torch.float32: None, torch.bfloat16: 32}
BF16_TILES_MAX_ROWS = 128
# bf16 where the CPU has AMX-BF16: torch's bf16 matmuls (oneDNN) run on its tiles and beat
# the kernel's AVX512-BF16 tiles past 16 rows at head_dim 64 and over. Measured at 1 thread
# on the Intel Xeon (Sapphire Rapids class, AMX) with benchmarks/attention_paths.py, torch /
# kernel time, load 1.6: head_dim 64, 16/4 and 9/3 heads, 500-2,000 keys: 16 rows 0.83-1.29,
# 32-256 rows 0.49-0.97; head_dim 32 (half the products per key read): 16-256 rows 0.88-1.7
# (benchmarks/results/attention_paths_xeon_amx.json).
AMX_BF16_MAX_ROWS = 16
AMX_BF16_SMALL_HEAD_DIM = 32  # at most this: the AVX512-BF16 tiles' limit still
# The deterministic mode: every row of every step (first chunks too) goes to the kernel, its
# keys reduced in ranges of this many blocks aligned on multiples of it (``cpu_kernels``); in
# bf16 on AMX tiles where the CPU has them, for every row (CPU time a layer at 1 thread, the
# embedded model's shapes, busy machine: a 2,048-token prompt 101-111 -> 46-55 ms, the plain
# mode's torch matmuls 54-62; 64 decodes of 256 keys 3.3-4.0 -> 2.3-2.4 ms): a machine with
# AMX and one without give different bits (each the same whatever the batch).
DETERMINISTIC_RANGE_BLOCKS = 32


def kernel_max_rows(
    dtype: torch.dtype,
    head_dim: int,
    block_size: int = 16,
    *,
    bf16_tiles: bool = False,
    amx_bf16: bool = False,
    deterministic: bool = False,
) -> int | None:
    """The most rows of a chunk continuing a cached sequence that the kernel takes (None:
    any; longer ones go to the torch path), by what measured faster where.

    The deterministic mode: every row (its bits must not depend on the chunking). A shape
    the kernel has no vector path for (head_dim not a multiple of 16, blocks over 16
    tokens) runs its scalar loops, 4-10x slower than torch's for a chunk of 16 rows or more
    (head_dim 32 before it had tiles): only what the torch backend itself treats as short.
    Else fp32: any (its tiles at least match torch's SDPA, at head_dim 32 and 64, 16-512 rows
    after 500-4,000 keys, on the EPYC and the AMX Xeon); bf16 as ``KERNEL_MAX_ROWS`` and the
    constants above say (with AMX: by head_dim)."""
    if deterministic:
        return None
    if head_dim % 16 or block_size > 16:
        return SHORT_CHUNK_ROWS
    if dtype != torch.bfloat16:
        return KERNEL_MAX_ROWS.get(dtype)
    if amx_bf16 and bf16_tiles and head_dim <= AMX_BF16_SMALL_HEAD_DIM:
        return BF16_TILES_MAX_ROWS
    if amx_bf16:
        return AMX_BF16_MAX_ROWS
    return BF16_TILES_MAX_ROWS if bf16_tiles else KERNEL_MAX_ROWS[dtype]


@dataclass
class _KernelBatch:
    """The sequences the kernel attends, as its int64 arrays."""

    tables: torch.Tensor  # [n, blocks of the longest]
    q_start: torch.Tensor  # [n] first row of each in the step's batch
    q_len: torch.Tensor  # [n] its rows
    ctx_lens: torch.Tensor  # [n] keys its last row sees


@dataclass
class _CpuMetadata(_TorchMetadata):
    kernel_batch: _KernelBatch | None = None


class CpuAttentionBackend(TorchAttentionBackend):
    name = "cpu"

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        kernel: PagedAttentionKernel,
        dtype: torch.dtype,
        *,
        deterministic: bool = False,
        block_size: int = 16,
    ) -> None:
        super().__init__(num_heads, num_kv_heads, head_dim)
        self.kernel = kernel
        self.kernel_max_rows = kernel_max_rows(
            dtype,
            head_dim,
            block_size,
            bf16_tiles=kernel.bf16_tiles,
            amx_bf16=cpu_has_amx_bf16(),
            deterministic=deterministic,
        )
        # Deterministic: a row is attended the same way as a decode, a draft, a chunk's row
        # or a whole prompt's, whatever the chunk boundaries, cached prefix or thread count.
        self.fixed_range = DETERMINISTIC_RANGE_BLOCKS if deterministic else 0
        if deterministic and dtype == torch.bfloat16:  # AMX, AVX512-BF16, widened: other bits
            if kernel.amx(head_dim, block_size):
                self.arithmetic = "amx-bf16"
            else:
                self.arithmetic = "avx512-bf16" if kernel.bf16_tiles else "widened-bf16"

    def _prepare_prefills(self, layout: BatchLayout, meta: _TorchMetadata) -> list[int]:
        """Deterministic: every prefill chunk to the kernel (first chunks' keys are in the
        cache too: ``write_kv`` runs first)."""
        if not self.fixed_range:
            return super()._prepare_prefills(layout, meta)
        return list(range(layout.num_prefill_seqs))

    def supports(self, spec: AttentionSpec | None) -> str | None:
        """Every scale, window, soft-cap and attention sinks (the kernel takes them on all
        its paths)."""
        return None

    def _new_metadata(self) -> _CpuMetadata:
        return _CpuMetadata()

    def _prepare_runs(self, layout: BatchLayout, cached: list[int], meta: _TorchMetadata) -> None:
        qs, lens, bs = layout.query_start_host, layout.seq_lens_k_host, layout.block_size
        seqs = cached + list(range(layout.num_prefill_seqs, layout.num_seqs))
        if not seqs:
            return
        width = -(-max(lens[i] for i in seqs) // bs)
        idx = torch.tensor(seqs, dtype=torch.int64)
        assert isinstance(meta, _CpuMetadata)
        meta.kernel_batch = _KernelBatch(
            tables=layout.block_tables[idx, :width].to(torch.int64).contiguous(),
            q_start=torch.tensor([qs[i] for i in seqs], dtype=torch.int64),
            q_len=torch.tensor([qs[i + 1] - qs[i] for i in seqs], dtype=torch.int64),
            ctx_lens=torch.tensor([lens[i] for i in seqs], dtype=torch.int64),
        )

    def _forward_runs(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        out: torch.Tensor,
        metadata: _TorchMetadata,
        opts: _Opts,
        sinks: torch.Tensor | None = None,
    ) -> None:
        batch = metadata.kernel_batch
        if batch is None:
            return
        if torch.autograd._profiler_enabled():  # named in profiler tables (6 us a call)
            with torch.profiler.record_function("chunkserve::paged_attention"):
                self._call_kernel(q, k_cache, v_cache, out, batch, opts, sinks)
        else:
            self._call_kernel(q, k_cache, v_cache, out, batch, opts, sinks)

    def _call_kernel(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        out: torch.Tensor,
        batch: _KernelBatch,
        opts: _Opts,
        sinks: torch.Tensor | None = None,
    ) -> None:
        self.kernel(
            q.contiguous(),
            k_cache,
            v_cache,
            out,
            batch.tables,
            batch.q_start,
            batch.q_len,
            batch.ctx_lens,
            opts.scale,
            opts.window,
            opts.softcap,
            None if sinks is None else sinks.contiguous(),
            self.fixed_range,
        )
