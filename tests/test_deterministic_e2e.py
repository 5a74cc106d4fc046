"""The deterministic mode (issue 42) on a mixture-of-experts model and under tensor and
expert parallel, end to end.

A tiny random Qwen2-MoE model (transformers' config class, ``tests.test_moe``'s fields:
8 experts, top 4, a gated shared expert; 3 layers) in bf16 and fp32:

- one prompt alone, beside 5 and beside 37 others of mixed lengths, under budgets 16 and
  adaptive, after a prefix-cache hit and preempted: bitwise the same token ids and
  logprobs. A batch changes how many tokens each expert gets in a step (its matmul's row
  count): the experts' matmuls run on ``RowTiling``'s fixed row tiles, so a token's expert
  output does not depend on it (``test_an_experts_row_does_not_depend_on_its_load`` checks
  the layer alone, in both dtypes; end to end, experts run untiled fail the fp32 cases: at
  these tiny shapes and row counts oneDNN's bf16 rows happen not to change). The same with
  its experts quantized (Q8_0 GGUF). The shared expert's sigmoid gate ([T, 1]) runs on
  fixed slices (``moe.shared_gate``; ``test_a_moe_layers_row_does_not_depend_on_the_batch``).
  Without the mode bf16 results change with the batch (chunked against whole-prompt
  prefill).
- tensor parallel 2 (bf16, fp32; sums through shared memory) and expert parallel 2: alone
  = beside 37 others = after a prefix-cache hit, bitwise. Not the same bits as one
  process: each row-parallel matmul (attention's output projection, the shared expert's
  and the experts' down projections) adds its ranks' partial products, another reduction
  than the unsharded one over all of K; the mode promises invariance to the batch within one
  tensor-parallel size and layout (``EngineConfig.deterministic``).
- the all-reduce itself: every path adds the ranks' parts in rank order, whatever the
  tensor's size (gloo's ring over 3 or more ranks adds a row's parts in an order that
  depends on where the row falls in the tensor).

Engines are shared (module-scoped); prompts and outputs are short.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from chunkserve.attention import cpu_kernels
from chunkserve.engine.engine import Engine
from chunkserve.model.layers import DETERMINISTIC_TILING
from chunkserve.model.moe import grouped_experts, route
from chunkserve.scheduling.sampling_params import SamplingParams
from tests.conftest import mixed_prompts, random_prompt, run_among
from tests.test_model_families import write_model
from tests.test_moe import moe_hf_config, rewrite

pytestmark = pytest.mark.skipif(
    cpu_kernels.load() is None, reason=f"the C attention kernel: {cpu_kernels.load_error()}"
)

MAX_TOKENS = 3
BUDGETS = {
    "16": {"max_num_batched_tokens": 16},
    "adaptive": {},
    "off": {"enable_chunked_prefill": False, "max_num_batched_tokens": 2048},
}
DTYPES = ["bfloat16", "float32"]
Result = tuple[list[int], list]


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory, hf_dir: Path) -> Path:
    """Qwen2-MoE as ``tests.test_moe`` builds it (8 experts top 4 of 32 columns, a shared
    expert of 96: a dense MLP beside the experts), 3 layers. Routers drawn
    wider so routing is not a coin toss; the MLPs' and experts' weights 10x HF's N(0, 0.02)
    init so their outputs weigh in the residual stream as a trained model's do (at 0.02 an
    expert's last-bit differences vanish in the residual's rounding, and the fp32 cases
    below did not notice the experts' matmuls run untiled)."""
    config = moe_hf_config("qwen2_moe", num_hidden_layers=3)
    path = write_model(tmp_path_factory.mktemp("moe") / "qwen2_moe", config, hf_dir)

    def edit(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out = {k: v * 20 for k, v in tensors.items() if k.endswith("gate.weight")}
        mlp = {k: v * 10 for k, v in tensors.items() if ".mlp." in k and k.endswith("proj.weight")}
        return out | mlp

    rewrite(path, edit)
    return path


def make(path: Path, dtype: str, deterministic: bool = True, **kwargs) -> Engine:
    base = dict(
        model=str(path),
        dtype=dtype,
        max_model_len=512,
        kv_cache_memory=16 << 20,
        num_threads=1,
        deterministic=deterministic,
    )
    return Engine(**(base | kwargs))


@pytest.fixture(scope="module")
def engines(moe_dir):
    """In-process engines by (dtype, budget name, deterministic), built on first use."""
    made: dict[tuple[str, str, bool], Engine] = {}

    def get(dtype: str, budget: str, deterministic: bool = True) -> Engine:
        key = (dtype, budget, deterministic)
        if key not in made:
            made[key] = make(moe_dir, dtype, deterministic, **BUDGETS[budget])
        return made[key]

    yield get
    made.clear()
    torch.set_num_threads(1)


TARGET = random_prompt(random.Random(5), 45)


def beside_37(engine: Engine) -> Result:
    """The target 21st of 38 prompts arriving 6 every other step."""
    return run_among(
        engine, [*mixed_prompts(20), TARGET, *mixed_prompts(37)[20:]], at=20, per_arrival=6
    )


@pytest.fixture(scope="module")
def alone(engines):
    """The target alone, chunking off, by dtype: the reference of the in-process cases."""
    memo: dict[str, Result] = {}

    def get(dtype: str) -> Result:
        if dtype not in memo:
            memo[dtype] = run_among(engines(dtype, "off"), [TARGET])
        return memo[dtype]

    return get


# ---- mixture of experts, one process --------------------------------------------------------
@pytest.mark.parametrize("budget", ["16", "adaptive"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_moe_beside_5_and_37_others(engines, alone, dtype, budget) -> None:
    engine = engines(dtype, budget)
    steps = []
    engine.step_listeners.append(steps.append)
    try:
        assert beside_37(engine) == alone(dtype)
        assert run_among(engine, [*mixed_prompts(5), TARGET], at=5) == alone(dtype)
    finally:
        engine.step_listeners.remove(steps.append)
    if budget == "16":  # the target's prompt was chunked beside other work
        assert any(s.kind == "mixed" for s in steps)


@pytest.mark.parametrize("dtype", DTYPES)
def test_moe_prefix_cache_hit(engines, alone, dtype) -> None:
    """A request sharing the target's first two blocks runs first: the target starts from
    cached blocks (another chunk boundary, a cached prefix) and gets the same."""
    engine = engines(dtype, "16")
    run_among(engine, [TARGET[:32] + random_prompt(random.Random(3), 7)])
    cached: list[int] = []
    assert run_among(engine, [TARGET, *mixed_prompts(3)], cached=cached) == alone(dtype)
    assert cached == [32]


@pytest.mark.parametrize("dtype", DTYPES)
def test_moe_preemption(moe_dir, engines, dtype) -> None:
    """A pool of 8 blocks (128 slots) for 5 requests of 20 to 45 prompt tokens growing by 16
    each: requests are preempted and recomputed, and the target's tokens and logprobs are
    those it gets alone."""
    size = 2 if dtype == "bfloat16" else 4
    block = 2 * 3 * 2 * 16 * size * 16  # K + V of 16 tokens: 3 layers, 2 KV heads of 16
    engine = make(
        moe_dir,
        dtype,
        kv_cache_memory=9 * block,
        max_model_len=128,
        schedule_conservativeness=0.0,
        max_num_batched_tokens=64,
    )
    assert engine.core.kv.num_blocks == 8
    rng = random.Random(7)
    prompts = [random_prompt(rng, n) for n in (30, 45, 20, 38)]
    params = SamplingParams(max_tokens=16, min_tokens=16, temperature=0.0, logprobs=2)
    got = run_among(engine, [*prompts, TARGET], at=4, params=params)
    assert engine.core.scheduler.num_preemptions > 0
    assert got == run_among(engines(dtype, "off"), [TARGET], params=params)


def test_moe_needs_the_mode(engines) -> None:
    """Without the mode, bf16: the target's logprobs beside others differ from alone (so
    the tests above can tell the mode from its absence)."""
    plain = run_among(engines("bfloat16", "off", False), [TARGET])
    batched = engines("bfloat16", "16", False)
    cases = [beside_37(batched), run_among(batched, [*mixed_prompts(5), TARGET], at=5)]
    assert any(case != plain for case in cases)


@pytest.fixture(scope="module")
def q8_gguf(moe_dir, tmp_path_factory) -> Path:
    """The model as llama.cpp's converter writes it with Q8_0 matrices: its experts (and
    every linear layer) kept quantized, one weight per expert."""
    from tests.test_gguf import write_gguf

    return write_gguf(moe_dir, tmp_path_factory.mktemp("gguf") / "moe-q8_0.gguf", quant="Q8_0")


@pytest.mark.parametrize("dtype", DTYPES)
def test_moe_quantized_experts_beside_5_and_37_others(q8_gguf, dtype) -> None:
    """Q8_0 experts (bf16: the row-invariant int8 kernel; fp32: dequantized tiles on the
    row tiles): alone, chunking off = beside 5 and 37 others, budget 16."""
    reference = make(q8_gguf, dtype, enable_chunked_prefill=False, max_num_batched_tokens=2048)
    assert isinstance(reference.core.worker.model.layers[1].mlp.qw13, list)
    want = run_among(reference, [TARGET])
    del reference
    engine = make(q8_gguf, dtype, max_num_batched_tokens=16)
    assert beside_37(engine) == want
    assert run_among(engine, [*mixed_prompts(5), TARGET], at=5) == want


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_an_experts_row_does_not_depend_on_its_load(dtype) -> None:
    """``grouped_experts`` with the mode's tiling: a token's output is the same computed
    alone (each of its experts a 1-row matmul) as among 300 tokens (its experts given 60
    to 200 rows, over one 128-row call); without the tiling it is not (bf16)."""
    gen = torch.Generator().manual_seed(0)
    e, h, inter, k = 8, 64, 32, 4
    x = torch.randn(300, h, generator=gen).to(dtype)
    router = torch.randn(e, h, generator=gen).to(dtype)
    w13 = (0.3 * torch.randn(e, 2 * inter, h, generator=gen)).to(dtype)
    w2 = (0.3 * torch.randn(e, h, inter, generator=gen)).to(dtype)
    weights, ids = route(F.linear(x, router), k, False)
    counts = torch.bincount(ids.reshape(-1), minlength=e)
    assert counts.max() > 128 and counts.min() > 0

    def rows(tiling) -> tuple[torch.Tensor, torch.Tensor]:
        batch = grouped_experts(x, w13, w2, weights, ids, F.silu, tiling=tiling)
        one = [
            grouped_experts(x[t : t + 1], w13, w2, weights[t : t + 1], ids[t : t + 1], F.silu,
                            tiling=tiling)
            for t in range(0, 300, 7)
        ]  # fmt: skip
        return batch[::7], torch.cat(one)

    batch, one = rows(DETERMINISTIC_TILING)
    assert torch.equal(batch, one)
    if dtype == torch.bfloat16:
        batch, one = rows(None)
        assert not torch.equal(batch, one)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_moe_layers_row_does_not_depend_on_the_batch(dtype) -> None:
    """The whole layer with the mode's tiling (router, experts, Qwen2-MoE's shared expert
    and its sigmoid gate: ``moe.shared_gate``), alone = among 300 rows. Before the gate's
    sigmoid ran in fixed slices, 4 of 100 fp32 rows differed (found by the fp32 tensor-
    parallel case below: the row's gate alone took the scalar tail of torch's vector loop)."""
    from tests.test_moe import build_layer, checkpoint, moe_config

    config = moe_config(
        hidden_size=64, num_experts=8, num_experts_per_tok=4, moe_intermediate_size=32,
        shared_expert_intermediate_size=96,
    )  # fmt: skip
    layer = build_layer(config, checkpoint(config)).to(dtype)
    layer.tiling = DETERMINISTIC_TILING
    x = torch.randn(300, 64, generator=torch.Generator().manual_seed(3)).to(dtype)
    alone = torch.cat([layer(x[t : t + 1]) for t in range(0, 300, 3)])
    assert torch.equal(layer(x)[::3], alone)


# ---- tensor and expert parallel -------------------------------------------------------------
@pytest.fixture(scope="module")
def parallel(moe_dir):
    """Two-rank engines (budget 64, the mode) by (``enable_expert_parallel``, dtype), built
    on first use; shut down at the end. Budget 64: the target alone is one whole-prompt
    chunk, beside others it is cut where the others leave room."""
    made: dict[tuple[bool, str], Engine] = {}

    def get(ep: bool, dtype: str) -> Engine:
        if (ep, dtype) not in made:
            made[ep, dtype] = make(
                moe_dir, dtype, tensor_parallel_size=2, enable_expert_parallel=ep,
                max_num_batched_tokens=64,
            )  # fmt: skip
        return made[ep, dtype]

    yield get
    for engine in made.values():
        engine.shutdown()


# bf16 (the default) and fp32: at the tiny model's shapes only fp32's matmul rows change
# with their row count on this CPU, so the fp32 cases are the ones that notice untiled
# matmuls on the ranks (checked: expert-parallel-fp32 fails); bf16's notices the attention
# of a chunk against a whole prompt's (checked: without the mode it fails).
@pytest.mark.parametrize(
    ("ep", "dtype"),
    [(False, "bfloat16"), (False, "float32"), (True, "float32")],
    ids=["tensor-parallel-bf16", "tensor-parallel-fp32", "expert-parallel-fp32"],
)
def test_two_ranks_alone_batched_and_cached(parallel, ep, dtype) -> None:
    """Two ranks: the target alone, beside 37 others (chunked), and after a prefix-cache
    hit (beside 3 others), bitwise the same. One process's bits are not
    promised (another reduction of the row-parallel matmuls)."""
    engine = parallel(ep, dtype)
    mlp = engine.core.worker.model.layers[1].mlp
    assert engine.core.worker.shard.size == 2
    assert mlp.w13.shape[0] == (4 if ep else 8)
    assert engine.core.worker.group.shm is not None and engine.core.worker.group.ordered_sums
    first = run_among(engine, [TARGET])
    steps = []
    engine.step_listeners.append(steps.append)
    try:
        assert beside_37(engine) == first
    finally:
        engine.step_listeners.remove(steps.append)
    assert any(s.kind == "mixed" for s in steps)
    run_among(engine, [TARGET[:32] + random_prompt(random.Random(3), 7)])
    cached: list[int] = []
    assert run_among(engine, [TARGET, *mixed_prompts(3)], cached=cached) == first
    assert cached == [32]
    # Not promised: two ranks' bits equal to one process's (another reduction; on the AMX
    # Xeon they differed in the logprobs, on the AMD EPYC they happened to agree in fp32).


# ---- the all-reduce ---------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_ordered_sums_over_three_ranks_do_not_depend_on_the_rows(dtype) -> None:
    """Three ranks (gloo, threads of this process, no shared memory: the path of sums too
    large for it or of ranks on several hosts): with ``ordered_sums`` a row's sum is the
    same alone as among 3 or 300 rows, on every rank, and the shared-memory path's
    (``sum_in_rank_order``); gloo's own all-reduce's is not (bf16)."""
    import datetime
    import threading

    import torch.distributed as dist

    from chunkserve.distributed.group import TPGroup
    from chunkserve.distributed.shm import sum_in_rank_order

    size, sizes = 3, (1, 3, 300)
    store = dist.HashStore()
    parts = [torch.randn(300, 64, generator=torch.Generator().manual_seed(r)).to(dtype)
             for r in range(size)]  # fmt: skip
    got: dict[tuple[bool, int, int], torch.Tensor] = {}
    errors: list[BaseException] = []

    def rank(r: int) -> None:
        try:
            pg = dist.ProcessGroupGloo(store, r, size, datetime.timedelta(seconds=60))
            for ordered in (True, False):
                group = TPGroup(r, size, pg, None, ordered_sums=ordered)
                for m in sizes:
                    got[ordered, r, m] = group.all_reduce(parts[r][:m].clone())
        except BaseException as exc:  # reported by the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors and len(got) == 2 * size * len(sizes)
    want = sum_in_rank_order(torch.empty_like(parts[0]), parts)
    for r in range(size):
        for m in sizes:
            assert torch.equal(got[True, r, m], want[:m]), (r, m)
    if dtype == torch.bfloat16:  # what the ordered sums are for
        assert not all(torch.equal(got[False, 0, m][:1], got[False, 0, 1]) for m in sizes)
