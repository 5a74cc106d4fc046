"""Per-layer attention options (``AttentionSpec``: scale, sliding window, soft-cap) in every
backend that runs on a CPU, against ``dense_reference`` (an explicit mask over every key of a
request, built in the test) on mixed batches through the model runner's layouts.

A window W lets the query at position p see keys max(0, p-W+1)..p, whatever the chunk size,
block size or cached prefix: the batches below put windows smaller and larger than their
chunks, across block edges, behind cached prefixes longer than the window, on decodes beside
prefill chunks, and at W = 1. The CPU backend's kernel paths are each reached: the vector row
path (decodes; several rows of a draft when G is 1), the tile path (chunks of many rows),
the scalar loops (blocks of 32 tokens, or head sizes other than 64/128/256), and the torch
path it keeps for a prompt's first chunk.
"""

from __future__ import annotations

import random
import shutil

import pytest
import torch

from chunkserve.attention import AttentionSpec, get_attention_backend, triton_usable
from tests.test_attention import GPU_DEVICE, _check_random_batch

CPU = torch.device("cpu")
needs_cpu_kernel = pytest.mark.skipif(
    not shutil.which("gcc") and not shutil.which("cc"),
    reason="no C compiler to build the CPU attention kernel",
)
CPU_BACKENDS = [
    pytest.param("torch", id="torch"),
    pytest.param("cpu", id="cpu-kernel", marks=needs_cpu_kernel),
]
# (H, Hkv, head_dim): Llama-like 64 and 128 with G = 4; Gemma 3 270M's 4 heads of 256 over
# one KV head; G = 1 (several rows of a draft stay on the kernel's row path).
HEADS = [(8, 2, 64), (8, 2, 128), (4, 1, 256), (4, 4, 64)]


def _batches(bs: int) -> list[tuple[int, list, list]]:
    """(W, prefills, decodes): prefills and decodes as (cached tokens, new tokens)."""
    return [
        # window smaller than the chunk, from position 0 and from mid-block
        (5, [(0, 40), (37, 50)], [(60, 1)]),
        # window larger than the chunk (and than some whole requests)
        (100, [(20, 30), (0, 30)], [(7, 1), (150, 1)]),
        # a window one past a block, crossing block edges, chunks not block-aligned
        (bs + 1, [(bs - 2, 2 * bs), (3, 5)], [(3 * bs + 5, 1), (bs, 1)]),
        # cached prefixes much longer than the window: the early blocks are never needed;
        # at 54 cached the first row's first key (54 - 24 + 1 = 31) is a block's last one
        (24, [(200, 17), (301, 64), (54, 20)], [(500, 1), (23, 1), (24, 1), (54, 1)]),
        # decodes only, W one short of a block; short chunks (drafts) of 2-7 rows
        (bs - 1, [(90, 2), (41, 7)], [(1, 1), (bs - 1, 1), (bs, 1), (5 * bs + 3, 1)]),
        # W = 1: every row sees only itself
        (1, [(0, 9), (33, 4)], [(70, 1)]),
    ]


def _run_batches(backend, heads, bs, dtype, spec_for, all_to_kernel=False):
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    torch.manual_seed(seed)
    for w, prefills, decodes in _batches(bs):
        _check_random_batch(
            rng,
            bs,
            dtype,
            CPU,
            seed,
            backend,
            heads,
            (prefills, decodes),
            all_to_kernel,
            spec=spec_for(w),
        )


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("heads", HEADS, ids=str)
@pytest.mark.parametrize("block_size", [16, 32])
def test_sliding_window_matches_dense(backend: str, heads, block_size: int) -> None:
    _run_batches(
        backend, heads, block_size, torch.float32, lambda w: AttentionSpec(sliding_window=w)
    )


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("heads", HEADS, ids=str)
@pytest.mark.parametrize("block_size", [16, 32])
def test_window_softcap_and_scale_match_dense(backend: str, heads, block_size: int) -> None:
    """Gemma 2's layer: a custom scale (query_pre_attn_scalar ** -0.5, here larger than
    head_dim ** -0.5 so that the cap bites), a soft-cap, with and without a window."""
    hd = heads[2]

    def spec(w):
        return AttentionSpec(
            scale=4 * hd**-0.5, sliding_window=w if w > 5 else None, logit_softcap=3.0
        )

    _run_batches(backend, heads, block_size, torch.float32, spec)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("heads", [(8, 2, 64), (4, 1, 256)], ids=str)
