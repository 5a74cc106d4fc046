"""Attention backends against a dense, loop-by-loop reference on random mixed batches.

Fresh random data each run (the seed is printed on failure), several block sizes, chunk
offsets not aligned to blocks, decodes of different lengths in the same batch.
"""

from __future__ import annotations

import logging
import os
import platform
import random
import shutil

import pytest
import torch

from chunkserve.attention import cpu_kernels, get_attention_backend, triton_usable
from chunkserve.platform import cpu_has_amx_bf16
from chunkserve.scheduling.kv_cache import KVCacheManager
from chunkserve.scheduling.request import Request
from chunkserve.scheduling.sampling_params import SamplingParams
from chunkserve.scheduling.scheduler import ScheduledChunk, SchedulerOutput
from chunkserve.worker.model_runner import ModelRunner, allocate_kv_caches

H, HKV, HD = 6, 2, 32


def dense_reference(q_rows, k_all, v_all, positions, scale, window=None, softcap=None, sinks=None):
    """q_rows: [n, H, hd] of one request at ``positions``; k_all/v_all: [ctx, Hkv, hd] of
    that request from position 0. Each row sees keys 0..its position; with a ``window`` W
    only keys > position - W (HF transformers' ``kv_idx > q_idx - sliding_window``). Scores
    ``scale * q . k``, then ``softcap * tanh(s / softcap)``, then the mask, then softmax
    (with ``sinks`` [H]: over the keys and one more column per head holding its sink
    logit, dropped after)."""
    g = q_rows.shape[1] // k_all.shape[1]
    k = k_all.repeat_interleave(g, dim=1).float()  # [ctx, H, hd]
    v = v_all.repeat_interleave(g, dim=1).float()
    key_pos = torch.arange(k_all.shape[0], device=k_all.device).view(1, -1)
    pos = torch.tensor(positions, device=k_all.device).view(-1, 1)
    visible = key_pos <= pos  # [n, ctx]: an explicit mask over every key of the request
    if window is not None:
        visible &= key_pos > pos - window
    scores = torch.einsum("nhd,khd->nhk", q_rows.float(), k) * scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    scores = scores.masked_fill(~visible[:, None, :], float("-inf"))
    if sinks is None:
        probs = scores.softmax(-1)
    else:
        sink_col = sinks.float().to(scores.device).view(1, -1, 1).expand(scores.shape[0], -1, 1)
        probs = torch.cat([scores, sink_col], dim=-1).softmax(-1)[..., :-1]
    out = torch.einsum("nhk,khd->nhd", probs, v).to(q_rows.dtype)
    return out


def random_batch(rng: random.Random, block_size: int):
    """(request, context already cached, new tokens this step) for a random mixed batch."""
    items = []
    for _ in range(rng.randint(1, 3)):  # prefill chunks, some with a cached prefix
        items.append((rng.choice([0, 0, rng.randint(1, 70)]), rng.randint(1, 40)))
    for _ in range(rng.randint(0, 5)):  # decodes
        items.append((rng.randint(1, 90), 1))
    rng.shuffle(items)
    prefills = [x for x in items if x[1] > 1 or x[0] == 0]
    decodes = [x for x in items if not (x[1] > 1 or x[0] == 0)]
    return prefills, decodes


