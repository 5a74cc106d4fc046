"""Step-time cost model: a step's wall time as a linear function of what it computes.

Pure Python (no torch, no numpy at run time): the scheduler's budget controller and the
simulator evaluate it every step. Fitting (``fit``) uses numpy.

Features of a step (all known before it runs):

    1                       fixed cost: reading the weights, launching the layers
    prefill_tokens          matmul work of the prefill rows
    decode_tokens           matmul + sampling work of the decode rows
    decode_context / 1e3    keys the decodes attend to (sum of their context lengths)
    prefill_pairs / 1e6     query-key pairs of the prefill chunks: sum n * (start + n / 2)
    prefill_chunks          per-chunk overhead (gathers, masks)
    prefill_context_k       keys the prefill chunks read: sum of (start + n) / 1e3 (a chunk
                            reads its whole cached prefix once, however few its tokens)
    logits                  1 if the step samples any row: the LM head's weights are read
                            (a decode always samples; a prefill chunk when it ends its prompt)
    decode_padded_k         keys the decodes read when batched as the torch backend batches
                            them, each padded to the longest in its group (``decode_groups``)
                            / 1e3. Equal to decode_context_k when the contexts are alike; one
                            long decode among short ones makes it several times larger. A
                            backend that reads only each decode's own keys (Triton) fits a
                            zero weight here.
    experts_touched         mixture of experts: the expected number of (MoE layer, expert)
                            pairs the step's rows touch (``ExpertRouting.touched``): each
                            touched expert's weights are read and its matmuls launched once,
                            however few its rows. A decode batch touches the experts its
                            tokens pick, a prefill chunk nearly all. 0 for a dense model.

The weights are seconds per unit. ``OnlineCostModel`` corrects them from measured step times
by refitting over a window of recent steps (pulled toward the profile), so a stale or
missing profile converges.
"""

from __future__ import annotations

import itertools
import json
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

from chunkserve.scheduling.decode_groups import padded_decode_keys

FEATURES = (
    "const",
    "prefill_tokens",
    "decode_tokens",
    "decode_context_k",
    "prefill_pairs_m",
    "prefill_chunks",
    "prefill_context_k",
    "logits",
    "decode_padded_k",
    "experts_touched",
)
# The features a profile saved before the MoE feature has (its weight for it is 0).
DENSE_FEATURES = FEATURES[:-1]
# Block size the padded-key feature rounds to (the engine's default; a different block size
# changes the feature by under one block per decode).
PADDING_BLOCK_SIZE = 16
NUM_FEATURES = len(FEATURES)


@dataclass(frozen=True)
class ExpertRouting:
    """How a mixture-of-experts model's tokens spread over its experts: per MoE layer, the
    probability that one token picks each expert (``inclusion[l][e]``, a layer's sum is
    top_k). Uniform for a random router; measured (``from_counts``) for a trained or skewed
    one.

    The expected number of distinct experts ``T`` independent tokens touch in a layer is
    ``sum_e 1 - (1 - p_e)^T`` (an expert is missed only if every token misses it), exact
    however each token's ``top_k`` choices depend on each other. Tokens of one prompt route
    alike more often than independent ones, so a prefill chunk may touch fewer; the fit
    absorbs the average."""

    inclusion: tuple[tuple[float, ...], ...]

    def __post_init__(self) -> None:
        for layer in self.inclusion:
            if not layer or not all(0.0 <= p <= 1.0 for p in layer):
                raise ValueError("expert routing: inclusion probabilities must be in [0, 1]")
        object.__setattr__(self, "_cache", {})

    @classmethod
    def uniform(cls, num_experts: int, top_k: int, num_layers: int = 1) -> ExpertRouting:
        if not 1 <= top_k <= num_experts or num_layers < 1:
            raise ValueError(
                f"expert routing: need 1 <= top_k ({top_k}) <= num_experts ({num_experts}) "
                f"and num_layers ({num_layers}) >= 1"
            )
        return cls(((top_k / num_experts,) * num_experts,) * num_layers)

    @classmethod
    def from_counts(cls, counts: Sequence[Sequence[int]], num_tokens: int) -> ExpertRouting:
        """From the (token, choice) pairs each layer routed to each expert over
        ``num_tokens`` tokens."""
        if num_tokens <= 0:
            raise ValueError("expert routing: from_counts needs tokens")
        return cls(tuple(tuple(min(1.0, c / num_tokens) for c in layer) for layer in counts))

    @property
    def num_layers(self) -> int:
        return len(self.inclusion)

    def touched(self, num_tokens: int) -> float:
        """Expected (layer, expert) pairs ``num_tokens`` rows touch, over all MoE layers."""
        cache: dict[int, float] = self._cache  # type: ignore[attr-defined]
        got = cache.get(num_tokens)
        if got is None:
            got = sum(1.0 - (1.0 - p) ** num_tokens for layer in self.inclusion for p in layer)
            if len(cache) < 65_536:
                cache[num_tokens] = got
        return got

    def to_json(self) -> dict[str, Any]:
        return {"inclusion": [list(layer) for layer in self.inclusion]}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ExpertRouting:
        try:
            return cls(tuple(tuple(float(p) for p in layer) for layer in data["inclusion"]))
        except (KeyError, TypeError) as exc:
            raise ValueError(f"expert routing: malformed {data!r}") from exc


