"""Property tests of the scheduler and the KV cache together (hypothesis): random arrivals
with priorities and shared prefixes, steps, aborts and stop-string finishes (the engine
finishing a request between steps), under both policies, both prefill orders, the
long-prefill limits, prefix caching, and a pool small enough to force preemption.

After every operation: the pool's own invariants, reference counts equal to the block
tables that hold them, a running request's table covers what it computed, no request in two
queues, every step within its token budget and sequence cap. At the end everything
finishes within a bounded number of steps (no starvation, no deadlock) and no block is held.
"""

from __future__ import annotations

import random

from hypothesis import HealthCheck, given, settings, target
from hypothesis import strategies as st

from chunkserve.config import SchedulerConfig
from chunkserve.scheduling.kv_cache import KVCacheManager
from chunkserve.scheduling.request import Request, RequestStatus
from chunkserve.scheduling.sampling_params import SamplingParams
from chunkserve.scheduling.scheduler import Scheduler

BLOCK = 4
MAX_MODEL_LEN = 64
EOS = 2
PREFIXES = [[], [11] * 8, [12] * 13, [13] * 4 + [14] * 9]

add = st.tuples(
    st.just("add"),
    st.integers(0, len(PREFIXES) - 1),  # shared prefix
    st.integers(1, 40),  # own tokens
    st.integers(1, 12),  # max_tokens
    st.integers(-2, 2),  # priority
)
# Steps, and which of each step's sampled rows draw EOS (the rest draw an ordinary token).
step = st.tuples(st.just("step"), st.integers(1, 4), st.lists(st.booleans(), max_size=6))
abort = st.tuples(st.just("abort"), st.integers(0, 50))
stop = st.tuples(st.just("stop"), st.integers(0, 50))  # a stop string matched: finish it
ops = st.lists(st.one_of(add, step, step, abort, stop), min_size=1, max_size=60)

configs = st.fixed_dictionaries(
    {
        "max_num_batched_tokens": st.sampled_from([8, 16, 32]),
        "max_num_seqs": st.integers(1, 6),
        "enable_chunked_prefill": st.booleans(),
        "policy": st.sampled_from(["fcfs", "priority"]),
        "prefill_order": st.sampled_from(["shortest", "arrival"]),
        "long_prefill_token_threshold": st.sampled_from([0, 8, 16]),
        "max_long_partial_prefills": st.sampled_from([0, 1, 2]),
        "init_new_token_ratio": st.sampled_from([0.0, 0.7]),
    }
)


def make(config: dict, num_blocks: int, caching: bool) -> Scheduler:
    config = dict(config)
    if not config["enable_chunked_prefill"]:  # as the engine does: a whole prompt fits a step
        config["max_num_batched_tokens"] = MAX_MODEL_LEN
    config["max_num_seqs"] = min(config["max_num_seqs"], config["max_num_batched_tokens"])
    sc = SchedulerConfig(
        max_model_len=MAX_MODEL_LEN, block_size=BLOCK, min_new_token_ratio=0.0, **config
    )
    clock = iter(range(10**9))
    return Scheduler(sc, KVCacheManager(num_blocks, BLOCK, caching), clock=lambda: next(clock))


def check(sched: Scheduler, added: list[Request]) -> None:
    kv = sched.kv
    kv.pool.check_invariants()
    holders = [0] * (kv.num_blocks + 1)
    for r in added:
        if r.is_finished:
            assert not r.block_ids, f"{r.request_id} finished holding blocks"
            continue
        for b in r.block_ids:
            holders[b] += 1
    assert holders[1:] == kv.pool.ref_cnt[1:]
    ids = [r.request_id for r in sched.running + sched.waiting]
    assert len(ids) == len(set(ids)), "a request in two queues"
    for r in sched.running:
        assert r.status == RequestStatus.RUNNING
        assert len(r.block_ids) * BLOCK >= r.num_computed_tokens
    for r in sched.waiting:
        assert r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)


def run_step(sched: Scheduler, eos: list[bool] = ()) -> None:
    """One step; the ``i``-th sampled row draws EOS where ``eos[i]`` says so."""
    out = sched.schedule()
    cfg = sched.config
    assert out.num_batched_tokens <= cfg.max_num_batched_tokens
    assert len(out.chunks) <= cfg.max_num_seqs
    for c in out.chunks:
        assert c.request.status == RequestStatus.RUNNING
        assert c.start == c.request.num_computed_tokens
        assert len(c.request.block_ids) * BLOCK >= c.start + c.num_tokens
    sampled = [c for c in out.chunks if c.samples]
    draws = {
        c.request.request_id: EOS if i < len(eos) and eos[i] else 5 for i, c in enumerate(sampled)
    }
    sched.update(out, draws)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    ops=ops,
    config=configs,
    num_blocks=st.integers(MAX_MODEL_LEN // BLOCK + 1, 40),
    caching=st.booleans(),
)
def test_scheduler_and_cache_invariants_hold_under_any_interleaving(
    ops, config: dict, num_blocks: int, caching: bool
) -> None:
    sched, added = run_ops(ops, config, num_blocks, caching)
    # Steer the search toward the hard cases: preemption, and requests that end on EOS.
    target(float(sched.num_preemptions), label="preemptions")
    target(float(sum(ended_on_eos(r) for r in added)), label="EOS finishes")


