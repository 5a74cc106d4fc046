"""DeepSeek-V2 (V2, V2-Lite, V2.5): multi-head latent attention (MLA) and a mixture of
experts with DeepSeek's grouped router and ungated shared experts (``moe``), the first
``first_k_dense_replace`` layers dense.

Multi-head latent attention. Per token, ``kv_a_proj_with_mqa`` gives a latent ``c`` of
``kv_lora_rank`` values (RMS-normed) and one rope key ``k_pe`` of ``qk_rope_head_dim`` values
shared by every head; head h's key is ``[W_UK_h c, k_pe]`` and its value ``W_UV_h c``
(``kv_b_proj`` = [W_UK_h; W_UV_h] per head). Queries: ``q_proj``, or ``q_b_proj(norm(q_a_proj
x))`` with ``q_lora_rank``; split into a no-rope part and a rope part per head. The rope is
YaRN's (``layers.rope_inv_freq``: its attention factor in cos/sin) applied to interleaved
pairs (dims 2i, 2i+1), as DeepSeek rotates; the softmax scale is ``qk_head_dim ** -0.5``
times YaRN's ``mscale(factor, mscale_all_dim) ** 2``.

The paged cache (``KVLayout.latent``) keeps per token per layer only ``[c, k_pe]`` (the roped
key part): ``kv_lora_rank + qk_rope_head_dim`` values, no heads. Two ways to attend:

- decode rows (through the attention backend, one KV "head" of the latent's width): the
  up-projections are absorbed into the query: ``q_h . k_h = (W_UK_h^T q_nope_h) . c +
  q_pe_h . k_pe``, so the query ``[W_UK_h^T q_nope_h, q_pe_h]`` attends over the cached
  latents themselves (MQA), its output (the latent part of the attended latents) is mapped
  by ``W_UV_h`` to the head's value;
- prefill chunks: the latents of the chunk and of its cached prefix expand to every head's
  keys and values (``kv_b_proj``), causal attention over them (one chunk at a time).

Tensor parallel: the heads are divided (``q_proj``/``q_b_proj``/``kv_b_proj`` rows,
``o_proj`` columns, all-reduced after); the latent projections and the cache are whole on
every rank.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from chunkserve.attention.base import AttentionSpec, BatchLayout
from chunkserve.config import ModelConfig, rope_type
from chunkserve.distributed.shard import ShardPlan
from chunkserve.model.decoder import DecoderLM
from chunkserve.model.layers import (
    ColumnParallelLinear,
    RMSNorm,
    RowParallelLinear,
    Target,
    _yarn_mscale,
)
from chunkserve.model.lazy import LazyTensor
from chunkserve.model.moe import MOE_NAMES, gguf_moe_names
from chunkserve.model.registry import GGUFJoin, GGUFSpec, KVLayout, register

if TYPE_CHECKING:
    from chunkserve.attention.base import AttentionBackend
    from chunkserve.distributed.group import TPGroup

# DeepSeek's MoE block: experts.N.{gate,up,down}_proj, the router "gate", ungated
# "shared_experts".
DEEPSEEK_NAMES = {**MOE_NAMES, "shared": "shared_experts"}
# The eps of DeepSeek's q_a / kv_a norms (built without the config's rms_norm_eps).
LATENT_NORM_EPS = 1e-6


def softmax_scale(config: ModelConfig) -> float:
    """``qk_head_dim ** -0.5``, times YaRN's ``mscale(factor, mscale_all_dim) ** 2`` for a
    scaled rope with ``mscale_all_dim`` (transformers' ``yarn_apply_mscale``)."""
    scale = (config.qk_nope_head_dim + config.head_dim) ** -0.5
    scaling = config.rope_scaling or {}
    if rope_type(scaling) != "default" and scaling.get("mscale_all_dim"):
        m = _yarn_mscale(float(scaling["factor"]), float(scaling["mscale_all_dim"]))
        scale *= m * m
    return scale


def rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (2i, 2i + 1) of ``x`` [T, H, rd] by frequency i (DeepSeek's complex
    rotation); ``cos``/``sin`` [T, 1, rd] as ``RotaryEmbedding`` gives them (each frequency
    twice, half-split), in fp32 and back to ``x``'s dtype."""
    half = x.shape[-1] // 2
    c, s = cos[..., :half].float(), sin[..., :half].float()
    x1, x2 = x[..., 0::2].float(), x[..., 1::2].float()
    return torch.stack((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1).flatten(-2).to(x.dtype)


class LatentStep:
    """What a step's latent-attention layers share: the prefill chunks (rows, first
    position, keys, cached blocks) attended by expansion, and the decode rows' layout and
    backend metadata (``BatchLayout.decodes_only``, prepared once per step when the step
    also has chunks)."""

    def __init__(self, layout: BatchLayout, attn: AttentionBackend, attn_meta: object) -> None:
        self.chunks: list[tuple[int, int, int, int, torch.Tensor | None]] = []
        device = layout.input_ids.device
        for i in range(layout.num_prefill_seqs):
            r0, r1 = layout.query_start_host[i], layout.query_start_host[i + 1]
            start, keys = layout.context_start_host[i], layout.seq_lens_k_host[i]
            blocks = None
            if start > 0:
                n = -(-keys // layout.block_size)
                blocks = torch.tensor(
                    layout.block_tables_host[i][:n], dtype=torch.int64, device=device
                )
            self.chunks.append((r0, r1, start, keys, blocks))
        self.rows = layout.num_prefill_tokens  # the decodes' first row
        self.decode_layout: BatchLayout | None = None
        self.decode_meta: object = None
        if layout.num_decode_tokens:
            if layout.num_prefill_seqs:
                self.decode_layout = layout.decodes_only()
                self.decode_meta = attn.prepare(self.decode_layout)
            else:
                self.decode_layout, self.decode_meta = layout, attn_meta


class LatentAttention(nn.Module):
    """DeepSeek's multi-head latent attention over the latent cache (module docstring)."""

    def __init__(
        self,
        config: ModelConfig,
        shard: ShardPlan,
        dtype: torch.dtype,
        device: torch.device,
        group: TPGroup | None,
    ) -> None:
        super().__init__()
        assert config.kv_lora_rank is not None
        h = config.hidden_size
        self.rank_dim, self.rope_dim = config.kv_lora_rank, config.head_dim
        self.nope_dim, self.v_dim = config.qk_nope_head_dim, config.v_head_dim
        self.qk_dim = self.nope_dim + self.rope_dim
        self.num_heads = shard.num_heads
        h0, h1 = shard.q_heads
        full = config.num_heads
        bias = config.attention_bias
        qk, kv = self.qk_dim, self.nope_dim + self.v_dim
        self.q_lora = config.q_lora_rank
        self.q_a = self.q_a_norm = None
        q_rows = [(full * qk, (h0 * qk, h1 * qk))]  # this rank's heads
        if self.q_lora is None:
            self.q = ColumnParallelLinear(h, q_rows, False, dtype, device)
        else:
            r = self.q_lora
            self.q_a = ColumnParallelLinear(h, [(r, (0, r))], bias, dtype, device)
            self.q_a_norm = RMSNorm(r, LATENT_NORM_EPS, dtype, device)
            self.q = ColumnParallelLinear(r, q_rows, False, dtype, device)
        width = self.rank_dim + self.rope_dim
        self.kv_a = ColumnParallelLinear(h, [(width, (0, width))], bias, dtype, device)
        self.kv_a_norm = RMSNorm(self.rank_dim, LATENT_NORM_EPS, dtype, device)
        self.kv_b = ColumnParallelLinear(
            self.rank_dim, [(full * kv, (h0 * kv, h1 * kv))], False, dtype, device
        )
        self.kv_b.slot.accepts_quantized = False  # read as floats: absorbed into the queries
        self.o = RowParallelLinear(
            full * self.v_dim, h, (h0 * self.v_dim, h1 * self.v_dim), bias, dtype, device, group
        )
        self.scale = softmax_scale(config)
        self.spec = AttentionSpec(scale=self.scale)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache: torch.Tensor,
        _same_cache: torch.Tensor,
        attn: AttentionBackend,
        layout: BatchLayout,
        step: LatentStep,
    ) -> torch.Tensor:
        t, heads = x.shape[0], self.num_heads
        if self.q_a is None:
            q = self.q.forward(x)
        else:
            q = self.q.forward(self.q_a_norm.forward(self.q_a.forward(x)))
        q = q.view(t, heads, self.qk_dim)
        q_nope, q_pe = q.split((self.nope_dim, self.rope_dim), dim=-1)
        c, k_pe = self.kv_a.forward(x).split((self.rank_dim, self.rope_dim), dim=-1)
        q_pe = rope_interleaved(q_pe, cos, sin)
        k_pe = rope_interleaved(k_pe[:, None, :], cos, sin)
        latent = torch.cat((self.kv_a_norm.forward(c)[:, None, :], k_pe), dim=-1)  # [T, 1, W]
        # kv_b's rows per head: W_UK (nope_dim rows) then W_UV (v_dim rows), over the latent.
        w = self.kv_b.weight.view(heads, self.nope_dim + self.v_dim, self.rank_dim)
        out = x.new_zeros(t, heads, self.v_dim)
        if step.chunks:
            # The chunks attend by hand: the step's latents go to the cache first (the
            # decodes' again through the backend, harmlessly).
            if layout.fresh_block_ids.numel():
                cache.index_fill_(0, layout.fresh_block_ids, 0)
            n = layout.num_tokens
            cache.view(-1, 1, latent.shape[-1]).index_copy_(0, layout.slot_mapping[:n], latent[:n])
            for r0, r1, start, keys, blocks in step.chunks:
                if blocks is None:
                    lat = latent[r0:r1, 0]
                else:
                    lat = cache.index_select(0, blocks).view(-1, latent.shape[-1])[:keys]
                out[r0:r1] = self._expanded(q_nope[r0:r1], q_pe[r0:r1], lat, start)
        if step.decode_layout is not None:
            d = step.rows
            # The query absorbs W_UK: [T, H, nope] x [H, nope, rank] -> [T, H, rank].
            q_lat = torch.einsum("thn,hnr->thr", q_nope[d:], w[:, : self.nope_dim])
            q_abs = torch.cat((q_lat, q_pe[d:]), dim=-1)
            lat = latent[d:]
            o = attn.forward(
                q_abs, lat, lat, cache, cache, step.decode_layout, step.decode_meta, self.spec
            )
            # The attended latents' latent part through W_UV: -> [T, H, v_dim].
            out[d:] = torch.einsum("thr,hvr->thv", o[..., : self.rank_dim], w[:, self.nope_dim :])
        return self.o.forward(out.view(t, heads * self.v_dim))

    def _expanded(
        self, q_nope: torch.Tensor, q_pe: torch.Tensor, lat: torch.Tensor, start: int
    ) -> torch.Tensor:
        """One chunk's rows (first position ``start``) over the latents ``lat`` [S, W] of
        positions 0..S-1, expanded to every head's keys and values: [n, H, v_dim]."""
        n, s, heads = q_nope.shape[0], lat.shape[0], self.num_heads
        kv = self.kv_b.forward(lat[:, : self.rank_dim]).view(s, heads, -1)
        k_nope, v = kv.split((self.nope_dim, self.v_dim), dim=-1)
        k_pe = lat[:, None, self.rank_dim :].expand(s, heads, self.rope_dim)
        k = torch.cat((k_nope, k_pe), dim=-1)
        q = torch.cat((q_nope, q_pe), dim=-1)
        # Row i (position start + i) sees keys 0 .. start + i.
        pos = torch.arange(n, device=q.device)[:, None] + start
        mask = torch.arange(s, device=q.device)[None, :] <= pos
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1).float(),
            k.transpose(0, 1).float(),
            v.transpose(0, 1).float(),
            attn_mask=mask,
            scale=self.scale,
        )
        return o.transpose(0, 1).to(q.dtype)

    def targets(self, prefix: str, fused: str | None = None) -> dict[str, Target]:
        out: dict[str, Target] = {}
        if self.q_a is None:
            out.update(self.q.targets([prefix + "q_proj"]))
        else:
            out.update(self.q_a.targets([prefix + "q_a_proj"]))
            out.update(self.q_a_norm.targets(prefix + "q_a_layernorm.weight"))
            out.update(self.q.targets([prefix + "q_b_proj"]))
        out.update(self.kv_a.targets([prefix + "kv_a_proj_with_mqa"]))
        out.update(self.kv_a_norm.targets(prefix + "kv_a_layernorm.weight"))
        out.update(self.kv_b.targets([prefix + "kv_b_proj"]))
        out.update(self.o.targets(prefix + "o_proj"))
        return out


