"""Tensor parallel on CPU (gloo, two ranks on loopback): the logits and greedy tokens of one
process, with chunked mixed batches, preemption and prefix hits; blocks freed; a rank that
dies or hangs ends the engine with an error; two "nodes" on one host."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx
import numpy as np
import pytest
import torch

from chunkserve.config import ModelConfig
from chunkserve.distributed.shard import plan_shards
from chunkserve.engine.engine import Engine
from chunkserve.scheduling.sampling_params import SamplingParams
from chunkserve.worker.worker import DeviceError
from tests.conftest import NATURAL_PROMPTS, assert_no_blocks_in_use, pin_step_times, random_prompt
from tests.test_invariance import BYTES_PER_BLOCK, run_staggered, workload
from tests.test_server import MODEL, Server, alive, free_port, wait_for

BASE = dict(dtype="float32", max_model_len=1024, kv_cache_memory=64 << 20)
# BASE as ``chunkserve serve`` flags.
SERVE_FLAGS = ["--dtype", "float32", "--max-model-len", "1024", "--kv-cache-memory", "64MiB"]
BUDGET = 64  # static: both engines run the same steps, so their logits compare step by step


def model_config(heads: int, kv_heads: int, inter: int = 1536, vocab: int = 49152):
    return ModelConfig(
        architecture="llama",
        vocab_size=vocab,
        hidden_size=576,
        intermediate_size=inter,
        num_layers=2,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=64,
        rope_theta=1e4,
        rms_norm_eps=1e-5,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
    )


def test_shard_plans_cover_the_model_once() -> None:
    # SmolLM2-135M: 9 query heads in 3 KV groups, split 1 + 2 over two ranks.
    cfg = model_config(9, 3, vocab=49153)
    a, b = (plan_shards(cfg, 2, r) for r in range(2))
    assert (a.kv_heads, b.kv_heads) == ((0, 1), (1, 3))
    assert (a.q_heads, b.q_heads) == ((0, 3), (3, 9))
    assert a.max_kv_heads == b.max_kv_heads == 2
    assert (a.intermediate, b.intermediate) == ((0, 768), (768, 1536))
    assert a.vocab_shard == b.vocab_shard == 24577  # padded: ceil(49153 / 2)
    assert (a.vocab, b.vocab) == ((0, 24577), (24577, 49153))
    # More ranks than KV heads: each KV head replicated, its query heads split.
    plans = [plan_shards(model_config(8, 2), 4, r) for r in range(4)]
    assert [p.kv_heads for p in plans] == [(0, 1), (0, 1), (1, 2), (1, 2)]
    assert [p.q_heads for p in plans] == [(0, 2), (2, 4), (4, 6), (6, 8)]
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        plan_shards(cfg, 4, 0)  # 3 KV heads cannot be shared by 4 ranks


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(tensor_parallel_size=4), "tensor_parallel_size"),  # the model's 3 KV heads
        (dict(tensor_parallel_size=0), "tensor_parallel_size"),
        (dict(tensor_parallel_size=2, nnodes=3), "nnodes"),
        (dict(tensor_parallel_size=2, nnodes=2, node_rank=2), "node_rank"),
    ],
)
def test_bad_tensor_parallel_configs_fail_before_loading(kwargs, field, no_weight_loading) -> None:
    with pytest.raises(ValueError, match=field):
        Engine(**BASE, **kwargs)


def record_logits(engine: Engine) -> list[torch.Tensor]:
    """Every step's logits as rank 0 gets them (after the gather)."""
    model = engine.core.worker.runner.model
    seen: list[torch.Tensor] = []
    original = model.compute_logits

    def recording(hidden):
        out = original(hidden)
        seen.append(out.clone())
        return out

    model.compute_logits = recording
    return seen


def run_all(engine: Engine, prompts, params) -> list[list[int]]:
    ids = [engine.add_request(p, params) for p in prompts]
    done: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.token_ids
    return [done[i] for i in ids]


