"""The tensor-parallel plan of a dense decoder, written with torch's own parallel styles.

A plan is data: module names mapped to `torch.distributed.tensor.parallel` styles, one
dict for the model's own modules and one applied to every block. `forja.parallel`
applies it; nothing here touches a mesh or a process group, so model code stays
single-device and a family changes its plan by editing a dict.

Megatron-LM's scheme: column-parallel q, k, v, gate and up projections split the heads
and hidden columns; row-parallel o and down projections sum the partial results. With
sequence parallelism the residual stream and the norms between blocks hold (B, T/tp, dim)
per rank instead of the whole (B, T, dim) (Korthikanti et al. 2022), and each block
gathers the sequence before its projections. The output projection stays split over the
vocabulary: the loss runs vocabulary-parallel, so no rank holds the full logits.

Under float8 (`float8_styles`), the projections forja/ops/float8.py converted take
torchao's float8 styles in place of torch's, as torchtitan composes them: the same
sharding, with activations cast to float8 before they are gathered, so TP's all-gathers
move float8, and each gradient cast to float8 as it enters the layer's backward.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    RowwiseParallel,
    SequenceParallel,
)


@dataclass
class TPPlan:
    """Where each module goes under tensor parallelism."""

    root: dict[str, ParallelStyle]
    """The model's own modules (embeddings, final norm, output), by dotted name; names a
    pipeline stage lacks are skipped."""
    block: dict[str, ParallelStyle]
    """Every transformer block's modules, by name within the block."""
    sequence_parallel: bool
    """Whether the residual stream between blocks is split along the sequence."""
    float8: bool = False
    """Whether layers converted to float8 take torchao's float8 styles (`float8_styles`)."""
    mixers: dict[str, dict[str, ParallelStyle]] = field(default_factory=dict)
    """For a kind of block (TransformerArgs.layer_types) whose sequence mixer is not the
    attention `block` plans: that mixer's styles, in place of the block's "attention" ones."""

    def block_plan(self, moe: bool, kind: str = "full_attention") -> dict[str, ParallelStyle]:
        """The plan of one block; `moe`: its feed-forward is a mixture of experts; `kind`:
        its sequence mixer's kind.

        An MoE layer is split over the tensor-parallel ranks by its tokens (`SplitTokens`):
        each rank routes and computes its slice; its routed experts are spread over those
        ranks by forja.parallel.ep, as under expert parallelism."""
        plan = self._mixer_plan(kind) if kind in self.mixers else self.block
        if not moe:
            return plan
        plan = {k: v for k, v in plan.items() if not k.startswith("feed_forward")}
        plan["feed_forward"] = SplitTokens(self.sequence_parallel)
        return plan

    def _mixer_plan(self, kind: str) -> dict[str, ParallelStyle]:
        """`block` with the attention's styles replaced by those of `kind`'s mixer; the
        sequence gather before the mixer (under SP) is kept."""
        gather = self.block.get("attention")
        if isinstance(gather, LocalParameters):  # the attention's own parameters: keep only the gather
            gather = gather.then
        plan = {k: v for k, v in self.block.items() if k != "attention" and not k.startswith("attention.")}
        mixer = dict(self.mixers[kind])
        own = mixer.pop("attention", None)
        plan.update(mixer)
        if own is not None or gather is not None:
            plan["attention"] = (LocalParameters(own.names, then=gather, replicated=own.replicated)
                                 if own is not None else gather)
        return plan


