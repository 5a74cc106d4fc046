"""The fused Triton kernels of the decoder layer against the plain torch ops they replace, on
fresh random data (CUDA when present, else Triton's interpreter), and the whole model with
fused ops against the plain path on the same batch."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from chunkserve.attention import triton_usable
from chunkserve.model.llama import apply_rope, rms_norm
from tests.test_gpu_path import _prompts, tiny_model_dir  # noqa: F401 (fixture)

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
pytestmark = pytest.mark.skipif(not triton_usable(DEVICE), reason="triton not installed")
DTYPES = [torch.float32, torch.bfloat16]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [64, 576])
def test_add_rms_norm(dtype: torch.dtype, hidden: int) -> None:
    from chunkserve.model.fused_ops import add_rms_norm

    x = torch.randn(7, hidden, device=DEVICE).to(dtype)
    res = torch.randn(7, hidden, device=DEVICE).to(dtype)
    w = (1 + 0.1 * torch.randn(hidden, device=DEVICE)).to(dtype)
    want_res = res + x
    want = rms_norm(want_res, w, 1e-5)
    res_in = res.clone()
    got, got_res = add_rms_norm(x, res_in, w, 1e-5)
    assert got_res is res_in  # updated in place
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    # (bf16 within rounding: Triton's interpreter truncates where GPUs round to nearest)
    assert _rel(got_res, want_res) < tol
    assert _rel(got, want) < tol
    got, same = add_rms_norm(x, None, w, 1e-5)  # first layer: no residual yet
    assert same is x and _rel(got, rms_norm(x, w, 1e-5)) < tol


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 2, 16), (9, 3, 64)])
def test_rotary_qkv(dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int) -> None:
    from chunkserve.model.fused_ops import rotary_qkv

    t = 11
    width = (heads + 2 * kv_heads) * head_dim
    qkv = torch.randn(t, width, device=DEVICE).to(dtype)
    positions = torch.tensor(random.sample(range(300), t), device=DEVICE)
    inv = 1.0 / (10000 ** (torch.arange(0, head_dim, 2, device=DEVICE).float() / head_dim))
    freqs = torch.outer(torch.arange(300, device=DEVICE).float(), inv)
    cos, sin = torch.cat((freqs, freqs), -1).cos(), torch.cat((freqs, freqs), -1).sin()
    q_ref, k_ref, v_ref = qkv.split(
        (heads * head_dim, kv_heads * head_dim, kv_heads * head_dim), dim=-1
    )
    c, s = cos[positions].to(dtype)[:, None], sin[positions].to(dtype)[:, None]
    want_q = apply_rope(q_ref.view(t, heads, head_dim), c, s)
    want_k = apply_rope(k_ref.view(t, kv_heads, head_dim), c, s)
    q, k, v = rotary_qkv(qkv, positions, cos, sin, heads, kv_heads, head_dim)
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    assert _rel(q, want_q) < tol and _rel(k, want_k) < tol
    assert torch.equal(v, v_ref.view(t, kv_heads, head_dim))


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul(dtype: torch.dtype) -> None:
    from chunkserve.model.fused_ops import silu_mul

    gate_up = torch.randn(5, 2 * 1500, device=DEVICE).to(dtype)  # crosses a 1024 block
    gate, up = gate_up.chunk(2, dim=-1)
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    assert _rel(silu_mul(gate_up), F.silu(gate) * up) < tol


def test_model_with_fused_ops_matches_plain(tiny_model_dir) -> None:  # noqa: F811
    from chunkserve.engine.engine import Engine
    from chunkserve.scheduling.sampling_params import SamplingParams

    engine = Engine(
        model=str(tiny_model_dir),
        load_format="dummy",
        device=str(DEVICE),
        dtype="float32",
        attention_backend="triton",
        enforce_eager=True,
        kv_cache_memory=8 << 20,
    )
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    for p in _prompts(5):
        engine.add_request(prompt_token_ids=p, sampling_params=params)
    out = engine.core.scheduler.schedule()
    layout, _ = engine.core.worker.runner.build_layout(out)
    runner = engine.core.worker.runner
    hidden = {}
    for fused in (False, True):
        engine.core.worker.model.fused_ops = fused
        meta = runner.attn.prepare(layout)
        with torch.inference_mode():
            hidden[fused] = engine.core.worker.model(layout, runner.kv_caches, runner.attn, meta)
    n = layout.num_tokens
    assert _rel(hidden[True][:n], hidden[False][:n]) < 1e-5
