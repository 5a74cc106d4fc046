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
- **DeepSeek's router** (``route_grouped``, ``ModelConfig.topk_method``): softmax scores,
  the top-k restricted to the best ``topk_group`` of ``n_group`` expert groups, weights
  times ``routed_scaling_factor`` (or renormalised). DeepSeek-V3's ("noaux_tc",
  ``route_noaux_tc``): sigmoid scores; the experts are chosen by score plus a learned
  per-expert bias (the router's ``e_score_correction_bias``), a group ranked by the sum of
  its best two; the weights are the chosen experts' unbiased scores.
- **GPT-OSS** (``router="topk_softmax"``, ``bias=True``, ``ModelConfig.swiglu_limit``): the
  router's logits have a bias, the top k *logits* are chosen and the softmax runs over those
  k only (``route_topk_softmax``); every expert's gate/up and down have biases; the gate is
  the clamped SwiGLU (``clamped_swiglu``). The checkpoint ships the experts pre-fused and
  stacked: ``experts.gate_up_proj`` [E, H, 2 * I] (x @ W; gate and up columns interleaved:
  gate 0, up 0, gate 1, ...), ``gate_up_proj_bias`` [E, 2 * I], ``down_proj`` [E, I, H],
  ``down_proj_bias`` [E, H] (``GPT_OSS_NAMES``); ``targets`` de-interleaves and transposes
  them into ``w13`` / ``w2`` as they load. The down bias is added once per (token, choice):
  under tensor parallel on the rank holding the experts' first columns only.
- **Shared expert** (Qwen2-MoE): a gated MLP every token takes, scaled by
  ``sigmoid(x . w_gate)``, added to the routed experts' sum (DeepSeek's: ungated).

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
from chunkserve.model.layers import (
    ACTIVATIONS,
    RowTiling,
    Target,
    Weight,
    WeightSlot,
    _param,
    linear,
)

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
# GPT-OSS's: the router ``mlp.router`` (weight and bias), the experts stacked and pre-fused
# (``mlp.experts.gate_up_proj``, ``mlp.experts.down_proj`` and their ``_bias``).
GPT_OSS_NAMES = {"block": "mlp", "router": "router", "gate_up": "gate_up_proj", "down": "down_proj"}
ROUTERS = ("softmax_topk", "topk_softmax")


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


