"""The optimizer's bytes on one rank, as forja's optimizers really hold them (forja/optim):

- AdamW / Adam (2 fp32 moments), Lion and SGD (1): elementwise state, sharded as the
  parameters are: `k x 4` bytes per parameter of the rank's shard.
- SOAP (soap.py): every block matrix's state is kept whole and identical on every rank,
  whatever the sharding: M and V' (2 m n), L and Q_L (2 m^2), R and Q_R (2 n^2), a side above
  max_precond_dim (10,000) getting no factor; vectors, embeddings and the output take sharded
  Adam (forja/optim/params.py; an MoE router, Adam's too, is still counted as a block matrix:
  an overestimate by its factors, 8 (E^2 + d^2) bytes a router). Its step gathers each
  gradient whole and makes a few matrix-sized temporaries and the factors' products.
- Adafactor (adafactor.py): factored statistics, rows + columns per matrix, whole on every
  rank; under FSDP/TP each step gathers one parameter and its gradient whole, updates, and
  keeps its shard: a transient of about four full matrices (parameter, gradient, estimate,
  update) at a time. On plain tensors torch's foreach step makes two parameter-sized
  temporaries for the whole shard.
- Muon (muon.py): a momentum buffer sharded as its matrix (1 x 4 bytes per element), AdamW's
  two moments for the rest (embeddings, output, norms, routers). The orthogonalization gathers
  each matrix whole to one owner rank of the group that shards it (every mesh dimension but
  ep): a rank holds, for a moment, its owned matrices whole (about 1 / group of them, fp32),
  plus Newton-Schulz's buffers for the largest (X, its normalized copy, X X^T, the polynomial,
  the next X: 3 m n + 2 m^2 in bf16 on a GPU, fp32 on a CPU, m the shorter side).
"""

from __future__ import annotations

from forja.plan.job import Job
from forja.plan.layout import Layout

FP32 = 4
SOAP_MAX_PRECOND_DIM = 10_000  # forja.optim.config SoapConfig.max_precond_dim's default


def _whole_matrices(job: Job, rm) -> tuple[list, list, float]:
    """(the blocks' matrices, the root's, as (count, stack, rows, columns), whole; the vector
    elements, whole) of what pipeline rank `rm` holds."""
    s = job.shape
    blocks, root, vectors = [], [], 0.0
    for b, idx in rm.groups:
        n = len(idx)
        blocks += [(n, stack, r, c) for stack, r, c in b.matrices]
        vectors += n * (b.tp_split + b.replicated + b.experts - sum(stack * r * c for stack, r, c in b.matrices))
    for name, r, c in s.root_matrices:
        if (name.startswith("output") and rm.last) or (not name.startswith("output") and rm.first):
            root.append((1, 1, r, c))
    if rm.last:
        vectors += s.final_norm
    return blocks, root, vectors


def _sharded(job: Job, lay: Layout) -> bool:
    """Whether the parameters are DTensors (FSDP, TP or EP), so the optimizers gather them."""
    return lay.fsdp * lay.dp_replicate > 1 or lay.tp > 1 or lay.ep > 1 or job.bf16_params or lay.cpu_offload


def optimizer_memory(job: Job, lay: Layout, rm, held: float, elements: float) -> tuple[float, float]:
    """(state bytes, peak temporary bytes of the step) of the rank `rm` whose shard holds `held`
    parameter elements out of the `elements` it holds before FSDP sharding."""
    name = job.optimizer
    if name not in ("soap", "adafactor", "muon"):
        # torch's fused step (optim.implementation = auto) makes no temporary
        return held * FP32 * job.state_per_param, 0.0
    blocks, root, vectors = _whole_matrices(job, rm)
    mats = blocks + root
    # Vectors (norms, biases) are whole on every TP rank; the rank's shard holds its share of them.
    vector_share = held * min(1.0, vectors / elements) if elements > 0 else 0.0
    if name == "soap":
        # The root matrices (embeddings, output) take SOAP's plain Adam step, sharded like the
        # vectors (forja/optim/params.py); only the blocks' matrices are preconditioned, whole.
        adam_share = vector_share + _root_share(job, lay, rm, held, elements)
        state = sum(n * soap_matrix_state(stack * r, c) for n, stack, r, c in blocks) + 2 * adam_share * FP32
        return state, max((soap_step_temporaries(stack * r, c) for _, stack, r, c in blocks), default=0.0)
    if name == "adafactor":
        state = (sum(n * (stack * r + c) for n, stack, r, c in mats) + vectors) * FP32
        if _sharded(job, lay):
            largest = max((stack * r * c for _, stack, r, c in mats), default=0)
            return state, 4 * largest * FP32
        return state, 2 * held * FP32
    # Muon: momentum for the blocks' matrices (sharded), AdamW moments for the rest.
    muon_share = max(0.0, held - vector_share - _root_share(job, lay, rm, held, elements))
    state = muon_share * FP32 + 2 * (held - muon_share) * FP32
    ns = max((stack_local(stack, lay) * newton_schulz_bytes(r, c, job.gpu) for _, stack, r, c in blocks),
             default=0.0)
    if not _sharded(job, lay):
        return state, ns
    group = lay.dp_replicate * lay.fsdp * lay.tp  # every mesh dimension but ep
    whole = sum(n * stack_local(stack, lay) * r * c for n, stack, r, c in blocks)
    return state, whole / group * FP32 + ns


def stack_local(stack: int, lay: Layout) -> float:
    """Expert matrices this rank's EP group gathers: its own experts only (ep is not gathered)."""
    return stack / lay.ep if stack > 1 else 1.0


def soap_matrix_state(rows: int, cols: int) -> float:
    """Bytes of SOAP's state for one rows x cols matrix (whole)."""
    factors = (2 * rows * rows if rows <= SOAP_MAX_PRECOND_DIM else 0) + \
        (2 * cols * cols if cols <= SOAP_MAX_PRECOND_DIM else 0)
    return (2 * rows * cols + factors) * FP32


def soap_step_temporaries(rows: int, cols: int) -> float:
    """Bytes SOAP's step makes for one matrix: the gathered gradient, its rotation, the rotated
    momentum, the normalized step and its rotation back (about 6 m n), G G^T and G^T G."""
    factors = sum(n * n for n in (rows, cols) if n <= SOAP_MAX_PRECOND_DIM)
    return (6 * rows * cols + factors) * FP32


def newton_schulz_bytes(rows: int, cols: int, gpu: bool) -> float:
    """Newton-Schulz's buffers for one matrix (forja.optim.muon.newton_schulz)."""
    m = min(rows, cols)
    return (3 * rows * cols + 2 * m * m) * (2 if gpu else FP32)


def _root_share(job: Job, lay: Layout, rm, held: float, elements: float) -> float:
    """The rank's shard of its root matrices (embeddings, output): AdamW's, under Muon and SOAP."""
    s, root = job.shape, 0.0
    if rm.first:
        root += s.embedding / lay.tp
    if rm.last and s.output:
        root += s.output / lay.tp
    return held * root / elements if elements > 0 else 0.0

