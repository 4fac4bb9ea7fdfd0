"""Peak memory of one rank: parameters, gradients, optimizer state, gathered parameters,
activations, logits and buffers, walked through one training step.

How (docs/planner.md has the formulas):
- Parameters and gradients (fp32) are the rank's shard: what TP, EP and PP leave of the
  model, divided by the FSDP degree; the optimizer's state and step temporaries are counted
  as each optimizer holds them (forja/plan/optimizer_memory.py: SOAP and Adafactor keep
  whole-matrix state on every rank, Muon gathers each matrix to one owner).
- Activations are counted tensor by tensor: what autograd saves for backward in each op
  of a block, by the kind of block (forja/plan/activations.py, read off forja's own
  blocks; `tests/unit/plan` checks the count against the tensors autograd really saves),
  and under eager autocast the bf16 casts of the weights the matmuls keep (`weight_casts`).
  Activation checkpointing keeps the block inputs (full), or the matmul and attention
  outputs (selective, op level), and recomputes the rest one block at a time in backward.
- The step is walked event by event: forward (blocks' activations pile up, ZeRO-2 keeps
  gathered parameters), the loss's backward (the logits' working set), each block's
  backward (its activations freed, its gradients made, FSDP's unsharded gradients before
  the reduce-scatter), the optimizer step (its temporaries). The peak is the largest sum.
- Pipelines hold several micro-batches in flight; how many depends on the schedule and the
  rank (`inflight_chunks`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field, fields

from forja.errors import ForjaError
from forja.parallel.pp_split import StageCosts, balanced_layers, rank_stages
from forja.plan.activations import FP32, block_activations, widths
from forja.plan.context_parallel import cp_buffers
from forja.plan.gemma4_activations import per_layer_inputs_saved
from forja.plan.job import Job
from forja.plan.layout import Layout
from forja.plan.optimizer_memory import optimizer_memory
from forja.plan.shape import BlockShape


class Breakdown:
    """A dataclass whose float fields are the parts of one total (bytes or seconds)."""

    @classmethod
    @functools.cache
    def parts(cls) -> tuple[str, ...]:
        """The names of the float fields, read once a class: the planner sums a breakdown for
        each of its thousands of candidates and moments."""
        return tuple(f.name for f in fields(cls) if f.type == "float")

    def as_dict(self) -> dict[str, float]:
        return {name: float(getattr(self, name)) for name in self.parts()}

    @property
    def total(self) -> float:
        return sum(float(getattr(self, name)) for name in self.parts())


@dataclass
class MemoryBreakdown(Breakdown):
    """Bytes of one rank at its peak, by what holds them."""

    parameters: float = 0.0
    gradients: float = 0.0
    optimizer_state: float = 0.0
    gathered_parameters: float = 0.0
    activations: float = 0.0
    logits: float = 0.0
    optimizer_temporaries: float = 0.0
    buffers: float = 0.0
    """Communication staging (pipeline send/receive, FSDP copy-in/out, context parallelism's
    K/V ring buffers or all-to-all's other copy of q, k, v and the output)."""
    pp_rank: int = 0
    phase: str = ""
    """When the peak happens: forward end, loss backward, block backward, optimizer step."""


def weight_casts(job: Job, lay: Layout, block: BlockShape, index: int) -> float:
    """Bytes of the bf16 copies of a block's weights that eager autocast makes, which each
    matmul keeps for its backward (the input's gradient reads the weight) until the block's
    backward: whole weights even under FSDP (cast once gathered), so not sharded. Only with
    fp32 parameters under autocast, in eager mode (a compiled block recomputes the cast), and
    in a block that activation checkpointing does not recompute."""
    if not job.bf16 or job.bf16_params or job.compiled:
        return 0.0
    if lay.ac == "full" or (lay.ac == "selective" and (not lay.ac_every or index % lay.ac_every == 0)):
        return 0.0
    experts = block.experts / (lay.ep * lay.tp)
    if job.float8:  # torchao's Float8Linear takes no autocast cast: it keeps the weight itself
        return 2 * experts
    return 2 * (block.tp_split / lay.tp + block.replicated + experts)


def _block_activations_cached(job: Job, lay: Layout, block: BlockShape, index: int) -> tuple[float, float]:
    """block_activations, remembered: of a search's thousands of layouts only a few differ in
    what decides a block's activations (tp, sequence parallelism, AC)."""
    key = ("activations", lay.tp, lay.sequence_parallel, lay.ac, lay.ac_every, lay.ac_matmuls, lay.cp, lay.cp_kind,
           block, index)
    if key not in job.memo:
        job.memo[key] = block_activations(job, lay, block, index)
    return job.memo[key]


# -- what one rank holds ----------------------------------------------------------------------

@dataclass
class RankModel:
    """One pipeline rank's share of the model (all ranks when pp = 1)."""

    pp_rank: int
    groups: list[tuple[BlockShape, tuple[int, ...]]] = field(default_factory=list)
    """The blocks it holds, grouped by shape: (shape, layer indices). Blocks of one shape cost
    the same, so the walk is over a handful of groups, not over every layer."""
    first: bool = True
    last: bool = True
    stages: int = 1
    stage_layers: tuple[tuple[int, ...], ...] = ()
    """Each of its pipeline stages' layer indices, in the order the schedule runs them."""


def _group(job: Job, indices: list[int]) -> list[tuple[BlockShape, tuple[int, ...]]]:
    groups: dict[BlockShape, list[int]] = {}
    for i in indices:
        groups.setdefault(job.shape.blocks[i], []).append(i)
    return [(b, tuple(idx)) for b, idx in groups.items()]


def end_ranks(job: Job, lay: Layout) -> list[RankModel]:
    """The first and last pp ranks: the first holds the most micro-batches in flight and the
    embedding, the last the logits; the balanced ranks between hold less than both."""
    key = ("ranks", lay.pp, lay.pp_schedule if lay.pp > 1 else "")
    if key not in job.memo:
        job.memo[key] = [rank_model(job, lay, r) for r in sorted({0, lay.pp - 1})]
    return job.memo[key]


def rank_model(job: Job, lay: Layout, pp_rank: int) -> RankModel:
    """The blocks pp rank `pp_rank` holds, split as forja's pipeline balances them."""
    n_layers = len(job.shape.blocks)
    if lay.pp == 1:
        return RankModel(0, _group(job, list(range(n_layers))))
    n_stages = lay.pp * lay.stages_per_rank
    mean = sum(b.flops_per_token for b in job.shape.blocks) / n_layers
    spans = tuple(job.args.pipeline_spans())  # blocks that share a stage, as the pipeline keeps them
    counts = _stage_layers(n_layers, n_stages, mean, job.shape.output_flops_per_token, spans)
    starts = [sum(counts[:s]) for s in range(n_stages)]
    stages = rank_stages(pp_rank, lay.pp, lay.pp_schedule)
    stage_layers = tuple(tuple(range(starts[s], starts[s] + counts[s])) for s in stages)
    return RankModel(pp_rank, _group(job, [i for layers in stage_layers for i in layers]), 0 in stages,
                     n_stages - 1 in stages, len(stages), stage_layers)


@functools.lru_cache(maxsize=4096)
def _stage_layers(n_layers: int, n_stages: int, block: float, last: float, spans: tuple = ()) -> list[int]:
    costs = StageCosts(block=block, last=last)
    try:
        return balanced_layers(n_layers, n_stages, costs, spans)
    except ForjaError:  # more stages than the spans leave room for: the validator refuses it, priced without them
        return balanced_layers(n_layers, n_stages, costs)


def inflight_chunks(lay: Layout, pp_rank: int, microbatches: int) -> float:
    """(stage, micro-batch) forwards whose activations a pp rank holds at its peak, per stage
    it holds: the schedule's warm-up depth (torch.distributed.pipelining's schedules)."""
    p, m, r = lay.pp, microbatches, pp_rank
    if p == 1:
        return 1.0
    if lay.pp_schedule == "gpipe":
        return float(m)
    if lay.pp_schedule == "1f1b":
        return float(min(m, p - r))
    # Two stages per rank: warm-up forwards over both before the first backward.
    v = lay.stages_per_rank
    if lay.pp_schedule == "interleaved-1f1b":
        chunks = (v - 1) * p + 2 * (p - 1 - r) + 1
    else:  # V shapes (zero-bubble, dualpipev): the first rank runs the most warm-up forwards
        chunks = 2 * (p - r)
    return min(m * v, chunks) / v


def rank_elements(job: Job, lay: Layout, rm: RankModel) -> tuple[float, float, float, float]:
    """(root elements, largest block's, all blocks', the routed experts' among them) this rank
    holds before FSDP sharding."""
    s, t = job.shape, lay.tp
    root = 0.0
    if rm.first:
        root += s.embedding / t
    if rm.last:
        tied_copy = s.args.tie_embeddings and (lay.pp > 1 or not rm.first)
        root += s.final_norm + (s.output / t if s.output else (s.embedding / t if tied_copy else 0.0))
    # Routed experts are spread over ep x tp ranks (forja/parallel/ep.py, expert_layout).
    sizes = [(b.tp_split / t + b.replicated + b.experts / (lay.ep * t), b.experts / (lay.ep * t), len(idx))
             for b, idx in rm.groups]
    return (root, max((e for e, _, _ in sizes), default=0.0), sum(e * n for e, _, n in sizes),
            sum(x * n for _, x, n in sizes))


def _logits(job: Job, lay: Layout, tokens: float) -> tuple[float, float]:
    """(bytes the loss keeps from forward to backward, bytes its backward adds at once)."""
    vocab = job.args.vocab_size / lay.tp
    if "cross_entropy" in job.fused:  # gradients made in forward, chunk by chunk
        rows = min(tokens, max(1.0, 2 ** 28 / (vocab * FP32)))
        kept = tokens * job.args.dim * widths(job).lin + vocab * job.args.dim * FP32
        return kept + 2 * rows * vocab * FP32, 0.0
    # log_softmax's fp32 output is kept; backward makes d(log_softmax) and d(logits) at once.
    # The loss's fp32 cast of bf16 logits keeps nothing of them (its backward casts the
    # gradient back); under TP the vocabulary-parallel loss (loss_parallel) keeps the same but
    # its backward makes a third fp32 copy (measured by the rehearsal, forja/train/rehearse/).
    # Soft-capped logits (Gemma 4's cap * tanh(logits / cap)) also keep tanh's output, in the logits' dtype.
    capped = tokens * vocab * widths(job).lin if getattr(job.args, "final_logit_softcap", None) else 0.0
    return tokens * vocab * FP32 + capped, (3 if lay.tp > 1 else 2) * tokens * vocab * FP32


def predict_memory(job: Job, lay: Layout) -> MemoryBreakdown:
    """The peak of the rank that peaks highest."""
    return max((rank_peak(job, lay, rm) for rm in end_ranks(job, lay)), key=lambda m: m.total)


def rank_peak(job: Job, lay: Layout, rm: RankModel) -> MemoryBreakdown:
    """The peak of one rank: the largest of its three candidate moments."""
    return max(rank_moments(job, lay, rm), key=lambda m: m.total)


@dataclass(frozen=True)
class _Held:
    """What a rank's FSDP units hold, in elements: the root's, the largest block's, every
    block's, this rank's shard of them all (`held`), and FSDP's sharding degree."""

    root: float
    largest: float
    blocks: float
    held: float
    shard: int
    fsdp_on: bool
    gathered_width: int
    """Bytes per element of a gathered parameter (and of its unsharded gradient)."""


def _held(job: Job, lay: Layout, rm: RankModel) -> _Held:
    fsdp_on = lay.fsdp * lay.dp_replicate > 1 or job.bf16_params or lay.cpu_offload
    shard = lay.fsdp if fsdp_on else 1
    root, largest, blocks, experts = rank_elements(job, lay, rm)
    # Routed experts are already split over ep ranks; FSDP shards them over the rest (dp_shard / ep).
    held = (root + blocks - experts) / shard + experts / max(1, shard // lay.ep)
    return _Held(root, largest, blocks, held, shard, fsdp_on, 2 if job.bf16_params else FP32)


def rank_moments(job: Job, lay: Layout, rm: RankModel) -> list[MemoryBreakdown]:
    """What one rank holds at each candidate moment of its peak: the loss's backward, the
    first block's backward, the optimizer step, without a pipeline the backward's end, and
    under a pipeline the end of a stage's backward (each `phase` names its own)."""
    h = _held(job, lay, rm)
    on_host = lay.cpu_offload and job.gpu  # offloaded state lives in host memory
    params = 0.0 if on_host else h.held * FP32
    state, optimizer_temps = optimizer_memory(job, lay, rm, h.held, h.root + h.blocks)
    state = 0.0 if on_host else state
    grads = 0.0 if on_host else h.held * FP32
    tokens = lay.sequences_per_microbatch(job.global_batch_size) * job.seq_len / lay.cp
    micro = lay.microbatches(job.global_batch_size)
    kept, working = _kept_activations(job, lay, rm, tokens, micro)
    loss_kept, loss_backward = _loss_memory(job, lay, rm, tokens, micro)
    buffers = _pipeline_buffers(job, lay, rm, tokens, micro)
    # Context parallelism's transients live while a block computes (one at a time: the largest
    # block's), not while the loss runs (measured by the rehearsal, forja/train/rehearse/).
    in_block = max((cp_buffers(job, lay, b, tokens) for b, _ in rm.groups), default=0.0)
    inflight = inflight_chunks(lay, rm.pp_rank, micro)
    order = stage_order(lay, rm, micro, inflight)
    gathered = _gathered(lay, rm, h, order)
    if h.fsdp_on:
        in_block += 2 * h.largest / h.shard * FP32  # all-gather copy-in, reduce-scatter output
    output_root = h.root - (job.shape.embedding / lay.tp if rm.first else 0.0)  # the final norm and output's
    accumulated = _accumulated_gradients(lay, grads, micro, (h.root + h.blocks) * FP32 if h.fsdp_on else None)
    if h.fsdp_on and order == "one at a time":  # only the stage nearest the loss has run a backward
        accumulated = (output_root + h.blocks / rm.stages) * FP32
    elif order == "all first":
        accumulated = 0.0  # no backward before the first one
    # A block's unsharded gradient before its reduce-scatter, unless the whole ones are held anyway.
    holds_whole = (lay.pp > 1 and lay.pp_schedule != "gpipe") or (lay.grad_sync == "step" and micro > 1)
    unsharded_grad = h.largest * h.gathered_width if h.fsdp_on and not holds_whole else 0.0

    def snap(phase: str, *, acts: float, logits: float = 0.0, grads_now: float, temps: float = 0.0,
             staged: float = 0.0, gathered_now: float = gathered) -> MemoryBreakdown:
        return MemoryBreakdown(parameters=params, gradients=grads_now, optimizer_state=state,
                               gathered_parameters=gathered_now, activations=acts, logits=logits,
                               optimizer_temporaries=temps, buffers=buffers + staged, pp_rank=rm.pp_rank,
                               phase=phase)

    # The root's gradients made before the first block's backward: the output projection's and
    # the final norm's, or a tied embedding's with them. An untied embedding's comes last (its
    # backward ends the step), and the root's unit keeps them all until then (measured by the
    # rehearsal, forja/train/rehearse/).
    # With Gemma 4's per-layer embeddings the root also holds their table and projection, whose
    # gradients come with the embedding's, last: a tied root makes only the token table's here.
    tied = job.args.vocab_size * job.args.dim / lay.tp if job.args.tie_embeddings and rm.first else 0.0
    output_grad = (output_root + tied) * FP32 if rm.last else 0.0
    moments = [
        snap("loss backward", acts=kept, logits=loss_kept + loss_backward, grads_now=accumulated),
        snap("first block backward", acts=kept + working,
             grads_now=accumulated + output_grad + unsharded_grad, staged=in_block),
        snap("optimizer step", acts=0.0, grads_now=max(grads, accumulated), temps=optimizer_temps),
    ]
    if h.fsdp_on and lay.pp == 1:
        moments.append(_backward_end(snap, lay, h, max(grads, accumulated), micro))
    if h.fsdp_on and lay.pp > 1:
        for acts, whole, others in _stage_backward_ends(order, rm, kept, inflight, micro, h.root, output_root,
                                                        h.blocks):
            moments.append(snap("stage backward end", acts=acts + working, gathered_now=whole * h.gathered_width,
                                grads_now=whole * FP32 + others * grads + output_grad))
    return moments


def _pipeline_buffers(job: Job, lay: Layout, rm: RankModel, tokens: float, micro: int) -> float:
    """Bytes of a pipeline rank's receive buffers: torch's stages allocate one per micro-batch
    up front, for the activations a stage receives (all but the model's first stage) and the
    gradients it receives (all but the last), each a micro-batch's hidden states, split over
    the TP ranks under sequence parallelism (measured by the rehearsal, forja/train/rehearse/)."""
    if lay.pp == 1:
        return 0.0
    receiving = 2 * rm.stages - rm.first - rm.last  # this rank's stages' receiving sides
    return micro * receiving * _stage_io(job, lay, tokens)


def _stage_io(job: Job, lay: Layout, tokens: float) -> float:
    """Bytes of what a pipeline stage sends or receives for one micro-batch: its hidden states
    (`stage_width` a token: DeepSeek-V4's streams are hc_mult x dim), split over the TP ranks
    under sequence parallelism."""
    return tokens / lay.sp_degree * (job.shape.stage_width or job.args.dim) * widths(job).lin


def _gathered(lay: Layout, rm: RankModel, h: _Held, order: str) -> float:
    """Bytes of gathered parameters through forward and backward: FSDP's root stays gathered;
    ZeRO-3 regathers each block (itself and the prefetched next), ZeRO-2 keeps every block
    gathered until its backward."""
    if not h.fsdp_on:
        return 0.0
    blocks_gathered = 2 * h.largest if lay.reshard_after_forward else h.blocks + h.largest
    if order == "together" and lay.reshard_after_forward:
        # A rank's other stage keeps its blocks gathered from its last backward (the schedule
        # reshards a stage only after its last micro-batch) while this one's backward begins.
        blocks_gathered += h.blocks * (rm.stages - 1) / rm.stages
    return (h.root + blocks_gathered) * h.gathered_width


def _backward_end(snap, lay: Layout, h: _Held, sharded_grads: float, micro: int) -> MemoryBreakdown:
    """The backward's end, the embedding's, without a pipeline: every activation freed, but the
    blocks' sharded gradients made (the root's and the block just done not yet: their
    reduce-scatters are to come or in flight, with fp32 buffers), the root's whole ones, and
    that block still gathered (DeepSeek-V3 671B's peak with experts sharded over few ranks;
    measured by the rehearsal, forja/train/rehearse/)."""
    pending = (h.root + h.largest) / h.shard * FP32 if micro == 1 else 0.0
    # HSDP: torch keeps each block's all-reduce input (its sharded fp32 gradient) until the
    # backward ends, so that the allocator cannot hand it to a later reduce-scatter early.
    all_reduce_inputs = (h.held - h.root / h.shard) * FP32 if lay.dp_replicate > 1 and h.shard > 1 else 0.0
    return snap("embedding backward", acts=0.0, grads_now=sharded_grads - pending + h.root * FP32,
                gathered_now=(h.root + h.largest) * h.gathered_width, staged=2 * h.largest * FP32 + all_reduce_inputs)


def stage_order(lay: Layout, rm: RankModel, micro: int, inflight: float) -> str:
    """How a pipeline rank's backwards overlap its stages (torch.distributed.pipelining's
    schedules, which reduce a stage's gradients and reshard it right after its last backward):
    "" without a pipeline; "all first" when every forward runs before the first backward;
    "together" when its stages' backwards interleave, all of them whole at once (interleaved
    1F1B over several rounds of pp micro-batches; the V schedules); "one at a time" when the
    stage nearest the loss finishes every backward before the next begins (interleaved 1F1B
    with one round); a rank of one stage in its steady phase is "together" with itself."""
    if lay.pp == 1:
        return ""
    if inflight >= micro:
        return "all first"
    if rm.stages > 1 and lay.pp_schedule == "interleaved-1f1b" and micro <= lay.pp:
        return "one at a time"
    return "together"


def _stage_backward_ends(order: str, rm: RankModel, kept: float, inflight: float, micro: int, root: float,
                         output_root: float, blocks: float) -> list[tuple[float, float, float]]:
    """(activations in flight, elements whole, share of the rank's sharded gradients held) at
    the end of a stage's first backward, when a schedule keeps each stage gathered with whole
    fp32 gradients from its first backward to its last: one (stage, micro-batch) fewer is in
    flight, of the `inflight` x stages the rank holds."""
    one_fewer = kept * (1 - 1 / (inflight * rm.stages))
    if order == "together" or rm.stages == 1:
        return [(one_fewer, root + blocks, 0.0)]
    per_stage = blocks / rm.stages
    # The stage nearest the loss (holding the output on the last rank) runs its backwards first,
    # every other stage's micro-batches still in flight; the lowest (the embedding's, on the
    # first rank) runs last, its own m - 1 later micro-batches in flight, the others reduced.
    return [(one_fewer, output_root + per_stage, 0.0),
            (kept * (micro - 1) / inflight / rm.stages, root - output_root + per_stage, (rm.stages - 1) / rm.stages)]


def _kept_activations(job: Job, lay: Layout, rm: RankModel, tokens: float, micro: int) -> tuple[float, float]:
    """(bytes the rank's blocks keep for backward over the micro-batches in flight, the largest
    block's working memory in its backward)."""
    kept = working = 0.0
    layer_bytes = {}  # (shape, whole) -> bytes one such layer keeps a micro-batch
    for b, idx in rm.groups:
        for whole in (0, 1):  # 0: checkpointed by ac_every
            n = sum(1 for i in idx if _whole(lay, i) == whole)
            if n:
                k, wk = _block_activations_cached(job, lay, b, whole)
                layer_bytes[b, whole] = k * tokens + weight_casts(job, lay, b, whole)
                kept, working = kept + n * layer_bytes[b, whole], max(working, wk * tokens)
    if lay.pp > 1:
        shape = {i: b for b, idx in rm.groups for i in idx}
        per_stage = [sum(layer_bytes[shape[i], _whole(lay, i)] for i in layers)
                     for layers in rm.stage_layers] or [kept]
        # A stage that sends its output keeps it (torch's schedule does, for the backward that
        # the gradient received for it starts) until that micro-batch's backward: all but the
        # model's last stage, whose output is the loss; the backward under way has let its go.
        output = _stage_io(job, lay, tokens)
        sends = [0.0 if rm.last and i == len(per_stage) - 1 else output for i in range(len(per_stage))]
        kept = _in_flight(lay, rm.pp_rank, micro, [b + o for b, o in zip(per_stage, sends)]) - max(sends)
    if rm.first:  # Gemma 4's per-layer inputs, made before the first block and read by every one
        kept += tokens * per_layer_inputs_saved(job, lay) * inflight_chunks(lay, rm.pp_rank, micro)
    if rm.last:
        # The final norm's input and output, split over tp under sequence parallelism, and the
        # output projection's input, whole (gathered for the vocabulary-split projection).
        kept += tokens * job.args.dim * (2 * widths(job).res / lay.sp_degree + widths(job).lin)
    return kept, working


def _whole(lay: Layout, index: int) -> int:
    """0 for a block `parallel.ac_every` checkpoints whole, 1 for the others."""
    return 0 if lay.ac_every and index % lay.ac_every == 0 else 1


def _in_flight(lay: Layout, pp_rank: int, micro: int, per_stage: list[float]) -> float:
    """Bytes a pp rank keeps for backward at its peak, its stages keeping `per_stage` bytes a
    micro-batch. Interleaved 1F1B is walked as torch's schedule orders it: rounds of micro-batches
    through one stage, then the next, so its warm-up runs the rank's first stage more often than
    its last (a last stage thinned for the output layer keeps less than the mean). The other
    schedules keep `inflight_chunks` of each stage's."""
    if lay.pp_schedule != "interleaved-1f1b" or len(per_stage) == 1:
        return sum(per_stage) * inflight_chunks(lay, pp_rank, micro)
    v, p = len(per_stage), lay.pp
    per_round = micro // max(1, micro // p)
    warmup = min((v - 1) * per_round + 2 * (p - 1 - pp_rank), micro * v)
    held, peak = [0] * v, 0.0
    # Past the warm-up the held mix repeats every v rounds: one cycle of it is enough.
    for t in range(min(micro * v, warmup + v * per_round)):  # forward t, then backward t - warmup
        held[(t // per_round) % v] += 1
        if t >= warmup - 1:
            peak = max(peak, sum(n * b for n, b in zip(held, per_stage)))
        if t >= warmup:
            held[v - 1 - ((t - warmup) // per_round) % v] -= 1
    return peak


def _loss_memory(job: Job, lay: Layout, rm: RankModel, tokens: float, micro: int) -> tuple[float, float]:
    """(logits and loss bytes kept until backward, the loss's backward transients): the last stage's."""
    loss_kept, loss_backward = _logits(job, lay, tokens) if rm.last else (0.0, 0.0)
    # Each multi-token prediction depth runs the output head and its loss again, kept until backward.
    loss_kept *= 1 + (job.args.mtp_depth if rm.last else 0)
    if lay.pp > 1 and lay.pp_schedule == "gpipe":
        loss_kept *= micro  # every micro-batch's forward (and loss) runs before any backward
    return loss_kept, loss_backward


def _accumulated_gradients(lay: Layout, grads: float, micro: int, unsharded: float | None) -> float:
    """Gradient bytes held between micro-batches. FSDP (`unsharded`: the rank's whole gradients
    in fp32, FSDP's reduce dtype, in which it accumulates them; None without FSDP) reduces each
    micro-batch's, sharded, except under PP, whose schedule reduce-scatters once after the last
    micro-batch (unsharded meanwhile), and under parallel.grad_sync = "step", which does the same."""
    accumulated = grads if micro > 1 else 0.0  # a pipeline's first backward comes before its last forward
    if unsharded is not None and (lay.pp > 1 or (lay.grad_sync == "step" and micro > 1)):
        accumulated = unsharded
    if lay.pp > 1 and lay.pp_schedule == "gpipe":
        accumulated = 0.0  # GPipe runs every forward before the first backward makes a gradient
    return accumulated
