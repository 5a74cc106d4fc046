"""A streaming load generator for any OpenAI-compatible server, and its metrics.

Each request is sent at its arrival offset, streamed, and the arrival time of every SSE chunk
that carries text is recorded. Metric names follow ``vllm bench serve`` (``mean_ttft_ms``,
``p99_itl_ms``, ``output_throughput`` ...) so results compare directly. For the tails a stall
shows in: ``p99.9_itl_ms``, ``max_itl_ms`` (the worst single gap between two tokens of any
request: the stall a user sees) and ``stalled_token_fraction`` (the share of inter-token gaps
longer than ``STALL_FACTOR`` times the run's median gap).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

from chunkserve.bench.datasets import BenchRequest

PERCENTILES = (50, 90, 99, 99.9)
# A gap this many times the run's median inter-token gap counts as a stalled token.
STALL_FACTOR = 3.0


@dataclass
class RequestRecord:
    index: int
    kind: str
    prompt_len: int
    arrival: float  # scheduled offset
    start: float = 0.0  # actual send time, seconds from the benchmark start
    ttft: float | None = None
    chunk_times: list[float] = field(default_factory=list)  # seconds from the start
    end: float | None = None
    output_tokens: int = 0
    success: bool = False
    error: str | None = None
    text: str = ""

    @property
    def itls(self) -> list[float]:
        t = self.chunk_times
        return [b - a for a, b in itertools.pairwise(t)]

    @property
    def e2el(self) -> float | None:
        return None if self.end is None else self.end - self.start

    @property
    def tpot(self) -> float | None:
        if self.ttft is None or self.e2el is None or self.output_tokens < 2:
            return None
        return (self.e2el - self.ttft) / (self.output_tokens - 1)


@dataclass
class GoodputSLO:
    """Per-request SLOs in milliseconds; ``itl`` bounds the request's worst gap."""

    ttft: float | None = None
    tpot: float | None = None
    itl: float | None = None
    e2el: float | None = None

    @classmethod
    def parse(cls, items: Sequence[str] | None) -> GoodputSLO | None:
        if not items:
            return None
        slo = cls()
        for item in items:
            key, sep, value = item.partition(":")
            if not sep or key not in ("ttft", "tpot", "itl", "e2el"):
                raise ValueError(
                    f"goodput: expected KEY:MS with KEY in ttft, tpot, itl, e2el; got {item!r}"
                )
            try:
                setattr(slo, key, float(value))
            except ValueError:
                raise ValueError(f"goodput: {value!r} is not a number of ms") from None
        return slo

    def met(self, r: RequestRecord) -> bool:
        checks = [
            (self.ttft, r.ttft),
            (self.tpot, r.tpot),
            (self.e2el, r.e2el),
            (self.itl, max(r.itls, default=0.0)),
        ]
        return r.success and all(
            slo is None or (value is not None and value * 1e3 <= slo) for slo, value in checks
        )


def _request_body(
    req: BenchRequest, endpoint: str, model: str | None, ignore_eos: bool
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "max_tokens": req.output_len,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": ignore_eos,
    }
    if model:
        body["model"] = model
    if endpoint == "chat":
        body["messages"] = [{"role": "user", "content": req.text or ""}]
    else:
        body["prompt"] = req.prompt
    return body


async def _send(
    client: httpx.AsyncClient,
    url: str,
    body: dict[str, Any],
    rec: RequestRecord,
    t0: float,
    chat: bool,
) -> None:
    rec.start = time.perf_counter() - t0
    try:
        async with client.stream("POST", url, json=body) as resp:
            if resp.status_code != 200:
                rec.error = f"HTTP {resp.status_code}: {(await resp.aread())[:300]!r}"
                return
            usage_tokens = None
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    rec.error = str(chunk["error"])[:300]
                    return
                if chunk.get("usage"):
                    usage_tokens = chunk["usage"].get("completion_tokens")
                for choice in chunk.get("choices") or []:
                    text = (
                        (choice.get("delta") or {}).get("content") if chat else choice.get("text")
                    )
                    if text:
                        now = time.perf_counter() - t0
                        if rec.ttft is None:
                            rec.ttft = now - rec.start
                        rec.chunk_times.append(now)
                        rec.text += text
            rec.end = time.perf_counter() - t0
            rec.output_tokens = usage_tokens if usage_tokens else len(rec.chunk_times)
            rec.success = rec.ttft is not None
            if not rec.success:
                rec.error = "no tokens received"
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        rec.error = f"{type(exc).__name__}: {exc}"


async def run_load(
    base_url: str,
    requests: Sequence[BenchRequest],
    *,
    endpoint: str = "completions",
    model: str | None = None,
    max_concurrency: int | None = None,
    max_duration: float = 3600.0,
    ignore_eos: bool = True,
    progress: bool = True,
    api_key: str | None = None,
) -> tuple[list[RequestRecord], float]:
    """Send every request at its arrival offset; returns the records and the duration.

    ``max_concurrency`` bounds the requests in flight (a closed-loop population of users
    when they all arrive at once); ``long`` requests of the stall and fairness workloads are
    not counted against it."""
    if endpoint not in ("completions", "chat"):
        raise ValueError(f"endpoint: must be completions or chat, got {endpoint!r}")
    url = base_url.rstrip("/") + ("/chat/completions" if endpoint == "chat" else "/completions")
    records = [RequestRecord(i, r.kind, r.prompt_len, r.arrival) for i, r in enumerate(requests)]
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    timeout = httpx.Timeout(max_duration, connect=30.0)
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(requests), desc="requests", unit="req", dynamic_ncols=True)
    t0 = time.perf_counter()

    async def one(i: int, req: BenchRequest, client: httpx.AsyncClient) -> None:
        delay = req.arrival - (time.perf_counter() - t0)
        if delay > 0:
            await asyncio.sleep(delay)
        body = _request_body(req, endpoint, model, ignore_eos)
        if sem is None or req.kind == "long":  # long documents arrive on their own clock
            await _send(client, url, body, records[i], t0, endpoint == "chat")
        else:
            async with sem:
                await _send(client, url, body, records[i], t0, endpoint == "chat")
        if bar is not None:
            bar.update(1)

    async with httpx.AsyncClient(limits=limits, timeout=timeout, headers=headers) as client:
        tasks = [asyncio.create_task(one(i, r, client)) for i, r in enumerate(requests)]
        _done, pending = await asyncio.wait(tasks, timeout=max_duration)
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        for _i, rec in enumerate(records):
            if not rec.success and rec.error is None:
                rec.error = "cancelled: max_duration reached"
    duration = time.perf_counter() - t0
    if bar is not None:
        bar.close()
    return records, duration


