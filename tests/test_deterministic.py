"""The deterministic mode (``deterministic=True``, issue 42): a request's token ids and
logprobs are bitwise the same alone or beside 1, 5 or 37 others, under every budget (16, 64,
512, adaptive, chunking off), after a prefix-cache hit, when preempted and recomputed, with
n-gram speculation and at another thread count, in bf16 and fp32; seeded sampling too. And
the mode is needed: without it, bf16 results change with the batch on this CPU.

Engines are shared per setting (``engines``, module-scoped); prompts and outputs are short.
"""

from __future__ import annotations

import itertools
import random
from pathlib import Path

import pytest
import torch

from chunkserve.attention import cpu_kernels
from chunkserve.engine.engine import Engine
from chunkserve.model.layers import DETERMINISTIC_TILING, linear, quantized_parts
from chunkserve.scheduling.sampling_params import SamplingParams
from tests.conftest import mixed_prompts, random_prompt, run_among

pytestmark = pytest.mark.skipif(
    cpu_kernels.load() is None, reason=f"the C attention kernel: {cpu_kernels.load_error()}"
)

MAX_TOKENS = 3
TARGET_TEXT = (
    "def fibonacci(n):\n    # return the n-th Fibonacci number, iteratively, with two running"
    " values a and b that start at zero and one and move one step along the sequence"
)
BUDGETS = {
    "16": {"max_num_batched_tokens": 16},
    "64": {"max_num_batched_tokens": 64},
    "512": {"max_num_batched_tokens": 512},
    "adaptive": {},
    "off": {"enable_chunked_prefill": False, "max_num_batched_tokens": 2048},
}
Result = tuple[list[int], list]


def make(dtype: str, deterministic: bool = True, **kwargs) -> Engine:
    base = dict(
        dtype=dtype,
        max_model_len=512,
        kv_cache_memory=48 << 20,
        num_threads=1,
        deterministic=deterministic,
    )
    return Engine(**(base | kwargs))


@pytest.fixture(scope="module")
def engines():
    """Engines by (dtype, budget name), built on first use; the last few kept (memory)."""
    made: dict[tuple[str, str], Engine] = {}

    def get(dtype: str, budget: str) -> Engine:
        key = (dtype, budget)
        if key not in made:
            while len(made) >= 3:
                made.pop(next(iter(made)))
            made[key] = make(dtype, **BUDGETS[budget])
        made[key] = made.pop(key)  # most recently used last
        return made[key]

    yield get
    made.clear()
    torch.set_num_threads(1)


@pytest.fixture(scope="module")
def target(engines) -> list[int]:
    return engines("float32", "off").tokenizer.encode(TARGET_TEXT)


@pytest.fixture(scope="module")
def alone(engines, target):
    """The target alone, chunking off, by dtype: the reference of every case."""
    memo: dict[str, Result] = {}

    def get(dtype: str) -> Result:
        if dtype not in memo:
            memo[dtype] = run_among(engines(dtype, "off"), [target])
        return memo[dtype]

    return get


DTYPES = ["bfloat16", "float32"]


# bf16 under every budget; fp32 (batch-invariant on this CPU without the mode but for
# the kernels' choices by size) under three.
CASES = [("bfloat16", b) for b in BUDGETS] + [("float32", b) for b in ("16", "512", "off")]


@pytest.mark.parametrize(("dtype", "budget"), CASES)
def test_beside_37_others_under_every_budget(engines, alone, target, dtype, budget) -> None:
    engine = engines(dtype, budget)
    steps = []
    engine.step_listeners.append(steps.append)
    try:  # 6 arrive every other step: the 38 are all in within 13 steps
        got = run_among(
            engine, [*mixed_prompts(20), target, *mixed_prompts(37)[20:]], at=20, per_arrival=6
        )
    finally:
        engine.step_listeners.remove(steps.append)
    assert got == alone(dtype)
    if budget in ("16", "64"):  # the target's prompt was chunked beside other work
        assert any(s.kind == "mixed" for s in steps)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [1, 5])
