"""``chunkserve simulate``: the real ``Scheduler`` (same code, not a copy) driven by a cost
model instead of a model, over the load generator's workloads and arrival processes.

A discrete-event loop: requests join at the first step boundary after their arrival (their
TTFT counts from the arrival, the wait for the running step included), each step's duration is the
cost model's prediction for the step the scheduler built, times a scale (how much slower
a real server runs than its profile predicts), plus a fixed per-step serving overhead, if
given; tokens are "sampled" at the end of the step. The steps go through the engine core's
own step loop (``engine.step_loop.StepLoop``: the online budget's token and draft budgets,
and what its controller observes) on the simulated clock: the predicted duration is the
step, the overhead the loop's gap after it (as a server's ``step_gap_seconds``). Per-request token
times feed the same metrics as ``bench serve``, so a user can ask what happens at request
rates or on hardware they don't have (a profile measured elsewhere, e.g. on a GPU).
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence

from chunkserve.bench.datasets import BenchRequest
from chunkserve.bench.loadgen import RequestRecord
from chunkserve.config import BudgetPolicy, SchedulerConfig
from chunkserve.engine.step_loop import StepLoop
from chunkserve.scheduling.budget import BudgetController
from chunkserve.scheduling.costmodel import CostModel, OnlineCostModel, StepShape
from chunkserve.scheduling.kv_cache import KVCacheManager
from chunkserve.scheduling.request import Request
from chunkserve.scheduling.sampling_params import SamplingParams
from chunkserve.scheduling.scheduler import Scheduler

SAMPLED_TOKEN = 5  # never EOS: outputs run to their requested length, as with ignore_eos


def simulate(
    requests: Sequence[BenchRequest],
    config: SchedulerConfig,
    num_blocks: int,
    model: CostModel,
    *,
    enable_prefix_caching: bool = True,
    policy: BudgetPolicy | None = None,
    max_concurrency: int | None = None,
    noise: float = 0.0,
    noise_correlation: float | None = None,
    step_overhead_s: float = 0.0,
    cost_scale: float | Mapping[str, float] = 1.0,
    seed: int = 0,
    max_steps: int = 10_000_000,
) -> tuple[list[RequestRecord], float, dict[str, float]]:
    """Returns the per-request records (as the load generator makes them), the simulated
    duration, and step statistics. ``step_overhead_s`` is added to every step: the serving
    loop's own work between steps (a server reports it as ``chunkserve:step_gap_seconds``);
    0 models the engine alone. ``cost_scale`` multiplies every predicted step time, one
    factor or one per step kind (``decode``, ``mixed``, ``prefill``; a kind left out is 1):
    a server's mean ``chunkserve:step_time_over_predicted`` (its steps over the profile's
    predictions: scheduling, host work and the machine's state that the profiled shapes
    did not see); 1 takes the profile as it is. ``policy``: an online budget policy (adaptive
    or an ITL target) run by the engine's controller; None: ``config``'s static budget.
    ``noise``: each step's time is multiplied by independent normal noise of this relative
    standard deviation; with ``noise_correlation`` (0 <= rho < 1), by log-normal noise
    whose log follows an AR(1) process of that step-to-step correlation and standard
    deviation ``noise``, mean 1 (a machine that runs slow for seconds at a time: this VM's
    identical decode steps correlate 0.82 from one step to the next)."""
    scales = check_cost_scale(cost_scale)
    if noise < 0:
        raise ValueError(f"noise: must be >= 0, got {noise!r}")
    if noise_correlation is not None and not 0.0 <= noise_correlation < 1.0:
        raise ValueError(f"noise_correlation: must be in [0, 1), got {noise_correlation!r}")
    if step_overhead_s < 0:
        raise ValueError(f"step_overhead_s: must be >= 0, got {step_overhead_s!r}")
    clock = [0.0]
    kv = KVCacheManager(num_blocks, config.block_size, enable_prefix_caching)
    sched = Scheduler(config, kv, clock=lambda: clock[0])
    controller = None
    if policy is not None and policy.is_online:
        # The controller starts from the profile, as a server's does. When the simulated
        # steps run as the profile predicts, the profile is the truth and is held; scaled,
        # it is off by the scale and the controller learns from the steps, as a server's does.
        prior_weight = 1e4 if set(scales.values()) == {1.0} else 1.0
        online = OnlineCostModel(model.weights, prior_weight=prior_weight, routing=model.routing)
        controller = BudgetController(online, policy, min_prefill_tokens=config.block_size)
    loop = StepLoop(sched, controller, lambda: clock[0])
    rng = random.Random(seed)
    log_noise = 0.0  # the AR(1) state of correlated noise
    records = [RequestRecord(i, r.kind, r.prompt_len, r.arrival) for i, r in enumerate(requests)]
    order = sorted(range(len(requests)), key=lambda i: requests[i].arrival)
    index_of: dict[str, int] = {}
    next_i = 0
    in_flight = 0  # closed-loop population: short requests counted against max_concurrency
    held: list[int] = []  # arrived, waiting for a free slot of the population
    steps = 0
    busy = 0.0

    waited: set[int] = set()  # held past a step end for want of a free slot

    def admit(i: int) -> None:
        nonlocal in_flight
        req = requests[i]
        rid = f"sim-{i}"
        # The client sends a request at its arrival time (or, when it waited for a slot of
        # the population, when a request ended: at a step end, now); the engine takes it
        # at the next step boundary, now. The wait in between counts toward its TTFT, as
        # it does in a real run.
        sent = clock[0] if i in waited else req.arrival
        params = SamplingParams(max_tokens=req.output_len, ignore_eos=True, temperature=0.0)
        r = Request(rid, req.prompt, params, max_tokens=req.output_len, arrival_time=sent)
        sched.add_request(r)
        index_of[rid] = i
        records[i].start = sent
        if req.kind != "long":
            in_flight += 1

    def release_arrivals() -> None:
        nonlocal next_i
        while next_i < len(order) and requests[order[next_i]].arrival <= clock[0]:
            held.append(order[next_i])
            next_i += 1
        while held and (
            max_concurrency is None
            or in_flight < max_concurrency
            or requests[held[0]].kind == "long"
        ):
            admit(held.pop(0))
        waited.update(held)

    while True:
        release_arrivals()
        if not sched.has_unfinished():
            if next_i >= len(order) and not held:
                break
            if next_i < len(order):
                clock[0] = max(clock[0], requests[order[next_i]].arrival)
            continue
        loop.start()
        out, _ = loop.schedule()
        if out.is_empty:
            raise RuntimeError("simulate: the scheduler made no progress")
        shape = StepShape.of(out)
        duration = scales[out.kind] * model.predict(shape)
        if noise and noise_correlation is not None:
            rho = noise_correlation
            log_noise = rho * log_noise + math.sqrt(1.0 - rho * rho) * rng.gauss(0.0, noise)
            duration *= math.exp(log_noise - noise * noise / 2)
        elif noise:
            duration *= max(0.1, rng.gauss(1.0, noise))
        clock[0] += duration  # the simulated worker: the step runs
        steps += 1
        if steps > max_steps:
            raise RuntimeError("simulate: step limit reached")
        produced = sched.update(
            out, {c.request.request_id: SAMPLED_TOKEN for c in out.chunks if c.samples}
        )
        loop.finish(out, shape)
        clock[0] += step_overhead_s  # the serving loop's work: the gap before the next step
        busy += duration + step_overhead_s
        for r in produced:
            rec = records[index_of[r.request_id]]
            if rec.ttft is None:
                rec.ttft = clock[0] - rec.start
            rec.chunk_times.append(clock[0])
            if r.is_finished:
                rec.end = clock[0]
                rec.output_tokens = r.num_output_tokens
                rec.success = True
                if requests[rec.index].kind != "long":
                    in_flight -= 1
    return records, clock[0], {"steps": steps, "busy_s": busy, "preemptions": sched.num_preemptions}


STEP_KINDS = ("decode", "mixed", "prefill")


def check_cost_scale(cost_scale: float | Mapping[str, float]) -> dict[str, float]:
    """The scale of each step kind; ``ValueError`` naming ``cost_scale`` if one is bad."""
    if isinstance(cost_scale, Mapping):
        unknown = sorted(set(cost_scale) - set(STEP_KINDS))
        if unknown:
            raise ValueError(
                f"cost_scale: unknown step kind(s) {', '.join(unknown)}; "
                f"expected {', '.join(STEP_KINDS)}"
            )
        scales = {k: cost_scale.get(k, 1.0) for k in STEP_KINDS}
    else:
        scales = dict.fromkeys(STEP_KINDS, cost_scale)
    for kind, value in scales.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise ValueError(f"cost_scale: {kind} steps' scale must be > 0, got {value!r}")
        scales[kind] = float(value)
    return scales


def parse_cost_scale(text: str) -> float | dict[str, float]:
    """``1.15`` (every step) or ``decode=1.17,mixed=1.08`` (per kind, others 1)."""
    try:
        if "=" not in text:
            return float(text)
        scales = {}
        for item in text.split(","):
            kind, _, value = item.partition("=")
            scales[kind.strip()] = float(value)
        return scales
    except ValueError:
        raise ValueError(
            f"cost_scale: expected a number or KIND=NUMBER,... (kinds {', '.join(STEP_KINDS)}), "
            f"got {text!r}"
        ) from None
