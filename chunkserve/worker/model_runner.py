"""Model runner: turns a SchedulerOutput into a BatchLayout, runs the forward pass over the
paged KV cache, and samples the rows that end a prompt or are decodes.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from chunkserve.attention import AttentionBackend, BatchLayout
from chunkserve.distributed.group import OP_STEP, CollectiveError, TPGroup
from chunkserve.model.registry import CausalLM, KVGroups
from chunkserve.scheduling.kv_cache import NULL_BLOCK
from chunkserve.scheduling.request import PromptLogprob
from chunkserve.scheduling.scheduler import ScheduledChunk, SchedulerOutput
from chunkserve.worker.cuda_graphs import DecodeGraphs
from chunkserve.worker.sampler import Sampler
from chunkserve.worker.structured import GrammarMasks, masks_can_overlap

logger = logging.getLogger("chunkserve.runner")


@dataclass
class RunnerOutput:
    # request id -> its new tokens (one; with drafts, the accepted ones then the target's
    # own), for every chunk that samples
    sampled: dict[str, list[int]]
    # request id -> per new token (its logprob, the top alternatives)
    logprobs: dict[str, list[tuple[float, list[tuple[int, float]]]]]
    layout_time: float = 0.0  # seconds building the BatchLayout and attention metadata
    # Requests whose sampling raised (request id -> error): only they fail, not the step.
    failed: dict[str, str] = field(default_factory=dict)
    # Structured outputs: rows masked, seconds filling the masks (beside the forward
    # pass) and waiting for them after it.
    num_masked_rows: int = 0
    mask_time: float = 0.0
    mask_wait_time: float = 0.0
    # Tensor parallel: seconds rank 0 spent in collectives (the step broadcast, all-reduces
    # and the logits gather, waiting for slower ranks included).
    comm_time: float = 0.0
    # ``prompt_logprobs`` requests: request id -> (first prompt position its chunk scored,
    # per position (logprob, top-n, rank) of the prompt's token there).
    prompt_logprobs: dict[str, tuple[int, list[PromptLogprob]]] = field(default_factory=dict)


# The per-step index arrays, in the order they lie in the step's one device buffer: the
# ones every KV group shares, then each group's own (one set per group).
SECTIONS = ("input_ids", "positions", "cu_seqlens_q", "seq_lens_k", "logits_indices")
GROUP_SECTIONS = ("slot_mapping", "fresh_block_ids", "block_tables")
_HEADER = 6 + len(SECTIONS)


@dataclass
class StepArrays:
    """One step's metadata on the host: what ``ModelRunner.layout_of`` copies to the device,
    and what rank 0 of a tensor-parallel group broadcasts (``encode``) so every rank runs
    the same batch."""

    sections: list[np.ndarray]  # int64 arrays: SECTIONS, then GROUP_SECTIONS per KV group
    num_prefill_seqs: int
    num_prefill_tokens: int
    num_decode_tokens: int
    table_width: int  # columns of block_tables (every group's tables are as long)
    context_start: list[int]  # [B]
    tables: list[list[list[int]]]  # [G][B][blocks of that sequence]
    # Host lists of two sections (the backends loop over them without a device sync).
    query_start: list[int]  # [B + 1], cu_seqlens_q
    seq_lens: list[int]  # [B], seq_lens_k

    @property
    def num_groups(self) -> int:
        return len(self.tables)

    def encode(self) -> np.ndarray:
        """One int64 array: a header (counts, section sizes), the sections, each sequence's
        first position and its block tables' length."""
        header = [
            self.num_prefill_seqs,
            self.num_prefill_tokens,
            self.num_decode_tokens,
            self.table_width,
            len(self.context_start),
            self.num_groups,
        ]
        return np.concatenate(
            [
                np.asarray(header + [len(a) for a in self.sections], dtype=np.int64),
                *self.sections,
                np.asarray(self.context_start, dtype=np.int64),
                np.asarray([len(t) for t in self.tables[0]], dtype=np.int64),
            ]
        )

    @classmethod
    def decode(cls, data: np.ndarray) -> StepArrays:
        header = data[:6].tolist()
        num_prefill_seqs, num_prefill_tokens, num_decode_tokens, width, num_seqs, groups = header
        num_sections = len(SECTIONS) + len(GROUP_SECTIONS) * groups
        sizes = data[6 : 6 + num_sections].tolist()
        sections, at = [], 6 + num_sections
        for n in sizes:
            sections.append(data[at : at + n])
            at += n
        context_start = data[at : at + num_seqs].tolist()
        table_lens = data[at + num_seqs : at + 2 * num_seqs].tolist()
        tables = []
        for g in range(groups):
            at = len(SECTIONS) + len(GROUP_SECTIONS) * g + GROUP_SECTIONS.index("block_tables")
            rows = sections[at].reshape(num_seqs, width)
            tables.append([rows[i, :n].tolist() for i, n in enumerate(table_lens)])
        return cls(
            sections,
            num_prefill_seqs,
            num_prefill_tokens,
            num_decode_tokens,
            width,
            context_start,
            tables,
            sections[SECTIONS.index("cu_seqlens_q")].tolist(),
            sections[SECTIONS.index("seq_lens_k")].tolist(),
        )


