"""What the planner needs to know of a model: its parameters by how each parallelism splits
them, and its FLOPs, counted from the model itself (built on the meta device: no memory).

Which parameters tensor parallelism splits is read from the family's own TP plan (the
modules it makes Colwise/Rowwise, and the parameters forja's `LocalParameters` shards with
their heads: sinks, short convolutions, decays, DeepSeek-V4's grouped `wo_a`), so the planner
and `forja train` cannot disagree; routed experts are split by expert parallelism instead;
everything else is replicated over TP.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from forja.models import build_from_args, spec_of
from forja.models.common.blocks import BlockStructure
from forja.models.common.tp_plan import LocalParameters
from forja.models.common.transformer import Transformer, TransformerArgs


def _split_by_plan(styles: dict) -> tuple[set[str], set[str]]:
    """(modules whose every parameter the plan splits, parameters it splits by name), paths
    within a block. A style's `then` (LocalParameters' other style) applies to the same module.
    A row-parallel Linear splits its weight, not its bias (added once, after the sum)."""
    modules, params = set(), set()
    for path, style in styles.items():
        while style is not None:
            if isinstance(style, RowwiseParallel):
                params.add(f"{path}.weight")
            elif isinstance(style, ColwiseParallel):
                modules.add(path)
            elif isinstance(style, LocalParameters):
                params |= {f"{path}.{name}" if path else name for name in style.names}
            style = getattr(style, "then", None)
    return modules, params


@dataclass(frozen=True)
class BlockShape:
    """One transformer block's parameters (element counts, whole model, before any split)."""

    tp_split: int
    """Split over the TP ranks (attention and dense MLP projections)."""
    replicated: int
    """Whole on every TP rank (norms, a router, an MoE layer's shared experts)."""
    experts: int
    """Routed experts: split over the EP ranks."""
    moe: bool
    gated: bool
    """A gated MLP (SwiGLU: gate, up, down) rather than GELU's two matrices."""
    layer_norm: bool
    """torch's LayerNorm (one kernel that saves its input and statistics) rather than RMSNorm."""
    flops_per_token: float
    """Training FLOPs (forward + backward) per token: 6 x active weights + attention scores."""
    matrices: tuple[tuple[int, int, int], ...] = ()
    """(stack, rows, columns) of each 2-D+ parameter, whole: routed experts are one stack of
    E matrices (Muon orthogonalizes each; SOAP and Adafactor see E x rows by columns)."""
    kind: str = "full_attention"
    """The block's sequence mixer (`TransformerArgs.layer_type`): full_attention,
    sliding_attention or linear_attention."""
    norms: str = "pre"
    """Where the block normalizes: "pre" (before each sublayer), "sandwich" (before and on
    each sublayer's output, Gemma 3) or "post" (only on the outputs, OLMo 2/3)."""
    ffn: str = "swiglu"
    """The feed-forward: "swiglu" (the fused kernel applies), "geglu" (never fused), "gelu"
    or "moe"."""
    output_gate: bool = False
    """Attention's output gate (`Attention.wg`): sigmoid(x W_g) times each head's output."""
    sinks: bool = False
    """Attention sinks: a logit per head in the softmax (forja's `attend(..., sinks=)`)."""
    mixer: tuple[int, ...] = ()
    """A linear-attention block's Gated DeltaNet, as built: (key heads, value heads, key
    width, value width, convolution taps, chunk size); () for attention."""
    mamba2: tuple[int, ...] = ()
    """A Mamba-2 block's mixer, as built: (heads, head width, groups, state size, convolution
    taps, chunk size); () for the others (forja/plan/activations.py `mamba2_saved`)."""
    mtp: bool = False
    """A multi-token prediction module's block (its input norms and 2d -> d projection too)."""
    zero_centered: bool = False
    """The block's RMSNorms scale by (1 + w) in fp32 (Gemma, Qwen3.5): the normalized x they
    keep is fp32 whatever the input's dtype."""
    expert_activation: str = ""
    """A mixture of experts' activation ("swiglu", "clamped_swiglu", gpt-oss's, or "relu2",
    Nemotron 3's); "" without."""
    shared_expert_gate: bool = False
    """A mixture of experts' shared expert scaled by a per-token sigmoid gate (Qwen3.5)."""
    expert_width: int = 0
    """The routed experts' width where the layer projects to it and back (Nemotron 3 Super's
    latent experts, `LatentMoE`); 0: the model's."""
    unit_qk: bool = False
    """Attention's weightless per-head RMS of q and k (`BlockStructure.unit_qk`, Llama 4)."""
    indexer: tuple[int, ...] = ()
    """DeepSeek Sparse Attention's indexer (`BlockStructure.indexer`): (heads, width, top-k, stage
    0 untrained / 1 dense warm-up / 2 sparse); () for dense attention."""
    gemma4: tuple[int, ...] = ()
    """A Gemma 4 block's own shapes (`BlockStructure.gemma4`: query and key/value heads, head width,
    values = keys, dense GeGLU width, per-layer input width; forja/plan/gemma4_activations.py)."""