# ---- GGUF (llama.cpp's ``deepseek2``) --------------------------------------------------------
# The converter writes MLA as MQA: head_count_kv 1, key_length kv_lora_rank + rope dims,
# value_length kv_lora_rank (the latent), the per-head sizes as key_length_mla (no-rope +
# rope) and value_length_mla; rope.dimension_count is qk_rope_head_dim; the first
# leading_dense_block_count layers dense; experts stacked, the shared experts (ungated) as
# ffn_*_shexp with expert_shared_count experts' width; expert_weights_scale is
# routed_scaling_factor; YaRN's mscale_all_dim as rope.scaling.yarn_log_multiplier (0.1 x it;
# llama.cpp applies it as DeepSeek does when mscale == mscale_all_dim, as V2 ships: cos/sin
# unscaled, the softmax scale x mscale(factor, mscale_all_dim) ** 2). kv_b_proj is attn_kv_b,
# or (newer converters, for absorbed attention) attn_k_b, each head's W_UK transposed
# ([H, rank, nope]), and attn_v_b ([H, v, rank]).
# The router: expert_gating_func 1 (softmax, or no key: llama.cpp's default for deepseek2)
# is V2's, 2 (sigmoid) V3's "noaux_tc" with exp_probs_b.bias its e_score_correction_bias
# (the model family deepseek_v3); expert_weights_norm is norm_topk_prob; expert_group_count
# / expert_group_used_count are n_group / topk_group (newer converters write them for V2
# too: with softmax and more than one group, V2's group_limited_greedy, whose groups rank by
# their best expert as DeepSeek-V2's code does; llama.cpp's graph ranks every family's groups
# by their best two, as V3's). V3 / R1 files with their multi-token-prediction layers:
# nextn_predict_layers of the block_count blocks are MTP blocks, the last (a block's tensors
# and blk.N.nextn.*), not run: the model is the block_count - nextn_predict_layers before
# them (the loader's ``_check_blocks`` refuses a file where that does not hold).
_DEEPSEEK_TENSORS, _DEEPSEEK_EXPERTS = gguf_moe_names(DEEPSEEK_NAMES, shared=True)
_DEEPSEEK_TENSORS.update(
    {
        "attn_q_a.weight": "self_attn.q_a_proj.weight",
        "attn_q_a_norm.weight": "self_attn.q_a_layernorm.weight",
        "attn_q_b.weight": "self_attn.q_b_proj.weight",
        "attn_kv_a_mqa.weight": "self_attn.kv_a_proj_with_mqa.weight",
        "attn_kv_a_norm.weight": "self_attn.kv_a_layernorm.weight",
        "attn_kv_b.weight": "self_attn.kv_b_proj.weight",
        "exp_probs_b.bias": "mlp.gate.e_score_correction_bias",  # V3's correction bias
    }
)
_DEEPSEEK_KEYS = {
    "attention.head_count_kv": "_head_count_kv",
    "attention.key_length": "_key_length",
    "attention.value_length": "_value_length",
    "attention.key_length_mla": "_key_length_mla",
    "attention.value_length_mla": "v_head_dim",
    "attention.kv_lora_rank": "kv_lora_rank",
    "attention.q_lora_rank": "q_lora_rank",
    "rope.dimension_count": "_rope_dim",
    "rope.scaling.yarn_log_multiplier": "_yarn_log_mul",
    "leading_dense_block_count": "_leading_dense",
    "expert_shared_count": "_shared_count",
    "expert_weights_scale": ("routed_scaling_factor", float),
    "expert_gating_func": "_gating_func",
    "expert_group_count": "_group_count",
    "expert_group_used_count": "_group_used_count",
    "nextn_predict_layers": "_nextn",
}
# llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX (V2's, and a file without the key) and
# _SIGMOID (V3's).
_SOFTMAX_GATING, _SIGMOID_GATING = 1, 2


