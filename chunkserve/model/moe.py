"""The mixture-of-experts MLP of the layer library: a router, routed experts computed by
grouping the step's tokens by expert, and an optional shared expert.

- **Router** (``route``): softmax over the router's logits in fp32, the ``top_k`` largest
  probabilities and their experts, optionally renormalised to sum to 1 (Mixtral always;
  Qwen2/3-MoE and OLMoE by ``norm_topk_prob``).
- **Routed experts** (``grouped_experts``): each expert is a gated MLP whose weights are
  stacked over experts (``w13`` [E, 2 * I, H]: gate rows then up rows; ``w2`` [E, H, I]).
  The step's (token, choice) pairs are sorted by expert (one stable argsort), the tokens'
  rows gathered in that order, each active expert runs two matmuls over its contiguous run
  of rows, the results are scaled by their routing weights and summed back into their
  tokens' rows (``index_add_``). A Python loop runs over the experts the step touches, never
  over tokens: a decode batch pays for the experts its tokens pick, a long prefill chunk for
  (nearly) all of them.
- **Shared expert** (Qwen2-MoE): a gated MLP every token takes, scaled by
  ``sigmoid(x . w_gate)``, added to the routed experts' sum.

Tensor parallel (the default over a tensor-parallel group): every expert's intermediate
columns are split over the ranks as a dense MLP's are (each rank holds its gate and up rows
and its down columns of every expert, and of the shared expert); the router is replicated;
each rank's partial sums are combined by the one all-reduce after the layer. Expert parallel
(``ShardPlan.expert_parallel``): each rank holds a contiguous range of whole experts (and its
columns of the shared expert); every rank already has every token (attention is tensor
parallel, its output all-reduced), so dispatching a token to its experts' ranks is each rank
selecting the (token, choice) pairs of its own experts, and combining is the same
all-reduce of partial sums.

Checkpoints store one tensor per expert (``experts.N.gate_proj``, Mixtral's
``experts.N.w1``...); ``SparseMoE.targets`` says where each goes in the stacked tensors, so
they are stacked as they load.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import nn

from chunkserve.config import ModelConfig
from chunkserve.distributed.shard import ShardPlan
from chunkserve.model.layers import ACTIVATIONS, RowTiling, Target, _param, linear

if TYPE_CHECKING:
    from chunkserve.distributed.group import TPGroup

# Checkpoint names of an MoE block's tensors (after "model.layers.N."): the block's module,
# the router, each expert's gate / up / down (after "experts.N."), the shared expert and its
# gate (Qwen2-MoE's names; Mixtral's in ``mixtral.py``).
MOE_NAMES = {
    "block": "mlp",
    "router": "gate",
    "gate": "gate_proj",
    "up": "up_proj",
    "down": "down_proj",
    "shared": "shared_expert",
    "shared_gate": "shared_expert_gate",
}


def gguf_moe_names(
    names: dict[str, str] = MOE_NAMES, shared: bool = False
) -> tuple[dict[str, str], dict[str, str]]:
    """llama.cpp's names of an MoE block (gguf-py's ``ffn_gate_inp``, ``ffn_*_exps``,
    ``ffn_*_shexp``) for a ``registry.GGUFSpec``: (``tensors``, ``experts``) -> the HF names
    ``names`` gives."""
    block = names["block"] + "."
    tensors = {"ffn_gate_inp.weight": block + names["router"] + ".weight"}
    experts = {
        f"ffn_{part}_exps.weight": block + "experts.{}." + names[part] + ".weight"
        for part in ("gate", "up", "down")
    }
    if shared:
        for part in ("gate", "up", "down"):
            tensors[f"ffn_{part}_shexp.weight"] = f"{block}{names['shared']}.{part}_proj.weight"
        tensors["ffn_gate_inp_shexp.weight"] = block + names["shared_gate"] + ".weight"
    return tensors, experts


def _split(n: int, parts: int, i: int) -> tuple[int, int]:
    return i * n // parts, (i + 1) * n // parts


def route(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax top-k routing: (weights [T, top_k] fp32, expert ids [T, top_k] int64) from
    router logits [T, E], the largest probability first."""
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def grouped_experts(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    act: Callable[[torch.Tensor], torch.Tensor],
    first_expert: int = 0,
    tiling: RowTiling | None = None,
) -> torch.Tensor:
    """sum over each token's choices c of ``weights[t, c] * expert_{ids[t, c]}(x[t])`` for
    the experts held here (``w13`` [E_local, 2 * I, H], ``w2`` [E_local, H, I]: experts
    ``first_expert`` .. ``first_expert + E_local - 1``); choices of other experts add
    nothing (another rank's). [T, H] in ``x``'s dtype. ``tiling``: the deterministic
    mode's batch-invariant matmuls (``layers.RowTiling``)."""
    t, k = ids.shape
    num_local = w13.shape[0]
    out = torch.zeros_like(x)
    if t == 0:
        return out
    flat = ids.reshape(-1)
    # (token, choice) slots in expert order; stable, so each expert's tokens stay in order.
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=first_expert + num_local).tolist()
    start = sum(counts[:first_expert])
    local = counts[first_expert : first_expert + num_local]
    end = start + sum(local)
    if end == start:
        return out
    slots = order[start:end]
    tokens = slots // k
    rows = x.index_select(0, tokens)  # [n, H], grouped by expert
    y = torch.empty_like(rows)
    r = 0
    for e, n in enumerate(local):
        if n == 0:
            continue
        gate, up = linear(rows[r : r + n], w13[e], tiling=tiling).chunk(2, dim=-1)
        y[r : r + n] = linear(act(gate) * up, w2[e], tiling=tiling)
        r += n
    y.mul_(weights.reshape(-1).index_select(0, slots).to(y.dtype)[:, None])
    return out.index_add_(0, tokens, y)