def ended_on_eos(r: Request) -> bool:
    """Finished by the scheduler on a sampled EOS (not by a "stop" operation)."""
    return (
        r.status == RequestStatus.FINISHED_STOPPED
        and r.output_token_ids[-1:] == [EOS]
        and not getattr(r, "stopped_by_test", False)
    )


def run_ops(ops, config: dict, num_blocks: int, caching: bool) -> tuple[Scheduler, list[Request]]:
    """Apply ``ops``, checking the invariants after each, then run to the end (bounded)."""
    sched = make(config, num_blocks, caching)
    added: list[Request] = []
    for op in ops:
        if op[0] == "add":
            _, prefix, own, max_tokens, priority = op
            prompt = PREFIXES[prefix] + [100 + len(added)] * own
            r = Request(
                f"r{len(added)}",
                prompt,
                SamplingParams(max_tokens=max_tokens),
                max_tokens=max_tokens,
                eos_token_ids=[EOS],
                priority=priority,
            )
            if len(prompt) + max_tokens > MAX_MODEL_LEN:
                continue  # the edge refuses it (tested elsewhere); the scheduler trusts it
            sched.add_request(r)
            added.append(r)
        elif op[0] == "step":
            for _ in range(op[1]):
                run_step(sched, op[2])
        elif op[0] == "abort" and added:
            r = added[op[1] % len(added)]
            was_live = not r.is_finished
            got = sched.abort_request(r.request_id)
            assert (got is not None) == was_live
        elif op[0] == "stop" and added:
            r = added[op[1] % len(added)]
            if r.status == RequestStatus.RUNNING and r.num_output_tokens:
                sched.finish_request(r, RequestStatus.FINISHED_STOPPED)
                r.stopped_by_test = True
        check(sched, added)
    # Liveness: with no more arrivals everything finishes, in a bounded number of steps.
    bound = 20 + sum(r.num_prompt_tokens + r.max_tokens for r in added) * 4
    for _ in range(bound):
        if not sched.has_unfinished():
            break
        run_step(sched)
        check(sched, added)
    assert not sched.has_unfinished(), [
        (r.request_id, r.status, r.num_computed_tokens) for r in sched.running + sched.waiting
    ]
    assert all(r.is_finished for r in added)
    assert all(
        r.num_output_tokens == r.max_tokens
        for r in added
        if r.status == RequestStatus.FINISHED_LENGTH
    )
    assert sum(c > 0 for c in sched.kv.pool.ref_cnt[1:]) == 0, "blocks held after the end"
    return sched, added


def test_the_operations_reach_preemption_and_eos() -> None:
    """What the property test promises it explores, it reaches: on 40 seeded draws of its
    kind of operations, pools run dry (requests are preempted and recomputed) and sampled
    EOS tokens finish requests, and the invariants hold through both."""
    rng = random.Random(7)
    preemptions = eos_finishes = 0
    for _ in range(40):
        ops = []
        for _ in range(rng.randint(10, 60)):
            kind = rng.choice(["add", "step", "step", "abort", "stop"])
            if kind == "add":
                ops.append(
                    ("add", rng.randrange(len(PREFIXES)), rng.randint(1, 40), rng.randint(1, 12),
                     rng.randint(-2, 2))
                )  # fmt: skip
            elif kind == "step":
                eos = [rng.random() < 0.2 for _ in range(rng.randint(0, 6))]
                ops.append(("step", rng.randint(1, 4), eos))
            else:
                ops.append((kind, rng.randint(0, 50)))
        config = {
            "max_num_batched_tokens": rng.choice([8, 16, 32]),
            "max_num_seqs": rng.randint(1, 6),
            "enable_chunked_prefill": rng.random() < 0.5,
            "policy": rng.choice(["fcfs", "priority"]),
            "prefill_order": rng.choice(["shortest", "arrival"]),
            "long_prefill_token_threshold": rng.choice([0, 8, 16]),
            "max_long_partial_prefills": rng.choice([0, 1, 2]),
            "init_new_token_ratio": rng.choice([0.0, 0.7]),
        }
        num_blocks = rng.randint(MAX_MODEL_LEN // BLOCK + 1, 24)  # the small end: preemption
        sched, added = run_ops(ops, config, num_blocks, rng.random() < 0.5)
        preemptions += sched.num_preemptions
        eos_finishes += sum(ended_on_eos(r) for r in added)
    assert preemptions > 0 and eos_finishes > 0, (preemptions, eos_finishes)