def test_window_and_softcap_in_bf16(backend: str, heads) -> None:
    """bf16 caches: the kernel's bf16 row and tile paths (AVX512-BF16 pairs where the CPU has
    them), every continuing chunk sent to the kernel however long."""
    hd = heads[2]
    _run_batches(
        backend,
        heads,
        16,
        torch.bfloat16,
        lambda w: AttentionSpec(scale=2 * hd**-0.5, sliding_window=w, logit_softcap=5.0),
        all_to_kernel=True,
    )


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_window_long_chunks(backend: str) -> None:
    """Chunks longer than a query block (torch: 128 rows by hand, 512 through SDPA) and the
    kernel's tile groups, with windows of 100 and 700, after long cached prefixes; the cpu
    backend sends every continuing chunk to its kernel."""
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    torch.manual_seed(seed)
    for w, cap in ((100, None), (700, None), (100, 4.0)):
        spec = AttentionSpec(
            sliding_window=w, logit_softcap=cap, scale=None if cap is None else 0.5
        )
        batch = ([(0, 600), (900, 300)], [(1200, 1)])
        _check_random_batch(
            rng, 16, torch.float32, CPU, seed, backend, (8, 2, 64), batch, True, spec=spec
        )


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("heads", [(8, 2, 64), (4, 4, 64), (6, 2, 32)], ids=str)
@pytest.mark.parametrize("block_size", [16, 32])
def test_window_off_by_one_is_caught(backend: str, heads, block_size: int) -> None:
    """The comparison sees a window one key too wide or too narrow: the backend's output
    against the reference for W - 1 and W + 1 is far outside the tolerance, for decodes,
    short chunks and long chunks alike (so the tests above would fail on such a bug)."""
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    torch.manual_seed(seed)
    w = block_size + 1
    batch = ([(0, 40), (70, 3), (block_size, 30)], [(90, 1), (3 * block_size + 2, 1)])
    for ref in (AttentionSpec(sliding_window=w - 1), AttentionSpec(sliding_window=w + 1)):
        err, _ = _check_random_batch(
            rng,
            block_size,
            torch.float32,
            CPU,
            seed,
            backend,
            heads,
            batch,
            spec=AttentionSpec(sliding_window=w),
            tol=float("inf"),
            want_spec=ref,
        )
        assert err > 1e-2, f"seed={seed}: a window off by one gives only {err}"
    # ... and without a window at all (the window really is applied)
    err, _ = _check_random_batch(
        rng,
        block_size,
        torch.float32,
        CPU,
        seed,
        backend,
        heads,
        batch,
        spec=AttentionSpec(sliding_window=w),
        tol=float("inf"),
        want_spec=None,
    )
    assert err > 1e-2


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_blocks_before_the_window_are_never_read(backend: str, dtype) -> None:
    """Under a window W attention reads only the blocks the window reaches (a decode at 2k
    keys with W = 256 reads ~17 blocks, not 128): blocks wholly before every row's window,
    filled with NaN, leave every path's output (decodes, short chunks, long chunks after a
    cache) finite and equal to the dense reference."""
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    torch.manual_seed(seed)
    batch = ([(600, 40), (333, 5), (900, 200)], [(2048, 1), (700, 1), (31, 1)])
    for w in (17, 256):
        for spec in (AttentionSpec(sliding_window=w), AttentionSpec(sliding_window=w, sinks=True)):
            _check_random_batch(
                rng, 16, dtype, CPU, seed, backend, (4, 1, 256), batch, backend == "cpu",
                spec=spec, sinks=torch.randn(4) if spec.sinks else None,
                poison_before_window=True,
            )  # fmt: skip


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_default_spec_is_exactly_no_spec(backend: str, dtype: torch.dtype) -> None:
    """``AttentionSpec()``, or one naming the default scale, gives the very bits of
    ``spec=None`` (the same paths, the same kernel call)."""
    seed = random.randrange(1 << 30)
    outs = []
    for spec in (None, AttentionSpec(), AttentionSpec(scale=64**-0.5)):
        rng = random.Random(seed)
        torch.manual_seed(seed)
        batch = ([(0, 30), (40, 20), (33, 3)], [(50, 1), (17, 1)])
        _, out = _check_random_batch(
            rng, 16, dtype, CPU, seed, backend, (8, 2, 64), batch, spec=spec
        )
        outs.append(out)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


