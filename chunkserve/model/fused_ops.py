"""Fused elementwise kernels for the decoder layer on GPUs (Triton).

The plain layer launches ~20 small kernels per layer besides its matmuls and attention: RMSNorm
in fp32 (convert, square, mean, rsqrt, multiply, convert, weight), the residual adds, rotary
embeddings (gather cos/sin, convert, negate, concatenate, multiply, add, for q and for k), and
SiLU times up. At 32 layers that is ~700 launches a step, a few microseconds each even inside
a CUDA graph: on an H100 it was most of the gap between an 8B decode step and its bandwidth
floor. Here each group is one kernel:

- ``add_rms_norm(x, residual, w)``: residual += x (rounded to the model dtype, as the plain
  path's add is), then RMSNorm of the sum in fp32, cast, times the weight; returns (normed,
  residual). One row per program.
- ``rotary_qkv(qkv, positions, cos, sin)``: rotates the q and k heads of the fused QKV
  projection's output in fp32 (half-split "rotate_half" layout, as HF Llama) and writes q and k
  contiguous; v stays a view. One token per program.
- ``silu_mul(gate_up)``: silu(gate) * up from the fused gate/up output.

Every kernel matches the plain torch ops (``tests/test_fused_ops.py``: on CUDA, or under
Triton's interpreter on a CPU). The model uses them only on CUDA with ``fused_ops`` on.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


@triton.jit
def _add_rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, n_cols, eps, HAS_RES: tl.constexpr, BLOCK: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * n_cols + cols, mask=mask, other=0.0)
    if HAS_RES:
        x = (x.to(tl.float32) + tl.load(res_ptr + row * n_cols + cols, mask=mask, other=0.0)).to(
            x.dtype
        )
        tl.store(res_ptr + row * n_cols + cols, x, mask=mask)
    xf = x.to(tl.float32)
    var = tl.sum(xf * xf, axis=0) / n_cols
    normed = (xf * tl.rsqrt(var + eps)).to(x.dtype)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    tl.store(out_ptr + row * n_cols + cols, (normed.to(tl.float32) * w).to(x.dtype), mask=mask)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm(x + residual) * weight, x + residual); ``residual`` (if given) is updated in
    place. x, residual: [T, hidden] contiguous."""
    if not x.is_contiguous():
        x = x.contiguous()
    t, n = x.shape
    out = torch.empty_like(x)
    if residual is None:
        residual = x
        has_res = False
    else:
        has_res = True
    if t:
        _add_rms_norm_kernel[(t,)](
            x, residual, weight, out, n, eps, HAS_RES=has_res, BLOCK=_pow2(n), num_warps=4
        )
    return out, residual


@triton.jit
def _rotary_kernel(
    qkv_ptr,
    pos_ptr,
    cos_ptr,
    sin_ptr,
    q_ptr,
    k_ptr,
    stride_qkv,
    NUM_Q_HEADS: tl.constexpr,
    NUM_K_HEADS: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t)
    heads = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_HALF)
    d_ok = d < HALF
    # cos/sin tables are [P, 2 * HALF] with both halves equal (HF layout): read the first.
    cos = tl.load(cos_ptr + pos * 2 * HALF + d, mask=d_ok, other=0.0)[None, :]
    sin = tl.load(sin_ptr + pos * 2 * HALF + d, mask=d_ok, other=0.0)[None, :]
    head_dim = 2 * HALF
    src = qkv_ptr + t * stride_qkv + heads[:, None] * head_dim + d[None, :]
    # q heads, then k heads (they follow q in the fused projection's output).
    for which in tl.static_range(2):
        if which == 0:
            n_heads = NUM_Q_HEADS
            base = src
            dst = q_ptr + t * NUM_Q_HEADS * head_dim + heads[:, None] * head_dim + d[None, :]
        else:
            n_heads = NUM_K_HEADS
            base = src + NUM_Q_HEADS * head_dim
            dst = k_ptr + t * NUM_K_HEADS * head_dim + heads[:, None] * head_dim + d[None, :]
        mask = (heads < n_heads)[:, None] & d_ok[None, :]
        x1 = tl.load(base, mask=mask, other=0.0)
        x2 = tl.load(base + HALF, mask=mask, other=0.0)
        # Rounded as the plain path rounds (cos/sin, each product, the sum in x's dtype).
        c = cos.to(x1.dtype).to(tl.float32)
        s = sin.to(x1.dtype).to(tl.float32)
        x1f, x2f = x1.to(tl.float32), x2.to(tl.float32)
        a1 = (x1f * c).to(x1.dtype).to(tl.float32)
        b1 = (x2f * s).to(x1.dtype).to(tl.float32)
        a2 = (x2f * c).to(x1.dtype).to(tl.float32)
        b2 = (x1f * s).to(x1.dtype).to(tl.float32)
        tl.store(dst, (a1 - b1).to(x1.dtype), mask=mask)
        tl.store(dst + HALF, (a2 + b2).to(x1.dtype), mask=mask)


def rotary_qkv(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """qkv [T, (H + 2 Hkv) * hd] -> q [T, H, hd], k [T, Hkv, hd] rotated (new tensors), and v
    [T, Hkv, hd] (a view). cos/sin: fp32 tables [max_positions, hd]."""
    t = qkv.shape[0]
    q = torch.empty(t, num_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    k = torch.empty(t, num_kv_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    v = qkv[:, (num_heads + num_kv_heads) * head_dim :].view(t, num_kv_heads, head_dim)
    if t:
        half = head_dim // 2
        _rotary_kernel[(t,)](
            qkv,
            positions,
            cos,
            sin,
            q,
            k,
            qkv.stride(0),
            NUM_Q_HEADS=num_heads,
            NUM_K_HEADS=num_kv_heads,
            HALF=half,
            BLOCK_H=_pow2(max(num_heads, num_kv_heads)),
            BLOCK_HALF=_pow2(half),
            num_warps=4,
        )
    return q, k, v


@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, n_cols, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    gate = tl.load(x_ptr + row * 2 * n_cols + cols, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * 2 * n_cols + n_cols + cols, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    # The plain path rounds silu(gate) to the model dtype before the product.
    act = (g / (1.0 + tl.exp(-g))).to(gate.dtype).to(tl.float32)
    tl.store(out_ptr + row * n_cols + cols, (act * up.to(tl.float32)).to(gate.dtype), mask=mask)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2 I] -> silu(gate_up[:, :I]) * gate_up[:, I:], [T, I]."""
    t, two_i = gate_up.shape
    n = two_i // 2
    out = torch.empty(t, n, dtype=gate_up.dtype, device=gate_up.device)
    if t:
        block = 1024
        _silu_mul_kernel[(t, triton.cdiv(n, block))](gate_up, out, n, BLOCK=block, num_warps=4)
    return out
