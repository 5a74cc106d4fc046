"""The CPU backend: the torch backend with its decodes and short chunks (drafts being
verified, the last rows of a prompt, a disaggregated prompt's one-token first step) sent
to the C kernel of ``cpu_kernels``, which reads each sequence's own blocks once, in place.

Long prefill chunks stay on the torch path (PyTorch's fused SDPA or the blocked matmuls):
they are bound by compute, where a matmul library beats a hand loop. So do short chunks of
more than ``KERNEL_MAX_ROWS`` rows: the kernel's cost grows with the rows it scores (each a
pass of vector dot products over the keys), the matmuls' much less. Measured at 2 threads on
the 2-core EPYC, 30 layers of the embedded model's shapes, torch -> kernel: fp32 one decode
at 4,000 keys 24.9 -> 6.3 ms, 4 rows there 43 -> 18 ms, 17 rows 128 -> 73 ms, four 17-row
chunks at 1,000 keys 112 -> 72 ms, 64 decodes at 300 keys 130 -> 67 ms; bf16 the same
25 -> 9.4, 41 -> 22, 91 -> 81, but four 17-row chunks 64 -> 82 ms and 32 runs of 4 rows at
300 keys 55 -> 59 ms (bf16 converts each key block to fp32 first), 64 decodes 60 -> 53 ms.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from chunkserve.attention.base import BatchLayout
from chunkserve.attention.cpu_kernels import PagedAttentionKernel
from chunkserve.attention.torch_ref import (
    SHORT_CHUNK_ROWS,
    TorchAttentionBackend,
    _TorchMetadata,
)

# Short chunks of at most this many rows go to the kernel (more: the torch path's gathers
# and matmuls), by dtype; decodes always do.
KERNEL_MAX_ROWS = {torch.float32: SHORT_CHUNK_ROWS, torch.bfloat16: 4}


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
    ) -> None:
        super().__init__(num_heads, num_kv_heads, head_dim)
        self.kernel = kernel
        self.kernel_max_rows = KERNEL_MAX_ROWS.get(dtype, 1)

    def _new_metadata(self) -> _CpuMetadata:
        return _CpuMetadata()

    def _prepare_runs(self, layout: BatchLayout, short: list[int], meta: _TorchMetadata) -> None:
        qs, lens, bs = layout.query_start_host, layout.seq_lens_k_host, layout.block_size
        few = [i for i in short if qs[i + 1] - qs[i] <= self.kernel_max_rows]
        self._prepare_short(layout, [i for i in short if i not in few], meta)
        seqs = few + list(range(layout.num_prefill_seqs, layout.num_seqs))
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
    ) -> None:
        super()._forward_runs(q, k_cache, v_cache, out, metadata)  # longer short chunks
        batch = metadata.kernel_batch
        if batch is None:
            return
        if torch.autograd._profiler_enabled():  # named in profiler tables (6 us a call)
            with torch.profiler.record_function("chunkserve::paged_attention"):
                self._call_kernel(q, k_cache, v_cache, out, batch)
        else:
            self._call_kernel(q, k_cache, v_cache, out, batch)

    def _call_kernel(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        out: torch.Tensor,
        batch: _KernelBatch,
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
            self.scale,
        )