@pytest.fixture(scope="module")
def engines():
    tp1 = Engine(**BASE, max_num_batched_tokens=BUDGET)
    tp2 = Engine(**BASE, max_num_batched_tokens=BUDGET, tensor_parallel_size=2)
    yield tp1, tp2
    pids = tp2.core_infos[0].tp_pids
    tp2.shutdown()
    assert pids
    wait_for(lambda: not any(alive(p) for p in pids), "the rank process ended with it", 30)


def test_logits_match_one_process(engines) -> None:
    tp1, tp2 = engines
    assert tp2.core.worker.shard.size == 2 and len(tp2.core_infos[0].tp_pids) == 1
    assert tp2.core.worker.group.shm is not None  # one host: sums through shared memory
    prompts = NATURAL_PROMPTS + [random_prompt(__import__("random").Random(5), 300)]
    params = SamplingParams(max_tokens=6, temperature=0.0)
    ref_logits, tp_logits = record_logits(tp1), record_logits(tp2)
    steps = []
    tp2.step_listeners.append(steps.append)
    expected = run_all(tp1, prompts, params)
    assert run_all(tp2, prompts, params) == expected
    assert any(s.kind == "mixed" for s in steps)  # prefill chunks beside decodes
    assert all(s.comm_time > 0 for s in steps)
    assert len(ref_logits) == len(tp_logits) > 0
    for a, b in zip(tp_logits, ref_logits, strict=True):
        assert a.shape == b.shape and a.shape[1] == 49152
        rel = ((a - b).abs().max() / b.abs().max()).item()
        assert rel < 1e-4, rel
    assert_no_blocks_in_use(tp2)


def test_greedy_tokens_chunked_staggered_and_prefix_hits(engines) -> None:
    tp1, tp2 = engines
    # 3 to 530 tokens: the long ones chunked at 64 a step, beside decodes.
    prompts = [workload()[i] for i in (0, 1, 3, 4, 5)]
    assert run_staggered(tp2, prompts) == run_staggered(tp1, prompts)
    assert_no_blocks_in_use(tp2)
    # A shared prefix: the second request's first blocks come from the prefix cache.
    rng = __import__("random").Random(7)
    prefix = random_prompt(rng, 200)
    pair = [prefix + random_prompt(rng, 20), prefix + random_prompt(rng, 30)]
    params = SamplingParams(max_tokens=8, temperature=0.0)
    ids = [tp2.add_request(p, params) for p in pair[:1]]
    got = run_all(tp2, pair[:1], params)
    hits_before = tp2.core.kv.num_hit_tokens
    got += run_all(tp2, pair[1:], params)
    assert tp2.core.kv.num_hit_tokens - hits_before >= 192
    assert got == run_all(tp1, pair[:1], params) + run_all(tp1, pair[1:], params)
    del ids
    assert_no_blocks_in_use(tp2)


def test_prompt_logprobs_match_one_process(engines) -> None:
    """Prompt logprobs (scored from every prefill chunk's rows, here 64 a step) from the
    gathered logits: each prompt token's logprob, rank and top 3 as one process gives them;
    a second request beside it (a decode) changes nothing."""
    tp1, tp2 = engines
    prompt = tp1.tokenizer.encode(" ".join(NATURAL_PROMPTS) * 3)[:150]
    params = SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=3)
    plain = SamplingParams(max_tokens=4, temperature=0.0)
    scored = []
    for engine in (tp1, tp2):
        rid = engine.add_request(prompt, params)
        engine.add_request(NATURAL_PROMPTS[0], plain)
        first = None
        while engine.has_unfinished():
            for out in engine.step():
                if out.request_id == rid and out.prompt_logprobs is not None:
                    first = first or out.prompt_logprobs
        assert first is not None and len(first) == len(prompt) and first[0] is None
        scored.append(first)
        assert_no_blocks_in_use(engine)
    other_rank = 0
    for i, (a, b) in enumerate(zip(*scored, strict=True)):
        if i == 0:
            continue
        assert a.token_id == b.token_id == prompt[i]
        assert abs(a.logprob - b.logprob) < 1e-4, i
        assert [lp for _, lp in a.top] == pytest.approx([lp for _, lp in b.top], abs=1e-4)
        # A near-tie (within the sums' rounding) may swap two tokens' order: a rank off by
        # one, rarely (seen: 1 token in 150, at rank ~1,200).
        assert abs(a.rank - b.rank) <= 1, (i, a.rank, b.rank)
        other_rank += a.rank != b.rank
    assert other_rank <= len(prompt) // 20