class SplitTokens(ParallelStyle):
    """A mixture-of-experts layer computed by each tensor-parallel rank on a slice of the
    tokens, instead of by every rank on all of them (which would repeat the experts' work
    tp times): the (B, T, dim) input is split along T, and the output gathered back.

    Under sequence parallelism the input is this rank's slice already: no communication.
    Without it the input is replicated: the split is a local slice (its backward gathers
    the gradient) and the output is all-gathered (its backward takes the local slice).
    Every part of the layer but the routed experts (the router's gate, the shared experts
    and their gate, a family's own parts such as latent experts' projections) keeps its
    weights whole on every rank, as replicated DTensors computing on the rank's tokens
    (Shard(0) of the (N, width) rows), so their gradients are partial sums that DTensor (or
    FSDP) reduces over the ranks. The layer's load statistics are summed over the ranks
    through `token_split_sum`, so its auxiliary losses and bias see the whole micro-batch.
    `token_ids`: the layer's second input is the (B, T) token ids (DeepSeek-V4's hash routing
    reads them), whole on every rank, split along T with the tokens."""

    def __init__(self, sequence_parallel: bool, *, token_ids: bool = False):
        super().__init__()
        self.sequence_parallel, self.token_ids = sequence_parallel, token_ids

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        whole = Shard(1) if self.sequence_parallel else Replicate()
        ids = ((Replicate(),), (Shard(1),)) if self.token_ids else ((), ())
        PrepareModuleInputOutput(
            input_layouts=(whole, *ids[0]), desired_input_layouts=(Shard(1), *ids[1]), use_local_input=True,
            output_layouts=(Shard(1),), desired_output_layouts=(whole,), use_local_output=True,
        )._apply(module, device_mesh)
        # The router's gate, not the router: the router returns a Routing, not a tensor.
        parts = [module.router.gate, *(m for name, m in module.named_children() if name not in ("router", "experts"))]
        for part in parts:
            distribute_module(part, device_mesh, _replicate_params, _rows_in, _local_out)
        module.token_split_sum = _Summed(device_mesh)
        return module


class LocalParameters(ParallelStyle):
    """Shards some of a module's parameters along dim 0 over the TP mesh, with the heads they
    belong to, and lets the module compute with them as plain tensors: during its forward each
    reads as this rank's shard (`DTensor.to_local`, through which the gradient reaches the
    sharded parameter). Model code stays single-device. For per-head parameters a module uses
    directly rather than through a Linear: attention sinks (H,), Gated DeltaNet's decay
    parameters (Hv,) and short convolutions' channels. `names` are dotted paths from the
    module ("conv_q.weight"); `then` is the module's other style, if any (a plan holds one
    style per name), applied after. `replicated`: parameters every head shares (a norm over
    each head's width), kept whole on every rank, their gradient from this rank's heads a
    partial sum, added up over the ranks."""

    def __init__(self, names: tuple[str, ...], then: ParallelStyle | None = None, replicated: tuple[str, ...] = ()):
        super().__init__()
        self.names, self.then, self.replicated = names, then, replicated

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        held = []
        for path in (*self.names, *self.replicated):
            owner_name, _, key = path.rpartition(".")
            owner = module.get_submodule(owner_name) if owner_name else module
            p = getattr(owner, key, None)
            if p is None:
                continue
            whole = path in self.replicated
            # src_data_rank=None: no scatter; every rank initializes the weights alike later.
            shard = distribute_tensor(p.data, device_mesh, [Replicate() if whole else Shard(0)], src_data_rank=None)
            param = nn.Parameter(shard, requires_grad=p.requires_grad)
            if whole:
                param.register_hook(_replicated)
            owner.register_parameter(key, param)
            held.append((owner, key))
        if held:
            module.register_forward_pre_hook(_LocalViews(held).enter)
            module.register_forward_hook(_LocalViews.leave)
        return module if self.then is None else self.then._apply(module, device_mesh)


class _LocalViews:
    """Swaps sharded parameters for their local tensors around one module's forward. The
    parameter objects are read when the forward starts: FSDP may have put its unsharded
    ones in their place since the last step."""

    def __init__(self, held: list[tuple[nn.Module, str]]):
        self.held = held

    def enter(self, module: nn.Module, args) -> None:
        saved = []
        for owner, key in self.held:
            p = owner._parameters[key]
            saved.append((owner, key, p))
            if isinstance(p, DTensor):  # a replicated one's gradient here covers this rank's heads only
                partial = [Partial()] if p.placements[0].is_replicate() else None
                p = p.to_local(grad_placements=partial)
            owner._parameters[key] = p
        module._forja_tp_saved = saved

    @staticmethod
    def leave(module: nn.Module, args, output):
        for owner, key, p in module.__dict__.pop("_forja_tp_saved", ()):
            owner._parameters[key] = p
        return output