def test_beside_a_few_others(engines, alone, target, dtype, n) -> None:
    engine = engines(dtype, "16")
    assert run_among(engine, [*mixed_prompts(n), target], at=n) == alone(dtype)
    assert run_among(engine, [target, *mixed_prompts(n)], at=0) == alone(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_prefix_cache_hit(engines, alone, target, dtype) -> None:
    """A request sharing the target's first two blocks runs first: the target starts from
    cached blocks (a different chunk boundary and a cached prefix) and gets the same."""
    engine = engines(dtype, "64")
    assert len(target) > 32
    run_among(engine, [target[:32] + random_prompt(random.Random(3), 7)])
    cached: list[int] = []
    got = run_among(engine, [target, *mixed_prompts(3)], cached=cached)
    assert cached == [32]
    assert got == alone(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_preemption(engines, alone, target, dtype) -> None:
    """A pool too small for everyone: requests are preempted and recomputed (as one longer
    prompt: the prompt and the outputs so far), and the target's tokens stay the same."""
    size = 2 if dtype == "bfloat16" else 4
    block = 2 * 30 * 3 * 64 * size * 16  # K+V of 16 tokens over 30 layers
    # 8 blocks (128 slots) for 5 requests of 20 to 45 prompt tokens growing by 16 each
    # (the target, the last to arrive, is preempted once it has 8).
    engine = make(
        dtype,
        kv_cache_memory=9 * block,
        max_model_len=128,
        schedule_conservativeness=0.0,
        max_num_batched_tokens=64,
    )
    rng = random.Random(7)
    prompts = [random_prompt(rng, n) for n in (30, 45, 20, 38)]
    params = SamplingParams(max_tokens=16, min_tokens=16, temperature=0.0, logprobs=2)
    got = run_among(
        engine, [*prompts, target], at=4, params=params
    )  # the target among the preempted
    assert engine.core.scheduler.num_preemptions > 0
    assert got == run_among(engines(dtype, "off"), [target], params=params)
    assert got[0][:MAX_TOKENS] == alone(dtype)[0]


@pytest.mark.parametrize("dtype", DTYPES)
def test_ngram_speculation(engines, dtype) -> None:
    """A repetitive prompt whose n-gram drafts are accepted (and rejected): the verified
    tokens and their logprobs are plain decoding's."""
    spec = {"method": "ngram", "num_speculative_tokens": 3, "min_acceptance_rate": 0.0}
    engine = make(dtype, speculative_config=spec, max_num_batched_tokens=64)
    plain = engines(dtype, "64")
    prompt = plain.tokenizer.encode("one two three four five one two three four five one two")
    expected = run_among(plain, [prompt, *mixed_prompts(3)], max_tokens=16)
    got = run_among(engine, [prompt, *mixed_prompts(3)], max_tokens=16)
    assert engine.core.speculator.num_accepted_tokens > 0
    assert got == expected


@pytest.mark.parametrize("dtype", DTYPES)
def test_seeded_sampling(engines, target, dtype) -> None:
    params = SamplingParams(max_tokens=6, temperature=1.0, top_p=0.9, seed=1234, logprobs=1)
    alone_run = run_among(engines(dtype, "off"), [target], params=params)
    batched = run_among(engines(dtype, "16"), [*mixed_prompts(5), target], at=5, params=params)
    assert batched == alone_run


def test_structured_outputs(engines, target) -> None:
    """A regex-constrained request (its mask applied to its own row) alone and beside 5
    others: the same tokens and logprobs."""
    params = SamplingParams(
        max_tokens=6, temperature=0.0, logprobs=2, structured_outputs={"regex": "[a-z ]{3,30}"}
    )
    alone_run = run_among(engines("bfloat16", "off"), [target], params=params)
    batched = run_among(engines("bfloat16", "16"), [*mixed_prompts(5), target], at=5, params=params)
    assert batched == alone_run
    assert alone_run[0]


def test_another_thread_count(alone, target) -> None:
    """An instance at 2 threads (a data-parallel replica or a decode instance may run another
    ``--num-threads``) gives the 1-thread instance's bf16 results (the target beside 3
    others, all arriving at once, in chunks of 16)."""
    try:
        engine = make("bfloat16", num_threads=2, max_num_batched_tokens=16)
        assert torch.get_num_threads() == 2
        assert run_among(engine, [*mixed_prompts(3), target], at=3, per_arrival=4) == alone(
            "bfloat16"
        )
    finally:
        torch.set_num_threads(1)


def test_data_parallel_2(alone, target) -> None:
    """Two engine-core processes (``--data-parallel-size 2``) in the mode, the target sent
    alone and then among 9 others spread over both cores: the in-process engine's result."""
    from chunkserve.config import EngineConfig
    from chunkserve.engine.multiprocess_engine import MultiprocessEngine

    config = EngineConfig.from_kwargs(
        dtype="bfloat16", max_model_len=512, kv_cache_memory=48 << 20, num_threads=1,
        deterministic=True, max_num_batched_tokens=16,
    )  # fmt: skip
    engine = MultiprocessEngine(config, data_parallel_size=2)
    try:
        got = []
        for batch in ([target], [*mixed_prompts(4), target, *mixed_prompts(9)[4:]]):
            params = SamplingParams(
                max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS, temperature=0.0, logprobs=2
            )
            ids = [engine.add_request(p, params) for p in batch]
            cores = {engine.core_of(i) for i in ids}
            results = {}
            while engine.has_unfinished():
                for out in engine.step():
                    if out.finished:
                        lps = [(lp.token_id, lp.logprob, lp.top) for lp in out.logprobs or []]
                        results[out.request_id] = (out.token_ids, lps)
            got.append(results[ids[batch.index(target)]])
        assert cores == {0, 1}  # the second batch was spread over both cores
        assert got == [alone("bfloat16")] * 2
    finally:
        engine.shutdown()


def test_prefill_decode_pair_behind_the_router_equals_colocated() -> None:
    """A prefill and a decode instance behind the router, both in the mode, bf16 (prefill
    budget 64, decode budget 16): the same text and logprobs as the decode instance gives
    the same request colocated (no prefix caching: the colocated run recomputes it)."""
    import httpx

    from tests.test_disaggregation import Router
    from tests.test_server import MODEL, Server

    common = ("--deterministic", "--dtype", "bfloat16", "--num-threads", "1")
    prefill = Server("--disaggregation-mode", "prefill", *common)
    decode = Server(
        "--disaggregation-mode", "decode", "--max-num-batched-tokens", "16", *common
    )  # fmt: skip
    router = None
    try:
        router = Router("--prefill", prefill.base, "--decode", decode.base)
        for prompt in (TARGET_TEXT, "Write a haiku about rain. " * 6):
            body = {"model": MODEL, "prompt": prompt, "max_tokens": 4, "temperature": 0.0}
            body["logprobs"] = 2
            routed = httpx.post(router.base + "/v1/completions", json=body, timeout=300)
            local = httpx.post(decode.base + "/v1/completions", json=body, timeout=300)
            assert routed.status_code == local.status_code == 200, (routed.text, local.text)
            a, b = routed.json()["choices"][0], local.json()["choices"][0]
            assert (a["text"], a["logprobs"]) == (b["text"], b["logprobs"])
        sent = prefill.metrics().get("chunkserve:kv_transfer_bytes_count", 0)
        assert sent == 2  # both prompts were computed on the prefill instance
    finally:
        if router is not None:
            router.stop()
        decode.stop()
        prefill.stop()


# ---- the parts ------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_tiled_linear_rows_do_not_depend_on_the_batch(dtype) -> None:
    """A row of ``linear`` with the deterministic tiling is the same in batches of 1 to
    2,048 rows, at any position (in a slice of 128 rows, or the last one of 64), for the
    embedded model's weight shapes, at 1 and 2 threads; in bf16 also the same at 1 as at 2
    threads."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2100, 1536, generator=gen).to(dtype)
    tiling = DETERMINISTIC_TILING
    for n, k in ((960, 576), (3072, 576), (576, 1536), (49152, 576)):
        w = torch.randn(n, k, generator=gen).to(dtype)
        xs = x[:, :k]

        def alone(first: int, end: int, threads: int, xs=xs, w=w) -> torch.Tensor:
            """Rows first .. end - 1 each alone (a padded 64-row call), at ``threads``."""
            torch.set_num_threads(threads)
            return torch.cat([linear(xs[i : i + 1], w, tiling=tiling) for i in range(first, end)])

        for threads in (1, 2):
            # bf16: a row alone at 1 thread; fp32's depend on the thread count: its own
            own = threads if dtype == torch.float32 else 1
            try:
                for m, at in ((2, 0), (37, 3), (300, 5), (2048, 1)):
                    if n == 49152 and m > 300:
                        continue
                    torch.set_num_threads(threads)
                    y = linear(xs[at : at + m], w, tiling=tiling)
                    rows = min(8 - at, m)
                    assert torch.equal(y[:rows], alone(at, at + rows, own)), (n, k, m, at, threads)
                    # the last rows: of a 64-row slice after 128-row ones (300 -> 128, 128,
                    # 64), of the last 128-row slice (2,048)
                    last = max(m - 3, 0)
                    tail = alone(at + last, at + m, own)
                    assert torch.equal(y[last:], tail), (n, k, m, at, threads)
            finally:
                torch.set_num_threads(1)


def _attend(kernel, q, kc, vc, table, rows, ctx, fixed, threads, window=None):
    """Rows ``rows`` (the last ones of a sequence of ``ctx`` keys) attended by the kernel
    at ``threads`` threads; returns their outputs."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = torch.empty_like(q[:rows])
        kernel(
            q[ctx - rows : ctx].contiguous(), kc, vc, out, table,
            torch.tensor([0]), torch.tensor([rows]), torch.tensor([ctx]),
            0.125, window, None, fixed_range=fixed,
        )  # fmt: skip
        return out
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("window", [None, 700])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_kernel_row_the_same_as_decode_chunk_row_and_prompt_row(dtype, window) -> None:
    """The C kernel with a fixed range: the last query row of a 1,100-key sequence is the
    same computed as a decode, as the last of a 7-row chunk, of a 300-row chunk and of the
    whole prompt, at 1 and 2 threads (and under a sliding window)."""
    kernel = cpu_kernels.load()
    gen = torch.Generator().manual_seed(1)
    ctx, bs, hkv, h, d = 1100, 16, 3, 9, 64
    nb = -(-ctx // bs)
    kc = torch.randn(nb + 1, bs, hkv, d, generator=gen).to(dtype)
    vc = torch.randn(nb + 1, bs, hkv, d, generator=gen).to(dtype)
    table = torch.randperm(nb, generator=gen)[None, :] + 1
    q = torch.randn(ctx, h, d, generator=gen).to(dtype)
    decode = _attend(kernel, q, kc, vc, table, 1, ctx, 32, 1, window)
    for rows, threads in ((1, 2), (7, 1), (300, 2), (ctx, 1)):
        got = _attend(kernel, q, kc, vc, table, rows, ctx, 32, threads, window)
        assert torch.equal(got[-1:], decode), (rows, threads)


def _attend_batch(kernel, q, kc, vc, table, runs, threads, window=None):
    """One kernel call (fixed range 32) attending several runs of rows of one sequence, each
    ``(first, rows)``: rows ``first .. first + rows - 1`` of the sequence, as if its keys up to
    the run's last row were cached (a decode, a chunk after a cached prefix, a whole prompt);
    returns each run's outputs."""
    qs = torch.cat([q[a : a + n] for a, n in runs]).contiguous()
    out = torch.empty_like(qs)
    starts = torch.tensor([0] + [n for _, n in runs]).cumsum(0)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        kernel(
            qs, kc, vc, out, table.expand(len(runs), -1).contiguous(),
            starts[:-1].contiguous(), torch.tensor([n for _, n in runs]),
            torch.tensor([a + n for a, n in runs]), 0.125, window, None, fixed_range=32,
        )  # fmt: skip
    finally:
        torch.set_num_threads(before)
    return [out[starts[i] : starts[i + 1]] for i in range(len(runs))]


@pytest.fixture(params=["amx", "avx512-bf16"])
def bf16_path(request):
    """The kernel, its deterministic bf16 tiles on AMX (skipped where the CPU has none) or
    kept off it (the AVX512-BF16 tiles: a CPU without AMX)."""
    kernel = cpu_kernels.load()
    if request.param == "amx" and not kernel.amx(64, 16):
        pytest.skip("no AMX-BF16 here, or CHUNKSERVE_ATTENTION_AMX=0")
    kernel.allow_amx(request.param == "amx")
    try:
        assert kernel.amx(64, 16) == (request.param == "amx")
        yield kernel
    finally:
        kernel.allow_amx(cpu_kernels.amx_allowed())


@pytest.mark.parametrize("window", [None, 300])
def test_kernel_bf16_rows_the_same_in_any_run_and_batch(bf16_path, window) -> None:
    """bf16, fixed range (AMX tiles where the CPU has them): every row of a 1,100-key prompt
    attended as part of the whole prompt equals the same row as a decode, in chunks cut at
    odd places (mid-block, mid-group, at a 512-key range's edge) after a cached prefix, and in
    calls that batch such runs of the same sequence together, at 1 and 2 threads: tiles
    holding 1, a few or 16 rows, first in a tile or last, give a row the same bits. On both
    of the mode's bf16 paths (AMX, AVX512-BF16), which differ from each other."""
    kernel = bf16_path
    gen = torch.Generator().manual_seed(7)
    ctx, bs, hkv, h, d = 1100, 16, 3, 9, 64
    nb = -(-ctx // bs)
    kc = torch.randn(nb + 1, bs, hkv, d, generator=gen).bfloat16()
    vc = torch.randn(nb + 1, bs, hkv, d, generator=gen).bfloat16()
    table = torch.randperm(nb, generator=gen)[None, :] + 1
    q = torch.randn(ctx, h, d, generator=gen).bfloat16()
    (whole,) = _attend_batch(kernel, q, kc, vc, table, [(0, ctx)], 1, window)
    # against fp32 attention: the right rows, keys and window
    k = kc[table[0]].reshape(-1, hkv, d)[:ctx].float().repeat_interleave(h // hkv, 1)
    v = vc[table[0]].reshape(-1, hkv, d)[:ctx].float().repeat_interleave(h // hkv, 1)
    pos = torch.arange(ctx)
    mask = pos[None, :] <= pos[:, None]
    if window:
        mask &= pos[None, :] > pos[:, None] - window
    want = torch.nn.functional.scaled_dot_product_attention(
        q.float().transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), mask, scale=0.125
    ).transpose(0, 1)
    assert (whole.float() - want).abs().max() < 0.02
    cuts = [0, 1, 37, 63, 64, 300, 511, 512, 513, 700, 1023, 1099, ctx]
    chunks = [(a, b - a) for a, b in itertools.pairwise(cuts)]
    decodes = [(i, 1) for i in (0, 15, 16, 63, 511, 512, 777, 1099)]
    # every row as a decode, in one call: a bf16 output hides most last-bit differences of
    # the fp32 sums, so it takes many rows to see one
    every = [(i, 1) for i in range(ctx)]
    every = torch.cat(_attend_batch(kernel, q, kc, vc, table, every, 2, window))
    assert torch.equal(every, whole)
    for threads in (1, 2):
        for runs in (chunks, decodes, [chunks[3], decodes[-1], chunks[-2], (5, 3), chunks[6]]):
            got = _attend_batch(kernel, q, kc, vc, table, runs, threads, window)
            for (a, n), o in zip(runs, got, strict=True):
                assert torch.equal(o, whole[a : a + n]), (a, n, threads)


def test_the_mode_pins_amx_tiles_where_the_cpu_has_them() -> None:
    """bf16 in the mode runs AMX tiles on a CPU with AMX-BF16 (the OS granting it, and
    ``CHUNKSERVE_ATTENTION_AMX`` not 0), for every row (the test above), with the engine's
    block size; never for blocks other than 16 tokens or head sizes not a multiple of 64 (the
    AVX512-BF16 tiles, whose bits differ: checked here)."""
    kernel = cpu_kernels.load()
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    if "amx_bf16" not in flags or not cpu_kernels.amx_allowed():  # CHUNKSERVE_ATTENTION_AMX=0
        assert not kernel.amx(64, 16)
    else:
        assert kernel.amx(64, 16) and kernel.amx(128, 16)
    assert not kernel.amx(64, 8) and not kernel.amx(96, 16)
    if kernel.amx(64, 16):  # and the two paths' bits differ: the tests above see both
        gen = torch.Generator().manual_seed(3)
        kc, vc = (torch.randn(9, 16, 3, 64, generator=gen).bfloat16() for _ in range(2))
        q = torch.randn(128, 9, 64, generator=gen).bfloat16()
        table = torch.arange(1, 9)[None, :]
        (amx,) = _attend_batch(kernel, q, kc, vc, table, [(0, 128)], 1)
        kernel.allow_amx(False)
        try:
            (avx,) = _attend_batch(kernel, q, kc, vc, table, [(0, 128)], 1)
        finally:
            kernel.allow_amx(cpu_kernels.amx_allowed())
        assert (amx.float() - avx.float()).abs().max() < 0.02 and not torch.equal(amx, avx)


def test_a_draft_model_attends_and_multiplies_as_the_target_does() -> None:
    """With the mode on, a draft model takes the target's deterministic attention (fixed
    key ranges) and row tiling: a sampled request's acceptance reads the draft's
    distributions, which must not depend on the batch either."""
    from chunkserve.model.loader import embedded_model_path

    spec = {
        "method": "draft_model",
        "model": str(embedded_model_path()),
        "num_speculative_tokens": 2,
    }
    worker = make("bfloat16", speculative_config=spec, load_format="dummy").core.worker
    assert worker.draft is not None
    assert worker.draft.attention.name == worker.attention.name == "cpu"
    assert worker.draft.attention.fixed_range == worker.attention.fixed_range > 0
    tilings = {m.tiling for m in worker.draft.model.modules() if hasattr(m, "tiling")}
    assert tilings == {DETERMINISTIC_TILING}


def test_deterministic_needs_the_cpu_kernel() -> None:
    with pytest.raises(ValueError, match="deterministic"):
        Engine(
            dtype="float32",
            max_model_len=256,
            kv_cache_memory=16 << 20,
            deterministic=True,
            attention_backend="torch",
        )


def test_a_prefill_decode_pair_must_agree_on_the_mode() -> None:
    """The decode side's KV handle says whether it runs the mode; a prefill instance that
    does not (or does when the decode side does not) fails the request, naming the field."""
    from chunkserve.disagg.connector import KVHandle, TransferError, new_transfer_id

    layout = (30, 2, 16, 3, 64)
    h = KVHandle("shm", new_transfer_id(), "", 0, 20, 2, layout, "bfloat16", deterministic=True)
    assert KVHandle.from_dict(h.as_dict()) == h
    h.check_fits(layout, "bfloat16", deterministic=True)
    with pytest.raises(TransferError, match=r"send\.deterministic"):
        h.check_fits(layout, "bfloat16", deterministic=False)
    plain = KVHandle.from_dict({k: v for k, v in h.as_dict().items() if k != "deterministic"})
    assert not plain.deterministic  # an older decode side's handle
    with pytest.raises(TransferError, match=r"send\.deterministic"):
        plain.check_fits(layout, "bfloat16", deterministic=True)
    with pytest.raises(ValueError, match=r"send\.deterministic"):
        KVHandle.from_dict({**h.as_dict(), "deterministic": "yes"})


def test_a_fp32_pair_must_agree_on_threads() -> None:
    """fp32 matmuls depend on the thread count even on fixed row tiles (bf16's do not):
    a deterministic fp32 pair at different thread counts fails the request, naming it."""
    from chunkserve.disagg.connector import KVHandle, TransferError, new_transfer_id

    layout = (30, 2, 16, 3, 64)
    for dtype in ("float32", "bfloat16"):
        h = KVHandle(
            "shm", new_transfer_id(), "", 0, 20, 2, layout, dtype, deterministic=True, threads=2
        )
        assert KVHandle.from_dict(h.as_dict()) == h
        h.check_fits(layout, dtype, deterministic=True, threads=2)
        if dtype == "float32":
            with pytest.raises(TransferError, match=r"send\.threads"):
                h.check_fits(layout, dtype, deterministic=True, threads=1)
        else:
            h.check_fits(layout, dtype, deterministic=True, threads=1)


def test_a_bf16_pair_must_agree_on_the_attention_arithmetic() -> None:
    """The mode's bf16 attention runs on AMX tiles where the CPU has them and on AVX512-BF16
    (or widened) tiles elsewhere, with other bits: the backend names its arithmetic, the
    decode side's handle carries it, and a prefill instance on another one fails the request,
    naming the field (an older handle without it, or the mode off, is not checked)."""
    from chunkserve.attention import get_attention_backend

    kernel = cpu_kernels.load()
    if kernel is None:
        pytest.skip(f"the C attention kernel does not build here: {cpu_kernels.load_error()}")
    cpu = torch.device("cpu")
    det = get_attention_backend("cpu", cpu, 4, 2, 64, torch.bfloat16, 16, deterministic=True)
    expected = "amx-bf16" if kernel.amx(64, 16) else "avx512-bf16"
    assert det.arithmetic == (expected if kernel.bf16_tiles else "widened-bf16")
    for dtype, deterministic in ((torch.bfloat16, False), (torch.float32, True)):
        backend = get_attention_backend("cpu", cpu, 4, 2, 64, dtype, 16, deterministic)
        assert backend.arithmetic == ""  # one arithmetic (or no promise across machines)

    a_said_arithmetic_is_checked("attention", "amx-bf16", "avx512-bf16")


def a_said_arithmetic_is_checked(field: str, said: str, other: str) -> None:
    """A decode side's handle saying ``field`` = ``said``: a prefill instance saying the same
    fits, one saying ``other`` fails naming the field and both values, one saying nothing
    (or an older handle without it) is not checked; a non-string is refused."""
    from chunkserve.disagg.connector import KVHandle, TransferError, new_transfer_id

    layout = (30, 2, 16, 3, 64)
    h = KVHandle(
        "shm", new_transfer_id(), "", 0, 20, 2, layout, "bfloat16", deterministic=True,
        **{field: said},
    )  # fmt: skip
    assert KVHandle.from_dict(h.as_dict()) == h
    h.check_fits(layout, "bfloat16", deterministic=True, **{field: said})
    with pytest.raises(TransferError, match=rf"send\.{field}.*{said}.*{other}"):
        h.check_fits(layout, "bfloat16", deterministic=True, **{field: other})
    h.check_fits(layout, "bfloat16", deterministic=True, **{field: ""})  # not said: no check
    old = KVHandle.from_dict({k: v for k, v in h.as_dict().items() if k != field})
    old.check_fits(layout, "bfloat16", deterministic=True, **{field: other})
    with pytest.raises(ValueError, match=rf"send\.{field}"):
        KVHandle.from_dict({**h.as_dict(), field: [said]})


def test_the_quant_kernel_option_is_the_modes() -> None:
    """``deterministic_quant_kernel``: 'int8' or 'bf16', and a kernel of the mode only: a
    ValueError naming the option otherwise."""
    from chunkserve.config import EngineConfig

    config = EngineConfig(deterministic=True, deterministic_quant_kernel="bf16")
    assert config.deterministic_quant_kernel == "bf16"
    assert EngineConfig().deterministic_quant_kernel == "int8"
    with pytest.raises(ValueError, match="deterministic_quant_kernel.*deterministic=True"):
        EngineConfig(deterministic_quant_kernel="bf16")
    with pytest.raises(ValueError, match="deterministic_quant_kernel: must be one of"):
        EngineConfig(deterministic=True, deterministic_quant_kernel="fp8")


def test_the_bf16_quant_kernel(target) -> None:
    """``deterministic_quant_kernel='bf16'`` on the embedded model (Q4_1, Q8_0 head): where
    the CPU has AMX-BF16, every GGUF weight runs ``gemm_bf16`` (unpacked to the file's rows)
    and the target's tokens and logprobs are the same alone and beside 5 others, chunked;
    elsewhere the load fails with a ValueError naming the option (not a silent int8)."""
    from chunkserve.quant import kernels
    from chunkserve.quant.weight import GGUFWeight

    k = kernels.load()
    if k is None or not k.amx_bf16:
        with pytest.raises(ValueError, match="deterministic_quant_kernel: 'bf16' needs"):
            make("bfloat16", deterministic_quant_kernel="bf16")
        return
    engine = make("bfloat16", deterministic_quant_kernel="bf16", max_num_batched_tokens=16)
    worker = engine.core.worker
    assert worker.invariant_products == "bf16"
    for module in worker.model.modules():
        for slot in getattr(module, "slots", ()):
            for w in quantized_parts(slot.qweight):
                assert isinstance(w, GGUFWeight)
                assert w.invariant_kernel == "bf16" and w.packed is None
    alone_bf16 = run_among(engine, [target])
    assert run_among(engine, [*mixed_prompts(5), target], at=5) == alone_bf16
    engine.shutdown()
    int8 = make("bfloat16", max_num_batched_tokens=16)
    assert int8.core.worker.invariant_products == "int8"
    assert run_among(int8, [target]) != alone_bf16  # another kernel: other bits
    int8.shutdown()


def test_a_pair_must_agree_on_the_quant_kernel(engines) -> None:
    """The decode side's handle carries its mode's quantized-product kernel; a prefill
    instance on another one fails the request, naming the field (not said: not checked).
    The embedded model's deterministic engines say what their products run on: bf16 the
    int8 kernel (built here; else the dequantized tiles), fp32 float arithmetic."""
    from chunkserve.quant import kernels

    int8 = "int8" if kernels.load() is not None else "reference"
    assert engines("bfloat16", "16").core.worker.invariant_products == int8
    assert engines("float32", "16").core.worker.invariant_products == "float"
    a_said_arithmetic_is_checked("products", "bf16", "int8")