@dataclass(frozen=True)
class ModelShape:
    args: TransformerArgs
    blocks: tuple[BlockShape, ...]
    embedding: int
    """Token (and learned position) embeddings; split over TP (vocabulary rows)."""
    output: int
    """Output projection; 0 when tied to the embedding (unless a pipeline splits them)."""
    final_norm: int
    output_flops_per_token: float
    """6 x the output projection (and final norm): the logits' matmuls, once more per
    multi-token prediction module."""
    root_matrices: tuple[tuple[str, int, int], ...] = ()
    """(name, rows, columns) of the embeddings and the output projection, whole."""
    stage_width: int = 0
    """Elements per token a pipeline stage hands the next, as the whole model's last block sends
    them (`Transformer.stage_widths`): dim, DeepSeek-V4's hc_mult x dim streams (Gemma 4's
    per-layer inputs, which only earlier stages send along, not counted); 0: dim."""

    @property
    def n_params(self) -> int:
        return sum(b.tp_split + b.replicated + b.experts for b in self.blocks) + self.embedding + \
            self.output + self.final_norm

    @property
    def flops_per_token(self) -> float:
        return sum(b.flops_per_token for b in self.blocks) + self.output_flops_per_token


def _numel(module: nn.Module | None) -> int:
    return 0 if module is None else sum(p.numel() for p in module.parameters())


# The shapes of the last few (args, seq_len) asked for, by the args object itself: a launch's
# preflight and a planner's test ask again for every layout with the same args.
_RECENT: dict[tuple[int, int], tuple[TransformerArgs, ModelShape]] = {}


def model_shape(args: TransformerArgs, seq_len: int) -> ModelShape:
    hit = _RECENT.get((id(args), seq_len))
    if hit is not None and hit[0] is args:
        return hit[1]
    shape = _model_shape(args, seq_len)
    if len(_RECENT) >= 16:
        _RECENT.pop(next(iter(_RECENT)))
    _RECENT[(id(args), seq_len)] = (args, shape)  # args held: its id is not reused while cached
    return shape


def _model_shape(args: TransformerArgs, seq_len: int) -> ModelShape:
    counted, embedding, output, final_norm, output_matmul, root_matrices, model = _counts(args)
    # Sequence mixing as Transformer.flops_per_token counts it: the model's own formula per block kind.
    mixing = [model.mixer_flops(args.layer_type(i), seq_len) for i in range(len(counted))]
    blocks = tuple(BlockShape(split, replicated, experts, moe, gated, layer_norm,
                              float(6 * (split + replicated + experts * active) + mixing[i]), matrices,
                              **structure)
                   for i, (split, replicated, experts, moe, gated, layer_norm, active, matrices, structure)
                   in enumerate(counted))
    return ModelShape(args, blocks, embedding, output, final_norm, 6.0 * output_matmul, root_matrices,
                      model.stage_widths()[1])


_COUNTS: dict[str, tuple] = {}


def _counts(args: TransformerArgs) -> tuple:
    """The model's parameter counts by how they split, from the model built on the meta device
    (remembered per argument set: a 671B model has thousands of modules to build)."""
    key = repr(args)
    if key in _COUNTS:
        return _COUNTS[key]
    model: Transformer = build_from_args(args, device="meta")
    plan = spec_of(args).tp_plan(args, True)
    counted = []
    # Multi-token prediction modules count as blocks after the main ones: each runs a block
    # (its norms and 2d -> d projection with it, replicated) and, below, the output head again.
    mtp = list(model.mtp.layers.values()) if model.mtp is not None else []
    for block, inner in [*((b, b) for b in model.layers.values()), *((m, m.block) for m in mtp)]:
        structure: BlockStructure = inner.structure  # an MTP module's: its transformer block's
        moe = structure.ffn == "moe"
        split_modules, split_params = _split_by_plan(plan.block_plan(moe, args.layer_type(len(counted))))
        split = replicated = experts = 0
        matrices = []
        for name, p in block.named_parameters():
            name = name.removeprefix("block.")  # the plan names a block's modules
            if p.dim() >= 2:  # (stack, rows, columns): a 3-D expert stack is `stack` matrices
                matrices.append((p.numel() // (p.shape[-2] * p.shape[-1]), p.shape[-2], p.shape[-1]))
            if ".experts." in f".{name}" and moe:
                experts += p.numel()
            elif name.rsplit(".", 1)[0] in split_modules or name in split_params:
                split += p.numel()
            else:
                replicated += p.numel()
        active = inner.feed_forward.active_fraction() if moe else 0.0
        gated = structure.ffn == "swiglu" or (moe and structure.expert_activation != "relu2")
        fields = _structure(structure, args.layer_type(len(counted)), block is not inner)
        counted.append((split, replicated, experts, moe, gated, structure.norm == "layer", active, tuple(matrices),
                        fields))
    output = 0 if args.tie_embeddings else _numel(model.output)
    # Whatever else the root holds is input side: token (and learned position) embeddings.
    embedding = _numel(model) - _numel(model.layers) - _numel(model.mtp) - _numel(model.norm) - output
    output_matmul = model.output.weight.numel() * (1 + len(mtp)) if model.output is not None else 0
    root = [(name, p.shape[-2], p.shape[-1]) for name, p in model.named_parameters()
            if p.dim() == 2 and not name.startswith(("layers.", "mtp."))]
    _COUNTS[key] = (counted, embedding, output, _numel(model.norm), output_matmul, tuple(root), model)
    return _COUNTS[key]


def _structure(s: BlockStructure, kind: str, mtp: bool) -> dict:
    """What the memory model needs of a block beyond its parameter counts, from the structure
    record the block declares (forja/models/common/blocks.py)."""
    return dict(kind=kind, norms=s.norms, ffn=s.ffn, output_gate=s.output_gate, sinks=s.sinks,
                mixer=s.gated_deltanet, mamba2=s.mamba2, mtp=mtp, zero_centered=s.norm == "zero_centered",
                expert_activation=s.expert_activation, shared_expert_gate=s.shared_expert_gate, indexer=s.indexer,
                unit_qk=s.unit_qk, expert_width=s.expert_width, gemma4=s.gemma4)