# The GPU backend runs on CUDA when present, else under Triton's interpreter (conftest sets
# TRITON_INTERPRET=1 on machines without CUDA); skipped where Triton is not installed.
GPU_DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
needs_triton = pytest.mark.skipif(
    not triton_usable(GPU_DEVICE), reason="triton not installed (or no CUDA and no interpreter)"
)
# The C kernel builds wherever a C compiler is (CI has gcc): there a failed build fails
# these tests rather than skipping them.
needs_cpu_kernel = pytest.mark.skipif(
    not (os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")),
    reason="no C compiler to build the CPU attention kernel",
)
BACKEND_DEVICES = [
    pytest.param("torch", torch.device("cpu"), id="torch-cpu"),
    pytest.param("cpu", torch.device("cpu"), id="cpu-kernel", marks=needs_cpu_kernel),
    pytest.param("triton", GPU_DEVICE, id=f"triton-{GPU_DEVICE.type}", marks=needs_triton),
]
if torch.cuda.is_available():
    BACKEND_DEVICES.append(pytest.param("torch", GPU_DEVICE, id="torch-cuda"))


@pytest.mark.parametrize("backend,device", BACKEND_DEVICES)
@pytest.mark.parametrize("block_size", [1, 4, 16, 32])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_backend_matches_dense(
    backend: str, device: torch.device, block_size: int, dtype: torch.dtype
) -> None:
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    torch.manual_seed(seed)
    # Triton's CPU interpreter runs each program in Python (~10x the other backends' cost):
    # two random batches there per block size and dtype, every edge still swept (fresh
    # batches each run); four everywhere else, the GPU included.
    interpreted = backend == "triton" and device.type == "cpu"
    for _ in range(2 if interpreted else 4):
        _check_random_batch(rng, block_size, dtype, device, seed, backend)


def _check_random_batch(
    rng,
    block_size,
    dtype,
    device,
    seed,
    backend="torch",
    heads=(H, HKV, HD),
    batch=None,
    all_to_kernel=False,
    spec=None,
    tol=None,
    want_spec="same",
    sinks=None,
    poison_before_window=False,
) -> tuple[float, torch.Tensor]:
    """One batch (``random_batch``'s, or ``batch``: (prefills, decodes)) through the backend
    against the dense reference, the pool poisoned with NaN outside what was written.
    ``all_to_kernel``: the cpu backend sends every chunk with a cached prefix to its kernel,
    however long. ``spec``: the ``AttentionSpec`` passed to forward; the reference uses
    ``want_spec`` ("same": that one). ``poison_before_window``: the cached blocks wholly
    before the window of a sequence's first row are filled with NaN after they were written
    (a backend that reads them, even to mask them, turns its output to NaN). Returns the
    largest error seen (under ``tol``) and the backend's output."""
    H, HKV, HD = heads  # the module's names, for these heads
    prefills, decodes = batch or random_batch(rng, block_size)
    num_blocks = sum(-(-(c + n) // block_size) for c, n in prefills + decodes) + 40
    kv = KVCacheManager(num_blocks, block_size)
    # Shuffle the free list so block tables are not contiguous.
    order = list(range(1, num_blocks + 1))
    rng.shuffle(order)
    kv.pool._free.clear()
    for b in order:
        kv.pool._free[b] = None
    ((k_cache, v_cache),) = allocate_kv_caches(1, num_blocks, block_size, HKV, HD, dtype, device)
    attn = get_attention_backend(backend, device, H, HKV, HD, dtype, block_size)
    assert attn.name == backend
    if all_to_kernel:
        attn.kernel_max_rows = None
    # Poison the pool: any read of a slot that was neither written nor zeroed turns into NaN.
    k_cache.fill_(float("nan"))
    v_cache.fill_(float("nan"))
    k_cache[0].zero_()  # the null block, zeroed at allocation
    v_cache[0].zero_()
    runner = ModelRunner(None, attn, None, [(k_cache, v_cache)], block_size, device)

    out = SchedulerOutput()
    full_k, full_v, reqs = {}, {}, []
    for i, (cached, new) in enumerate(prefills + decodes):
        total = cached + new
        r = Request(f"r{i}", list(range(1, total + 1)), SamplingParams(), max_tokens=1)
        r.num_computed_tokens = cached
        assert kv.allocate_slots(r, new)
        full_k[r.request_id] = torch.randn(total, HKV, HD).to(dtype).to(device)
        full_v[r.request_id] = torch.randn(total, HKV, HD).to(dtype).to(device)
        # Write the cached prefix straight into the pool through the block table, zeroing
        # each block first as the engine does on a block's first write.
        for b in r.block_ids[: -(-cached // block_size)]:
            k_cache[b].zero_()
            v_cache[b].zero_()
        for pos in range(cached):
            slot = r.block_ids[pos // block_size] * block_size + pos % block_size
            k_cache.view(-1, HKV, HD)[slot] = full_k[r.request_id][pos]
            v_cache.view(-1, HKV, HD)[slot] = full_v[r.request_id][pos]
        if poison_before_window and spec is not None and spec.sliding_window is not None:
            first_key = max(0, cached - spec.sliding_window + 1)  # the first row's first key
            for b in r.block_ids[: first_key // block_size]:
                k_cache[b].fill_(float("nan"))
                v_cache[b].fill_(float("nan"))
        chunk = ScheduledChunk(r, cached, new)
        (out.prefills if (i < len(prefills)) else out.decodes).append(chunk)
        reqs.append(r)

    layout, _ = runner.build_layout(out)
    t = layout.input_ids.numel()  # padded
    q = torch.randn(t, H, HD).to(dtype).to(device)
    k_new = torch.randn(t, HKV, HD).to(dtype).to(device)  # padding rows: any values
    v_new = torch.randn(t, HKV, HD).to(dtype).to(device)
    row = 0
    for c in out.chunks:
        rid = c.request.request_id
        k_new[row : row + c.num_tokens] = full_k[rid][c.start : c.end]
        v_new[row : row + c.num_tokens] = full_v[rid][c.start : c.end]
        row += c.num_tokens
    meta = attn.prepare(layout)
    if spec is None:
        got = attn.forward(q, k_new, v_new, k_cache, v_cache, layout, meta)
    elif sinks is None:
        got = attn.forward(q, k_new, v_new, k_cache, v_cache, layout, meta, spec=spec)
    else:
        got = attn.forward(q, k_new, v_new, k_cache, v_cache, layout, meta, spec, sinks)
    assert not got[layout.num_tokens :].any()  # padding rows stay zero

    row = 0
    if tol is None:
        tol = 2e-5 if dtype == torch.float32 else 6e-2  # bf16 rounds scores and probabilities
    ref = spec if want_spec == "same" else want_spec
    scale = HD**-0.5 if ref is None or ref.scale is None else ref.scale
    window = None if ref is None else ref.sliding_window
    softcap = None if ref is None else ref.logit_softcap
    worst = 0.0
    for c in out.chunks:
        rid = c.request.request_id
        rows = slice(row, row + c.num_tokens)
        want = dense_reference(
            q[rows], full_k[rid], full_v[rid], list(range(c.start, c.end)), scale, window, softcap,
            sinks,
        )  # fmt: skip
        err = (got[rows].float() - want.float()).abs().max().item()
        assert err < tol, (
            f"seed={seed} bs={block_size} {rid} start={c.start} n={c.num_tokens} spec={spec}: "
            f"max err {err}"
        )
        worst = max(worst, err)
        row += c.num_tokens
    # The new K/V landed in the cache at the request's slots.
    for c in out.chunks:
        r = c.request
        for pos in range(c.start, c.end):
            slot = r.block_ids[pos // block_size] * block_size + pos % block_size
            assert torch.equal(k_cache.view(-1, HKV, HD)[slot], full_k[r.request_id][pos])
    return worst, got


def test_unknown_backend_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="attention_backend"):
        get_attention_backend("nope", torch.device("cpu"), H, HKV, HD)


@pytest.mark.parametrize("start", [0, 200])
def test_fp32_prefill_through_sdpa_matches_the_blocked_path(start: int) -> None:
    """fp32 chunks go through PyTorch's SDPA, bf16 ones through query blocks: on a chunk
    longer than a query block, after a cached prefix or not, both give the same rows."""
    from chunkserve.attention.torch_ref import PREFILL_BLOCK_ROWS, TorchAttentionBackend

    torch.manual_seed(start)
    n = 2 * PREFILL_BLOCK_ROWS + 37
    attn = TorchAttentionBackend(H, HKV, HD)
    q = torch.randn(n, H, HD)
    k, v = torch.randn(start + n, HKV, HD), torch.randn(start + n, HKV, HD)
    got = attn._prefill(q, k, v, start)
    assert got.shape == (n, H, HD)
    torch.testing.assert_close(got, attn._prefill_blocked(q, k, v, start), atol=2e-5, rtol=1e-4)
    # The dense reference, for a few rows (the first, across a block edge, the last).
    rows = [0, PREFILL_BLOCK_ROWS - 1, PREFILL_BLOCK_ROWS, n - 1]
    want = dense_reference(q[rows], k, v, [start + i for i in rows], HD**-0.5)
    torch.testing.assert_close(got[rows], want, atol=2e-5, rtol=1e-4)


@needs_cpu_kernel
@pytest.mark.parametrize(
    "heads", [(9, 3, 64), (8, 2, 128), (4, 4, 64), (4, 1, 256), (16, 4, 32), (6, 2, 48)], ids=str
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_kernel_vector_path_and_split_ranges(heads, dtype: torch.dtype) -> None:
    """Head sizes of 32, 64, 128 and 256 take the kernel's vector path (48 its tiles and
    scalar loops); a lone long decode (a
    prompt's first token after a long prefill) and a few long rows are split over key ranges
    merged at the end; short chunks of several rows see their causal limits."""
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    torch.manual_seed(seed)
    cases = [
        ([], [(2999, 1)]),  # one long decode alone: split into ranges
        ([(1500, 17)], [(700, 1)]),  # a 17-row short chunk beside a decode
        ([(0, 40), (33, 5)], [(rng.randint(1, 300), 1) for _ in range(12)]),
    ]
    for batch in cases:
        _check_random_batch(rng, 16, dtype, torch.device("cpu"), seed, "cpu", heads, batch)


@needs_cpu_kernel
@pytest.mark.parametrize(
    "heads", [(9, 3, 64), (8, 2, 128), (4, 4, 64), (4, 1, 256), (16, 4, 32), (6, 2, 48)], ids=str
)
@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_kernel_tile_path_for_long_chunks(heads, block_size: int, dtype) -> None:
    """Chunks of many rows take the kernel's tile path (16 rows to a vector; in bf16 the
    AVX512-BF16 pairs where the CPU has them): rows past a tile's end, a last block cut
    short, more tiles than one pass holds (over 256 rows of a KV head), ranges split over
    the threads, and two chunks beside decodes, against the dense reference, the pool
    poisoned with NaN outside what was written."""
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    torch.manual_seed(seed)
    cases = [
        ([(37, 100)], []),  # starts mid-block, the last block cut short
        ([(rng.randint(1, 900), 300)], [(rng.randint(1, 200), 1) for _ in range(3)]),
        ([(5, 9), (700, 64)], [(50, 1)]),
    ]
    for batch in cases:
        _check_random_batch(
            rng, block_size, dtype, torch.device("cpu"), seed, "cpu", heads, batch, True
        )


@needs_cpu_kernel
def test_cpu_backend_sends_continuing_chunks_to_the_kernel() -> None:
    """fp32: every chunk that continues a cached sequence is the kernel's, however long; a
    prompt's first chunk stays on torch's fused path. bf16: up to the measured crossover."""
    from chunkserve.attention import cpu_paged

    cpu = torch.device("cpu")
    fp32 = get_attention_backend("cpu", cpu, 9, 3, 64, torch.float32, 16)
    assert fp32.kernel_max_rows is None
    bf16 = get_attention_backend("cpu", cpu, 9, 3, 64, torch.bfloat16, 16)
    want = cpu_paged.kernel_max_rows(
        torch.bfloat16,
        64,
        bf16_tiles=cpu_kernels.load().bf16_tiles,
        amx_bf16=cpu_has_amx_bf16(),
    )
    assert bf16.kernel_max_rows == want
    for attn, longest in ((fp32, 500), (bf16, want)):
        kv = KVCacheManager(200, 16)
        out = SchedulerOutput()
        for i, (cached, new) in enumerate([(0, 40), (100, longest), (2000, longest + 1)]):
            r = Request(f"r{i}", list(range(1, cached + new + 1)), SamplingParams(), max_tokens=1)
            r.num_computed_tokens = cached
            assert kv.allocate_slots(r, new)
            out.prefills.append(ScheduledChunk(r, cached, new))
        runner = ModelRunner(None, attn, None, [], 16, cpu)
        layout, _ = runner.build_layout(out)
        meta = attn.prepare(layout)
        torch_rows = sorted(p.row_end - p.row_start for p in meta.prefills)
        kernel_rows = meta.kernel_batch.q_len.tolist()
        if attn is fp32:
            assert (torch_rows, kernel_rows) == ([40], [longest, longest + 1])
        else:
            assert (torch_rows, kernel_rows) == (sorted([40, longest + 1]), [longest])


def test_kernel_or_torch_routing_for_continuing_chunks() -> None:
    """The measured crossovers: fp32 chunks to the kernel's tiles at any length (head_dim 32
    too, now that it has tiles); bf16 up to 128 rows with AVX512-BF16 tiles, 16 where torch's
    matmuls have AMX (head_dim over 32), 32 with neither; a shape with only the scalar loops
    (head_dim not a multiple of 16, blocks over 16 tokens) only what torch calls short; the
    deterministic mode every row, whatever the shape or CPU."""
    from chunkserve.attention.cpu_paged import kernel_max_rows
    from chunkserve.attention.torch_ref import SHORT_CHUNK_ROWS

    f32, bf16 = torch.float32, torch.bfloat16
    for hd in (32, 64, 128, 48):
        assert kernel_max_rows(f32, hd) is None
        assert kernel_max_rows(f32, hd, amx_bf16=True, bf16_tiles=True) is None
    assert kernel_max_rows(bf16, 64, bf16_tiles=True) == 128
    assert kernel_max_rows(bf16, 64, bf16_tiles=True, amx_bf16=True) == 16
    assert kernel_max_rows(bf16, 128, bf16_tiles=True, amx_bf16=True) == 16
    assert kernel_max_rows(bf16, 32, bf16_tiles=True, amx_bf16=True) == 128
    assert kernel_max_rows(bf16, 64) == 32
    assert kernel_max_rows(f32, 40) == SHORT_CHUNK_ROWS
    assert kernel_max_rows(f32, 64, 32) == SHORT_CHUNK_ROWS
    for args in ((f32, 40), (bf16, 64, 16), (bf16, 80, 32), (f32, 32)):
        assert kernel_max_rows(*args, deterministic=True, amx_bf16=True, bf16_tiles=True) is None


@needs_cpu_kernel
def test_cpu_kernel_uses_torch_threads_and_one_openmp_runtime() -> None:
    """The library links the OpenMP runtime torch loaded: one libgomp in the process."""
    assert cpu_kernels.load() is not None
    with open("/proc/self/maps") as f:
        gomps = {ln.rsplit(maxsplit=1)[-1] for ln in f if "libgomp" in ln}
    assert len(gomps) == 1, gomps


def test_cpu_kernel_build_failure_falls_back_to_torch(tmp_path, monkeypatch) -> None:
    """No working compiler: the build's error is kept, ``auto`` picks the torch backend and
    asking for ``cpu`` is a ValueError naming the field and the reason."""
    monkeypatch.setenv("CHUNKSERVE_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CC", "/nonexistent/cc")
    from chunkserve import cbuild

    fresh = cbuild.OnceLoaded(cpu_kernels._load, cpu_kernels.logger, logging.INFO, "%s")
    monkeypatch.setattr(cpu_kernels, "_once", fresh)
    assert cpu_kernels.load() is None and "/nonexistent/cc" in cpu_kernels.load_error()
    cpu = torch.device("cpu")
    assert get_attention_backend("auto", cpu, H, HKV, HD).name == "torch"
    with pytest.raises(ValueError, match="attention_backend: 'cpu'.*/nonexistent/cc"):
        get_attention_backend("cpu", cpu, H, HKV, HD)


def test_cpu_kernel_not_chosen_for_what_it_does_not_take() -> None:
    """fp16, blocks over 64 tokens or heads over 256 wide stay on the torch backend."""
    cpu = torch.device("cpu")
    assert get_attention_backend("auto", cpu, H, HKV, HD, torch.float16).name == "torch"
    assert get_attention_backend("auto", cpu, H, HKV, HD, torch.float32, 128).name == "torch"
    assert get_attention_backend("auto", cpu, 2, 1, 512).name == "torch"
    with pytest.raises(ValueError, match="attention_backend: 'cpu'"):
        get_attention_backend("cpu", cpu, H, HKV, HD, torch.float16)


def test_the_c_kernels_build_wherever_a_compiler_is_found() -> None:
    """The C kernels' tests skip where the kernels cannot build (not Linux, no compiler).
    Where a compiler is found they must build: a broken source, flag or cache directory (a
    full disk) would otherwise show up only as dozens of skipped tests."""
    from chunkserve.quant import kernels as quant_kernels

    compiler = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if platform.system() != "Linux" or compiler is None:
        pytest.skip("no C compiler here, so the kernels' tests skip too")
    assert cpu_kernels.load() is not None, cpu_kernels.load_error()
    assert quant_kernels.load() is not None, quant_kernels.load_error()


@needs_cpu_kernel
def test_cpu_kernel_cache_is_keyed_and_rebuilt(tmp_path, monkeypatch) -> None:
    """A fresh cache directory builds the library there; a second load reuses the file."""
    monkeypatch.setenv("CHUNKSERVE_CACHE_DIR", str(tmp_path))
    first = cpu_kernels._load()
    built = sorted((tmp_path / "kernels").glob("paged_attention-*.so"))
    assert [first.path] == built
    mtime = first.path.stat().st_mtime_ns
    assert cpu_kernels._load().path == first.path
    assert first.path.stat().st_mtime_ns == mtime