def _stats(values_s: list[float], name: str) -> dict[str, float]:
    ms = [v * 1e3 for v in values_s]
    out = {
        f"mean_{name}_ms": statistics.fmean(ms) if ms else 0.0,
        f"median_{name}_ms": percentile(ms, 50),
        f"std_{name}_ms": statistics.pstdev(ms) if len(ms) > 1 else 0.0,
    }
    for p in PERCENTILES:
        if p != 50:
            out[f"p{p:g}_{name}_ms"] = percentile(ms, p)
    return out


def percentile(values: Sequence[float], p: float) -> float:
    """Linear-interpolated percentile (numpy's default); 0 for no values."""
    if not values:
        return 0.0
    s = sorted(values)
    k = (len(s) - 1) * p / 100
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def summarize(
    records: Sequence[RequestRecord], duration: float, goodput: GoodputSLO | None = None
) -> dict[str, Any]:
    ok = [r for r in records if r.success]
    itls = [g for r in ok for g in r.itls]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_len for r in ok)
    result: dict[str, Any] = {
        "duration": duration,
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "request_throughput": len(ok) / duration,
        "output_throughput": out_tokens / duration,
        "total_token_throughput": (in_tokens + out_tokens) / duration,
        "max_itl_ms": 1e3 * max(itls, default=0.0),
        "stalled_token_fraction": stalled_fraction(itls),
    }
    if goodput is not None:
        good = sum(1 for r in ok if goodput.met(r))
        result["request_goodput"] = good / duration
        result["goodput_fraction"] = good / max(1, len(records))
    result.update(_stats([r.ttft for r in ok if r.ttft is not None], "ttft"))
    result.update(_stats([r.tpot for r in ok if r.tpot is not None], "tpot"))
    result.update(_stats(itls, "itl"))
    result.update(_stats([r.e2el for r in ok if r.e2el is not None], "e2el"))
    return result


def stalled_fraction(gaps: Sequence[float], factor: float = STALL_FACTOR) -> float:
    """Share of inter-token gaps longer than ``factor`` times their median (0 for none)."""
    if not gaps:
        return 0.0
    limit = factor * percentile(gaps, 50)
    return sum(1 for g in gaps if g > limit) / len(gaps)


def summarize_by_kind(
    records: Sequence[RequestRecord], duration: float, goodput: GoodputSLO | None = None
) -> dict[str, dict[str, Any]]:
    kinds = sorted({r.kind for r in records})
    if len(kinds) < 2:
        return {}
    return {k: summarize([r for r in records if r.kind == k], duration, goodput) for k in kinds}


def records_to_json(records: Sequence[RequestRecord]) -> dict[str, list]:
    """Per-request lists, as ``vllm bench serve`` saves them (plus kinds and token times)."""
    return {
        "input_lens": [r.prompt_len for r in records],
        "output_lens": [r.output_tokens for r in records],
        "ttfts": [r.ttft for r in records],
        "itls": [r.itls for r in records],
        "start_times": [r.start for r in records],
        "chunk_times": [r.chunk_times for r in records],
        "arrivals": [r.arrival for r in records],
        "kinds": [r.kind for r in records],
        "errors": [r.error or "" for r in records],
    }


def result_document(
    records: Sequence[RequestRecord], duration: float, goodput: GoodputSLO | None = None
) -> dict[str, Any]:
    """What a benchmark run saves: the summary, the same per request kind, and the
    per-request lists."""
    return {
        **summarize(records, duration, goodput),
        "by_kind": summarize_by_kind(records, duration, goodput),
        **records_to_json(records),
    }


def format_summary(result: dict[str, Any], title: str = "Serving benchmark") -> str:
    lines = [f"{'=' * 20} {title} {'=' * 20}"]
    keys = [
        "completed",
        "failed",
        "duration",
        "total_input_tokens",
        "total_output_tokens",
        "request_throughput",
        "request_goodput",
        "output_throughput",
        "total_token_throughput",
        "max_itl_ms",
        "stalled_token_fraction",
    ]
    for name in ("ttft", "tpot", "itl", "e2el"):
        keys += [f"mean_{name}_ms", f"median_{name}_ms", f"p90_{name}_ms", f"p99_{name}_ms"]
    keys.insert(keys.index("p99_itl_ms") + 1, "p99.9_itl_ms")
    for k in keys:
        if k in result:
            v = result[k]
            lines.append(f"{k:<28} {v:>12.2f}" if isinstance(v, float) else f"{k:<28} {v:>12}")
    return "\n".join(lines)


def run(
    base_url: str, requests: Sequence[BenchRequest], **kwargs: Any
) -> tuple[list[RequestRecord], float]:
    return asyncio.run(run_load(base_url, requests, **kwargs))
