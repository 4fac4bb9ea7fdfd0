"""Cutting a model into pipeline stages, and which rank runs which stage.

A stage is a copy of the whole model (still on the meta device) with the blocks of
other stages deleted from `layers` and the modules it does not run set to None, so every
parameter it keeps has its name in the whole model ("layers.5.attention.wq.weight") and
checkpoints load across layouts. The embeddings (every direct child besides `layers` and
the model's `output_side`: token and, for GPT-2, position embeddings) belong to the first stage;
the output side (the final norm, the output projection, the multi-token prediction modules;
DeepSeek-V4's collapse of its residual streams, `hc_head`) to the last, with a copy of the
token embedding for them (`mtp.embed`: the ids come from the labels). A model that ties its
output projection to the embedding keeps the tie inside a stage that holds both (a V
schedule's rank 0 holds both ends, but as two parts); otherwise the last stage's `output.weight`
becomes its own copy of the embedding, which `Transformer.tied_parameters` names so that
it is initialized, checkpointed and kept equal as the embedding (see train/step/engine.py).

Stages per rank: one for gpipe and 1f1b; two for interleaved-1f1b (rank r runs stages r
and r + pp, a loop) and for the V-shaped zero-bubble (ZBV) and dualpipev (rank r runs
stages r and 2 pp - 1 - r, so rank 0 holds both ends).

Without `parallel.pp_layers`, blocks are balanced by cost, in training FLOPs per token as
`Transformer.flops_per_token` counts them: a block costs 6 x its parameters plus its
attention scores; the last stage also pays 6 x the output projection's parameters (the
loss's softmax adds ~1/dim of that and is left out); the embedding is a lookup, with no
matmul, and adds nothing. Blocks that hand each other more than hidden states (the args'
`pipeline_spans`: Gemma 4's shared key/value blocks and the blocks they read) stay in one
stage: no stage ends inside such a span, whether the split is balanced or given.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from forja.errors import ForjaError
from forja.models.common.transformer import Transformer

MULTI_STAGE_SCHEDULES = ("interleaved-1f1b", "zero-bubble", "dualpipev")
V_SCHEDULES = ("zero-bubble", "dualpipev")


def stages_per_rank(schedule: str) -> int:
    return 2 if schedule in MULTI_STAGE_SCHEDULES else 1


def rank_stages(pp_rank: int, pp: int, schedule: str) -> list[int]:
    """The stage indices `pp_rank` runs, in increasing order."""
    if schedule in V_SCHEDULES:
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + k * pp for k in range(stages_per_rank(schedule))]


def stage_owners(pp: int, schedule: str) -> list[int]:
    """owner[s] = the pp rank that runs stage s."""
    owners = [0] * (pp * stages_per_rank(schedule))
    for rank in range(pp):
        for s in rank_stages(rank, pp, schedule):
            owners[s] = rank
    return owners


@dataclass(frozen=True)
class StageCosts:
    """Training FLOPs per token of the pieces a stage can hold."""

    block: float
    first: float = 0.0
    """What the first stage pays besides its blocks (the embedding)."""
    last: float = 0.0
    """What the last stage pays besides its blocks (final norm, output projection, loss)."""


def model_costs(model: Transformer, seq_len: int) -> StageCosts:
    a = model.args
    block = next(iter(model.layers.values()))
    attention = 12 * a.n_heads * a.head_dim * seq_len  # scores and weighted values, as flops_per_token
    per_block = 6 * sum(p.numel() for p in block.parameters()) + attention
    last = 6 * sum(p.numel() for name in model.output_side if getattr(model, name, None) is not None
                   for p in getattr(model, name).parameters())
    return StageCosts(block=float(per_block), first=0.0, last=float(last))


Span = tuple[int, int, str]
"""Blocks first..last that must share a stage, and why (TransformerArgs.pipeline_spans)."""


def allowed_cut(cut: int, spans: Sequence[Span]) -> bool:
    """Whether a stage may start at block `cut` (the one before ending at block cut - 1)."""
    return not any(first < cut <= last for first, last, _ in spans)


def balanced_layers(n_layers: int, n_stages: int, costs: StageCosts, spans: Sequence[Span] = ()) -> list[int]:
    """Blocks per stage (each >= 1) that minimize the costliest stage, no stage ending inside
    one of `spans`.

    Water filling: start with one block each and give every further block to the stage
    that is cheapest so far (the earliest on ties). Blocks all cost the same, so this
    reaches the smallest possible maximum. With spans, `_spanned_layers`."""
    if spans:
        return _spanned_layers(n_layers, n_stages, costs, spans)
    counts = [1] * n_stages
    extra = [0.0] * n_stages
    extra[0] += costs.first
    extra[-1] += costs.last

    def cost(s: int) -> float:
        return counts[s] * costs.block + extra[s]

    for _ in range(n_layers - n_stages):
        cheapest = min(range(n_stages), key=lambda s: (cost(s), s))
        counts[cheapest] += 1
    return counts


def _spanned_layers(n_layers: int, n_stages: int, costs: StageCosts, spans: Sequence[Span]) -> list[int]:
    """`balanced_layers` with stages ending only where `spans` allow: among the splits whose
    costliest stage is cheapest, the one with the least sum of squared stage costs (the most
    even), then the one with more blocks early, as water filling chooses. Two passes over the
    allowed cut points, each exact: the least maximum, then the least sum under it."""
    points = [0, *(c for c in range(1, n_layers) if allowed_cut(c, spans)), n_layers]
    last = len(points) - 1
    if last < n_stages:
        raise ForjaError(f"{n_stages} pipeline stages of at least one block each cannot keep together "
                         f"{'; '.join(why for _, _, why in spans)}; lower parallel.pp")

    def cost(s: int, blocks: int) -> float:
        return blocks * costs.block + (costs.first if s == 0 else 0.0) + (costs.last if s == n_stages - 1 else 0.0)

    def best(add: Callable[[float | None, float], float]) -> tuple:
        """The split of least `add`-accumulated stage cost: (that, its counts negated: min keeps more early)."""
        plans = {0: (None, ())}  # plans[j]: the best stages so far over blocks 0 .. points[j] - 1
        for s in range(n_stages):
            ends = range(s + 1, last - (n_stages - 1 - s) + 1)  # room left for the later stages
            plans = {j: min((add(plans[i][0], cost(s, points[j] - points[i])), (*plans[i][1], points[i] - points[j]))
                            for i in plans if i < j) for j in ends}
        return plans[last]

    worst = best(lambda acc, c: c if acc is None else max(acc, c))[0]
    fits = worst * (1 + 1e-12)  # float sums of the same costs may differ in the last place
    _, negated = best(lambda acc, c: (acc or 0.0) + (c * c if c <= fits else math.inf))
    return [-n for n in negated]


def _stage_description(pp: int, schedule: str) -> str:
    n = pp * stages_per_rank(schedule)
    if stages_per_rank(schedule) == 1:
        return f"{n} stages (parallel.pp = {pp}, one per rank)"
    return f"{n} stages (parallel.pp = {pp} x 2 per rank for parallel.pp_schedule = '{schedule}')"


def check_explicit_layers(pp_layers: list[int], n_layers: int, pp: int, schedule: str,
                          spans: Sequence[Span] = ()) -> None:
    n_stages = pp * stages_per_rank(schedule)
    where = f"parallel.pp_layers = {list(pp_layers)}"
    if len(pp_layers) != n_stages:
        raise ForjaError(f"{where} has {len(pp_layers)} entries but the pipeline has "
                         f"{_stage_description(pp, schedule)}; give one block count per stage, "
                         "or leave it empty to balance by cost")
    if sum(pp_layers) != n_layers:
        raise ForjaError(f"{where} adds up to {sum(pp_layers)} but the model has n_layers = {n_layers}; "
                         f"make the counts sum to {n_layers}, or leave it empty to balance by cost")
    for s, count in enumerate(pp_layers):
        middle = 0 < s < n_stages - 1
        if count < 0 or (middle and count == 0):
            raise ForjaError(f"{where}: stage {s} gets {count} blocks; every stage needs at least one "
                             "(only the first and last may hold none, keeping just the embedding or the output)")
    for cut in (sum(pp_layers[:s]) for s in range(1, n_stages)):
        for first, last, why in spans:
            if first < cut <= last:
                raise ForjaError(f"{where} ends a stage after block {cut - 1}, but blocks {first} to {last} must "
                                 f"share a stage ({why}); move that cut to block {first} or before, or leave "
                                 "parallel.pp_layers empty to balance by cost")


def check_layers(n_layers: int, *, pp: int, schedule: str, pp_layers: list[int], spans: Sequence[Span] = ()) -> None:
    """`parallel.pp_layers` when given, else enough blocks for one per stage, counting each
    of `spans` (blocks that must share a stage) as one."""
    if pp_layers:
        check_explicit_layers(pp_layers, n_layers, pp, schedule, spans)
        return
    splittable = 1 + sum(allowed_cut(c, spans) for c in range(1, n_layers))  # blocks, a span counted once
    if splittable < pp * stages_per_rank(schedule):
        held = f" ({'; '.join(why for _, _, why in spans)}, so they share a stage)" if spans else ""
        raise ForjaError(f"the model has n_layers = {n_layers}{held} but the pipeline has "
                         f"{_stage_description(pp, schedule)} of at least one block each; lower parallel.pp, "
                         "choose a schedule with one stage per rank (1f1b, gpipe), or use a deeper model")


def layers_per_stage(model: Transformer, *, pp: int, schedule: str, pp_layers: list[int],
                     seq_len: int) -> list[int]:
    """How many consecutive blocks each stage holds, stage 0 first."""
    spans = model.args.pipeline_spans()
    check_layers(len(model.layers), pp=pp, schedule=schedule, pp_layers=pp_layers, spans=spans)
    if pp_layers:
        return list(pp_layers)
    return balanced_layers(len(model.layers), pp * stages_per_rank(schedule), model_costs(model, seq_len), spans)


def stage_part(model: Transformer, stage: int, counts: list[int]) -> Transformer:
    """Stage `stage` of `model` (on the meta device): a copy holding only its own modules."""
    start = sum(counts[:stage])
    keep = {str(i) for i in range(start, start + counts[stage])}
    part = copy.deepcopy(model)
    for name in list(part.layers.keys()):
        if name not in keep:
            del part.layers[name]
    if stage > 0:  # the embeddings feed the first block only
        for name, _ in list(part.named_children()):
            if name != "layers" and name not in part.output_side:
                setattr(part, name, None)
    if stage < len(counts) - 1:
        for name in part.output_side:
            setattr(part, name, None)
    elif part.mtp is not None and part.tok_embeddings is None:  # MTP embeds the next tokens here too
        part.mtp.embed = copy.deepcopy(model.tok_embeddings)
    return part