def _elsewhere(like: torch.Tensor, shape: tuple[int, ...]) -> Target:
    """The target of a checkpoint tensor another rank keeps (expert parallel): its shape is
    checked, nothing of it is copied."""
    return Target(like.new_empty(0, *shape[1:]), (slice(0, 0),), shape)


class SparseMoE(nn.Module):
    """A layer's MoE MLP (see the module docstring): router, routed experts, optional shared
    expert; the all-reduce of the ranks' partial sums is its own."""

    def __init__(
        self,
        config: ModelConfig,
        shard: ShardPlan,
        dtype: torch.dtype,
        device: torch.device,
        group: TPGroup | None,
        *,
        renormalize: bool | None = None,
    ) -> None:
        super().__init__()
        h = config.hidden_size
        self.num_experts, self.top_k = config.num_experts, config.num_experts_per_tok
        self.renormalize = config.norm_topk_prob if renormalize is None else renormalize
        self.inter = config.expert_intermediate_size
        size, rank = shard.size, shard.rank
        if shard.expert_parallel and size > 1:
            if self.num_experts < size:
                raise ValueError(
                    f"enable_expert_parallel: {size} ranks are more than the model's "
                    f"{self.num_experts} experts"
                )
            self.experts = _split(self.num_experts, size, rank)
            self.cols = (0, self.inter)
        else:
            self.experts = (0, self.num_experts)
            self.cols = _split(self.inter, size, rank)
        num_local = self.experts[1] - self.experts[0]
        width = self.cols[1] - self.cols[0]
        self.router = _param(self.num_experts, h, dtype=dtype, device=device)
        self.w13 = _param(num_local, 2 * width, h, dtype=dtype, device=device)
        self.w2 = _param(num_local, h, width, dtype=dtype, device=device)
        self.act = ACTIVATIONS[config.hidden_act]
        self.shared_inter = config.shared_expert_intermediate_size
        self.shared_w13 = self.shared_w2 = self.shared_gate = None
        if self.shared_inter:
            self.shared_cols = _split(self.shared_inter, size, rank)
            sw = self.shared_cols[1] - self.shared_cols[0]
            self.shared_w13 = _param(2 * sw, h, dtype=dtype, device=device)
            self.shared_w2 = _param(h, sw, dtype=dtype, device=device)
            self.shared_gate = _param(1, h, dtype=dtype, device=device)
        self.group = group
        self.tiling: RowTiling | None = None  # the deterministic mode's (``RowTiling``)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tiling = self.tiling
        weights, ids = route(linear(x, self.router, tiling=tiling), self.top_k, self.renormalize)
        out = grouped_experts(x, self.w13, self.w2, weights, ids, self.act, self.experts[0], tiling)
        if self.shared_w13 is not None:
            gate, up = linear(x, self.shared_w13, tiling=tiling).chunk(2, dim=-1)
            shared = linear(self.act(gate) * up, self.shared_w2, tiling=tiling)
            out = out + torch.sigmoid(linear(x, self.shared_gate, tiling=tiling)) * shared
        if self.group is not None:
            out = self.group.all_reduce(out)
        return out

    def targets(self, prefix: str, names: dict[str, str]) -> dict[str, Target]:
        """Where each checkpoint tensor goes: ``prefix`` is "model.layers.N.", ``names``
        the family's (``MOE_NAMES``)."""
        h, inter = self.router.shape[1], self.inter
        block = prefix + names["block"] + "."
        out = {
            block + names["router"] + ".weight": Target(
                self.router, (slice(None),), (self.num_experts, h)
            )
        }
        c0, c1 = self.cols
        width = c1 - c0
        for e in range(self.num_experts):
            expert = f"{block}experts.{e}."
            local = e - self.experts[0]
            if not 0 <= local < self.w13.shape[0]:  # another rank's expert: read, not kept
                for name, shape in (("gate", (inter, h)), ("up", (inter, h)), ("down", (h, inter))):
                    out[expert + names[name] + ".weight"] = _elsewhere(self.w2, shape)
                continue
            w13 = self.w13[local]
            out[expert + names["gate"] + ".weight"] = Target(
                w13[:width], (slice(c0, c1),), (inter, h)
            )
            out[expert + names["up"] + ".weight"] = Target(
                w13[width:], (slice(c0, c1),), (inter, h)
            )
            out[expert + names["down"] + ".weight"] = Target(
                self.w2[local], (slice(None), slice(c0, c1)), (h, inter)
            )
        if self.shared_w13 is not None:
            s0, s1 = self.shared_cols
            sw, si = s1 - s0, self.shared_inter
            shared = block + names["shared"] + "."
            out[shared + "gate_proj.weight"] = Target(
                self.shared_w13[:sw], (slice(s0, s1),), (si, h)
            )
            out[shared + "up_proj.weight"] = Target(self.shared_w13[sw:], (slice(s0, s1),), (si, h))
            out[shared + "down_proj.weight"] = Target(
                self.shared_w2, (slice(None), slice(s0, s1)), (h, si)
            )
            out[block + names["shared_gate"] + ".weight"] = Target(
                self.shared_gate, (slice(None),), (1, h)
            )
        return out
