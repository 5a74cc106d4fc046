"""Llama-family decoder over one flat batch of tokens from many requests.

RMSNorm, rotary embeddings (the file's theta, optional llama3/linear scaling), grouped-query
attention through an ``AttentionBackend`` over the paged KV cache, SwiGLU MLP, tied or separate
LM head. Q/K/V and gate/up projections are fused into one matmul each. Numerics follow HF
transformers' ``LlamaForCausalLM`` (norms in fp32, cast back before the weight multiply).

Tensor parallel: given a ``ShardPlan`` and its ``TPGroup``, the model holds one rank's share
(see ``distributed.shard``): its query/KV heads, MLP columns and vocabulary rows, with an
all-reduce after the output and down projections and after the embedding lookup, and the
LM head's logits gathered to rank 0.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from chunkserve.attention.base import AttentionBackend, BatchLayout
from chunkserve.config import ModelConfig
from chunkserve.distributed.shard import ShardPlan, plan_shards

if TYPE_CHECKING:
    from chunkserve.distributed.group import TPGroup


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2] in fp32, with HF's rope scaling variants."""
    dim = config.head_dim
    inv_freq = 1.0 / (
        config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
    )
    scaling = config.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind == "llama3":
        factor = float(scaling["factor"])
        low = float(scaling.get("low_freq_factor", 1.0))
        high = float(scaling.get("high_freq_factor", 4.0))
        old_len = float(scaling["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, smoothed, scaled)
    raise ValueError(f"rope_scaling: type {kind!r} is not supported")


# On a CPU, a step of more rows runs its MLP in slices of this many: the intermediate
# activations (gate and up, 2 x 1,536 wide for the embedded model: 25 MB at 2,048 fp32 rows,
# and SiLU's and the product's copies) are the largest temporaries of a step, and the heap
# keeps its high-water mark resident (measured: the offline benchmark's peak RSS 50 MiB
# higher at a 2,048-token budget than at 512). Matmuls of 512 rows already run at the
# large-matrix rate.
MLP_SLICE_ROWS = 512


class RotaryEmbedding(nn.Module):
    """Precomputed cos/sin tables [max_positions, head_dim] indexed by absolute position."""

    def __init__(self, config: ModelConfig, max_positions: int, device: torch.device) -> None:
        super().__init__()
        inv_freq = rope_inv_freq(config).to(device)
        pos = torch.arange(max_positions, device=device, dtype=torch.float32)
        freqs = torch.outer(pos, inv_freq)  # [P, hd/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [P, hd]
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def forward(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # [T, 1, hd]: broadcast over heads.
        return (
            self.cos[positions].to(dtype)[:, None, :],
            self.sin[positions].to(dtype)[:, None, :],
        )


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class DecoderLayer(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        dtype: torch.dtype,
        device: torch.device,
        shard: ShardPlan,
        group: TPGroup | None = None,
    ) -> None:
        super().__init__()
        h, hd = config.hidden_size, config.head_dim
        # This rank's heads and MLP columns (all of them without tensor parallelism).
        self.num_heads, self.num_kv_heads, self.head_dim = shard.num_heads, shard.num_kv_heads, hd
        self.q_size = self.num_heads * hd
        self.kv_size = self.num_kv_heads * hd
        self.intermediate_size = shard.intermediate_size
        self.eps = config.rms_norm_eps
        self.group = group

        def param(*shape: int) -> nn.Parameter:
            return nn.Parameter(
                torch.empty(*shape, dtype=dtype, device=device), requires_grad=False
            )

        self.input_norm = param(h)
        self.qkv_proj = param(self.q_size + 2 * self.kv_size, h)
        self.qkv_bias = param(self.q_size + 2 * self.kv_size) if config.attention_bias else None
        self.o_proj = param(h, self.q_size)
        self.post_norm = param(h)
        self.gate_up_proj = param(2 * self.intermediate_size, h)
        self.down_proj = param(h, self.intermediate_size)

    def _reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over ranks of a row-parallel projection's partial output."""
        return x if self.group is None else self.group.all_reduce(x)

    def forward(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        attn: AttentionBackend,
        layout: BatchLayout,
        attn_meta: object,
    ) -> torch.Tensor:
        t = hidden.shape[0]
        x = rms_norm(hidden, self.input_norm, self.eps)
        qkv = F.linear(x, self.qkv_proj, self.qkv_bias)  # [T, (H + 2 Hkv) hd]
        q, k, v = qkv.split((self.q_size, self.kv_size, self.kv_size), dim=-1)
        q = apply_rope(q.view(t, self.num_heads, self.head_dim), cos, sin)
        k = apply_rope(k.view(t, self.num_kv_heads, self.head_dim), cos, sin)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        o = attn.forward(q, k, v, k_cache, v_cache, layout, attn_meta)
        hidden = hidden + self._reduce(F.linear(o.view(t, self.q_size), self.o_proj))

        x = rms_norm(hidden, self.post_norm, self.eps)
        return hidden + self._reduce(self.mlp(x))

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        """The MLP over ``x``'s rows; on a CPU in slices of ``MLP_SLICE_ROWS``."""
        t = x.shape[0]
        if t <= MLP_SLICE_ROWS or x.device.type != "cpu":
            return self._mlp(x)
        out = torch.empty_like(x)
        for r0 in range(0, t, MLP_SLICE_ROWS):
            out[r0 : r0 + MLP_SLICE_ROWS] = self._mlp(x[r0 : r0 + MLP_SLICE_ROWS])
        return out

    def _mlp(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = F.linear(x, self.gate_up_proj).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, self.down_proj)

    def forward_fused(
        self,
        delta: torch.Tensor,
        residual: torch.Tensor | None,
        positions: torch.Tensor,
        rotary: RotaryEmbedding,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        attn: AttentionBackend,
        layout: BatchLayout,
        attn_meta: object,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``forward`` with fused kernels (see ``fused_ops``): the hidden state is carried as
        ``residual + delta`` so each residual add is fused into the next norm. The first
        layer gets the embeddings as ``delta`` and no residual."""
        from chunkserve.model import fused_ops as ops

        t = delta.shape[0]
        x, residual = ops.add_rms_norm(delta, residual, self.input_norm, self.eps)
        qkv = F.linear(x, self.qkv_proj, self.qkv_bias)
        q, k, v = ops.rotary_qkv(
            qkv, positions, rotary.cos, rotary.sin, self.num_heads, self.num_kv_heads, self.head_dim
        )
        o = attn.forward(q, k, v, k_cache, v_cache, layout, attn_meta)
        x, residual = ops.add_rms_norm(
            self._reduce(F.linear(o.view(t, self.q_size), self.o_proj)),
            residual,
            self.post_norm,
            self.eps,
        )
        delta = F.linear(ops.silu_mul(F.linear(x, self.gate_up_proj)), self.down_proj)
        return self._reduce(delta), residual


class LlamaModel(nn.Module):
    """``forward`` maps a BatchLayout to hidden states [T, hidden]; ``compute_logits`` maps the
    rows to sample to fp32 logits [S, vocab] (on rank 0; None on the other ranks)."""

    def __init__(
        self,
        config: ModelConfig,
        dtype: torch.dtype,
        device: torch.device,
        max_positions: int,
        shard: ShardPlan | None = None,
        group: TPGroup | None = None,
    ) -> None:
        super().__init__()
        self.config = config
        self.dtype = dtype
        self.shard = shard = shard or plan_shards(config, 1, 0)
        self.group = group if shard.size > 1 else None
        vocab_rows = shard.vocab_shard  # V, or this rank's ceil(V / N) rows
        self.embed = nn.Parameter(
            torch.zeros(vocab_rows, config.hidden_size, dtype=dtype, device=device),
            requires_grad=False,
        )
        self.layers = nn.ModuleList(
            DecoderLayer(config, dtype, device, shard, self.group) for _ in range(config.num_layers)
        )
        self.norm = nn.Parameter(
            torch.empty(config.hidden_size, dtype=dtype, device=device), requires_grad=False
        )
        self.lm_head = (
            self.embed
            if config.tie_word_embeddings
            else nn.Parameter(
                torch.zeros(vocab_rows, config.hidden_size, dtype=dtype, device=device),
                requires_grad=False,
            )
        )
        self.rotary = RotaryEmbedding(config, max_positions, device)
        # Fused elementwise kernels (Triton; see fused_ops). The engine turns them on on CUDA.
        self.fused_ops = False

    def forward(
        self,
        layout: BatchLayout,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        attn: AttentionBackend,
        attn_meta: object,
    ) -> torch.Tensor:
        hidden = self.embed_tokens(layout.input_ids)  # [T, hidden]
        if self.fused_ops:
            residual = None
            for layer, (k_cache, v_cache) in zip(self.layers, kv_caches, strict=True):
                hidden, residual = layer.forward_fused(
                    hidden,
                    residual,
                    layout.positions,
                    self.rotary,
                    k_cache,
                    v_cache,
                    attn,
                    layout,
                    attn_meta,
                )
            return hidden if residual is None else residual + hidden
        cos, sin = self.rotary(layout.positions, self.dtype)
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches, strict=True):
            hidden = layer(hidden, cos, sin, k_cache, v_cache, attn, layout, attn_meta)
        return hidden

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[T] token ids -> [T, hidden]. Vocabulary-parallel: each rank looks up the ids in
        its rows (zeros for the others') and the all-reduce sums the ranks' parts."""
        if self.group is None:
            return F.embedding(input_ids, self.embed)
        local = input_ids - self.shard.vocab_start
        outside = (local < 0) | (local >= self.shard.vocab_shard)
        x = F.embedding(local.masked_fill(outside, 0), self.embed)
        return self.group.all_reduce(x.masked_fill_(outside[:, None], 0))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        x = rms_norm(hidden, self.norm, self.config.rms_norm_eps)
        logits = F.linear(x, self.lm_head).float()  # [S, V], or [S, V / N] on a rank
        if self.group is None:
            return logits
        return self.group.gather_vocab(logits, self.config.vocab_size)

    def _weight_targets(self) -> dict[str, tuple[torch.Tensor, tuple[slice, ...]]]:
        """HF weight name -> (the tensor it fills: a parameter or a row slice of a fused one,
        the slice of the checkpoint tensor this rank takes)."""
        cfg, shard, hd = self.config, self.shard, self.config.head_dim
        whole = (slice(None),)
        v0, v1 = shard.vocab
        vocab = (slice(v0, v1),)
        targets = {
            "model.embed_tokens.weight": (self.embed[: v1 - v0], vocab),
            "model.norm.weight": (self.norm, whole),
        }
        if not cfg.tie_word_embeddings:
            targets["lm_head.weight"] = (self.lm_head[: v1 - v0], vocab)
        (q0, q1), (k0, k1) = shard.q_heads, shard.kv_heads
        i0, i1 = shard.intermediate
        # Column-parallel: this rank's output rows; row-parallel: its input columns.
        src_rows = {"q": slice(q0 * hd, q1 * hd), "k": slice(k0 * hd, k1 * hd)}
        src_rows["v"] = src_rows["k"]
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            q, kv, inter = layer.q_size, layer.kv_size, layer.intermediate_size
            qkv_rows = {"q": slice(0, q), "k": slice(q, q + kv), "v": slice(q + kv, q + 2 * kv)}
            for n, rows in qkv_rows.items():
                src = (src_rows[n],)
                targets[p + f"self_attn.{n}_proj.weight"] = (layer.qkv_proj[rows], src)
                if layer.qkv_bias is not None:
                    targets[p + f"self_attn.{n}_proj.bias"] = (layer.qkv_bias[rows], src)
            targets[p + "self_attn.o_proj.weight"] = (layer.o_proj, (slice(None), src_rows["q"]))
            targets[p + "mlp.gate_proj.weight"] = (layer.gate_up_proj[:inter], (slice(i0, i1),))
            targets[p + "mlp.up_proj.weight"] = (layer.gate_up_proj[inter:], (slice(i0, i1),))
            targets[p + "mlp.down_proj.weight"] = (layer.down_proj, (slice(None), slice(i0, i1)))
            targets[p + "input_layernorm.weight"] = (layer.input_norm, whole)
            targets[p + "post_attention_layernorm.weight"] = (layer.post_norm, whole)
        return targets

    @torch.no_grad()
    def init_dummy_weights(self, seed: int = 0) -> None:
        """Random weights of the right shapes, drawn on the model's device (``load_format
        dummy``): norms 1, biases 0, the rest N(0, 0.02) as HF initialises Llama."""
        gen = torch.Generator(device=self.embed.device)
        gen.manual_seed(seed + self.shard.rank)
        for name, param in self.named_parameters():
            if name.endswith("norm"):
                param.fill_(1.0)
            elif name.endswith("bias"):
                param.zero_()
            else:
                param.normal_(0.0, 0.02, generator=gen)

    def _checkpoint_shapes(self) -> dict[str, tuple[int, ...]]:
        """Each weight's shape in the checkpoint: the unsharded model's (built on the meta
        device: shapes only, no memory)."""
        full = self
        if self.shard.size > 1:
            full = LlamaModel(self.config, self.dtype, torch.device("meta"), max_positions=1)
        return {name: tuple(dst.shape) for name, (dst, _) in full._weight_targets().items()}

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors (``model.layers.N.self_attn.q_proj.weight`` ...) into the
        fused parameters as they stream in, so peak memory is the model plus one tensor. A
        tensor-parallel rank copies its slice of each."""
        targets = self._weight_targets()
        shapes = self._checkpoint_shapes()
        for name, tensor in weights:
            if name not in targets:
                if name.endswith("rotary_emb.inv_freq") or (
                    name == "lm_head.weight" and self.config.tie_word_embeddings
                ):
                    continue  # derived, or a copy of the tied embedding
                raise ValueError(f"model: unexpected weight {name!r} in checkpoint")
            dst, part = targets.pop(name)
            expected = shapes[name]
            if tuple(tensor.shape) != expected:
                raise ValueError(
                    f"model: weight {name!r} has shape {tuple(tensor.shape)}, expected {expected}"
                )
            dst.copy_(tensor[part])
        if targets:
            missing = sorted(targets)
            raise ValueError(
                f"model: {len(missing)} weight(s) missing from the checkpoint, e.g. {missing[:3]}"
            )