@dataclass(frozen=True)
class StepShape:
    """What a step computes: its decodes' context lengths, its prefill chunks as
    (start position, number of tokens), and how many of those chunks end their prompt
    (their last row is sampled)."""

    decode_context_lens: tuple[int, ...] = ()
    prefill_chunks: tuple[tuple[int, int], ...] = ()
    prefill_samples: int = 0

    @property
    def samples(self) -> bool:
        return bool(self.decode_context_lens) or self.prefill_samples > 0

    @property
    def num_prefill_tokens(self) -> int:
        return sum(n for _, n in self.prefill_chunks)

    @property
    def num_decode_tokens(self) -> int:
        return len(self.decode_context_lens)

    @property
    def num_tokens(self) -> int:
        """Rows the step runs through the model (every one passes the MoE layers)."""
        return self.num_prefill_tokens + self.num_decode_tokens

    def features(self, routing: ExpertRouting | None = None) -> tuple[float, ...]:
        """The feature row (the dense part computed once: the online model refits from a
        window of shapes every step); ``routing`` prices the experts (None: a dense model).
        ``CostModel.features`` passes the model's own."""
        if routing is None:
            return self._features
        return (*self._features[:-1], routing.touched(self.num_tokens))

    @cached_property
    def _features(self) -> tuple[float, ...]:
        pairs = sum(n * (s + n / 2) for s, n in self.prefill_chunks)
        return (
            1.0,
            float(self.num_prefill_tokens),
            float(self.num_decode_tokens),
            sum(self.decode_context_lens) / 1e3,
            pairs / 1e6,
            float(len(self.prefill_chunks)),
            sum(s + n for s, n in self.prefill_chunks) / 1e3,
            float(self.samples),
            padded_decode_keys(self.decode_context_lens, PADDING_BLOCK_SIZE) / 1e3,
            0.0,
        )

    @classmethod
    def of(cls, out: Any) -> StepShape:
        """From a ``SchedulerOutput``. A decode with draft tokens (speculative decoding) is
        priced as what it runs: a short chunk at its position, whose rows are sampled."""
        verifies = [c for c in out.decodes if c.draft_token_ids]
        return cls(
            tuple(c.end for c in out.decodes if not c.draft_token_ids),
            tuple((c.start, c.num_tokens) for c in out.prefills + verifies),
            sum(1 for c in out.prefills if c.samples) + len(verifies),
        )


def dot(w: Sequence[float], x: Sequence[float]) -> float:
    return sum(a * b for a, b in zip(w, x))