def test_spec_validation_names_the_field() -> None:
    for kwargs, field in (
        ({"sliding_window": 0}, "sliding_window"),
        ({"sliding_window": 2.5}, "sliding_window"),
        ({"sliding_window": True}, "sliding_window"),
        ({"logit_softcap": 0.0}, "logit_softcap"),
        ({"logit_softcap": float("inf")}, "logit_softcap"),
        ({"scale": -1.0}, "scale"),
        ({"scale": float("nan")}, "scale"),
    ):
        with pytest.raises(ValueError, match=field):
            AttentionSpec(**kwargs)
    assert AttentionSpec().resolve_scale(256) == 256**-0.5
    assert AttentionSpec(scale=144**-0.5).resolve_scale(128) == 144**-0.5


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_cpu_backends_support_every_spec(backend: str) -> None:
    attn = get_attention_backend(backend, CPU, 8, 2, 64, torch.float32, 16)
    spec = AttentionSpec(scale=0.1, sliding_window=4096, logit_softcap=50.0)
    assert attn.supports(None) is None
    assert attn.supports(spec) is None


needs_triton = pytest.mark.skipif(
    not triton_usable(GPU_DEVICE), reason="triton not installed (or no CUDA and no interpreter)"
)


# Under Triton's interpreter (no CUDA) these cost seconds a batch: small heads there, the
# module's head shapes on a GPU.
TRITON_HEADS = HEADS if GPU_DEVICE.type == "cuda" else [(4, 2, 32)]


@needs_triton
@pytest.mark.parametrize("heads", TRITON_HEADS, ids=str)
@pytest.mark.parametrize("kind", ["window+cap+scale", "sinks", "window+sinks"])
def test_triton_windows_caps_and_sinks_match_dense(heads, kind: str) -> None:
    """The Triton kernel under every spec on the window batches (decodes beside chunks,
    cached prefixes longer than the window, W = 1, windows across block edges); the pool
    is NaN outside what was written, so a read before a row's window shows."""
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    torch.manual_seed(seed)
    hd = heads[2]
    sinks = torch.randn(heads[0]) * 2.0 if "sinks" in kind else None
    for w, prefills, decodes in _batches(16):
        spec = AttentionSpec(
            sliding_window=w if "window" in kind else None,
            logit_softcap=3.0 if "cap" in kind else None,
            scale=4 * hd**-0.5 if "scale" in kind else None,
            sinks=sinks is not None,
        )
        _check_random_batch(
            rng, 16, torch.float32, GPU_DEVICE, seed, "triton", heads, (prefills, decodes),
            spec=spec, sinks=sinks,
        )  # fmt: skip


@needs_triton
def test_triton_window_off_by_one_is_caught(monkeypatch) -> None:
    """The comparison above sees the Triton kernel's window one key too wide."""
    from chunkserve.attention import triton_paged

    forward = triton_paged.TritonAttentionBackend.forward

    def wider(self, *args, spec=None, **kw):
        spec = AttentionSpec(sliding_window=spec.sliding_window + 1)
        return forward(self, *args, spec=spec, **kw)

    monkeypatch.setattr(triton_paged.TritonAttentionBackend, "forward", wider)
    rng = random.Random(5)
    torch.manual_seed(5)
    w, prefills, decodes = _batches(16)[2]
    with pytest.raises(AssertionError, match="max err"):
        _check_random_batch(
            rng, 16, torch.float32, GPU_DEVICE, 5, "triton", (4, 2, 32), (prefills, decodes),
            spec=AttentionSpec(sliding_window=w),
        )  # fmt: skip


@needs_triton
def test_triton_custom_scale_matches_dense() -> None:
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    torch.manual_seed(seed)
    batch = ([(0, 9), (20, 5)], [(30, 1)])
    _check_random_batch(
        rng,
        16,
        torch.float32,
        GPU_DEVICE,
        seed,
        "triton",
        (4, 2, 32),
        batch,
        spec=AttentionSpec(scale=0.3),
    )


