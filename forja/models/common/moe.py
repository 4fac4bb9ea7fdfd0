"""Mixture-of-experts feed-forward layer: a router, routed experts, optional shared experts.

    scores = router(x)                       softmax or sigmoid over E experts, fp32
    chosen = top-k(scores + bias)            optionally within the best `topk_groups` groups
    y      = sum_k w_k * expert_k(x) + shared(x)

Each token goes to `top_k` of `n_experts` SwiGLU experts (Shazeer et al. 2017; GShard,
Lepikhin et al. 2020; Switch, Fedus et al. 2021). Rows are sorted by expert and every
expert's rows run as one grouped matrix multiply (forja/ops/grouped_mm.py).

gpt-oss's variant, each part an option off by default: a learned bias in the router, a
softmax over the top-k logits only (`topk_softmax`), biases on the experts' projections and
a clamped SwiGLU (`MoEArgs`). Llama 4's: sigmoid scores unnormalized, and each expert's
input scaled instead of its output, y = sum_k expert_k(w_k x) + shared(x) (`scale_expert_input`).
Nemotron 3's (Nemotron-H's 'E' blocks): experts without a gate, W2 relu(W1 x)^2, routed and
shared alike (`expert_activation = "relu2"`).

Balancing the load, each optional:
- the Switch/GShard auxiliary loss  E * sum_i f_i * P_i  (f_i: share of the token-slots
  routed to expert i, P_i: mean routing probability of i; 1 when perfectly balanced),
- the router z-loss  mean(logsumexp(logits)^2)  (ST-MoE, Zoph et al. 2022),
- DeepSeek-V3's auxiliary-loss-free bias (Wang et al. 2024, arXiv 2408.15664): a per-expert
  bias added to the scores only to choose experts, nudged after each optimizer step
  toward under-loaded experts (`Router.update_bias`, called by the step engine).
- a capacity factor: an expert takes at most ceil(cf * tokens * top_k / E) token-slots,
  the ones with the highest weights; the rest are dropped (the residual carries them).

The auxiliary losses do not change the layer's output; they reach the gradients through
`AddAuxLoss`, which gives them a gradient of the step context's `aux_loss_share` in backward
(forja/models/common/step_context.py: the step engine sets it to the micro-batch's share of the
step's loss, so a pipeline stage's layers count them like the last stage counts the
cross-entropy). Per-step statistics (tokens per expert, dropped slots, loss values) accumulate
on the device in `MoEStats` for the engine to read and reset.

Single-device code: under expert parallelism forja.parallel.ep shards `experts` and moves
each expert's rows to the rank holding it around `GroupedExperts.forward`. Under tensor
parallelism each rank routes a slice of the micro-batch's tokens (forja/models/common/tp_plan.py);
the statistics the auxiliary losses and the bias need are of the whole micro-batch, so the
layer sums them with `token_split_sum`, which the parallel plan sets (None: one device).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from forja.models.common.mlp import SquaredReLUMLP, SwiGLU
from forja.models.common.moe_args import MoEArgs  # its args, re-exported: families import them from here
from forja.models.common.precision import compute_dtype
from forja.models.common.step_context import OUTSIDE_A_STEP, AddAuxLoss
from forja.ops.grouped_mm import grouped_mm


@dataclass
class Routing:
    """Where each of N tokens goes."""

    weights: torch.Tensor  # (N, k) fp32: the chosen experts' weights
    experts: torch.Tensor  # (N, k) int64: the chosen experts
    logits: torch.Tensor  # (N, E) fp32: router logits
    probs: torch.Tensor  # (N, E) fp32: per-token distribution over experts (for the aux loss)


_KEPT_RECORDS = 1024  # a layer's forwards kept between reads of its statistics (a step's micro-batches)


@dataclass
class MoEStats:
    """What one layer saw since the engine last read it (a step's micro-batches). Counts
    are used as ratios only: activation checkpointing re-runs a forward and counts twice."""

    tokens_per_expert: torch.Tensor | None = None  # (E,) float64: token-slots routed to each expert
    dropped: torch.Tensor | float = 0.0  # token-slots dropped by the capacity limit
    # Sums over forwards of the unweighted losses, kept on the device (0-dim tensors): read as
    # numbers only once a step, by the engine, not with a host sync per layer and micro-batch.
    aux_loss: torch.Tensor | float = 0.0
    z_loss: torch.Tensor | float = 0.0
    forwards: int = 0


class RouterGate(nn.Linear):
    """The router's linear layer (with `MoEArgs.router_bias`, a bias too), computed in fp32
    whatever the weight's and the autocast dtype (fp64 in a fp64 model): top-k picks are
    sensitive to rounding, and bf16 logits would reorder near-ties."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast(x.device.type, enabled=False):
            dtype = compute_dtype(x.dtype)
            bias = self.bias.to(dtype) if self.bias is not None else None
            return F.linear(x.to(dtype), self.weight.to(dtype), bias)


class Router(nn.Module):
    """Scores experts for each token and picks `top_k` of them."""

    def __init__(self, dim: int, args: MoEArgs):
        super().__init__()
        self.args = args
        self.gate = RouterGate(dim, args.n_experts, bias=args.router_bias)
        if args.expert_bias:
            # A buffer, not a parameter: moved by the update rule, not by gradients; checkpointed.
            self.register_buffer("expert_bias", torch.zeros(args.n_experts, dtype=torch.float32))
        else:
            self.expert_bias = None

    def forward(self, x: torch.Tensor) -> Routing:
        """x (N, D) -> Routing; scores in fp32, fp64 in a fp64 model (`RouterGate`)."""
        a = self.args
        logits = self.gate(x)  # (N, E) at least fp32
        if a.score_func == "topk_softmax":
            return self._topk_softmax(logits)
        scores = logits.softmax(-1) if a.score_func == "softmax" else logits.sigmoid()  # (N, E)
        choice = scores if self.expert_bias is None else scores + self.expert_bias
        if a.n_expert_groups > 1:
            choice = self._mask_groups(choice)
        experts = choice.topk(a.top_k, dim=-1, sorted=False).indices  # (N, k)
        weights = scores.gather(1, experts)  # (N, k): the bias picks experts, never weighs them
        if a.norm_topk_prob:  # with top_k 1 too (w / (w + 1e-20)), as Hugging Face does
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        weights = weights * a.route_scale
        probs = scores if a.score_func == "softmax" else scores / scores.sum(-1, keepdim=True)
        return Routing(weights=weights, experts=experts, logits=logits, probs=probs)

    def _topk_softmax(self, logits: torch.Tensor) -> Routing:
        """gpt-oss's routing: the top_k logits, then a softmax over those k alone (the same
        weights as a renormalized softmax over all experts, rounded as transformers does)."""
        a = self.args
        choice = logits if self.expert_bias is None else logits + self.expert_bias
        if a.n_expert_groups > 1:
            choice = self._mask_groups(choice)
        experts = choice.topk(a.top_k, dim=-1).indices  # (N, k)
        weights = logits.gather(1, experts).softmax(-1) * a.route_scale  # (N, k)
        return Routing(weights=weights, experts=experts, logits=logits, probs=logits.softmax(-1))

    def _mask_groups(self, choice: torch.Tensor) -> torch.Tensor:
        """Keep the scores of each token's best `topk_groups` groups, -inf elsewhere."""
        a = self.args
        grouped = choice.view(choice.shape[0], a.n_expert_groups, -1)  # (N, G, E/G)
        if a.group_score == "top2_sum":
            group_scores = grouped.topk(2, dim=-1).values.sum(-1)  # (N, G)
        else:
            group_scores = grouped.amax(-1)
        best = group_scores.topk(a.topk_groups, dim=-1, sorted=False).indices  # (N, topk_groups)
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)  # (N, G)
        return grouped.masked_fill(~keep[..., None], float("-inf")).view_as(choice)

    def _apply(self, fn, recurse=True):
        # Keep the bias in fp32 when the model is cast to bf16: steps of 1e-3 on values near 1
        # would round away in bf16 (Hugging Face keeps it fp32 too).
        super()._apply(fn, recurse)
        if self.expert_bias is not None and self.expert_bias.dtype != torch.float32:
            self.expert_bias = self.expert_bias.float()
        return self

    @torch.no_grad()
    def update_bias(self, tokens_per_expert: torch.Tensor) -> None:
        """One auxiliary-loss-free step: raise the bias of experts below the mean load,
        lower it above (sign rule of DeepSeek-V3). `tokens_per_expert` (E,) summed over
        every rank that saw different data, so all ranks move the bias alike."""
        if self.expert_bias is None or self.args.bias_update_rate == 0:
            return
        load = tokens_per_expert.to(self.expert_bias)
        self.expert_bias.add_(self.args.bias_update_rate * torch.sign(load.mean() - load))

    def init_buffers(self) -> None:
        """The bias starts at zero (called by the model's init_weights)."""
        if self.expert_bias is not None:
            with torch.no_grad():
                self.expert_bias.zero_()


