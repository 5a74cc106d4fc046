"""A workload replayed inside one process, no HTTP: requests are added to an in-process
``Engine`` at their arrival offsets (and, with ``max_concurrency``, only while fewer than
that many are in flight, as the load generator's closed loop), and each output with new text
is timed when ``step()`` returns it, as a streaming client times its SSE events. The records
are the load generator's (``loadgen.RequestRecord``), so ``summarize`` reads both alike:
what the engine does, apart from the serving path."""

from __future__ import annotations

import time
from collections.abc import Sequence

from chunkserve.bench.datasets import BenchRequest
from chunkserve.bench.loadgen import RequestRecord
from chunkserve.scheduling.sampling_params import SamplingParams


def replay(
    engine,
    requests: Sequence[BenchRequest],
    *,
    max_concurrency: int | None = None,
    max_duration: float = 3600.0,
    ignore_eos: bool = True,
) -> tuple[list[RequestRecord], float]:
    """Returns the records (in ``requests``' order) and the duration in seconds."""
    order = sorted(range(len(requests)), key=lambda i: requests[i].arrival)
    records = [RequestRecord(i, r.kind, r.prompt_len, r.arrival) for i, r in enumerate(requests)]
    by_id: dict[str, RequestRecord] = {}
    in_flight = 0
    nxt = 0
    t0 = time.perf_counter()
    while nxt < len(order) or engine.has_unfinished():
        now = time.perf_counter() - t0
        if now > max_duration:
            break
        while nxt < len(order):
            req = requests[order[nxt]]
            counted = req.kind != "long"  # as the load generator counts them
            if req.arrival > now or (
                counted and max_concurrency is not None and in_flight >= max_concurrency
            ):
                break
            rec = records[order[nxt]]
            params = SamplingParams(
                max_tokens=req.output_len, temperature=0.0, ignore_eos=ignore_eos
            )
            rid = engine.add_request(prompt_token_ids=req.prompt, sampling_params=params)
            rec.start = now
            by_id[rid] = rec
            in_flight += counted
            nxt += 1
        if not engine.has_unfinished():
            if nxt < len(order):
                wait = requests[order[nxt]].arrival - (time.perf_counter() - t0)
                time.sleep(min(0.001, max(0.0, wait)))
            continue
        outs = engine.step()
        t = time.perf_counter() - t0
        for out in outs:
            rec = by_id.get(out.request_id)
            if rec is None:
                continue
            if out.delta_text:
                if rec.ttft is None:
                    rec.ttft = t - rec.start
                rec.chunk_times.append(t)
                rec.text += out.delta_text
            if out.finished:
                rec.end = t
                rec.output_tokens = len(out.token_ids)
                rec.success = rec.ttft is not None and out.finish_reason != "error"
                rec.error = out.error
                in_flight -= rec.kind != "long"
    return records, time.perf_counter() - t0