def shard_attention_sinks(plan: TPPlan) -> TPPlan:
    """`plan` with every block's attention sinks sharded with the heads (`LocalParameters`)."""
    plan.block["attention"] = LocalParameters(("sinks",), then=plan.block.get("attention"))
    return plan


GATED_DELTANET_PROJECTIONS = ("wq", "wk", "wv", "wz", "wb", "wa")


def gated_deltanet_tp_plan(plan: TPPlan, projections: tuple[str, ...] = GATED_DELTANET_PROJECTIONS) -> TPPlan:
    """`plan` with linear-attention blocks' Gated DeltaNet split by head over the TP ranks:
    column-parallel q, k, v, gate, beta and decay projections (a rank keeps whole key heads
    and the value heads grouped under them), its share of the short convolutions' channels
    and of the per-head decay parameters, the row-parallel output projection summing the
    heads' parts. The output norm's (dv,) weight is shared by all heads: replicated, its
    gradient summed over the ranks, as QK-norm's (`dense_tp_plan`). `projections`: the
    column-parallel ones, by name (Kimi Delta Attention's differ: its gates' second factors)."""
    seq = Shard(1) if plan.sequence_parallel else Replicate()
    mixer: dict[str, ParallelStyle] = {f"attention.{name}": ColwiseParallel() for name in projections}
    mixer["attention.wo"] = RowwiseParallel(output_layouts=seq)
    mixer["attention"] = LocalParameters(("A_log", "dt_bias", "conv_q.weight", "conv_k.weight", "conv_v.weight"),
                                         replicated=("norm.weight",))
    plan.mixers["linear_attention"] = mixer
    return plan


def _replicate_params(name: str, module: nn.Module, mesh: DeviceMesh) -> None:
    for key, p in list(module.named_parameters(recurse=False)):
        # src_data_rank=None: no broadcast; every rank initializes the weights alike later.
        whole = nn.Parameter(distribute_tensor(p.data, mesh, [Replicate()], src_data_rank=None),
                             requires_grad=p.requires_grad)
        # The gradient of the rank's tokens is a partial sum: all-reduce it as it arrives, so
        # the optimizer's foreach steps see a replicated gradient (FSDP, which replaces the
        # parameter, reduces it to the weight's placement itself).
        whole.register_hook(_replicated)
        module.register_parameter(key, whole)


def _replicated(grad: DTensor) -> DTensor:
    return grad.redistribute(placements=[Replicate()]) if grad.placements[0].is_partial() else grad


def _rows_in(module: nn.Module, inputs: tuple, mesh: DeviceMesh) -> tuple:
    # (N_local, dim): this rank's token rows of the layer's (N, dim) input.
    return (DTensor.from_local(inputs[0], mesh, [Shard(0)], run_check=False), *inputs[1:])


def _local_out(module: nn.Module, out: DTensor, mesh: DeviceMesh):
    return out.to_local()


class _Summed:
    """Sums a small tensor over the mesh's ranks (no gradient: statistics only)."""

    def __init__(self, mesh: DeviceMesh):
        self.mesh = mesh

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        return DTensor.from_local(t, self.mesh, [Partial()], run_check=False).full_tensor()