def test_gloo_sums_match_shared_memory(engines) -> None:
    """The shared-memory sums' off switch: every collective on gloo, the same tokens."""
    tp1, _ = engines
    engine = Engine(
        **BASE, max_num_batched_tokens=BUDGET, tensor_parallel_size=2, tensor_parallel_shm=False
    )
    try:
        assert engine.core.worker.group.shm is None
        params = SamplingParams(max_tokens=8, temperature=0.0)
        prompts = NATURAL_PROMPTS[:3] + [random_prompt(__import__("random").Random(3), 150)]
        assert run_all(engine, prompts, params) == run_all(tp1, prompts, params)
    finally:
        engine.shutdown()


def test_step_arrays_cross_as_one_array(engines) -> None:
    """What rank 0 broadcasts decodes to the layout it runs itself."""
    from chunkserve.worker.model_runner import StepArrays

    tp1, _ = engines
    runner = tp1.core.worker.runner
    sent: list[tuple[np.ndarray, dict]] = []
    original = runner.layout_of

    def keep(step):  # as it is now: a request's block list grows after the step
        sent.append(
            (
                step.encode(),
                dict(
                    sections=[a.tolist() for a in step.sections],
                    tables=[[list(t) for t in group] for group in step.tables],
                    query_start=list(step.query_start),
                    seq_lens=list(step.seq_lens),
                    context_start=list(step.context_start),
                    counts=(step.num_prefill_seqs, step.num_prefill_tokens, step.num_decode_tokens),
                ),
            )
        )
        return original(step)

    runner.layout_of = keep
    try:
        rng = __import__("random").Random(2)
        run_all(tp1, [random_prompt(rng, n) for n in (5, 90, 170)], SamplingParams(max_tokens=3))
    finally:
        runner.layout_of = original
    assert len(sent) > 3
    for data, want in sent:
        back = StepArrays.decode(data)
        assert [a.tolist() for a in back.sections] == want["sections"]
        assert back.tables == want["tables"]
        assert (back.query_start, back.seq_lens) == (want["query_start"], want["seq_lens"])
        assert back.context_start == want["context_start"]
        got = (back.num_prefill_seqs, back.num_prefill_tokens, back.num_decode_tokens)
        assert got == want["counts"]


def test_speculative_decoding_matches_one_process(engines) -> None:
    """n-gram drafts verified in tensor-parallel steps: the tokens of one process."""
    tp1, _ = engines
    spec = {"method": "ngram", "num_speculative_tokens": 3}
    engine = Engine(**BASE, tensor_parallel_size=2, speculative_config=spec)
    pin_step_times(engine)  # which drafts pay: from step times, the same on any machine
    try:
        steps = []
        engine.step_listeners.append(steps.append)
        text = "one two three four five six seven eight nine ten " * 6
        params = SamplingParams(max_tokens=24, temperature=0.0)
        prompts = [text, NATURAL_PROMPTS[2]]
        assert run_all(engine, prompts, params) == run_all(tp1, prompts, params)
        assert sum(s.num_draft_tokens for s in steps) > 0
        assert_no_blocks_in_use(engine)
    finally:
        engine.shutdown()


def test_aborts_free_every_block(engines) -> None:
    _, tp2 = engines
    params = SamplingParams(max_tokens=200, ignore_eos=True)
    rng = __import__("random").Random(11)
    ids = [tp2.add_request(random_prompt(rng, n), params) for n in (30, 150, 400)]
    for _ in range(6):
        tp2.step()
    assert tp2.core.kv.num_free_blocks < tp2.core.kv.num_blocks
    for i in ids:
        tp2.abort_request(i)
    tp2.step()
    assert_no_blocks_in_use(tp2)


# A small pool that runs dry: 5 requests admitted as soon as their prompts fit
# (conservativeness 0), each growing by 24 outputs, in 8 blocks of 16 (128 slots).
TP_PREEMPT_LENGTHS = (40, 60, 30, 50, 20)
TP_PREEMPT_TOKENS = 24
TP_PREEMPT_BLOCKS = 8