def _kv_b_from_k_b_v_b(config: ModelConfig, arrays: list) -> object:
    """kv_b_proj [H * (nope + v), rank] from attn_k_b [H, rank, nope] and attn_v_b
    [H, v, rank] (the converter's split, W_UK transposed)."""
    import numpy as np

    k_b, v_b = arrays
    heads, rank = config.num_heads, config.kv_lora_rank
    nope, v = config.qk_nope_head_dim, config.v_head_dim
    if k_b.size != heads * rank * nope or v_b.size != heads * v * rank:
        raise ValueError(
            f"attn_k_b {k_b.shape} / attn_v_b {v_b.shape} do not hold {heads} heads of "
            f"[{rank} x {nope}] / [{v} x {rank}]"
        )
    k = k_b.reshape(heads, rank, nope).transpose(0, 2, 1)
    return np.concatenate((k, v_b.reshape(heads, v, rank)), axis=1).reshape(-1, rank)


def _kv_b_lazy(config: ModelConfig, parts: list) -> LazyTensor:
    """``_kv_b_from_k_b_v_b`` over the parts as ``LazyTensor``s: a box of kv_b_proj's rows
    reads only the heads it touches (a tensor-parallel rank's) of attn_k_b and attn_v_b."""
    k_b, v_b = parts
    heads, rank = config.num_heads, config.kv_lora_rank
    nope, v = config.qk_nope_head_dim, config.v_head_dim
    if tuple(k_b.shape) != (heads, rank, nope) or tuple(v_b.shape) != (heads, v, rank):
        raise ValueError(
            f"attn_k_b {tuple(k_b.shape)} / attn_v_b {tuple(v_b.shape)} do not hold {heads} "
            f"heads of [{rank} x {nope}] / [{v} x {rank}]"
        )
    per = nope + v

    def read(box: tuple[slice, ...]) -> torch.Tensor:
        rows, cols = box
        h0, h1 = rows.start // per, (rows.stop - 1) // per + 1
        k = k_b[h0:h1].transpose(1, 2)  # [h, nope, rank]: W_UK
        kv = torch.cat((k, v_b[h0:h1]), dim=1).reshape(-1, rank)
        first = rows.start - h0 * per
        return kv[first : rows.stop - h0 * per : rows.step, cols]

    return LazyTensor((heads * per, rank), torch.float32, read)