class CostModel:
    """``predict(shape)`` in seconds. ``weights`` follow ``FEATURES``; ``routing`` prices the
    experts of a mixture-of-experts model (None: dense, the experts feature is 0)."""

    def __init__(
        self,
        weights: Sequence[float],
        meta: dict[str, Any] | None = None,
        routing: ExpertRouting | None = None,
    ) -> None:
        if len(weights) != NUM_FEATURES:
            raise ValueError(f"cost model: expected {NUM_FEATURES} weights, got {len(weights)}")
        self.weights = [float(w) for w in weights]
        self.meta = dict(meta or {})
        self.routing = routing

    def features(self, shape: StepShape) -> tuple[float, ...]:
        return shape.features(self.routing)

    def predict(self, shape: StepShape) -> float:
        return dot(self.weights, self.features(shape))

    def prefill_work_s(self, num_tokens: int, start: int = 0) -> float:
        """Seconds a prefill chunk adds to a step that runs anyway: its tokens, attention
        and per-chunk costs, not the step's fixed cost or the LM head."""
        return self.predict(StepShape((), ((start, num_tokens),))) - self.predict(StepShape())

    def max_prefill_tokens(
        self,
        decode_context_lens: Sequence[int],
        prefill_start: int,
        target_s: float,
        limit: int,
        num_chunks: int = 1,
        other_prefix_tokens: int = 0,
    ) -> int:
        """Most prefill tokens ``p`` (starting at ``prefill_start``, split over
        ``num_chunks`` chunks, the others reading ``other_prefix_tokens`` cached tokens in
        all) that keep the predicted step time within ``target_s`` beside these decodes; 0
        if the decodes alone take that long. Solves the model's quadratic in ``p``
        (conservatively: as if all tokens were one chunk at ``prefill_start``, and the step
        samples)."""
        w = self.weights
        decodes = StepShape(tuple(decode_context_lens), prefill_samples=1)
        base = dot(w, decodes.features())  # without the experts: added below
        # The chunks' fixed costs, and the prefixes they read.
        prefix_k = (prefill_start + other_prefix_tokens) / 1e3
        room = target_s - base - w[5] * max(1, num_chunks) - w[6] * prefix_k
        if room <= 0:
            return 0
        # room >= w1 p + w4 (p * start + p^2 / 2) / 1e6 + w6 p / 1e3
        a = max(w[4], 0.0) / 2e6
        b = max(w[1], 0.0) + max(w[4], 0.0) * prefill_start / 1e6 + max(w[6], 0.0) / 1e3
        if a <= 0:
            p = room / b if b > 0 else float(limit)
        else:
            p = (-b + math.sqrt(b * b + 4 * a * room)) / (2 * a)
        p = max(0, min(limit, int(p)))
        if self.routing is None or w[-1] <= 0:
            return p
        # The experts the decodes and the chunk touch: concave in p, so the most tokens
        # that fit is found by bisection below the bound the rest of the model gives.
        n = len(decode_context_lens)

        def fits(q: int) -> bool:
            return w[-1] * self.routing.touched(n + q) <= room - (
                a * q * q + b * q if a > 0 else b * q
            )

        if not fits(0):
            return 0
        lo, hi = 0, p
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
        return lo

    # ---- persistence ----------------------------------------------------------------------
    def to_json(self) -> dict[str, Any]:
        doc = {"features": list(FEATURES), "weights": self.weights, **self.meta}
        if self.routing is not None:
            doc["routing"] = self.routing.to_json()
        return doc

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=1))

    @classmethod
    def load(cls, path: str | Path) -> CostModel:
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(f"cost_profile: cannot read {str(path)!r}: {exc}") from exc
        weights = data.get("weights")
        if data.get("features") == list(DENSE_FEATURES) and isinstance(weights, list):
            weights = [*weights, 0.0]  # saved before the experts feature: a dense model's
        elif data.get("features") != list(FEATURES):
            raise ValueError(f"cost_profile: {str(path)!r} was made with other features")
        routing = ExpertRouting.from_json(data["routing"]) if data.get("routing") else None
        meta = {k: v for k, v in data.items() if k not in ("features", "weights", "routing")}
        return cls(weights, meta, routing)


def fit(
    shapes: Sequence[StepShape],
    times_s: Sequence[float],
    prior: Sequence[float] | None = None,
    prior_weight: float = 0.0,
    routing: ExpertRouting | None = None,
) -> list[float]:
    """Non-negative least squares of step times on the features (each weight is a cost),
    in relative terms (samples weighted by 1 / time). With ``prior``, a ridge pulls each
    weight toward it, measured at the feature's typical magnitude (``FEATURE_SCALE``):
    ``prior_weight`` counts like that many samples. ``routing``: the experts' (MoE)."""
    import numpy as np

    rows = [s.features(routing) for s in shapes]
    x = np.array(rows, dtype=np.float64).reshape(-1, NUM_FEATURES)
    y = np.array(times_s, dtype=np.float64)
    inv = 1.0 / np.maximum(y, 1e-6)
    xs, ys = x * inv[:, None], y * inv
    if prior is not None and prior_weight > 0:
        scale = np.array(FEATURE_SCALE)
        p = np.asarray(prior, dtype=np.float64)
        typical = max(float(p @ scale), 1e-6)  # predicted seconds of a "typical" step
        rows = np.diag(np.sqrt(prior_weight) * scale / typical)
        xs = np.vstack([xs, rows])
        ys = np.concatenate([ys, rows @ p])
    active = list(range(NUM_FEATURES))
    w = np.zeros(NUM_FEATURES)
    while active:  # drop the most negative weight, refit the rest (a small active set)
        sol, *_ = np.linalg.lstsq(xs[:, active], ys, rcond=None)
        if (sol >= 0).all():
            w[active] = sol
            break
        active.pop(int(np.argmin(sol)))
    return [float(v) for v in w]