def test_preemption_matches_unpreempted(engines) -> None:
    tp1, _ = engines
    rng = __import__("random").Random(99)
    prompts = [random_prompt(rng, n) for n in TP_PREEMPT_LENGTHS]
    # A rank's block holds 2 of the 3 KV heads.
    engine = Engine(
        dtype="float32",
        block_size=16,
        schedule_conservativeness=0.0,
        max_num_batched_tokens=128,
        kv_cache_memory=(TP_PREEMPT_BLOCKS + 1) * BYTES_PER_BLOCK * 2 // 3,
        max_model_len=TP_PREEMPT_BLOCKS * 16,
        tensor_parallel_size=2,
    )
    try:
        assert engine.core.worker.num_blocks == TP_PREEMPT_BLOCKS
        got = run_staggered(engine, prompts, TP_PREEMPT_TOKENS)
        assert engine.core.scheduler.num_preemptions > 0
        assert_no_blocks_in_use(engine)
    finally:
        engine.shutdown()
    # The reference: one process, a pool with room to spare (never preempted).
    preemptions = tp1.core.scheduler.num_preemptions
    assert got == run_staggered(tp1, prompts, TP_PREEMPT_TOKENS)
    assert tp1.core.scheduler.num_preemptions == preemptions == 0


def test_a_killed_rank_ends_the_engine_with_an_error() -> None:
    engine = Engine(**BASE, tensor_parallel_size=2)
    try:
        engine.add_request("Once upon a time", SamplingParams(max_tokens=400, ignore_eos=True))
        for _ in range(3):
            engine.step()
        (pid,) = engine.core_infos[0].tp_pids
        os.kill(pid, signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(DeviceError, match="rank 1|tensor-parallel"):
            while time.monotonic() - t0 < 120:
                engine.step()
        assert time.monotonic() - t0 < 60  # seconds, with room for a loaded machine
    finally:
        engine.shutdown()
    assert not alive(pid)


# A user's script: tensor parallel, and no shutdown; it simply ends.
SCRIPT_THAT_ENDS = """
from chunkserve import LLM, SamplingParams
llm = LLM(tensor_parallel_size=2, dtype="float32", max_model_len=256, kv_cache_memory=32 << 20)
out = llm.generate(["Hello"], SamplingParams(max_tokens=2, temperature=0), use_tqdm=False)
print("ranks", *llm.engine.core_infos[0].tp_pids, flush=True)
"""


def test_a_script_that_simply_ends_stops_its_ranks_quietly() -> None:
    """The leader's interpreter exits without ``shutdown``: its ranks stop on the way out (no
    rank prints a broken-broadcast traceback) and none outlives it."""
    proc = subprocess.Popen(
        [sys.executable, "-c", SCRIPT_THAT_ENDS],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        stdout, stderr = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the script's session: leader and its ranks
        proc.communicate()
        raise
    assert proc.returncode == 0, stderr
    assert "Traceback" not in stderr and "ERROR" not in stderr, stderr
    pids = [int(p) for p in stdout.split("ranks", 1)[1].split()]
    assert len(pids) == 1
    assert not any(alive(pid) for pid in pids)  # waited for by the leader before it exited


def test_served_with_a_hung_rank_goes_503_and_leaves_no_process() -> None:
    s = Server("--tensor-parallel-size", "2", "--watchdog-timeout", "3")
    try:
        client = s.client()
        r = client.completions.create(
            model=MODEL, prompt=NATURAL_PROMPTS[0], temperature=0.0, max_tokens=4
        )
        c = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Say hi."}],
            temperature=0.0,
            max_tokens=4,
        )
        assert r.choices[0].text and c.choices[0].message.content
        assert s.metrics()["chunkserve:tensor_parallel_comm_seconds_count"] > 0
        ranks = rank_pids(s.proc.pid)
        assert len(ranks) == 1, ranks
        os.kill(ranks[0], signal.SIGSTOP)  # hung: the next step's all-reduce waits on it
        long = {"model": MODEL, "prompt": "Hi", "max_tokens": 50, "ignore_eos": True}
        t0 = time.time()
        resp = httpx.post(s.base + "/v1/completions", json=long, timeout=60)
        assert resp.status_code >= 500 and "error" in resp.json(), resp.text
        # The watchdog (3 s) finds the hung rank; generous for a loaded machine.
        wait_for(
            lambda: httpx.get(s.base + "/health", timeout=10).status_code != 200,
            "/health turns 503",
            timeout=60,
        )
        assert time.time() - t0 < 90
    finally:
        s.stop()
    s.proc.wait(20)
    # The stopped rank was killed too.
    wait_for(lambda: not any(alive(p) for p in ranks), "the ranks are gone", timeout=30)


def rank_pids(server_pid: int) -> list[int]:
    """PIDs of tensor-parallel rank processes whose ancestor is ``server_pid``."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                if b"chunkserve.worker.tp_rank" not in f.read():
                    continue
        except OSError:
            continue
        pid = int(entry)
        p = pid
        while p > 1:
            try:
                with open(f"/proc/{p}/stat") as f:
                    p = int(f.read().rsplit(")", 1)[1].split()[1])
            except OSError:
                break
            if p == server_pid:
                out.append(pid)
                break
    return out


def test_two_nodes_on_loopback(engines, monkeypatch) -> None:
    """``--nnodes 2``: node 1 runs rank 1 headless, node 0 serves; MASTER_ADDR/PORT join
    them (here both on this host)."""
    tp1, _ = engines
    port = free_port()
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    node1 = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "chunkserve",
            "serve",
            "--tensor-parallel-size",
            "2",
            "--nnodes",
            "2",
            "--node-rank",
            "1",
            *SERVE_FLAGS,
            "--max-num-batched-tokens",
            str(BUDGET),
        ],
        env=env,
    )
    try:
        monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
        monkeypatch.setenv("MASTER_PORT", str(port))
        node0 = Engine(
            **BASE, max_num_batched_tokens=BUDGET, tensor_parallel_size=2, nnodes=2, node_rank=0
        )
        assert node0.core_infos[0].tp_pids == []  # its rank 1 is node 1's
        params = SamplingParams(max_tokens=6, temperature=0.0)
        assert run_all(node0, NATURAL_PROMPTS, params) == run_all(tp1, NATURAL_PROMPTS, params)
        node0.shutdown()
        assert node1.wait(30) == 0  # told to stop: the headless node exits cleanly
    finally:
        if node1.poll() is None:
            node1.kill()
            node1.wait(10)


def test_torchrun_starts_one_process_per_rank(engines) -> None:
    """A launcher's environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT): torchrun runs
    ``chunkserve serve`` twice; rank 0 serves, rank 1 computes; the answer is one process's."""
    tp1, _ = engines
    port, master = free_port(), free_port()
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    cmd = [
        torchrun,
        "--nnodes",
        "1",
        "--nproc-per-node",
        "2",
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(master),
        "-m",
        "chunkserve",
        "serve",
        "--tp",
        "2",
        "--port",
        str(port),
        *SERVE_FLAGS,
        "--log-level",
        "warning",
    ]
    proc = subprocess.Popen(cmd, start_new_session=True, stdout=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 120
        while True:
            assert proc.poll() is None, "torchrun exited"
            assert time.time() < deadline, "not healthy in time"
            try:
                if httpx.get(base + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        body = {"model": MODEL, "prompt": NATURAL_PROMPTS[0], "max_tokens": 6}
        r = httpx.post(base + "/v1/completions", json={**body, "temperature": 0}, timeout=60)
        assert r.status_code == 200, r.text
        rid = tp1.add_request(NATURAL_PROMPTS[0], SamplingParams(max_tokens=6, temperature=0))
        text = None
        while text is None:
            for out in tp1.step():
                if out.request_id == rid and out.finished:
                    text = out.text
        assert r.json()["choices"][0]["text"] == text
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(40)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)

    def left() -> list[int]:
        pids = []
        for entry in os.listdir("/proc"):
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    if str(port).encode() in f.read() and alive(int(entry)):
                        pids.append(int(entry))
            except (OSError, ValueError):
                continue
        return pids

    wait_for(lambda: not left(), "every process of the launch is gone", timeout=30)