def dense_tp_plan(sequence_parallel: bool, *, gated_mlp: bool = True, qk_norm: bool = False) -> TPPlan:
    """The plan of a pre-norm block with attention (wq, wk, wv, wo) and an MLP (w1, w2, and
    the gate's w3 when `gated_mlp`); norms named attention_norm and ffn_norm; with `qk_norm`,
    per-head attention.q_norm and attention.k_norm."""
    seq = Shard(1) if sequence_parallel else Replicate()
    root: dict[str, ParallelStyle] = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq),
        # Logits stay split over the vocabulary: the loss runs under loss_parallel().
        "output": ColwiseParallel(input_layouts=seq, output_layouts=Shard(-1), use_local_output=False),
    }
    block: dict[str, ParallelStyle] = {
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=seq),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(output_layouts=seq),
    }
    if gated_mlp:
        block["feed_forward.w3"] = ColwiseParallel()
    if qk_norm:
        # A rank holds whole heads, so the per-head norms compute on its local heads; but their
        # (head_dim,) weight's gradient sums over all heads. As "sequence parallel" along the
        # heads dimension of (B, T, heads, hd), the weight is a replicated DTensor whose partial
        # gradients are summed over the TP group; the output is handed back as a local tensor.
        for norm in ("attention.q_norm", "attention.k_norm"):
            block[norm] = SequenceParallel(sequence_dim=2, use_local_output=True)
    if sequence_parallel:
        root["norm"] = SequenceParallel()
        block.update({
            "attention_norm": SequenceParallel(),
            "ffn_norm": SequenceParallel(),
            # Gather the sequence before the projections: attention needs every position.
            # The block calls attention(x, rope, mask, cache, layer): only x is a DTensor.
            "attention": PrepareModuleInput(input_layouts=(Shard(1), None, None, None, None),
                                            desired_input_layouts=(Replicate(), None, None, None, None)),
            "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        })
    return TPPlan(root, block, sequence_parallel)


def default_tp_plan(args, sequence_parallel: bool) -> TPPlan:
    """The plan of a family whose blocks are the dense decoder's (a gated MLP or a mixture of
    experts; attention with optional per-head QK-norm and sinks): a ModelSpec's default."""
    plan = dense_tp_plan(sequence_parallel, gated_mlp=True, qk_norm=args.qk_norm)
    return shard_attention_sinks(plan) if args.attention_sinks else plan


def float8_styles(plan: dict[str, ParallelStyle], module: nn.Module) -> dict[str, ParallelStyle]:
    """`plan` (for `module`, a block or the model) with torchao's float8 styles for the
    layers that are Float8Linear (tensorwise scaling: parallel/checks.py refuses the rest).

    Column- and row-parallel layers keep their layouts. A module whose input is gathered
    (`PrepareModuleInput`, under sequence parallelism) casts it to float8 before the
    all-gather only when every column-parallel layer under it is float8: those layers are
    the input's consumers, and a high-precision one would be handed a float8 tensor."""
    from torchao.float8.float8_linear import Float8Linear
    from torchao.float8.float8_tensor_parallel import (
        Float8ColwiseParallel,
        Float8RowwiseParallel,
        PrepareFloat8ModuleInput,
    )

    def is_float8(name: str) -> bool:
        try:
            return isinstance(module.get_submodule(name), Float8Linear)
        except AttributeError:  # a name this module (a pipeline stage) lacks
            return False

    out = dict(plan)
    for name, style in plan.items():
        if type(style) in (ColwiseParallel, RowwiseParallel) and is_float8(name):
            cls = Float8ColwiseParallel if type(style) is ColwiseParallel else Float8RowwiseParallel
            out[name] = cls(input_layouts=style.input_layouts[0], output_layouts=style.output_layouts[0],
                            use_local_output=style.use_local_output)
    for name, style in plan.items():
        consumers = [k for k, v in plan.items() if k.startswith(name + ".") and type(v) is ColwiseParallel]
        if (type(style) is PrepareModuleInput and not style.use_local_output and not style.with_kwargs
                and consumers and all(is_float8(k) for k in consumers)):
            out[name] = PrepareFloat8ModuleInput(input_layouts=style.input_layouts,
                                                 desired_input_layouts=style.desired_input_layouts)
    return out

