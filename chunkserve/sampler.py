"""Batched sampling over the rows of one step that end a prompt or are decodes.

Order per row: penalties (repetition, presence, frequency) on the raw logits, then the
request's ``logit_bias``; greedy rows (temperature below ``SAMPLING_EPS``) take the argmax;
the others are divided by their temperature, filtered by top-k, top-p and min-p, and
sampled with the exponential race ``argmax(p / E)``, ``E ~ Exp(1)``. A row with a seed draws
``E`` from its own generator, so its tokens do not depend on what else shares the batch.
Logprobs are of the raw model distribution (as in vLLM's default).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from chunkserve.request import Request


@dataclass
class SampleResult:
    token_ids: list[int]  # [S]
    # When any row asked for logprobs: per row, (sampled logprob, [(token, logprob)] top-n),
    # None for rows that did not ask.
    logprobs: list[tuple[float, list[tuple[int, float]]] | None] | None = None


class Sampler:
    def __init__(self, vocab_size: int, device: torch.device, seed: int = 0) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self._generator = torch.Generator(device=device)
        self._generator.manual_seed(seed)
        self._seeded: dict[str, torch.Generator] = {}

    def forget(self, request_id: str) -> None:
        """Drop a finished request's generator."""
        self._seeded.pop(request_id, None)

    def _row_generator(self, request: Request) -> torch.Generator:
        gen = self._seeded.get(request.request_id)
        if gen is None:
            gen = torch.Generator(device=self.device)
            gen.manual_seed(request.sampling_params.seed)
            self._seeded[request.request_id] = gen
        return gen

    def __call__(self, logits: torch.Tensor, requests: Sequence[Request]) -> SampleResult:
        """``logits``: [S, V] fp32, one row per request in ``requests``."""
        params = [r.sampling_params for r in requests]
        want_logprobs = any(p.logprobs is not None for p in params)
        raw_logprobs = torch.log_softmax(logits, dim=-1) if want_logprobs else None

        if any(p.has_penalties for p in params):
            logits = self._apply_penalties(logits.clone(), requests)
        biased = [(i, p.logit_bias) for i, p in enumerate(params) if p.logit_bias]
        if biased:
            logits = logits.clone() if not any(p.has_penalties for p in params) else logits
            for i, bias in biased:
                ids = torch.tensor(list(bias), dtype=torch.int64, device=logits.device)
                values = torch.tensor(list(bias.values()), dtype=logits.dtype, device=logits.device)
                logits[i].index_add_(0, ids, values)
        ban = [
            (i, r)
            for i, r in enumerate(requests)
            if r.num_output_tokens < r.sampling_params.min_tokens
        ]
        if ban:
            copied = biased or any(p.has_penalties for p in params)
            logits = logits if copied else logits.clone()
            for i, r in ban:
                stop_ids = set(r.sampling_params.stop_token_ids)
                if not r.sampling_params.ignore_eos:
                    stop_ids |= r.eos_token_ids
                if stop_ids:
                    logits[i, sorted(stop_ids)] = float("-inf")

        if all(p.greedy for p in params):
            tokens = logits.argmax(dim=-1)
        else:
            tokens = self._sample(logits, requests)
        token_list = tokens.tolist()

        result = SampleResult(token_list)
        if raw_logprobs is not None:
            result.logprobs = self._gather_logprobs(raw_logprobs, tokens, params)
        return result

    # ---- penalties -----------------------------------------------------------------------
    def _apply_penalties(self, logits: torch.Tensor, requests: Sequence[Request]) -> torch.Tensor:
        rows = [i for i, r in enumerate(requests) if r.sampling_params.has_penalties]
        vocab = logits.shape[1]
        for i in rows:
            r = requests[i]
            p = r.sampling_params
            row = logits[i]
            out_ids = torch.tensor(r.output_token_ids, dtype=torch.int64, device=logits.device)
            if p.repetition_penalty != 1.0:
                # HF/vLLM: tokens seen in prompt or output; positive logits divided,
                # negative multiplied.
                seen = torch.zeros(vocab, dtype=torch.bool, device=logits.device)
                seen[torch.tensor(r.token_ids, dtype=torch.int64, device=logits.device)] = True
                penalised = torch.where(
                    row > 0, row / p.repetition_penalty, row * p.repetition_penalty
                )
                row.copy_(torch.where(seen, penalised, row))
            if out_ids.numel() and (p.presence_penalty or p.frequency_penalty):
                counts = torch.zeros(vocab, dtype=logits.dtype, device=logits.device)
                counts.index_add_(0, out_ids, torch.ones_like(out_ids, dtype=logits.dtype))
                row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0)
        return logits

    # ---- random sampling -----------------------------------------------------------------
    def _sample(self, logits: torch.Tensor, requests: Sequence[Request]) -> torch.Tensor:
        params = [r.sampling_params for r in requests]
        device = logits.device
        greedy_tokens = logits.argmax(dim=-1)
        temps = torch.tensor(
            [1.0 if p.greedy else p.temperature for p in params],
            dtype=logits.dtype,
            device=device,
        )
        logits = logits / temps[:, None]

        top_k = [p.top_k if p.top_k > 0 else 0 for p in params]
        if any(top_k):
            k = torch.tensor([k if k > 0 else logits.shape[1] for k in top_k], device=device)
            k = k.clamp(max=logits.shape[1])
            sorted_desc = logits.sort(dim=-1, descending=True).values
            kth = sorted_desc.gather(1, (k - 1)[:, None])  # [S, 1]
            logits = logits.masked_fill(logits < kth, float("-inf"))

        probs = torch.softmax(logits, dim=-1)
        top_p = [p.top_p for p in params]
        if any(tp < 1.0 for tp in top_p):
            tp = torch.tensor(top_p, dtype=probs.dtype, device=device)
            sorted_probs, order = probs.sort(dim=-1, descending=True)
            cum = sorted_probs.cumsum(dim=-1)
            # Keep the smallest prefix whose mass reaches top_p (the first token always).
            drop_sorted = (cum - sorted_probs) >= tp[:, None]
            drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
            probs = probs.masked_fill(drop, 0.0)
        min_p = [p.min_p for p in params]
        if any(mp > 0.0 for mp in min_p):
            mp = torch.tensor(min_p, dtype=probs.dtype, device=device)
            threshold = probs.max(dim=-1, keepdim=True).values * mp[:, None]
            probs = probs.masked_fill(probs < threshold, 0.0)

        noise = torch.empty_like(probs)
        unseeded = [i for i, p in enumerate(params) if p.seed is None]
        if unseeded:
            draw = torch.empty(
                (len(unseeded), probs.shape[1]), dtype=probs.dtype, device=device
            ).exponential_(generator=self._generator)
            noise[unseeded] = draw
        for i, r in enumerate(requests):
            if params[i].seed is not None:
                noise[i].exponential_(generator=self._row_generator(r))
        sampled = (probs / noise).argmax(dim=-1)
        is_greedy = torch.tensor([p.greedy for p in params], device=device)
        return torch.where(is_greedy, greedy_tokens, sampled)

    @staticmethod
    def _gather_logprobs(
        logprobs: torch.Tensor, tokens: torch.Tensor, params: Sequence
    ) -> list[tuple[float, list[tuple[int, float]]] | None]:
        max_n = max((p.logprobs or 0) for p in params)
        sampled = logprobs.gather(1, tokens[:, None])[:, 0].tolist()
        if max_n:
            top_vals, top_ids = logprobs.topk(max_n, dim=-1)
            top_vals_l, top_ids_l = top_vals.tolist(), top_ids.tolist()
        out: list[tuple[float, list[tuple[int, float]]] | None] = []
        for i, p in enumerate(params):
            if p.logprobs is None:
                out.append(None)
                continue
            n = p.logprobs
            top = list(zip(top_ids_l[i][:n], top_vals_l[i][:n])) if n else []
            out.append((sampled[i], top))
        return out