class GroupedExperts(nn.Module):
    """`n` experts with their weights stacked: w1, w3 (n, H, D), w2 (n, D, H); with `bias`,
    b1, b3 (n, H) and b2 (n, D). `activation` one of EXPERT_ACTIVATIONS (MoEArgs): "relu2"
    experts have no gate, so no w3 (nor b3): w1 is their up projection."""

    def __init__(self, n: int, dim: int, hidden: int, impl: str = "auto", *, bias: bool = False,
                 activation: str = "swiglu", limit: float = 7.0, alpha: float = 1.702):
        super().__init__()
        self.impl = impl
        self.activation, self.limit, self.alpha = activation, limit, alpha
        gated = activation != "relu2"
        self.w1 = nn.Parameter(torch.empty(n, hidden, dim))  # gate (without one: up)
        self.w3 = nn.Parameter(torch.empty(n, hidden, dim)) if gated else None  # up
        self.w2 = nn.Parameter(torch.empty(n, dim, hidden))  # down
        self.b1 = nn.Parameter(torch.empty(n, hidden)) if bias else None
        self.b3 = nn.Parameter(torch.empty(n, hidden)) if bias and gated else None
        self.b2 = nn.Parameter(torch.empty(n, dim)) if bias else None

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """x (M, D) rows sorted by expert, counts (n,) rows per expert -> (M, D)."""
        w1, w2 = _local(self.w1), _local(self.w2)
        gate = self._biased(grouped_mm(x, w1, counts, self.impl), self.b1, counts)  # (M, H)
        up = None if self.w3 is None else self._biased(grouped_mm(x, _local(self.w3), counts, self.impl), self.b3,
                                                        counts)
        return self._biased(grouped_mm(self.gated(gate, up), w2, counts, self.impl), self.b2, counts)

    def gated(self, gate: torch.Tensor, up: torch.Tensor | None) -> torch.Tensor:
        """The hidden activation (M, H) of the gate and up projections (of w1's alone without a gate)."""
        return gated_activation(gate, up, self.activation, self.limit, self.alpha)

    @staticmethod
    def _biased(y: torch.Tensor, bias: torch.Tensor | None, counts: torch.Tensor) -> torch.Tensor:
        """y (M, N) rows sorted by expert plus each row's expert's bias (n, N)."""
        if bias is None:
            return y
        rows = _local(bias).repeat_interleave(counts, dim=0, output_size=y.shape[0])  # (M, N)
        return y + rows.to(y.dtype)