# ---- attention sinks (GPT-OSS: a learned logit per head in every row's denominator) -------
@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("heads", [(8, 2, 64), (4, 1, 256), (4, 4, 64)], ids=str)
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_sinks_with_windows_match_dense(backend: str, heads, block_size: int, dtype) -> None:
    """Every path of the torch backend (first chunks, chunks behind a cache, short chunks,
    decodes) and of the C kernel (every continuing chunk sent to it, however long: its row,
    tile and scalar paths, key ranges split and merged) with sinks, alone and beside windows
    and a cap; sinks large enough to take a real share (a missing sink term is far outside
    the tolerance)."""
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    torch.manual_seed(seed)
    sinks = torch.randn(heads[0]) * 2.0
    scale = 0.2 if dtype == torch.float32 else None
    for w, prefills, decodes in _batches(block_size):
        for spec in (
            AttentionSpec(sinks=True),
            AttentionSpec(sliding_window=w, sinks=True),
            # (a scale of 0.2 over 256 dims makes bf16's rounding of peaked rows exceed the
            # bf16 tolerance with or without sinks: fp32 only)
            AttentionSpec(sliding_window=w, logit_softcap=30.0, scale=scale, sinks=True),
        ):
            _check_random_batch(
                rng, block_size, dtype, CPU, seed, backend, heads, (prefills, decodes),
                all_to_kernel=backend == "cpu", spec=spec, sinks=sinks,
            )  # fmt: skip


def test_a_missing_sink_term_is_caught(monkeypatch) -> None:
    """A backend that drops the sinks from the softmax fails the check above."""
    from chunkserve.attention import torch_ref

    softmax = torch_ref._softmax
    monkeypatch.setattr(torch_ref, "_softmax", lambda scores, sinks: softmax(scores, None))
    rng = random.Random(3)
    torch.manual_seed(3)
    w, prefills, decodes = _batches(16)[3]
    with pytest.raises(AssertionError, match="max err"):
        _check_random_batch(
            rng, 16, torch.float32, CPU, 3, "torch", (8, 2, 64), (prefills, decodes),
            spec=AttentionSpec(sliding_window=w, sinks=True), sinks=torch.full((8,), 1.0),
        )  # fmt: skip


@needs_cpu_kernel
@pytest.mark.parametrize("wrong", ["dropped", "other head"])
def test_the_kernel_missing_or_misplacing_sinks_is_caught(monkeypatch, wrong: str) -> None:
    """The kernel called without its sinks, or with them on the wrong heads, fails the check
    (the torch path's first chunks keep theirs, so only the kernel's rows differ)."""
    from chunkserve.attention import cpu_kernels

    call = cpu_kernels.PagedAttentionKernel.__call__

    def broken(self, *args):
        *args, sinks, fixed_range = args  # the backend passes every argument, these last
        if sinks is not None:
            sinks = None if wrong == "dropped" else sinks.roll(1).contiguous()
        return call(self, *args, sinks, fixed_range)

    monkeypatch.setattr(cpu_kernels.PagedAttentionKernel, "__call__", broken)
    rng = random.Random(3)
    torch.manual_seed(3)
    w, prefills, decodes = _batches(16)[3]
    with pytest.raises(AssertionError, match="max err"):
        _check_random_batch(
            rng, 16, torch.float32, CPU, 3, "cpu", (8, 2, 64), (prefills, decodes), True,
            spec=AttentionSpec(sliding_window=w, sinks=True), sinks=torch.randn(8) * 2.0,
        )  # fmt: skip


def test_sinks_are_supported_by_the_cpu_backends() -> None:
    spec = AttentionSpec(sliding_window=128, sinks=True)
    assert get_attention_backend("torch", CPU, 8, 2, 64, torch.float32, 16).supports(spec) is None
    with pytest.raises(ValueError, match="sinks"):
        AttentionSpec(sinks=1)  # type: ignore[arg-type]
    if shutil.which("gcc") or shutil.which("cc"):
        cpu = get_attention_backend("cpu", CPU, 8, 2, 64, torch.float32, 16)
        assert cpu.supports(spec) is None
        cpu.check_spec(spec)
        kernel = cpu.kernel
        q = torch.zeros(1, 8, 64)
        cache = torch.zeros(2, 16, 2, 64)
        index = torch.zeros(1, dtype=torch.int64)
        for bad in (torch.zeros(8, dtype=torch.float64), torch.zeros(4), torch.zeros(16)[::2]):
            with pytest.raises(ValueError, match="sinks"):
                kernel(
                    q, cache, cache, q.clone(), index.view(1, 1), index, index + 1, index + 1,
                    0.1, sinks=bad,
                )  # fmt: skip