def _deepseek_gguf_fields(f: dict) -> dict:
    """ModelConfig's MLA and MoE fields from the deepseek2 keys (see above)."""
    prefix = "deepseek2."

    def need(name: str, key: str) -> int:
        if f.get(name) is None:
            raise ValueError(f"model: GGUF file of 'deepseek2': key {prefix + key!r} is missing")
        return int(f[name])

    rank, rope = (
        need("kv_lora_rank", "attention.kv_lora_rank"),
        need("_rope_dim", "rope.dimension_count"),
    )
    qk = need("_key_length_mla", "attention.key_length_mla")
    for name, key, want in (
        ("_key_length", "attention.key_length", rank + rope),
        ("_value_length", "attention.value_length", rank),
        ("_head_count_kv", "attention.head_count_kv", 1),
    ):
        if f.get(name) is not None and int(f[name]) != want:
            raise ValueError(
                f"model: GGUF key {prefix + key!r}: {f[name]}, expected {want} (MLA written as "
                f"MQA over the latent); other layouts are not supported"
            )
    gating = int(f.get("_gating_func") or _SOFTMAX_GATING)
    if gating not in (_SOFTMAX_GATING, _SIGMOID_GATING):
        raise ValueError(
            f"model: GGUF key {prefix}expert_gating_func: {gating} is not supported (only 1, "
            f"softmax: DeepSeek-V2's router; 2, sigmoid: DeepSeek-V3's)"
        )
    groups, used = int(f.get("_group_count") or 1), int(f.get("_group_used_count") or 1)
    if groups <= 1 and used > 1:
        raise ValueError(
            f"model: GGUF key {prefix}expert_group_used_count: {used} groups of "
            f"expert_group_count {groups}"
        )
    # V3 / R1's multi-token-prediction layers: the last ``nextn_predict_layers`` of the
    # ``block_count`` blocks (the loader skips them, as ``load_weights`` skips them from a
    # directory); the decoder runs the rest.
    blocks, nextn = int(f["num_layers"]), int(f.get("_nextn") or 0)
    if not 0 <= nextn < blocks:
        raise ValueError(
            f"model: GGUF key {prefix}nextn_predict_layers: {nextn}, expected 0 to "
            f"{prefix}block_count - 1 ({blocks - 1})"
        )
    layers = blocks - nextn
    router: dict = dict(n_group=groups, topk_group=used if groups > 1 else 1)
    if gating == _SIGMOID_GATING:
        router.update(architecture="deepseek_v3", topk_method="noaux_tc")
    else:
        router["topk_method"] = "group_limited_greedy" if groups > 1 else "greedy"
    out: dict = dict(
        head_dim=rope,
        qk_nope_head_dim=qk - rope,
        num_kv_heads=f["num_heads"],  # transformers' config: one KV head per head
        shared_expert_gate=False,
        num_layers=layers,
        num_nextn_predict_layers=nextn,
        **router,
    )
    if f.get("num_experts"):
        first = int(f.get("_leading_dense") or 0)
        out["moe_layers"] = tuple(range(first, layers)) if first else None
        out["shared_expert_intermediate_size"] = int(f.get("_shared_count") or 0) * int(
            f.get("moe_intermediate_size") or 0
        )
    scaling = f.get("rope_scaling")
    if scaling and scaling.get("rope_type") == "yarn":
        scaling = dict(scaling)
        scaling.setdefault("attention_factor", 1.0)
        if f.get("_yarn_log_mul"):
            scaling["mscale"] = scaling["mscale_all_dim"] = float(f["_yarn_log_mul"]) / 0.1
        out["rope_scaling"] = scaling
    return out