def gated_activation(gate: torch.Tensor, up: torch.Tensor | None, activation: str = "swiglu", limit: float = 7.0,
                     alpha: float = 1.702) -> torch.Tensor:
    """silu(gate) * up ("swiglu"), or gpt-oss's "clamped_swiglu": both clamped (the gate only
    from above), a sigmoid-GELU gate g * sigmoid(alpha g), and up + 1; or "relu2", ungated:
    relu(gate)^2, `gate` being w1's output and `up` None (So et al. 2021, "Primer"); or "geglu",
    gelu_tanh(gate) * up (Gemma 4)."""
    if activation == "swiglu":
        return F.silu(gate) * up
    if activation == "geglu":
        return F.gelu(gate, approximate="tanh") * up
    if activation == "relu2":
        return F.relu(gate).square()
    gate = gate.clamp(max=limit)
    up = up.clamp(-limit, limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def _local(w: torch.Tensor) -> torch.Tensor:
    """This rank's experts: under expert parallelism the stacked weights are sharded
    (DTensors) along the expert dimension, and the layer computes with its own slice."""
    return w.to_local() if isinstance(w, DTensor) else w


class MoE(nn.Module):
    """The feed-forward of an MoE block: (B, T, D) -> (B, T, D)."""

    def __init__(self, dim: int, args: MoEArgs, *, fused_swiglu: bool = False, shared_bias: bool = False,
                 expert_dim: int = 0):
        super().__init__()
        args.check_moe()
        self.args = args
        self.router = Router(dim, args)
        # `expert_dim`: the routed experts' width where a family projects their input (0: dim).
        self.experts = GroupedExperts(args.n_experts, expert_dim or dim, args.moe_ffn_dim, args.moe_impl,
                                      bias=args.expert_proj_bias, activation=args.expert_activation,
                                      limit=args.swiglu_limit, alpha=args.swiglu_alpha)
        shared = args.shared_width
        # The shared experts are of the routed ones' kind: a SwiGLU, or squared-ReLU MLP without a gate
        # (`shared_bias`: biases on their projections, Nemotron-H's mlp_bias).
        if args.expert_activation == "relu2":
            self.shared_experts = SquaredReLUMLP(dim, shared, bias=shared_bias) if shared else None
        else:
            self.shared_experts = SwiGLU(dim, shared, fused=fused_swiglu, bias=shared_bias) if shared else None
        self.shared_gate = nn.Linear(dim, 1, bias=False) if shared and args.shared_expert_gate else None
        self.step_context = OUTSIDE_A_STEP  # the step engine's: this micro-batch's share of the loss
        self._records: list[tuple] = []  # each training forward's totals, until `take_stats`
        # Sums a small (S,) float64 tensor over the ranks that each route a slice of this
        # micro-batch's tokens (set by the tensor-parallel plan); None: the whole batch is here.
        self.token_split_sum = None

    def structure_fields(self) -> dict:
        """What it adds to its block's structure record (forja/models/common/blocks.py)."""
        return {"ffn": "moe", "expert_activation": self.args.expert_activation,
                "shared_expert_gate": self.shared_gate is not None}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, D = x.shape
        flat = x.reshape(-1, D)  # (N, D)
        route = self.router(flat)
        routed = torch.bincount(route.experts.flatten(), minlength=self.args.n_experts)  # (E,) slots per expert
        slots, token_of, weights, counts = self._dispatch_order(route, routed)
        expert_in = self.to_expert_width(flat)  # (N, W)
        rows = expert_in[token_of]  # (M, W), M kept token-slots sorted by expert
        if self.args.scale_expert_input:
            y = self.experts((rows * weights[:, None]).to(expert_in.dtype), counts)
        else:
            # The fp32 weights promote: one rounding to the model's dtype below.
            y = self.experts(rows, counts) * weights[:, None]
        summed = torch.zeros_like(expert_in).index_add_(0, token_of, y.to(expert_in.dtype))  # (N, W)
        out = self.from_expert_width(summed)  # (N, D)
        if self.shared_experts is not None:
            shared = self.shared_experts(flat)  # (N, D)
            out = out + (shared if self.shared_gate is None else torch.sigmoid(self.shared_gate(flat)) * shared)
        dropped = route.experts.numel() - slots.numel()
        aux, z, totals = self._aux_losses(route, routed, dropped)
        if torch.is_grad_enabled() and (aux is not None or z is not None):
            weighted = sum(w * v for w, v in ((self.args.aux_loss_weight, aux), (self.args.z_loss_weight, z))
                           if v is not None)
            out = AddAuxLoss.apply(out, weighted, self.step_context.aux_loss_share)
        if self.training:  # validation and generation forwards neither count nor move the bias
            self._record(*totals)
        return out.view(B, T, D)

    def to_expert_width(self, flat: torch.Tensor) -> torch.Tensor:
        """The routed experts' input rows (N, W) of the layer's (N, D): the same here; a family whose
        experts compute in another width projects them (Nemotron 3 Super's latent experts)."""
        return flat

    def from_expert_width(self, y: torch.Tensor) -> torch.Tensor:
        """The layer's routed output (N, D) of the experts' weighted sum (N, W): the same here."""
        return y

    def _dispatch_order(self, route: Routing, routed: torch.Tensor):
        """The kept token-slots sorted by expert: (slot ids (M,), their tokens (M,), their
        weights (M,), rows per expert (E,)). Dropless keeps every slot; with a capacity
        factor each expert keeps its highest-weighted slots up to its capacity."""
        k, E = self.args.top_k, self.args.n_experts
        expert_of = route.experts.flatten()  # (N k,): slot s is token s // k's choice
        weight_of = route.weights.flatten()
        if self.args.capacity_factor > 0:
            by_weight = torch.argsort(weight_of, descending=True, stable=True)
            order = by_weight[torch.argsort(expert_of[by_weight], stable=True)]  # by expert, then weight
            starts = torch.cumsum(routed, 0) - routed  # (E,) first sorted slot of each expert
            rank_in_expert = torch.arange(order.numel(), device=order.device) - starts[expert_of[order]]
            capacity = math.ceil(self.args.capacity_factor * route.experts.shape[0] * k / E)
            order = order[rank_in_expert < capacity]
            counts = torch.bincount(expert_of[order], minlength=E)  # (E,) kept slots per expert
        else:
            order = torch.argsort(expert_of, stable=True)  # (N k,) slots grouped by expert
            counts = routed  # dropless: every routed slot is kept
        return order, order // k, weight_of[order], counts

    def _aux_losses(self, route: Routing, routed: torch.Tensor, dropped: int):
        """(load-balancing loss, z-loss, totals for `_record`). Each loss is 0-dim fp32 with
        its graph, or None when its weight is 0.

        The statistics are the whole micro-batch's: with its tokens split over ranks,
        `token_split_sum` adds up the counts, the probability sums and the squared
        log-partitions (one collective), and each rank's loss is its tokens' share of the
        whole batch's loss: the shares sum to it, and so do their gradients."""
        a, E = self.args, self.args.n_experts
        N, k = route.experts.shape
        lse2 = torch.logsumexp(route.logits, dim=-1).square() if a.z_loss_weight > 0 else None  # (N,)
        probs_sum = route.probs.sum(0)  # (E,)
        lse2_sum = lse2.detach().sum() if lse2 is not None else probs_sum.new_zeros(())
        # new_full, not new_tensor([N, dropped]): a list copied to a GPU waits for the device.
        sizes = [routed.new_full((1,), n, dtype=torch.float64) for n in (N, dropped)]
        local = torch.cat([routed.double(), probs_sum.detach().double(), *sizes, lse2_sum.double()[None]])  # (2E + 3,)
        with torch.no_grad():
            whole = local if self.token_split_sum is None else self.token_split_sum(local)
        routed_all, probs_all = whole[:E], whole[E:2 * E]
        n_all, dropped_all, lse2_all = whole[2 * E], whole[2 * E + 1], whole[2 * E + 2]
        f = (routed_all / (n_all * k)).float()  # (E,) share of the batch's slots per expert
        aux = E * (f * probs_sum).sum() / n_all.float() if a.aux_loss_weight > 0 else None
        z = lse2.sum() / n_all.float() if lse2 is not None else None
        aux_value = (E * (f.double() * probs_all).sum() / n_all).float() if aux is not None else None
        z_value = (lse2_all / n_all).float() if z is not None else None
        return aux, z, (routed_all, aux_value, z_value, dropped_all)

    def _record(self, routed: torch.Tensor, aux: torch.Tensor | None, z: torch.Tensor | None,
                dropped: torch.Tensor) -> None:
        # Kept as they are and summed when read: activation checkpointing's recompute must run
        # exactly the ops the forward ran, and a running sum's first add is not its later ones.
        # A loop that never reads them (no step engine) keeps the latest _KEPT_RECORDS.
        self._records.append((routed, None if aux is None else aux.detach(), None if z is None else z.detach(),
                              dropped))
        if len(self._records) > _KEPT_RECORDS:
            del self._records[0]

    def take_stats(self) -> MoEStats:
        """This layer's statistics since the last call, and a fresh start."""
        records, self._records = self._records, []
        stats = MoEStats(forwards=len(records))
        with torch.no_grad():
            for routed, aux, z, dropped in records:
                before = stats.tokens_per_expert
                stats.tokens_per_expert = routed if before is None else before + routed
                stats.dropped = stats.dropped + dropped
                stats.aux_loss = stats.aux_loss if aux is None else stats.aux_loss + aux
                stats.z_loss = stats.z_loss if z is None else stats.z_loss + z
        return stats

    def active_fraction(self) -> float:
        """Share of the routed experts' weights each token uses."""
        return self.args.top_k / self.args.n_experts


def load_balancing_loss(route: Routing, n_experts: int, routed: torch.Tensor | None = None) -> torch.Tensor:
    """Switch/GShard loss E * sum_i f_i P_i (0-dim, fp32): f_i the share of token-slots
    routed to expert i (not differentiable), P_i the mean probability of i. 1 when balanced.
    `routed` (E,): the slots per expert, when the caller has counted them already."""
    N, k = route.experts.shape
    if routed is None:
        routed = torch.bincount(route.experts.flatten(), minlength=n_experts)
    f = routed.float() / (N * k)  # (E,)
    P = route.probs.mean(0)  # (E,)
    return n_experts * (f * P).sum()


def router_z_loss(logits: torch.Tensor) -> torch.Tensor:
    """ST-MoE's z-loss: mean squared log-partition of the router logits (0-dim, fp32)."""
    return torch.logsumexp(logits, dim=-1).square().mean()


def moe_layers(model: nn.Module) -> list[tuple[int, MoE]]:
    """(block index, MoE) of every MoE layer a model (or pipeline stage) holds."""
    out = []
    for name, module in model.named_modules():
        if isinstance(module, MoE):
            parts = [p for p in name.split(".") if p.isdigit()]
            out.append((int(parts[0]) if parts else -1, module))
    return out
