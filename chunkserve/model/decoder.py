"""A decoder-only transformer built from ``layers``: embedding, blocks, final norm, LM head.

A family (``llama.py``, ``qwen.py``, ...) is a subclass that says how its blocks differ:
``qkv_bias`` (Qwen2's Q/K/V biases), ``qk_norm`` ("head": Qwen3, "all": OLMo 2),
``norm_style`` ("pre": a norm before attention and before the MLP, as Llama; "post": OLMo 2's
norms of the attention and MLP outputs before the residual adds; "sandwich": Gemma 2/3's
both), ``norm_offset`` (every RMSNorm Gemma's ``1 + w``), ``scale_embeddings`` (embeddings
times sqrt(hidden) rounded to the model's dtype, as Gemma), and the checkpoint's names
(``norm_names``; ``fused_names``: Phi-3's pre-fused qkv_proj and gate_up_proj; ``moe_names``:
an MoE block's, Mixtral's ``block_sparse_moe``; ``moe_router`` / ``moe_bias``: GPT-OSS's
router and expert biases; ``o_bias``: the output projection's bias). A layer the config
makes a mixture of experts (``ModelConfig.is_moe_layer``) has ``moe.SparseMoE`` for its MLP.
Config-driven numerics (Granite's multipliers, SmolLM3's layers without rope, partial rotary,
the activation, the softmax scale, soft-capping, Gemma 3's local rope) come from
``ModelConfig``.

``forward`` maps a ``BatchLayout`` to hidden states [T, hidden]; ``compute_logits`` maps the
rows to sample to fp32 logits [S, vocab] (on rank 0; None on the other tensor-parallel ranks).
On CUDA, a family with Llama's block (pre-norms, no q/k norm, full rotary, SiLU, no
multipliers) can run the fused elementwise kernels of ``fused_ops`` (``fused_ops`` set True).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING, ClassVar

import torch
from torch import nn

from chunkserve.attention.base import AttentionBackend, BatchLayout
from chunkserve.config import ModelConfig
from chunkserve.distributed.shard import ShardPlan, plan_shards
from chunkserve.model.layers import (
    Attention,
    ColumnParallelLinear,
    GatedMLP,
    ParallelLMHead,
    RMSNorm,
    RotaryEmbedding,
    RowParallelLinear,
    RowTiling,
    Target,
    VocabParallelEmbedding,
    WeightSlot,
    quantized_parts,
    take_quantized,
    weight_format,
    weight_nbytes,
)
from chunkserve.model.moe import MOE_NAMES, SparseMoE
from chunkserve.model.registry import KVLayout, layer_spec
from chunkserve.quant.weight import QuantizedWeight
from chunkserve.quant.weight_only import load_group_size, quantize_weight

if TYPE_CHECKING:
    from chunkserve.distributed.group import TPGroup

logger = logging.getLogger(__name__)


class DecoderLayer(nn.Module):
    def __init__(
        self,
        model: type[DecoderLM],
        index: int,
        config: ModelConfig,
        dtype: torch.dtype,
        device: torch.device,
        shard: ShardPlan,
        group: TPGroup | None,
    ) -> None:
        super().__init__()
        h, eps, offset = config.hidden_size, config.rms_norm_eps, model.norm_offset
        fp32 = model.norm_fp32_weight
        self.attn: Attention | nn.Module
        if model.attention_cls is not None:  # the family's own (DeepSeek's latent attention)
            self.attn = model.attention_cls(config, shard, dtype, device, group)
        else:
            self.attn = Attention(
                config,
                shard,
                dtype,
                device,
                group,
                qkv_bias=model.qkv_bias or config.attention_bias,
                qk_norm=model.qk_norm,
                use_rope=index not in config.no_rope_layers,
                spec=layer_spec(config, index),
                norm_offset=offset,
                o_bias=model.o_bias and config.attention_bias,
            )
        # A mixture of experts where the config puts one (``model.moe``), else a dense MLP.
        self.mlp: GatedMLP | SparseMoE
        self.moe = config.is_moe_layer(index)
        if self.moe:
            self.mlp = SparseMoE(
                config, shard, dtype, device, group, renormalize=model.moe_renormalize,
                router=model.moe_router, bias=model.moe_bias,
            )  # fmt: skip
        else:
            self.mlp = GatedMLP(config, shard, dtype, device, group)
        # Gemma 3: the sliding-window layers rotate with the local rope table.
        self.local_rope = config.rope_local_theta is not None and config.is_window_layer(index)
        self.norm_style = model.norm_style
        # "pre": before attention, before the MLP; "post": after each, before the residual
        # add; "sandwich": norm1 / norm3 before attention / the MLP, norm2 / norm4 after.
        self.norm1 = RMSNorm(h, eps, dtype, device, offset=offset, fp32_weight=fp32)
        self.norm2 = RMSNorm(h, eps, dtype, device, offset=offset, fp32_weight=fp32)
        self.norm3 = self.norm4 = None
        if self.norm_style == "sandwich":
            self.norm3 = RMSNorm(h, eps, dtype, device, offset=offset, fp32_weight=fp32)
            self.norm4 = RMSNorm(h, eps, dtype, device, offset=offset, fp32_weight=fp32)
        self.residual_multiplier = config.residual_multiplier

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
        # Submodules' ``forward`` called directly: nn.Module.__call__ costs two more Python
        # calls each, ~500 a step over 30 layers.
        m = self.residual_multiplier
        norm1, norm2, mlp = self.norm1.forward, self.norm2.forward, self.mlp.forward
        if self.norm3 is not None:  # sandwich
            out = self.attn.forward(
                norm1(hidden), cos, sin, k_cache, v_cache, attn, layout, attn_meta
            )
            hidden = hidden + norm2(out)
            return hidden + self.norm4.forward(mlp(self.norm3.forward(hidden)))
        if self.norm_style == "post":
            out = norm1(
                self.attn.forward(hidden, cos, sin, k_cache, v_cache, attn, layout, attn_meta)
            )
            hidden = hidden + out if m == 1.0 else hidden + out * m
            out = norm2(mlp(hidden))
            return hidden + out if m == 1.0 else hidden + out * m
        out = self.attn.forward(norm1(hidden), cos, sin, k_cache, v_cache, attn, layout, attn_meta)
        hidden = hidden + out if m == 1.0 else hidden + out * m
        out = mlp(norm2(hidden))
        return hidden + out if m == 1.0 else hidden + out * m

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
        """``forward`` of a Llama block with fused kernels (see ``fused_ops``): the hidden
        state is carried as ``residual + delta`` so each residual add is fused into the next
        norm. The first layer gets the embeddings as ``delta`` and no residual."""
        from chunkserve.model import fused_ops as ops

        a = self.attn
        t = delta.shape[0]
        x, residual = ops.add_rms_norm(delta, residual, self.norm1.weight, self.norm1.eps)
        qkv = a.qkv.forward(x)
        q, k, v = ops.rotary_qkv(
            qkv, positions, rotary.cos, rotary.sin, a.num_heads, a.num_kv_heads, a.head_dim
        )
        o = attn.forward(q, k, v, k_cache, v_cache, layout, attn_meta, a.spec)
        x, residual = ops.add_rms_norm(
            a.o.forward(o.view(t, a.q_size)), residual, self.norm2.weight, self.norm2.eps
        )
        mlp = self.mlp
        delta = mlp.down.forward(ops.silu_mul(mlp.gate_up.forward(x)))
        return delta, residual

    def targets(
        self,
        prefix: str,
        names: dict[str, str],
        fused: dict[str, str],
        moe_names: dict[str, str] = MOE_NAMES,
    ) -> dict[str, Target | list[Target]]:
        out = self.attn.targets(prefix + "self_attn.", fused.get("qkv"))
        if isinstance(self.mlp, SparseMoE):
            out.update(self.mlp.targets(prefix, moe_names))
        else:
            out.update(self.mlp.targets(prefix + "mlp.", fused.get("gate_up")))
        out.update(self.norm1.targets(prefix + names["norm1"]))
        out.update(self.norm2.targets(prefix + names["norm2"]))
        if self.norm3 is not None:
            out.update(self.norm3.targets(prefix + names["norm3"]))
            out.update(self.norm4.targets(prefix + names["norm4"]))
        return out


class DecoderLM(nn.Module):
    """The ``CausalLM`` of a decoder-only family (see ``registry``)."""

    # What a family sets.
    qkv_bias: ClassVar[bool] = False  # Q/K/V biases whatever the config says
    qk_norm: ClassVar[str | None] = None
    o_bias: ClassVar[bool] = False  # the output projection's bias too, by attention_bias
    norm_style: ClassVar[str] = "pre"
    norm_offset: ClassVar[bool] = False  # RMSNorms are x * (1 + w) (Gemma)
    # The block and final RMSNorms multiply by the weight in fp32, then cast (GPT-OSS).
    norm_fp32_weight: ClassVar[bool] = False
    scale_embeddings: ClassVar[bool] = False  # embeddings times sqrt(hidden) (Gemma)
    # Checkpoint names of the block norms (after "model.layers.N.").
    norm_names: ClassVar[dict[str, str]] = {
        "norm1": "input_layernorm.weight",
        "norm2": "post_attention_layernorm.weight",
    }
    # Projections the checkpoint stores fused ("qkv", "gate_up" -> the tensor's name after
    # "self_attn." / "mlp."; Phi-3); the rest are separate q/k/v and gate/up tensors.
    fused_names: ClassVar[dict[str, str]] = {}
    # Mixture of experts (layers the config makes sparse): the checkpoint's names of the
    # block's tensors (``moe.MOE_NAMES``), and whether the router always renormalises the
    # chosen experts' weights (Mixtral; None: the config's ``norm_topk_prob``).
    moe_names: ClassVar[dict[str, str]] = MOE_NAMES
    moe_renormalize: ClassVar[bool | None] = None
    # An attention module of the family's own in place of ``layers.Attention``: built as
    # ``attention_cls(config, shard, dtype, device, group)``, with Attention's ``forward``
    # and ``targets`` (DeepSeek's latent attention).
    attention_cls: ClassVar[type[nn.Module] | None] = None
    # The router (``moe.ROUTERS``: softmax then top-k, or GPT-OSS's top-k then softmax) and
    # whether the router and experts have biases (GPT-OSS).
    moe_router: ClassVar[str] = "softmax_topk"
    moe_bias: ClassVar[bool] = False

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
        self.group = group = group if shard.size > 1 else None
        self.embed_tokens = VocabParallelEmbedding(config, shard, dtype, device, group)
        self.layers = nn.ModuleList(
            DecoderLayer(type(self), i, config, dtype, device, shard, group)
            for i in range(config.num_layers)
        )
        self.norm = RMSNorm(
            config.hidden_size, config.rms_norm_eps, dtype, device, offset=self.norm_offset,
            fp32_weight=self.norm_fp32_weight,
        )  # fmt: skip
        self.lm_head = ParallelLMHead(config, self.embed_tokens, dtype, device, group)
        self.rotary = RotaryEmbedding(config, max_positions, device)
        # Gemma 3's sliding-window layers: their own base, unscaled.
        self.rotary_local = None
        if config.rope_local_theta is not None:
            local = dataclasses.replace(
                config, rope_theta=config.rope_local_theta, rope_scaling=None
            )
            self.rotary_local = RotaryEmbedding(local, max_positions, device)
        # What the embeddings are multiplied by: Granite's multiplier (a Python float, as
        # HF's), or Gemma's sqrt(hidden) as a tensor of the model's dtype (HF casts it).
        self.embed_scale: float | torch.Tensor = config.embedding_multiplier
        if self.scale_embeddings:
            self.embed_scale = torch.tensor(
                config.hidden_size**0.5 * config.embedding_multiplier, dtype=dtype, device=device
            )
        # Fused elementwise kernels (Triton; see fused_ops). The worker turns them on on
        # CUDA where ``supports_fused_ops``.
        self.fused_ops = False
        self.supports_fused_ops = (
            self.norm_style == "pre"
            and not self.norm_offset
            and self.rotary_local is None
            and self.qk_norm is None
            and config.rotary_dim == config.head_dim
            and not config.no_rope_layers
            and config.hidden_act in ("silu", "swish")
            and config.attention_multiplier is None
            and config.residual_multiplier == 1.0
            and not config.mlp_bias
            and config.num_experts == 0
        )
        # A step of an MoE model asks the host how many tokens each expert got (its loop
        # over experts), which a CUDA graph cannot capture.
        self.supports_cuda_graphs = config.num_experts == 0

    def set_row_tiling(self, tiling: RowTiling | None, quant_kernel: str = "int8") -> int:
        """Every matmul of the model (projections, MLPs, experts, the LM head) batch-invariant
        with ``tiling`` (the deterministic mode; ``layers.RowTiling``), or plain (None); its
        GGUF-quantized weights' row-invariant kernel ``quant_kernel``
        (``EngineConfig.deterministic_quant_kernel``; a ValueError naming it where this CPU
        cannot run it). Returns how many weights have that choice."""
        chosen = 0
        for module in self.modules():
            if hasattr(module, "tiling"):
                module.tiling = tiling
            for slot in getattr(module, "slots", ()):
                for weight in quantized_parts(slot.qweight):
                    chosen += weight.set_invariant_kernel(quant_kernel)
        return chosen

    @classmethod
    def kv_layout_for(cls, config: ModelConfig, num_kv_heads: int) -> KVLayout:
        """The KV layout of a model of ``config`` with ``num_kv_heads`` KV heads (a rank's),
        known before the model is built (the worker sizes the cache from it)."""
        layer_windows = tuple(config.layer_window(i) for i in range(config.num_layers))
        window = layer_windows[0] if len(set(layer_windows)) == 1 else None
        return KVLayout(config.num_layers, num_kv_heads, config.head_dim, window, layer_windows)

    def kv_layout(self) -> KVLayout:
        return self.kv_layout_for(self.config, self.shard.num_kv_heads)

    def forward(
        self,
        layout: BatchLayout,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        attn: AttentionBackend,
        attn_meta: object,
    ) -> torch.Tensor:
        hidden = self.embed_tokens.forward(layout.input_ids)  # [T, hidden]
        if self.scale_embeddings or self.config.embedding_multiplier != 1.0:
            hidden = hidden * self.embed_scale
        views = layout.layer_views(attn_meta, len(self.layers))
        if self.fused_ops:
            residual = None
            for layer, (k_cache, v_cache), (lay, meta) in zip(
                self.layers, kv_caches, views, strict=True
            ):
                hidden, residual = layer.forward_fused(
                    hidden, residual, layout.positions, self.rotary, k_cache, v_cache, attn,
                    lay, meta,
                )  # fmt: skip
            return hidden if residual is None else residual + hidden
        cos, sin = self.rotary(layout.positions, self.dtype)
        local = cos, sin
        if self.rotary_local is not None:
            local = self.rotary_local(layout.positions, self.dtype)
        for layer, (k_cache, v_cache), (lay, meta) in zip(
            self.layers, kv_caches, views, strict=True
        ):
            c, s = local if layer.local_rope else (cos, sin)
            hidden = layer.forward(hidden, c, s, k_cache, v_cache, attn, lay, meta)
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        logits = self.lm_head(self.norm(hidden))
        if logits is None:
            return None
        if self.config.logits_scaling != 1.0:
            logits = logits / self.config.logits_scaling
        cap = self.config.final_logit_softcap
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits

    def weight_targets(self) -> dict[str, Target | list[Target]]:
        """HF weight name -> where it goes (see ``layers.Target``; a list: a fused
        checkpoint tensor whose parts go to several places)."""
        targets = self.embed_tokens.targets("model.embed_tokens.weight")
        targets.update(self.norm.targets("model.norm.weight"))
        targets.update(self.lm_head.targets("lm_head.weight"))
        for i, layer in enumerate(self.layers):
            targets.update(
                layer.targets(
                    f"model.layers.{i}.", self.norm_names, self.fused_names, self.moe_names
                )
            )
        return targets

    def weight_slots(self) -> list[WeightSlot]:
        """The weights that may be kept quantized (``layers.WeightSlot``)."""
        return [slot for m in self.modules() for slot in getattr(m, "slots", ())]

    def weight_bytes(self) -> int:
        """Resident bytes of the model's weights: float parameters and quantized weights."""
        held = {id(p): p for p in self.parameters()}
        for slot in self.weight_slots():
            held[id(slot.qweight)] = slot.qweight
        return sum(weight_nbytes(w) for w in held.values())

    def weights_format(self) -> str | None:
        """The quantized types the weights are held in ("Q4_1+Q8_0"), or None when every
        weight is float."""
        kinds: set[str] = set()
        for slot in self.weight_slots():
            kinds |= weight_format(slot.qweight)
        return "+".join(sorted(kinds)) or None

    @torch.no_grad()
    def init_dummy_weights(self, seed: int = 0) -> None:
        """Random weights of the right shapes, drawn on the model's device (``load_format
        dummy``): norms 1 (0 for a ``1 + w`` norm), biases 0, the rest N(0, 0.02) as HF
        initialises Llama."""
        for slot in self.weight_slots():
            slot.materialize()
        self.lm_head.tie()
        gen = torch.Generator(device=self.embed_tokens.weight.device)
        gen.manual_seed(seed + self.shard.rank)
        norms = {id(m.weight): m.offset for m in self.modules() if isinstance(m, RMSNorm)}
        for name, param in self.named_parameters():
            if id(param) in norms:
                param.fill_(0.0 if norms[id(param)] else 1.0)
            elif name.endswith("bias"):
                param.zero_()
            else:
                param.normal_(0.0, 0.02, generator=gen)

    @torch.no_grad()
    def quantize_linear(self, method: str) -> None:
        """Quantize the float weights of the linear layers in place (``--quantization`` on
        weights made here rather than loaded: ``load_format dummy``)."""
        for slot in self.weight_slots():
            w = slot.weight
            if _quantizable(slot) and w is not None and not w.is_meta:
                q = _quantize_part(w, method, type(slot.module).__name__)
                if q is not None:
                    setattr(slot.module, slot.qattr, q)
                    setattr(slot.module, slot.attr, None)

    @torch.no_grad()
    def load_weights(
        self, weights: Iterable[tuple[str, torch.Tensor]], quantization: str | None = None
    ) -> None:
        """Copy HF-named tensors (``model.layers.N.self_attn.q_proj.weight`` ...) into this
        rank's (fused) parameters as they stream in, so peak memory is the model plus one
        tensor. A missing tensor, an unexpected one or a wrong shape is a ValueError naming
        it.

        A tensor may arrive quantized (a ``QuantizedWeight``, from a GGUF file): a linear
        layer, the embedding and the LM head keep it so (their rank's rows or columns of it;
        a column cut inside a quantization block is a ValueError naming the tensor), and no
        float copy of it is made; anything else (norms, MoE experts and routers, a weight
        its family reads as floats) takes it dequantized, with a log line naming them.
        Mixture-of-experts layers keep their experts' (and shared expert's) weights
        quantized too, one weight per expert.

        ``quantization`` ("int8" / "int4", ``--quantization``): each float weight of a linear
        layer (not the embedding, the LM head, MoE experts or routers) is quantized as it
        arrives, this rank's part of it (``quant.weight_only``); an int4 weight whose columns
        are not a multiple of 32 stays float, with a log line."""
        targets = self.weight_targets()
        dequantized: set[str] = set()
        kept_float: list[str] = []
        for name, tensor in weights:
            if name not in targets:
                if name.endswith("rotary_emb.inv_freq") or (
                    name == "lm_head.weight" and self.config.tie_word_embeddings
                ):
                    continue  # derived, or a copy of the tied embedding
                raise ValueError(f"model: unexpected weight {name!r} in checkpoint")
            entry = targets.pop(name)
            for dst, part, expected, slot, index in entry if isinstance(entry, list) else [entry]:
                if tuple(tensor.shape) != expected:
                    raise ValueError(
                        f"model: weight {name!r} has shape {tuple(tensor.shape)}, "
                        f"expected {expected}"
                    )
                target = Target(dst, part, expected, slot, index)
                if isinstance(tensor, QuantizedWeight):
                    if slot is not None and slot.accepts_quantized:
                        slot.put(index, take_quantized(tensor, part, name))
                        continue
                    if slot is None and dst.numel() == 0:
                        continue  # another rank's (expert parallel): nothing kept here
                    dequantized.add(tensor.qtype)
                    tensor = tensor.dequantize(self.dtype)
                elif quantization and slot is not None and _quantizable(slot):
                    q = _quantize_part(tensor[part], quantization, name)
                    if q is not None:
                        slot.put(index, q)
                        continue
                    kept_float.append(name)
                target.take(tensor)
        for slot in self.weight_slots():
            slot.finish()
        self.lm_head.tie()
        if kept_float:
            logger.info(
                "model: --quantization %s: %d weight(s) kept float (columns not a multiple "
                "of 32), e.g. %s",
                quantization,
                len(kept_float),
                kept_float[:3],
            )
        if dequantized:
            logger.info(
                "model: quantized weights of layers without quantized kernels (norms, MoE "
                "routers, GPT-OSS's fused experts, DeepSeek's kv_b) dequantized at load: %s",
                ", ".join(sorted(dequantized)),
            )
        if targets:
            missing = sorted(targets)
            raise ValueError(
                f"model: {len(missing)} weight(s) missing from the checkpoint, e.g. {missing[:3]}"
            )


def _quantizable(slot: WeightSlot) -> bool:
    """Whether ``--quantization`` quantizes this slot's weight: a linear layer's whose maths
    take a quantized weight (not the embedding or the LM head)."""
    return (
        slot.accepts_quantized
        and slot.stack is None
        and isinstance(slot.module, (ColumnParallelLinear, RowParallelLinear))
    )


def _quantize_part(tensor: torch.Tensor, method: str, name: str) -> QuantizedWeight | None:
    """A float weight part quantized by ``method`` (None: an int4 weight no group fits)."""
    if method == "int4":
        group = load_group_size(tensor.shape[-1])
        if group is None:
            return None
        return quantize_weight(tensor, method, name, group)
    return quantize_weight(tensor, method, name)