DEEPSEEK_GGUF = GGUFSpec(
    "deepseek2",
    tensors=_DEEPSEEK_TENSORS,
    experts=_DEEPSEEK_EXPERTS,
    keys=_DEEPSEEK_KEYS,
    joins=(
        GGUFJoin(
            "self_attn.kv_b_proj.weight",
            ("attn_k_b.weight", "attn_v_b.weight"),
            _kv_b_from_k_b_v_b,
            lazy=_kv_b_lazy,
        ),
    ),
    derive=_deepseek_gguf_fields,
)


@register("deepseek_v2", hf=("DeepseekV2ForCausalLM",), gguf=[DEEPSEEK_GGUF])
class DeepseekV2Model(DecoderLM):
    attention_cls = LatentAttention
    moe_names: ClassVar[dict[str, str]] = DEEPSEEK_NAMES

    def __init__(self, config: ModelConfig, *args, **kwargs) -> None:
        if config.kv_lora_rank is None:
            raise ValueError(
                "model: a deepseek_v2 config needs kv_lora_rank (multi-head latent attention)"
            )
        super().__init__(config, *args, **kwargs)
        self.supports_fused_ops = False
        self.supports_cuda_graphs = False

    @classmethod
    def kv_layout_for(cls, config: ModelConfig, num_kv_heads: int) -> KVLayout:
        """One latent of ``kv_lora_rank + qk_rope_head_dim`` values per token and layer,
        the same on every tensor-parallel rank (``num_kv_heads`` does not divide it)."""
        if config.kv_lora_rank is None:
            raise ValueError(
                "model: a deepseek_v2 config needs kv_lora_rank (multi-head latent attention)"
            )
        return KVLayout(config.num_layers, 1, config.kv_lora_rank + config.head_dim, latent=True)

    def forward(
        self,
        layout: BatchLayout,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        attn: AttentionBackend,
        attn_meta: object,
    ) -> torch.Tensor:
        return super().forward(layout, kv_caches, attn, LatentStep(layout, attn, attn_meta))

    def load_weights(
        self, weights: Iterable[tuple[str, torch.Tensor]], quantization: str | None = None
    ) -> None:
        """``DecoderLM.load_weights``, skipping DeepSeek-V3's multi-token-prediction layers
        (``model.layers.{num_layers + i}.*``, i < ``num_nextn_predict_layers``)."""
        first = self.config.num_layers
        last = first + self.config.num_nextn_predict_layers

        def decoder_only() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                m = _LAYER.match(name)
                if m is None or not first <= int(m.group(1)) < last:
                    yield name, tensor

        super().load_weights(decoder_only(), quantization)


_LAYER = re.compile(r"model\.layers\.(\d+)\.")


@register("deepseek_v3", hf=("DeepseekV3ForCausalLM",))
class DeepseekV3Model(DeepseekV2Model):
    """DeepSeek-V3 (and R1): V2's latent attention and experts, the "noaux_tc" router
    (``moe.route_noaux_tc``; its correction bias is the router's
    ``e_score_correction_bias``). From GGUF it loads as ``deepseek2`` with sigmoid gating
    (``_deepseek_gguf_fields``)."""