def allocate_kv_caches(
    num_layers: int,
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device,
    layer_slot: Sequence[int] | None = None,
    latent: bool = False,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One pool per layer for K and for V: [num_blocks + 1, block_size, Hkv, hd] each, block 0
    being the null block (see ``kv_cache``). ``layer_slot``: a hybrid cache's layer ->
    pool slot (``KVGroups.layer_slot``): layers of one slot share its pool, told apart by
    their groups' block ids. ``latent`` (``KVLayout.latent``): one pool per layer, its
    entry the layer's (k, v) pair twice (multi-head latent attention caches one vector).

    Uninitialised: on a CPU its pages take memory only once written. Blocks are zeroed when
    first written (``BatchLayout.fresh_block_ids``); the null block is zeroed here."""
    num_slots = num_layers if layer_slot is None else max(layer_slot) + 1
    pool = torch.empty(
        (num_slots, 1 if latent else 2, num_blocks + 1, block_size, num_kv_heads, head_dim),
        dtype=dtype,
        device=device,
    )
    pool[:, :, NULL_BLOCK].zero_()
    slots = range(num_layers) if layer_slot is None else layer_slot
    return [(pool[i, 0], pool[i, 0 if latent else 1]) for i in slots]


def padded_num_tokens(num_tokens: int) -> int:
    """Round a step's token count up to one of 16 sizes per power of two (at most 6.25%
    padding; exact below 32). Few distinct shapes keep oneDNN's per-shape primitive caches
    small and warm: with every count distinct they grew by hundreds of MiB and re-created
    primitives (measured: 2.4 GiB and 56 s vs 1.7 GiB and 107 s with caching off)."""
    if num_tokens < 32:
        return num_tokens
    step = 1 << (num_tokens.bit_length() - 5)
    return -(-num_tokens // step) * step


class ModelRunner:
    def __init__(
        self,
        model: CausalLM,
        attn: AttentionBackend,
        sampler: Sampler | None,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        block_size: int,
        device: torch.device,
        pad_batches: bool = True,
        group: TPGroup | None = None,
        kv_groups: KVGroups | None = None,
    ) -> None:
        """``sampler`` None: a tensor-parallel rank other than 0 (it samples nothing);
        ``group``: on rank 0 of a tensor-parallel group, every layout is broadcast to the
        other ranks before the forward pass; ``kv_groups``: a hybrid KV cache's groups (None:
        one group, the requests' first block table)."""
        self.model = model
        self.group = group
        self.attn = attn
        self.sampler = sampler
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = device
        self.pad_batches = pad_batches
        self.kv_groups = kv_groups
        self.num_kv_groups = 1 if kv_groups is None else kv_groups.num_groups
        # Pinned staging buffers for the per-step metadata (CUDA), used in turn so a buffer
        # is never refilled while its previous copy may still be in flight.
        self._pinned = [torch.empty(0, dtype=torch.int64), torch.empty(0, dtype=torch.int64)]
        self._pinned_next = 0
        self.graphs: DecodeGraphs | None = None
        self.masks: GrammarMasks | None = None  # made at the first step with a grammar
        # The last ``build_layout``'s prompt-logprob rows: (chunk, rows), after the sampled
        # rows in ``logits_indices``.
        self.prompt_rows: list[tuple[ScheduledChunk, int]] = []

    def transfer(self, host: np.ndarray) -> torch.Tensor:
        """One int64 host array to the device: on CUDA through pinned memory, one
        non-blocking copy; on the CPU, no copy at all."""
        if self.device.type != "cuda":
            return torch.from_numpy(host)
        if self._pinned[self._pinned_next].numel() < host.size:
            size = max(1 << 16, 2 * host.size)
            self._pinned[self._pinned_next] = torch.empty(size, dtype=torch.int64, pin_memory=True)
        buf = self._pinned[self._pinned_next][: host.size]
        self._pinned_next ^= 1
        buf.numpy()[:] = host
        return buf.to(self.device, non_blocking=True)

    def enable_decode_graphs(self, max_batch_size: int, max_model_len: int) -> DecodeGraphs:
        """Capture CUDA graphs of the forward pass for decode-only steps (see cuda_graphs)."""
        self.graphs = DecodeGraphs(self, max_batch_size, max_model_len)
        self.graphs.capture()
        return self.graphs

    def build_layout(self, out: SchedulerOutput) -> tuple[BatchLayout, list[ScheduledChunk]]:
        """Flatten the step's chunks into one batch: the multi-row queries first (prefill
        chunks, then decodes with draft tokens: a decode with k drafts is a (k+1)-row query
        over its own cache, causal among the drafts, as a chunk is), then the one-row
        decodes. Also return the chunks whose rows are sampled, in ``logits_indices`` order
        (every row of a decode with drafts is; one row of the others)."""
        bs = self.block_size
        verifies = [c for c in out.decodes if c.draft_token_ids]
        singles = [c for c in out.decodes if not c.draft_token_ids] if verifies else out.decodes
        multi = out.prefills + verifies
        chunks = multi + singles
        num_tokens = out.num_batched_tokens
        padded = padded_num_tokens(num_tokens) if self.pad_batches else num_tokens
        # Padding rows: token 0 at position 0; they write no KV (see write_kv).
        input_ids = np.zeros(padded, dtype=np.int64)
        positions = np.zeros(padded, dtype=np.int64)
        query_start = [0]
        context_start: list[int] = []
        seq_lens: list[int] = []
        logits_rows: list[int] = []
        sampled_chunks: list[ScheduledChunk] = []
        prompt_rows: list[int] = []
        self.prompt_rows = []
        num_groups = self.num_kv_groups
        # Per KV group: the slots rows write, the blocks first written, the block tables.
        slots = [np.full(padded, NULL_BLOCK * bs, dtype=np.int64) for _ in range(num_groups)]
        fresh_blocks: list[list[int]] = [[] for _ in range(num_groups)]
        tables: list[list[list[int]]] = [[] for _ in range(num_groups)]
        row = 0
        for chunk in chunks:
            r, s, n = chunk.request, chunk.start, chunk.num_tokens
            request_tables = r.block_tables
            if n == 1:
                input_ids[row] = r.token_ids[s]
                positions[row] = s
                for g in range(num_groups):
                    slots[g][row] = request_tables[g][s // bs] * bs + s % bs
            else:
                pos = np.arange(s, s + n)
                if chunk.draft_token_ids:
                    input_ids[row] = r.token_ids[s]
                    input_ids[row + 1 : row + n] = chunk.draft_token_ids
                else:
                    input_ids[row : row + n] = r.token_ids[s : s + n]
                positions[row : row + n] = pos
                index, offset = pos // bs, pos % bs
                for g in range(num_groups):
                    slots[g][row : row + n] = np.asarray(request_tables[g])[index] * bs + offset
            first = -(-s // bs) * bs  # first block-aligned position in [s, s + n)
            for g in range(num_groups):
                table = request_tables[g]
                fresh_blocks[g].extend(table[p // bs] for p in range(first, s + n, bs))
                tables[g].append(table)
            row += n
            query_start.append(row)
            context_start.append(s)
            seq_lens.append(s + n)
            if chunk.draft_token_ids:
                logits_rows.extend(range(row - n, row))
                sampled_chunks.append(chunk)
            elif chunk.samples:
                logits_rows.append(row - 1)
                sampled_chunks.append(chunk)
            if getattr(r, "prompt_logprobs", None) is not None and not chunk.draft_token_ids:
                # Rows s.. predict prompt tokens s+1..: those inside the prompt.
                k = min(n, r.num_prompt_tokens - 1 - s)
                if k > 0:
                    prompt_rows.extend(range(row - n, row - n + k))
                    self.prompt_rows.append((chunk, k))
        logits_rows += prompt_rows  # after the sampled rows: sampling sees [0, S)

        max_blocks = max((len(t) for t in tables[0]), default=0)
        width = max(max_blocks, 1)
        sections = [
            input_ids,
            positions,
            np.asarray(query_start, dtype=np.int64),
            np.asarray(seq_lens, dtype=np.int64),
            np.asarray(logits_rows, dtype=np.int64),
        ]
        for g in range(num_groups):
            block_tables = np.zeros((len(tables[g]), width), dtype=np.int64)
            for i, t in enumerate(tables[g]):
                block_tables[i, : len(t)] = t
            sections += [
                slots[g],
                np.asarray(fresh_blocks[g], dtype=np.int64),
                block_tables.ravel(),
            ]
        step = StepArrays(
            sections,
            num_prefill_seqs=len(multi),
            num_prefill_tokens=sum(c.num_tokens for c in multi),
            num_decode_tokens=len(singles),
            table_width=width,
            context_start=context_start,
            tables=tables,
            query_start=query_start,
            seq_lens=seq_lens,
        )
        if self.group is not None:  # the other ranks run the same batch
            self.group.send(OP_STEP, step.encode())
        return self.layout_of(step), sampled_chunks

    def layout_of(self, step: StepArrays) -> BatchLayout:
        """The step's arrays on the device (one copy) as a ``BatchLayout`` (with KV groups,
        the first group's, carrying every group's in ``kv_groups``)."""
        # Every per-step array in one int64 buffer: one host-to-device copy per step.
        # Sections start at even offsets (16-byte aligned), as GPU kernels load best.
        sizes = [len(a) for a in step.sections]
        starts = np.cumsum([0] + [n + n % 2 for n in sizes])
        host = np.zeros(int(starts[-1]), dtype=np.int64)
        for a, start, n in zip(step.sections, starts, sizes):
            host[start : start + n] = a
        dev = self.transfer(host)
        views = [dev[start : start + n] for start, n in zip(starts, sizes)]
        num_seqs = len(step.context_start)
        common = dict(zip(SECTIONS, views))
        per_group = []
        for g in range(step.num_groups):
            at = len(SECTIONS) + len(GROUP_SECTIONS) * g
            own = dict(zip(GROUP_SECTIONS, views[at : at + len(GROUP_SECTIONS)]))
            own["block_tables"] = own["block_tables"].view(num_seqs, step.table_width)
            per_group.append(own)
        layout = BatchLayout(
            **common,
            **per_group[0],
            num_prefill_seqs=step.num_prefill_seqs,
            num_prefill_tokens=step.num_prefill_tokens,
            num_decode_tokens=step.num_decode_tokens,
            query_start_host=step.query_start,
            context_start_host=step.context_start,
            seq_lens_k_host=step.seq_lens,
            block_tables_host=step.tables[0],
            block_size=self.block_size,
        )
        if step.num_groups > 1:
            assert self.kv_groups is not None
            layout.kv_groups = [layout] + [
                replace(layout, **per_group[g], block_tables_host=step.tables[g])
                for g in range(1, step.num_groups)
            ]
            layout.layer_group = self.kv_groups.layer_group
        return layout

    def prepare(self, layout: BatchLayout) -> object:
        """The attention backend's per-step metadata (with KV groups, a list: each
        group's)."""
        if layout.kv_groups is None:
            return self.attn.prepare(layout)
        return [self.attn.prepare(g) for g in layout.kv_groups]

    @torch.inference_mode()
    def execute(
        self, out: SchedulerOutput, draft_probs: dict[str, torch.Tensor] | None = None
    ) -> RunnerOutput:
        """Run the step. ``draft_probs``: a draft model's distributions of the drafts it
        sampled (request id -> [k, V]), for rejection sampling; n-gram drafts have none."""
        t0 = time.perf_counter()
        # Grammar masks are filled on their own thread while the forward pass runs.
        if self.graphs is not None and self.graphs.fits(out):
            # Decode-only: every row is sampled, in order.
            sampled_chunks = list(out.decodes)
            self.prompt_rows = []
            masks = self._start_masks(sampled_chunks)
            hidden, _ = self.graphs.run(out)
            layout_time = self.graphs.last_layout_time
            logits = self.model.compute_logits(hidden)  # [S, V] fp32
        else:
            layout, sampled_chunks = self.build_layout(out)
            masks = self._start_masks(sampled_chunks)
            meta = self.prepare(layout)
            layout_time = time.perf_counter() - t0
            try:
                hidden = self.model(layout, self.kv_caches, self.attn, meta)  # [T, hidden]
                hidden = hidden[layout.logits_indices]
                scored = sampled_chunks or self.prompt_rows
                logits = self.model.compute_logits(hidden) if scored else None
            except Exception as exc:
                if self.group is None or isinstance(exc, CollectiveError):
                    raise
                # The other ranks wait in a collective this rank will not reach.
                raise CollectiveError(
                    f"rank 0 failed inside a tensor-parallel forward pass: "
                    f"{type(exc).__name__}: {exc}"
                ) from exc
        result = RunnerOutput({}, {}, layout_time)
        if self.prompt_rows and logits is not None:
            num_sampled = logits.shape[0] - sum(k for _, k in self.prompt_rows)
            self._prompt_logprobs(logits[num_sampled:], result)
            logits = logits[:num_sampled]
        if not sampled_chunks:
            return result
        assert logits is not None
        if masks is not None:
            assert self.masks is not None
            t_wait = time.perf_counter()
            self.masks.apply(logits, masks)
            result.mask_wait_time = time.perf_counter() - t_wait
            result.mask_time, result.num_masked_rows = masks.seconds, len(masks.rows)
            result.failed.update(masks.failed)  # their rows sampled unmasked: dropped
        # Consecutive chunks of one kind (one row, or a decode with drafts) sample together.
        row = 0
        for verify, group in itertools.groupby(sampled_chunks, key=_has_drafts):
            group = list(group)
            n = sum(c.num_tokens for c in group) if verify else len(group)
            self._sample_group(logits[row : row + n], group, verify, draft_probs, result)
            row += n
        return result

    def _prompt_logprobs(self, logits: torch.Tensor, result: RunnerOutput) -> None:
        """The prompt tokens' logprobs from their rows' logits (fp32 log-softmax, as the
        sampler's logprobs): the token's logprob, rank and the top-n alternatives."""
        row = 0
        for chunk, k in self.prompt_rows:
            r, s = chunk.request, chunk.start
            lps = torch.log_softmax(logits[row : row + k].float(), dim=-1)
            row += k
            targets = torch.tensor(r.token_ids[s + 1 : s + 1 + k], device=lps.device)
            chosen = lps.gather(1, targets[:, None])
            ranks = (lps > chosen).sum(dim=-1).add_(1).tolist()
            n = r.sampling_params.prompt_logprobs or 0
            top_vals, top_ids = lps.topk(n, dim=-1) if n else (None, None)
            entries = []
            for i, (lp, rank) in enumerate(zip(chosen[:, 0].tolist(), ranks)):
                top = list(zip(top_ids[i].tolist(), top_vals[i].tolist())) if n else []
                entries.append((lp, top, rank))
            result.prompt_logprobs[r.request_id] = (s + 1, entries)

    @torch.inference_mode()
    def follow(self, step: StepArrays) -> None:
        """A tensor-parallel rank other than 0: run rank 0's batch (its share of every
        layer, the collectives with the others, and its part of the logits)."""
        layout = self.layout_of(step)
        meta = self.prepare(layout)
        hidden = self.model(layout, self.kv_caches, self.attn, meta)
        if layout.logits_indices.numel():
            self.model.compute_logits(hidden[layout.logits_indices])

    def zero_null_block(self) -> None:
        for k_cache, v_cache in self.kv_caches:
            k_cache[NULL_BLOCK].zero_()
            v_cache[NULL_BLOCK].zero_()

    def _start_masks(self, chunks: list[ScheduledChunk]):
        """Begin the grammar masks of the sampled chunks that carry one (None: none do)."""
        if all(c.request.grammar is None for c in chunks):
            return None
        if self.masks is None:
            overlap = masks_can_overlap(self.device)
            self.masks = GrammarMasks(self.sampler.vocab_size, overlap=overlap)
        return self.masks.start(chunks)

    def _sample_group(
        self,
        logits: torch.Tensor,
        chunks: list[ScheduledChunk],
        verify: bool,
        draft_probs: dict[str, torch.Tensor] | None,
        result: RunnerOutput,
    ) -> None:
        """Sample (or verify) the rows of these chunks into ``result``. If the batch raises,
        chunk by chunk, so the one that raises fails only its own request (greedy and
        seeded rows get the tokens the batch would have given them)."""

        def sample(rows: torch.Tensor, batch: list[ScheduledChunk]) -> None:
            requests = [c.request for c in batch]
            if verify:
                probs = [draft_probs.get(r.request_id) for r in requests] if draft_probs else None
                drafts = [c.draft_token_ids for c in batch]
                out = self.sampler.verify(rows, requests, drafts, probs)
                tokens, lps = out.token_ids, out.logprobs
            else:
                out = self.sampler(rows, requests)
                tokens = [[t] for t in out.token_ids]
                lps = None if out.logprobs is None else [lp and [lp] for lp in out.logprobs]
            for i, r in enumerate(requests):
                result.sampled[r.request_id] = tokens[i]  # type: ignore[assignment]
                if lps is not None and lps[i] is not None:
                    result.logprobs[r.request_id] = lps[i]  # type: ignore[assignment]

        try:
            sample(logits, chunks)
            return
        except Exception:
            if len(chunks) == 1:
                raise
        row = 0
        for c in chunks:
            n = c.num_tokens if verify else 1
            try:
                sample(logits[row : row + n], [c])
            except Exception as exc:
                logger.exception("sampling request %s failed", c.request.request_id)
                result.failed[c.request.request_id] = f"{type(exc).__name__}: {exc}"
            row += n


def _has_drafts(chunk: ScheduledChunk) -> bool:
    return bool(chunk.draft_token_ids)