def relative_errors(
    model: CostModel, shapes: Sequence[StepShape], times_s: Sequence[float]
) -> list[float]:
    return [abs(model.predict(s) - t) / t for s, t in zip(shapes, times_s)]


# Typical magnitude of each feature (a mid-sized step), for the ridge prior.
FEATURE_SCALE = (1.0, 256.0, 32.0, 32.0, 0.5, 2.0, 2.0, 1.0, 32.0, 64.0)


class OnlineCostModel(CostModel):
    """A cost model refit from the last ``window`` measured steps (non-negative least
    squares in relative terms), pulled toward its starting weights by a ridge worth
    ``prior_weight`` samples: high for a profile measured here, low for a guess. A stale or
    missing profile converges as soon as the window holds varied steps; while it does not
    (all steps alike), the prior keeps the unexcited directions sensible."""

    def __init__(
        self,
        weights: Sequence[float],
        prior_weight: float = 8.0,
        window: int = 256,
        refit_every: int = 1,
        meta: dict[str, Any] | None = None,
        routing: ExpertRouting | None = None,
    ) -> None:
        super().__init__(weights, meta, routing)
        self.prior = list(self.weights)
        self.prior_weight = prior_weight
        self.window = window
        self.refit_every = refit_every
        self._shapes: list[StepShape] = []
        self._times: list[float] = []
        self.num_updates = 0

    def observe(self, shape: StepShape, measured_s: float) -> None:
        if measured_s <= 0:
            return
        self._shapes.append(shape)
        self._times.append(measured_s)
        if len(self._shapes) > self.window:
            del self._shapes[0], self._times[0]
        self.num_updates += 1
        if self.num_updates % self.refit_every == 0:
            self.weights = fit(
                self._shapes, self._times, self.prior, self.prior_weight, self.routing
            )


# A deliberately pessimistic guess for when no profile exists: prefill tokens look
# expensive, so the first budgets are small; measurements then raise them.
# (The experts' weight starts at 0: how much an expert's weights cost to read depends on the
# model; the online fit learns it.)
DEFAULT_PRIOR = (0.02, 4e-3, 1e-3, 1e-3, 0.05, 1e-3, 5e-3, 5e-3, 1e-3, 0.0)


def default_profile_path(
    model_path: str, device: str, dtype: str, num_threads: int, weight_format: str | None = None
) -> Path:
    """``<model>.<device>-<dtype>-t<threads>.profile.json`` beside the model file, or the
    same name under ~/.cache/chunkserve/profiles when the model's folder is read-only or is
    a hub cache's snapshot (huggingface_hub owns those folders: nothing of ours goes there).
    ``weight_format``: the quantized types the weights are held in ("Q4_1+Q8_0"; None for
    float weights): ``<device>-<dtype>-<format>-t<threads>``, since a model kept quantized
    steps at other costs than the same file dequantized."""
    kind = dtype if weight_format is None else f"{dtype}-{weight_format}"
    name = f"{Path(model_path).name}.{device}-{kind}-t{num_threads}.profile.json"
    beside = Path(model_path).parent
    parts = beside.resolve().parts if beside.exists() else beside.parts
    in_hub_cache = any(
        a.startswith("models--") and b == "snapshots" for a, b in itertools.pairwise(parts)
    )
    if not in_hub_cache and os.access(beside, os.W_OK):
        return beside / name
    return Path.home() / ".cache" / "chunkserve" / "profiles" / name


def find_profile(
    model_path: str, device: str, dtype: str, num_threads: int, weight_format: str | None = None
) -> Path | None:
    """The profile saved for this model, device, dtype, weight format and thread count, if
    any."""
    path = default_profile_path(model_path, device, dtype, num_threads, weight_format)
    for candidate in (path, Path.home() / ".cache" / "chunkserve" / "profiles" / path.name):
        if candidate.is_file():
            return candidate
    return None
