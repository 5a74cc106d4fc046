"""Benchmark workloads: what each request asks and when it arrives.

- ``random``: random token ids of given input/output lengths (as ``vllm bench serve``).
- ``sharegpt``: first human turn and reply length from a local ShareGPT-format JSON file.
- ``stall``: a steady stream of short interactive requests (tens of tokens in, ~100 out)
  into which long prose documents (1,500-4,000 tokens) arrive at fixed intervals: the
  scenario where a long prefill stalls everyone's token stream (seed 000, section 4.1).
- ``fairness``: 8 prompts of 4,000+ tokens arrive together, then short requests keep
  arriving: short requests should not queue behind the long ones.
- ``mix``: a realistic spread of lengths at Poisson arrivals: prompt lengths log-normal
  (median 300 tokens, a tail to 6,000: chat turns, pasted documents, code), output lengths
  log-normal (median 100, a tail to 800), prose from the shipped corpus. ``kind`` is the
  prompt-length class (short < 256 <= medium < 1,024 <= long), for TTFT per class.

Every request has an ``arrival`` offset (seconds from the start) drawn here, so one seed gives
the same workload against every server. Short/long ``kind`` lets reports split the metrics.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from chunkserve.bench.prose import prose_prompts

DATASETS = ("random", "sharegpt", "stall", "fairness", "mix")
# Prompt-length classes of the mix workload (TTFT is reported per class).
LENGTH_CLASSES = ((256, "short"), (1024, "medium"), (float("inf"), "long"))
VOCAB_LOW, VOCAB_HIGH = 100, 49_000  # ordinary tokens of the embedded model's vocabulary


@dataclass
class BenchRequest:
    prompt: list[int]  # token ids (sent as ids, so every server sees the same input)
    output_len: int
    arrival: float  # seconds after the start
    kind: str = "default"  # "short" / "long" in the stall and fairness scenarios
    text: str | None = None  # the prompt as text (chat endpoint)

    @property
    def prompt_len(self) -> int:
        return len(self.prompt)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("prompt")
        d["prompt_len"] = self.prompt_len
        return d


@dataclass
class WorkloadSpec:
    dataset: str = "stall"
    num_prompts: int = 100
    request_rate: float = float("inf")  # of the main (short) stream; inf = all at t=0
    burstiness: float = 1.0  # 1 = Poisson; else gamma-distributed gaps with this shape
    seed: int = 0
    input_len: int = 256  # random
    output_len: int = 128  # random
    range_ratio: float = 0.0  # random: lengths uniform in [(1-r) L, (1+r) L]
    dataset_path: str | None = None  # sharegpt
    short_input: tuple[int, int] = (20, 60)
    short_output: tuple[int, int] = (90, 110)
    long_input: tuple[int, int] = (1500, 4000)
    long_output: int = 16
    long_interval: float = 10.0  # stall: seconds between long documents
    long_start: float = 3.0  # stall: first long document
    stall_num_long: int = 0  # stall: long documents (0: enough to span the short arrivals)
    num_long: int = 8  # fairness: long prompts at t=0
    fairness_long_input: tuple[int, int] = (4000, 4200)
    # mix: log-normal lengths (median, sigma of the log), clipped to [lo, hi].
    mix_input: tuple[float, float, int, int] = (300.0, 1.0, 16, 6000)
    mix_output: tuple[float, float, int, int] = (100.0, 0.8, 8, 800)

    def validate(self) -> None:
        if self.dataset not in DATASETS:
            raise ValueError(f"dataset: must be one of {DATASETS}, got {self.dataset!r}")
        if self.num_prompts < 1:
            raise ValueError("num_prompts: must be >= 1")
        if not self.request_rate > 0:
            raise ValueError("request_rate: must be > 0 (inf sends everything at once)")
        if not self.burstiness > 0:
            raise ValueError("burstiness: must be > 0")
        if self.dataset == "sharegpt" and not self.dataset_path:
            raise ValueError("dataset_path: the sharegpt dataset needs a local JSON file")


def arrival_times(
    n: int, rate: float, burstiness: float, rng: random.Random, start: float = 0.0
) -> list[float]:
    """Arrival offsets of ``n`` requests: Poisson at ``rate`` (burstiness 1) or gamma gaps
    with shape ``burstiness`` and the same mean; all at ``start`` if the rate is infinite."""
    if rate == float("inf"):
        return [start] * n
    t, out = start, []
    for _ in range(n):
        out.append(t)
        t += rng.gammavariate(burstiness, 1.0 / (rate * burstiness))
    return out


def _random_ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(VOCAB_LOW, VOCAB_HIGH) for _ in range(n)]


def build_workload(spec: WorkloadSpec, tokenizer: Any) -> list[BenchRequest]:
    """The requests of a workload, sorted by arrival. ``tokenizer`` needs ``encode`` and
    ``decode`` (chunkserve's ``Tokenizer``)."""
    spec.validate()
    rng = random.Random(spec.seed)
    build: dict[str, Callable[[], list[BenchRequest]]] = {
        "random": lambda: _random(spec, rng),
        "sharegpt": lambda: _sharegpt(spec, rng, tokenizer),
        "stall": lambda: _stall(spec, rng, tokenizer),
        "fairness": lambda: _fairness(spec, rng, tokenizer),
        "mix": lambda: _mix(spec, rng, tokenizer),
    }
    requests = build[spec.dataset]()
    for r in requests:
        if r.text is None:
            r.text = tokenizer.decode(r.prompt)
    requests.sort(key=lambda r: r.arrival)
    return requests


def _lengths(rng: random.Random, n: int, base: int, ratio: float) -> list[int]:
    lo, hi = max(1, int(base * (1 - ratio))), max(1, int(base * (1 + ratio)))
    return [rng.randint(lo, hi) for _ in range(n)]


def _random(spec: WorkloadSpec, rng: random.Random) -> list[BenchRequest]:
    ins = _lengths(rng, spec.num_prompts, spec.input_len, spec.range_ratio)
    outs = _lengths(rng, spec.num_prompts, spec.output_len, spec.range_ratio)
    times = arrival_times(spec.num_prompts, spec.request_rate, spec.burstiness, rng)
    return [BenchRequest(_random_ids(rng, i), o, t) for i, o, t in zip(ins, outs, times)]


def _sharegpt(spec: WorkloadSpec, rng: random.Random, tokenizer: Any) -> list[BenchRequest]:
    path = Path(spec.dataset_path or "")
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"dataset_path: cannot read ShareGPT JSON {str(path)!r}: {exc}") from exc
    pairs = []
    for entry in data:
        turns = entry.get("conversations") or entry.get("conversation") or []
        if len(turns) < 2:
            continue
        prompt, reply = turns[0].get("value", ""), turns[1].get("value", "")
        p_ids = tokenizer.encode(prompt, add_special_tokens=False)
        o_len = len(tokenizer.encode(reply, add_special_tokens=False))
        if 4 <= len(p_ids) <= 4096 and 4 <= o_len <= 2048:  # vLLM's filter, roughly
            pairs.append((p_ids, o_len, prompt))
    if not pairs:
        raise ValueError(f"dataset_path: no usable conversations in {str(path)!r}")
    rng.shuffle(pairs)
    pairs = (pairs * (spec.num_prompts // len(pairs) + 1))[: spec.num_prompts]
    times = arrival_times(len(pairs), spec.request_rate, spec.burstiness, rng)
    return [BenchRequest(p, o, t, text=text) for (p, o, text), t in zip(pairs, times)]


def _shorts(
    spec: WorkloadSpec, rng: random.Random, tokenizer: Any, n: int, start: float
) -> list[BenchRequest]:
    lens = [rng.randint(*spec.short_input) for _ in range(n)]
    prompts = prose_prompts(tokenizer, lens, rng)
    times = arrival_times(n, spec.request_rate, spec.burstiness, rng, start)
    return [
        BenchRequest(p, rng.randint(*spec.short_output), t, "short") for p, t in zip(prompts, times)
    ]


def _stall(spec: WorkloadSpec, rng: random.Random, tokenizer: Any) -> list[BenchRequest]:
    shorts = _shorts(spec, rng, tokenizer, spec.num_prompts, 0.0)
    if spec.stall_num_long:
        n_long = spec.stall_num_long
    else:  # cover the short stream's arrivals
        horizon = shorts[-1].arrival if shorts else 0.0
        n_long = max(1, int((horizon - spec.long_start) // spec.long_interval) + 1)
    lens = [rng.randint(*spec.long_input) for _ in range(n_long)]
    docs = prose_prompts(tokenizer, lens, rng)
    longs = [
        BenchRequest(d, spec.long_output, spec.long_start + i * spec.long_interval, "long")
        for i, d in enumerate(docs)
    ]
    return shorts + longs


def _fairness(spec: WorkloadSpec, rng: random.Random, tokenizer: Any) -> list[BenchRequest]:
    lens = [rng.randint(*spec.fairness_long_input) for _ in range(spec.num_long)]
    longs = [
        BenchRequest(d, spec.long_output, 0.0, "long") for d in prose_prompts(tokenizer, lens, rng)
    ]
    return longs + _shorts(spec, rng, tokenizer, spec.num_prompts, 0.5)


def length_class(prompt_len: int) -> str:
    return next(name for limit, name in LENGTH_CLASSES if prompt_len < limit)


def _lognormal(rng: random.Random, n: int, params: tuple[float, float, int, int]) -> list[int]:
    median, sigma, lo, hi = params
    return [min(hi, max(lo, round(rng.lognormvariate(math.log(median), sigma)))) for _ in range(n)]


def _mix(spec: WorkloadSpec, rng: random.Random, tokenizer: Any) -> list[BenchRequest]:
    ins = _lognormal(rng, spec.num_prompts, spec.mix_input)
    outs = _lognormal(rng, spec.num_prompts, spec.mix_output)
    prompts = prose_prompts(tokenizer, ins, rng)
    times = arrival_times(spec.num_prompts, spec.request_rate, spec.burstiness, rng)
    return [BenchRequest(p, o, t, length_class(len(p))) for p, o, t in zip(prompts, outs, times)]
