"""The draft model of speculative decoding (``{"method": "draft_model", "model": PATH}``).

A smaller model of the target's vocabulary proposes each decode's draft tokens. Its KV cache
is its own pool over the *same block ids* as the target's: the scheduler's block tables
(the first KV group's, with a hybrid cache) serve both, so prefix caching, preemption and
freed blocks need nothing of their own.

- ``follow(out)``: every step, after the target's forward pass, the draft model runs the
  same batch (prefill chunks, decodes, verified drafts) and writes its KV where the target
  wrote; its prefill follows the target's chunks.
- ``propose(wanted)``: after the step, k single-token passes from each decode's newest token
  (sampled from the draft's own distribution, after the request's temperature, top-k, top-p
  and min-p; greedy requests take its argmax). It writes KV at the positions it proposes
  from, in slots the core allocated (the next step's allocation covers them); the next
  step's ``follow`` overwrites them with the verified tokens. A sampled request's draft
  distributions are kept for rejection sampling (``Sampler.verify``).
"""

from __future__ import annotations

import torch

from chunkserve.attention import select_attention_backend
from chunkserve.config import ModelConfig
from chunkserve.model.layers import DETERMINISTIC_TILING
from chunkserve.model.loader import ModelSource, iter_weights
from chunkserve.model.registry import attention_specs, build_model, check_attention
from chunkserve.scheduling.request import Request
from chunkserve.scheduling.scheduler import ScheduledChunk, SchedulerOutput
from chunkserve.worker.model_runner import ModelRunner, allocate_kv_caches
from chunkserve.worker.sampler import Sampler


class _Ahead:
    """A request as a proposal pass sees it: its tokens and the drafts proposed so far."""

    def __init__(self, request: Request, drafts: list[int]) -> None:
        self.request_id = request.request_id
        self.sampling_params = request.sampling_params
        self.block_tables = request.block_tables
        self.token_ids = request.token_ids + drafts
        # Seeded rows are keyed by output position: the draft's noise at a position is the
        # target's there (coupled draws: the draft matches when the two models agree).
        self.num_output_tokens = request.num_output_tokens + len(drafts)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


class DraftModel:
    def __init__(
        self,
        source: ModelSource,
        model_config: ModelConfig,
        reader,
        *,
        dtype: torch.dtype,
        device: torch.device,
        num_blocks: int,
        block_size: int,
        max_model_len: int,
        attention_backend: str,
        seed: int,
        dummy_weights: bool = False,
        quantized: bool = False,
        deterministic: bool = False,
        quant_kernel: str = "int8",
    ) -> None:
        self.model_config = model_config
        # The target's choice (``auto``: the C kernel's backend, else torch's where the
        # kernel does not build or lacks what this model's attention needs); with
        # ``deterministic`` the target's batch-invariant attention and row tiling (and
        # ``quant_kernel``) too (a sampled request's acceptance reads the draft's
        # distributions).
        self.attention = select_attention_backend(
            attention_backend,
            device,
            model_config.num_heads,
            model_config.num_kv_heads,
            model_config.head_dim,
            dtype,
            block_size,
            deterministic=deterministic,
            specs=attention_specs(model_config),
            who="draft model",
        )
        check_attention(self.attention, model_config, "draft model")
        self.model = build_model(
            model_config,
            dtype,
            device,
            max_positions=max_model_len,  # as the target's (``Worker.load``)
        )
        if dummy_weights:
            self.model.init_dummy_weights(seed)
        else:
            self.model.load_weights(iter_weights(source, model_config, reader, dtype, quantized))
        if deterministic:
            self.model.set_row_tiling(DETERMINISTIC_TILING, quant_kernel)
        kv_caches = allocate_kv_caches(
            model_config.num_layers,
            num_blocks,
            block_size,
            model_config.num_kv_heads,
            model_config.head_dim,
            dtype,
            device,
        )
        # Its own generator (seeded requests stay reproducible: the same draws in order).
        self.sampler = Sampler(model_config.vocab_size, device, seed=seed + 1)
        self.runner = ModelRunner(
            self.model,
            self.attention,
            self.sampler,
            kv_caches,
            block_size,
            device,
            pad_batches=device.type != "cuda",
        )
        # request id -> the draft distributions of its pending drafts, [k, V] (sampled
        # requests only: greedy verification needs none).
        self.probs: dict[str, torch.Tensor] = {}

    def forget(self, request_id: str) -> None:
        self.probs.pop(request_id, None)
        self.sampler.forget(request_id)

    @torch.inference_mode()
    def follow(self, out: SchedulerOutput) -> None:
        """Run the target's batch through the draft model: its KV where the target's is."""
        if out.is_empty:
            return
        layout, _ = self.runner.build_layout(out)
        meta = self.attention.prepare(layout)
        self.model(layout, self.runner.kv_caches, self.attention, meta)

    @torch.inference_mode()
    def propose(self, wanted: list[tuple[Request, int]]) -> None:
        """Set ``draft_token_ids`` of each request to ``k`` tokens of the draft model (and
        keep their distributions for sampled requests)."""
        drafts: dict[str, list[int]] = {r.request_id: [] for r, _ in wanted}
        dists: dict[str, list[torch.Tensor]] = {}
        for j in range(max((k for _, k in wanted), default=0)):
            active = [r for r, k in wanted if k > j]
            views = [_Ahead(r, drafts[r.request_id]) for r in active]
            out = SchedulerOutput(
                decodes=[ScheduledChunk(v, v.num_tokens - 1, 1) for v in views]  # type: ignore[arg-type]
            )
            layout, _ = self.runner.build_layout(out)
            meta = self.attention.prepare(layout)
            hidden = self.model(layout, self.runner.kv_caches, self.attention, meta)
            logits = self.model.compute_logits(hidden[layout.logits_indices])
            greedy = logits.argmax(dim=-1).tolist()
            sampled = [i for i, v in enumerate(views) if not v.sampling_params.greedy]
            probs = None
            if sampled:
                probs = self.sampler.distributions(logits[sampled], [views[i] for i in sampled])  # type: ignore[arg-type]
            for i, v in enumerate(views):
                token = greedy[i]
                if probs is not None and i in sampled:
                    p = probs[sampled.index(i)]
                    p = p / p.sum()
                    token = self.sampler.draw(p, v)  # type: ignore[arg-type]
                    dists.setdefault(v.request_id, []).append(p)
                drafts[v.request_id].append(token)
        for r, _ in wanted:
            r.draft_token_ids = drafts[r.request_id]
            rows = dists.get(r.request_id)
            if rows:
                self.probs[r.request_id] = torch.stack(rows)
            else:
                self.probs.pop(r.request_id, None)