def route_grouped(
    logits: torch.Tensor,
    top_k: int,
    num_groups: int,
    topk_group: int,
    scaling: float,
    renormalize: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V2's router (``topk_method`` "group_limited_greedy"; "greedy" is one group):
    softmax scores in fp32; the experts, cut into ``num_groups`` groups, keep only those of
    the ``topk_group`` groups with the best single score; the ``top_k`` best of those. Their
    weights are renormalised to sum to 1 (``renormalize``, with top_k > 1) or else times
    ``scaling`` (``routed_scaling_factor``), as DeepSeek's V2 code does."""
    scores = torch.softmax(logits.float(), dim=-1)
    if num_groups > 1:
        t, e = scores.shape
        best = scores.view(t, num_groups, e // num_groups).amax(dim=-1)  # [T, groups]
        keep = torch.zeros_like(best, dtype=torch.bool)
        keep.scatter_(1, torch.topk(best, topk_group, dim=-1).indices, True)
        keep = keep[:, :, None].expand(t, num_groups, e // num_groups).reshape(t, e)
        scores = scores.masked_fill(~keep, 0.0)
    weights, ids = torch.topk(scores, top_k, dim=-1)
    if renormalize and top_k > 1:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    elif scaling != 1.0:
        weights = weights * scaling
    return weights, ids


def route_noaux_tc(
    logits: torch.Tensor,
    bias: torch.Tensor,
    top_k: int,
    num_groups: int,
    topk_group: int,
    scaling: float,
    renormalize: bool,
    tiling: RowTiling | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3's router (``topk_method`` "noaux_tc"): sigmoid scores in fp32; the
    choice is made on score + ``bias`` [E] (the correction bias): the experts, cut into
    ``num_groups`` groups, keep only those of the ``topk_group`` groups whose best two
    biased scores sum highest, and the ``top_k`` best biased scores of those are chosen.
    Their weights are their unbiased scores, renormalised to sum to 1 (``renormalize``),
    then times ``scaling`` (``routed_scaling_factor``). ``tiling``: the deterministic
    mode's, as in ``sigmoid_rows``."""
    scores = sigmoid_rows(logits.float(), tiling)
    choice = scores + bias.float()
    if num_groups > 1:
        t, e = choice.shape
        grouped = choice.view(t, num_groups, e // num_groups)
        best = grouped.topk(2, dim=-1).values.sum(dim=-1)  # [T, groups]
        keep = torch.zeros_like(best, dtype=torch.bool)
        keep.scatter_(1, torch.topk(best, topk_group, dim=-1).indices, True)
        keep = keep[:, :, None].expand(t, num_groups, e // num_groups).reshape(t, e)
        choice = choice.masked_fill(~keep, float("-inf"))
    ids = torch.topk(choice, top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * scaling, ids


def route_topk_softmax(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """GPT-OSS's routing: the ``top_k`` largest router logits [T, E] and their experts, the
    weights a softmax over those k logits only (fp32), the largest first."""
    values, ids = torch.topk(logits.float(), top_k, dim=-1)
    return torch.softmax(values, dim=-1), ids


def clamped_swiglu(
    alpha: float, limit: float
) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """GPT-OSS's gate: ``(up + 1) * g * sigmoid(alpha * g)``, g = gate clamped above at
    ``limit``, up clamped to [-limit, limit]."""

    def glu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        gate = gate.clamp(max=limit)
        up = up.clamp(min=-limit, max=limit)
        return (up + 1) * (gate * torch.sigmoid(gate * alpha))

    return glu


def grouped_experts(
    x: torch.Tensor,
    w13: torch.Tensor | list[Weight],
    w2: torch.Tensor | list[Weight],
    weights: torch.Tensor,
    ids: torch.Tensor,
    act: Callable[[torch.Tensor], torch.Tensor],
    first_expert: int = 0,
    *,
    b13: torch.Tensor | None = None,
    b2: torch.Tensor | None = None,
    glu: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
    tiling: RowTiling | None = None,
) -> torch.Tensor:
    """sum over each token's choices c of ``weights[t, c] * expert_{ids[t, c]}(x[t])`` for
    the experts held here (``w13`` [E_local, 2 * I, H], ``w2`` [E_local, H, I]: experts
    ``first_expert`` .. ``first_expert + E_local - 1``); choices of other experts add
    nothing (another rank's); ``w13`` / ``w2`` may be lists of one quantized weight per
    expert (``layers.WeightSlot``). ``b13`` [E_local, 2 * I] / ``b2`` [E_local, H]: the experts'
    biases (GPT-OSS), or None; ``glu(gate, up)``: the gate (default ``act(gate) * up``).
    [T, H] in ``x``'s dtype. ``tiling``: the deterministic mode's batch-invariant matmuls
    (``layers.RowTiling``)."""
    t, k = ids.shape
    num_local = len(w13)
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
        b13_e = None if b13 is None else b13[e]
        gate, up = linear(rows[r : r + n], w13[e], b13_e, tiling=tiling).chunk(2, dim=-1)
        h = act(gate) * up if glu is None else glu(gate, up)
        y[r : r + n] = linear(h, w2[e], None if b2 is None else b2[e], tiling=tiling)
        r += n
    y.mul_(weights.reshape(-1).index_select(0, slots).to(y.dtype)[:, None])
    return out.index_add_(0, tokens, y)


def sigmoid_rows(logits: torch.Tensor, tiling: RowTiling | None = None) -> torch.Tensor:
    """``sigmoid`` of [T, ...] logits (a shared expert's gate [T, 1], a router's scores
    [T, E]). With ``tiling`` (the deterministic mode) each row's the same whatever T: torch's
    elementwise kernels run a tensor's elements through vector lanes but the last few (T x E
    mod 32) through a scalar loop whose ``exp`` differs in the last bit (measured: fp32, 16 of
    300 shared-gate rows alone differed from the same rows among 300, and 13 of 300 rows'
    routing weights with 16 experts). So the rows, padded to a multiple of
    ``tiling.multiple``, go in slices of ``tiling.most`` (64 or 128 rows: whole vectors for
    fp32 and bf16, one thread)."""
    if tiling is None:
        return torch.sigmoid(logits)
    t = logits.shape[0]
    padded = -(-t // tiling.multiple) * tiling.multiple
    x = torch.cat((logits, logits.new_zeros(padded - t, *logits.shape[1:])))
    out = torch.empty_like(x)
    for r0 in range(0, padded, tiling.most):
        out[r0 : r0 + tiling.most] = torch.sigmoid(x[r0 : r0 + tiling.most])
    return out[:t]


class RoutingTap:
    """Instrumentation of the routers (the profiler, tests and benchmarks; never a serving
    path): while ``active`` (``with tap:``), every MoE layer's router

    - adds a Zipf-shaped bias to its logits when ``zipf_s`` > 0: expert ``e`` gets
      ``-zipf_s * log(e + 1)`` times the row's own logit spread (its standard deviation),
      so a random router, which spreads tokens uniformly, favours low-numbered experts as
      trained routers favour some (how skewed the result is is measured, not assumed);
    - when ``recording``, appends the expert ids it picked ([T, top_k]) to ``ids``, one
      entry per MoE layer in the order the layers run.
    """

    def __init__(self, zipf_s: float = 0.0, recording: bool = True) -> None:
        if zipf_s < 0:
            raise ValueError(f"zipf_s: must be >= 0, got {zipf_s}")
        self.zipf_s = zipf_s
        self.recording = recording
        self.ids: list[torch.Tensor] = []

    def bias(self, logits: torch.Tensor) -> torch.Tensor:
        if self.zipf_s <= 0 or logits.shape[0] == 0:
            return logits
        e = logits.shape[-1]
        ranks = torch.arange(1, e + 1, device=logits.device, dtype=torch.float32)
        spread = logits.float().std(dim=-1, keepdim=True) if e > 1 else 1.0
        return (logits.float() - self.zipf_s * torch.log(ranks) * spread).to(logits.dtype)

    def observe(self, ids: torch.Tensor) -> None:
        if self.recording:
            self.ids.append(ids.detach().clone())

    def __enter__(self) -> RoutingTap:
        global _tap
        if _tap is not None:
            raise RuntimeError("RoutingTap: another tap is already active")
        _tap = self
        return self

    def __exit__(self, *exc: object) -> None:
        global _tap
        _tap = None


_tap: RoutingTap | None = None  # the active RoutingTap (instrumentation only)


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
        router: str = "softmax_topk",
        bias: bool = False,
    ) -> None:
        super().__init__()
        if router not in ROUTERS:
            raise ValueError(f"router: {router!r} is not one of {ROUTERS}")
        self.router_kind = router
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
        # The experts' weights may be kept quantized, one weight per expert (``WeightSlot``;
        # GPT-OSS's pre-fused, interleaved experts load as floats).
        self.slots: list[WeightSlot] = []
        self.qw13 = self.qw2 = None
        if bias:
            self.w13 = _param(num_local, 2 * width, h, dtype=dtype, device=device)
            self.w2 = _param(num_local, h, width, dtype=dtype, device=device)
        else:
            self.slots += [
                WeightSlot(
                    self, [width] * 2 * num_local, h, dtype, device, attr="w13", qattr="qw13",
                    stack=num_local,
                ),
                WeightSlot(
                    self, [h] * num_local, width, dtype, device, attr="w2", qattr="qw2",
                    stack=num_local,
                ),
            ]  # fmt: skip
        # GPT-OSS: biases on the router and on every expert's gate/up and down; the down
        # bias is held (nonzero) by the ranks that hold the experts' first columns, so the
        # all-reduce adds it once.
        self.router_bias = self.b13 = self.b2 = None
        if bias:
            self.router_bias = _param(self.num_experts, dtype=dtype, device=device)
            self.b13 = _param(num_local, 2 * width, dtype=dtype, device=device)
            self.b2 = nn.Parameter(
                torch.zeros(num_local, h, dtype=dtype, device=device), requires_grad=False
            )
        self.act = ACTIVATIONS[config.hidden_act]
        self.glu = None
        if config.swiglu_limit is not None:
            self.glu = clamped_swiglu(config.swiglu_alpha, config.swiglu_limit)
        self.shared_inter = config.shared_expert_intermediate_size
        self.shared_w13 = self.shared_w2 = self.shared_gate = None
        self.shared_qw13 = self.shared_qw2 = None
        if self.shared_inter:
            self.shared_cols = _split(self.shared_inter, size, rank)
            sw = self.shared_cols[1] - self.shared_cols[0]
            self.slots += [
                WeightSlot(
                    self, [sw, sw], h, dtype, device, attr="shared_w13", qattr="shared_qw13"
                ),
                WeightSlot(self, [h], sw, dtype, device, attr="shared_w2", qattr="shared_qw2"),
            ]
            if config.shared_expert_gate:
                self.shared_gate = _param(1, h, dtype=dtype, device=device)
        # DeepSeek's grouped router (``route_grouped``) where the config names its method.
        self.topk_method = config.topk_method
        self.groups = (config.n_group, config.topk_group) if self.topk_method else (1, 1)
        if self.topk_method == "greedy":
            self.groups = (1, 1)
        self.routed_scaling = config.routed_scaling_factor
        # DeepSeek-V3's correction bias (fp32, as transformers keeps it): biases the choice
        # of experts, not their weights.
        self.score_bias = None
        if self.topk_method == "noaux_tc":
            self.score_bias = _param(self.num_experts, dtype=torch.float32, device=device)
        self.group = group
        self.tiling: RowTiling | None = None  # the deterministic mode's (``RowTiling``)

    def select(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The router's choice for each row of ``x``: (weights [T, top_k] fp32, expert ids
        [T, top_k]), the largest first (seen and biased by a ``RoutingTap`` when one is on)."""
        logits = linear(x, self.router, self.router_bias, tiling=self.tiling)
        tap = _tap
        if tap is not None:
            logits = tap.bias(logits)
        if self.router_kind == "topk_softmax":
            weights, ids = route_topk_softmax(logits, self.top_k)
        elif self.score_bias is not None:
            weights, ids = route_noaux_tc(
                logits, self.score_bias, self.top_k, *self.groups, self.routed_scaling,
                self.renormalize, self.tiling,
            )  # fmt: skip
        elif self.topk_method is not None:
            weights, ids = route_grouped(
                logits, self.top_k, *self.groups, self.routed_scaling, self.renormalize
            )
        else:
            weights, ids = route(logits, self.top_k, self.renormalize)
        if tap is not None:
            tap.observe(ids)
        return weights, ids

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tiling = self.tiling
        weights, ids = self.select(x)
        w13 = self.w13 if self.qw13 is None else self.qw13
        w2 = self.w2 if self.qw2 is None else self.qw2
        out = grouped_experts(
            x, w13, w2, weights, ids, self.act, self.experts[0],
            b13=self.b13, b2=self.b2, glu=self.glu, tiling=tiling,
        )  # fmt: skip
        if self.shared_inter:
            s13 = self.shared_w13 if self.shared_qw13 is None else self.shared_qw13
            s2 = self.shared_w2 if self.shared_qw2 is None else self.shared_qw2
            gate, up = linear(x, s13, tiling=tiling).chunk(2, dim=-1)
            shared = linear(self.act(gate) * up, s2, tiling=tiling)
            if self.shared_gate is None:  # DeepSeek's shared experts: ungated
                out = out + shared
            else:
                gate = sigmoid_rows(linear(x, self.shared_gate, tiling=tiling), tiling)
                out = out + gate * shared
        if self.group is not None:
            out = self.group.all_reduce(out)
        return out

    def _fused_targets(
        self, prefix: str, names: dict[str, str]
    ) -> dict[str, Target | list[Target]]:
        """GPT-OSS's stacked, pre-fused experts (see the module docstring): this rank's
        experts (expert parallel) and columns (tensor parallel) of each, gate columns from
        the even columns of ``gate_up_proj``, up from the odd ones, both transposed into
        ``w13``'s rows; ``down_proj`` transposed into ``w2``."""
        e, h, inter = self.num_experts, self.router.shape[1], self.inter
        (e0, e1), (c0, c1) = self.experts, self.cols
        width = c1 - c0
        experts = slice(e0, e1)
        gate_cols, up_cols = slice(2 * c0, 2 * c1, 2), slice(2 * c0 + 1, 2 * c1, 2)
        gate_up, down = prefix + names["gate_up"], prefix + names["down"]
        w13 = self.w13.transpose(1, 2)  # [E_local, H, 2 * width]: gate_up_proj's layout
        out: dict[str, Target | list[Target]] = {
            gate_up: [
                Target(w13[:, :, :width], (experts, slice(None), gate_cols), (e, h, 2 * inter)),
                Target(w13[:, :, width:], (experts, slice(None), up_cols), (e, h, 2 * inter)),
            ],
            down: Target(self.w2.transpose(1, 2), (experts, slice(c0, c1)), (e, inter, h)),
        }
        if self.b13 is not None:
            out[gate_up + "_bias"] = [
                Target(self.b13[:, :width], (experts, gate_cols), (e, 2 * inter)),
                Target(self.b13[:, width:], (experts, up_cols), (e, 2 * inter)),
            ]
            # Tensor parallel: the down bias on the first columns' rank only (the others
            # keep zeros); expert parallel: every rank its experts'.
            out[down + "_bias"] = (
                Target(self.b2, (experts,), (e, h)) if c0 == 0 else _elsewhere(self.b2, (e, h))
            )
        return out

    def targets(self, prefix: str, names: dict[str, str]) -> dict[str, Target | list[Target]]:
        """Where each checkpoint tensor goes: ``prefix`` is "model.layers.N.", ``names``
        the family's (``MOE_NAMES``)."""
        h, inter = self.router.shape[1], self.inter
        block = prefix + names["block"] + "."
        out: dict[str, Target | list[Target]] = {
            block + names["router"] + ".weight": Target(
                self.router, (slice(None),), (self.num_experts, h)
            )
        }
        if self.router_bias is not None:
            out[block + names["router"] + ".bias"] = Target(
                self.router_bias, (slice(None),), (self.num_experts,)
            )
        if self.score_bias is not None:
            out[block + names["router"] + ".e_score_correction_bias"] = Target(
                self.score_bias, (slice(None),), (self.num_experts,)
            )
        c0, c1 = self.cols
        width = c1 - c0
        if ("gate_up" in names) != (self.b13 is not None) or (
            "gate_up" in names and self.shared_inter
        ):
            raise ValueError(
                "moe: expert biases load from the stacked, pre-fused expert tensors only "
                "(GPT_OSS_NAMES), which have no shared expert"
            )
        if "gate_up" in names:
            out.update(self._fused_targets(block + "experts.", names))
            return out
        for e in range(self.num_experts):
            expert = f"{block}experts.{e}."
            local = e - self.experts[0]
            if not 0 <= local < self.w13.shape[0]:  # another rank's expert: read, not kept
                for name, shape in (("gate", (inter, h)), ("up", (inter, h)), ("down", (h, inter))):
                    out[expert + names[name] + ".weight"] = _elsewhere(self.w2, shape)
                continue
            w13 = self.w13[local]
            s13, s2 = self.slots[0], self.slots[1]
            out[expert + names["gate"] + ".weight"] = Target(
                w13[:width], (slice(c0, c1),), (inter, h), s13, 2 * local
            )
            out[expert + names["up"] + ".weight"] = Target(
                w13[width:], (slice(c0, c1),), (inter, h), s13, 2 * local + 1
            )
            out[expert + names["down"] + ".weight"] = Target(
                self.w2[local], (slice(None), slice(c0, c1)), (h, inter), s2, local
            )
        if self.shared_inter:
            s0, s1 = self.shared_cols
            sw, si = s1 - s0, self.shared_inter
            shared = block + names["shared"] + "."
            s13, s2 = self.slots[2], self.slots[3]
            out[shared + "gate_proj.weight"] = Target(
                self.shared_w13[:sw], (slice(s0, s1),), (si, h), s13, 0
            )
            out[shared + "up_proj.weight"] = Target(
                self.shared_w13[sw:], (slice(s0, s1),), (si, h), s13, 1
            )
            out[shared + "down_proj.weight"] = Target(
                self.shared_w2, (slice(None), slice(s0, s1)), (h, si), s2
            )
            if self.shared_gate is not None:
                out[block + names["shared_gate"] + ".weight"] = Target(
                    self.shared_gate, (slice(None),), (1, h)
                )
        return out
