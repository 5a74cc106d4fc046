"""Batched sampling over the rows of one step that end a prompt or are decodes.

Order per row: penalties (repetition, presence, frequency) on the raw logits, then the
request's ``logit_bias``; greedy rows (temperature below ``SAMPLING_EPS``) take the argmax;
the others are divided by their temperature, filtered by top-k, top-p and min-p, and
sampled with the exponential race ``argmax(p / E)``, ``E ~ Exp(1)``. A row with a seed draws
``E`` from a generator keyed by its seed and the position of the token, so its tokens do not
depend on what else shares the batch, nor on speculative decoding.
Logprobs are of the raw model distribution (as in vLLM's default).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from chunkserve.scheduling.request import Request


@dataclass
class SampleResult:
    token_ids: list[int]  # [S]
    # When any row asked for logprobs: per row, (sampled logprob, [(token, logprob)] top-n),
    # None for rows that did not ask.
    logprobs: list[tuple[float, list[tuple[int, float]]] | None] | None = None


def _mix(seed: int, position: int) -> int:
    """A 64-bit key of (seed, position) (splitmix64's finaliser over both)."""
    mask = (1 << 64) - 1
    z = (seed * 0x9E3779B97F4A7C15 + (position + 1) * 0xBF58476D1CE4E5B9) & mask
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
    return (z ^ (z >> 31)) & ((1 << 63) - 1)


class SampleRow:
    """Row j of a decode with drafts, as the sampler sees it: the request with its first j
    draft tokens taken as output (penalties and the min_tokens ban count them)."""

    def __init__(self, request: Request, extra: list[int]) -> None:
        self.request = request
        self.extra = extra
        self.request_id = request.request_id
        self.sampling_params = request.sampling_params
        self.eos_token_ids = request.eos_token_ids
        self.grammar = request.grammar

    @property
    def output_token_ids(self) -> list[int]:
        return self.request.output_token_ids + self.extra

    @property
    def token_ids(self) -> list[int]:
        return self.request.token_ids + self.extra

    @property
    def num_output_tokens(self) -> int:
        return self.request.num_output_tokens + len(self.extra)


class Sampler:
    def __init__(self, vocab_size: int, device: torch.device, seed: int = 0) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self._generator = torch.Generator(device=device)
        self._generator.manual_seed(seed)
        # Seeded rows draw from a generator keyed by (seed, output position): a seeded
        # request's token at each position is the same whatever shares the batch and
        # however many draft tokens were verified with it.
        self._keyed = torch.Generator(device=device)

    def forget(self, request_id: str) -> None:
        """A request ended (per-request sampling state would be dropped here; seeded draws
        are keyed by position, so there is none)."""

    def _row_generator(self, request: Request) -> torch.Generator:
        """The generator of a seeded row: keyed by the request's seed and the position of
        the token it samples."""
        self._keyed.manual_seed(_mix(request.sampling_params.seed, request.num_output_tokens))
        return self._keyed

    def __call__(self, logits: torch.Tensor, requests: Sequence[Request]) -> SampleResult:
        """``logits``: [S, V] fp32, one row per request in ``requests``."""
        params = [r.sampling_params for r in requests]
        want_logprobs = any(p.logprobs is not None for p in params)
        raw_logprobs = torch.log_softmax(logits, dim=-1) if want_logprobs else None
        logits = self._process(logits, requests)
        if all(p.greedy for p in params):
            tokens = logits.argmax(dim=-1)
        else:
            tokens = self._sample(logits, requests)
        token_list = tokens.tolist()

        result = SampleResult(token_list)
        if raw_logprobs is not None:
            result.logprobs = self._gather_logprobs(raw_logprobs, tokens, params)
        return result

    def verify(
        self,
        logits: torch.Tensor,
        requests: Sequence[Request],
        drafts: Sequence[Sequence[int]],
        draft_probs: Sequence[torch.Tensor | None] | None = None,
    ) -> SampleResult:
        """Speculative verification. Request i has ``len(drafts[i]) + 1`` consecutive rows of
        ``logits``: row j is the target's distribution after its tokens and the first j
        drafts. Returns per request the accepted drafts then one token of the target's own
        (``token_ids[i]`` a list), and their logprobs.

        Greedy rows accept a draft exactly when it is the target's argmax (the tokens are
        those of decoding without drafts); seeded rows likewise when it is the token the
        exponential race with the position's keyed noise picks (so a seeded request's tokens
        are those it makes without drafts, whatever was drafted). Other sampled rows use
        rejection sampling (Leviathan et al. 2023; Chen et al. 2023): draft d from q is kept
        with probability
        min(1, p(d) / q(d)); the first rejected one is replaced by a sample of
        norm(max(p - q, 0)); all kept, one more from p. The tokens then follow the target's
        distribution p (after temperature, top-k, top-p, min-p) exactly. ``draft_probs[i]``
        is q, [k, V] (a draft model's); None: the drafts were proposed deterministically
        (q one-hot, n-gram)."""
        rows: list[Request | SampleRow] = []
        for r, d in zip(requests, drafts):
            rows.append(r)
            rows.extend(SampleRow(r, list(d[:j])) for j in range(1, len(d) + 1))
        params = [r.sampling_params for r in rows]
        want_logprobs = any(p.logprobs is not None for p in params)
        raw_logprobs = torch.log_softmax(logits, dim=-1) if want_logprobs else None
        processed = self._process(logits, rows)
        argmax = processed.argmax(dim=-1).tolist()
        probs = None
        if not all(p.greedy for p in params):
            probs = self.distributions(processed, rows)
        out_tokens: list[list[int]] = []
        emitted_rows: list[int] = []
        row0 = 0
        for i, (r, d) in enumerate(zip(requests, drafts)):
            k = len(d)
            if r.sampling_params.greedy or r.sampling_params.seed is not None:
                # Greedy, and seeded rows (coupled): the token each row would sample without
                # drafts (argmax, or the race with the position's keyed noise); a draft is
                # kept exactly when it is that token. Exact, and the tokens are those of
                # decoding without drafts.
                if r.sampling_params.greedy:
                    target = argmax[row0 : row0 + k + 1]
                else:
                    assert probs is not None
                    target = self._race(probs[row0 : row0 + k + 1], rows[row0 : row0 + k + 1])
                a = 0
                while a < k and d[a] == target[a]:
                    a += 1
                tokens = list(d[:a]) + [target[a]]
            else:
                assert probs is not None
                q = draft_probs[i] if draft_probs is not None else None
                tokens = self._rejection_sample(probs[row0 : row0 + k + 1], r, d, q)
            out_tokens.append(tokens)
            emitted_rows.extend(range(row0, row0 + len(tokens)))
            row0 += k + 1

        result = SampleResult(out_tokens)  # type: ignore[arg-type]
        if raw_logprobs is not None:
            idx = torch.tensor(emitted_rows, dtype=torch.int64, device=logits.device)
            flat = [t for tokens in out_tokens for t in tokens]
            emitted = torch.tensor(flat, dtype=torch.int64, device=logits.device)
            row_params = [params[j] for j in emitted_rows]
            per_row = self._gather_logprobs(raw_logprobs[idx], emitted, row_params)
            grouped, n = [], 0
            for r, tokens in zip(requests, out_tokens):
                lps = per_row[n : n + len(tokens)]
                n += len(tokens)
                grouped.append(lps if r.sampling_params.logprobs is not None else None)
            result.logprobs = grouped  # type: ignore[assignment]
        return result

    def _race(self, probs: torch.Tensor, rows: Sequence[Request]) -> list[int]:
        """Each row's token by the exponential race, seeded rows' noise keyed by position."""
        noise = torch.empty_like(probs)
        for i, r in enumerate(rows):
            noise[i].exponential_(generator=self._generator_of(r))
        return (probs / noise).argmax(dim=-1).tolist()

    def _generator_of(self, request: Request) -> torch.Generator:
        if request.sampling_params.seed is None:
            return self._generator
        return self._row_generator(request)

    def _uniform(self, request: Request) -> float:
        gen = self._generator_of(request)
        return torch.rand((), generator=gen, device=self.device).item()

    def draw(self, p: torch.Tensor, request: Request) -> int:
        """One token from the distribution ``p`` [V] (need not be normalised), by the same
        exponential race as plain sampling, from the request's generator if seeded."""
        gen = self._generator_of(request)
        noise = torch.empty_like(p).exponential_(generator=gen)
        return int((p / noise).argmax())

    def _rejection_sample(
        self, p: torch.Tensor, request: Request, drafts: Sequence[int], q: torch.Tensor | None
    ) -> list[int]:
        """``p``: [k + 1, V] target probabilities; ``q``: [k, V] draft probabilities or None
        (one-hot at the drafts)."""
        p_host = p[:, list(drafts)] if drafts else None
        tokens: list[int] = []
        for j, d in enumerate(drafts):
            assert p_host is not None
            p_d = float(p_host[j, j])
            q_d = 1.0 if q is None else float(q[j, d])
            if q_d > 0 and self._uniform(request) * q_d < p_d:
                tokens.append(d)
                continue
            if q is None:
                residual = p[j].clone()
                residual[d] = 0.0
            else:
                residual = (p[j] - q[j]).clamp_(min=0.0)
            if float(residual.sum()) <= 0.0:  # p and q agree: any token of p is exact
                residual = p[j]
            tokens.append(self.draw(residual, request))
            return tokens
        tokens.append(self.draw(p[len(drafts)], request))
        return tokens

    def _process(self, logits: torch.Tensor, requests: Sequence[Request]) -> torch.Tensor:
        """Penalties, logit biases and the min_tokens ban (a copy if any applies)."""
        params = [r.sampling_params for r in requests]
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
                    ids = sorted(stop_ids)
                    kept = logits[i, ids].clone()
                    logits[i, ids] = float("-inf")
                    if r.grammar is not None and not logits[i].isfinite().any():
                        logits[i, ids] = kept  # the grammar allows only its end: it wins
        return logits

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
        probs = self.distributions(logits, requests)
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

    def distributions(self, logits: torch.Tensor, requests: Sequence[Request]) -> torch.Tensor:
        """The distribution each row samples from: temperature, then top-k, top-p and min-p
        (greedy rows at temperature 1; their probabilities are not used)."""
        params = [r.sampling_params for r in requests]
        device = logits.device
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
        return probs

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
            # Tokens a grammar masked have no probability: fewer alternatives, not -inf
            # (which JSON cannot carry).
            top = list(zip(top_ids_l[i][:n], top_vals_l[i][:n])) if n else []
            top = [(t, v) for t, v in top if v != float("-inf")]
            out.append((sampled[i], top))
        return out
