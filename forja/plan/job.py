"""The job a plan is for: the model, the batch, the precision and the optimizer, as a run's
config resolves them on a device kind (fused kernels and bf16 autocast only on GPUs), and
every setting of the run the layout validator reads (`job_from_config` is the one reader of
them; `forja.plan.planner.layout_request` hands them on)."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field

from forja.config import Config
from forja.models.common.transformer import TransformerArgs
from forja.parallel.config import ParallelConfig
from forja.plan.shape import ModelShape, model_shape

# Optimizer state per parameter, in fp32 elements, for the elementwise optimizers (AdamW: two
# moments). The memory model counts SOAP, Adafactor and Muon as they hold their state
# (forja/plan/optimizer_memory.py: whole matrices on every rank, not per element); these
# averages only size CPU offload's host traffic.
STATE_PER_PARAM = {"adamw": 2.0, "adam": 2.0, "sgd": 1.0, "lion": 1.0, "muon": 1.1, "adafactor": 0.05,
                   "soap": 6.0}


@dataclass(frozen=True, kw_only=True)
class Job:
    """What is trained, independent of how it is spread."""

    shape: ModelShape
    seq_len: int
    """train.seq_len: the longest length the run trains at (memory and time are predicted there)."""
    global_batch_size: int
    """Sequences per step over the data-parallel ranks: train.global_batch_size, or under [ft]
    one replica group's share of it (a group is a job of its own: `--gpus` counts its ranks)."""
    seq_lens: tuple[int, ...] = ()
    """Every sequence length the run trains at (train.seq_len_schedule, data stages), each one a
    layout must split; empty: seq_len alone."""
    micro_batch_size: int = 1
    """The recipe's train.micro_batch_size (a layout gives its own)."""
    optimizer: str = "adamw"
    gpu: bool = True
    """On a GPU: bf16 autocast ("auto" precision), fused AdamW, Triton kernels when asked for."""
    bf16: bool = True
    """Compute in bf16 (autocast, or FSDP bf16 parameters)."""
    bf16_params: bool = False
    """parallel.mixed_precision = bf16: FSDP gathers bf16 parameters and the residual stream is bf16."""
    fused: frozenset[str] = frozenset()
    """Fused ops in effect (model.fused_ops on a GPU; on a CPU their PyTorch path runs)."""
    float8: bool = False
    compiled: bool = False
    """parallel.compile: elementwise ops fused into the matmuls' neighbours."""
    async_tp: bool = False
    """parallel.async_tp (with compile, on GPUs): part of the TP collectives hides behind matmuls."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig, compare=False, repr=False)
    """The recipe's [parallel] section: the options a layout does not set (compile, async_tp,
    pp_layers, mixed_precision), which the layout validator reads with the layout's keys."""
    document_mask: bool = False
    float8_recipe: str = "none"
    """train.float8 as the recipe names it (the validator tells recipes apart)."""
    precision: str = "auto"
    """train.precision, as the recipe gives it."""
    qk_clip_tau: float = 0.0
    """optim.qk_clip_tau (the validator refuses it, and the next key, with context parallelism)."""
    max_logit_metric: bool = False
    """optim.max_logit_metric."""
    ft: bool = False
    """[ft] is on: the replicas are torchft replica groups, not parallel.dp_replicate."""
    check_interval: int = 0
    """ft.check_interval: replicas compare their weights (the validator asks for replicas)."""
    ft_replicas: int = 1
    """Replica groups that hold the same weights after every step: ft.groups under [ft] hsdp, else 1."""
    fla: bool = False
    """flash-linear-attention is installed: on a GPU Gated DeltaNet blocks run its kernel
    (which keeps far less for backward than the PyTorch chunked reference)."""
    memo: dict = field(default_factory=dict, compare=False, repr=False)
    """What a search computes once per job and reuses over its thousands of layouts (the
    pipeline split of the blocks, a block's activations per layout setting)."""

    @property
    def args(self) -> TransformerArgs:
        return self.shape.args

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch_size * self.seq_len

    @property
    def state_per_param(self) -> float:
        return STATE_PER_PARAM.get(self.optimizer, 2.0)


def job_from_config(cfg: Config, *, gpu: bool, args: TransformerArgs | None = None) -> Job:
    """The job of a run's config, on a GPU or a CPU machine; `args`: the model's, when the
    tokenizer's vocabulary is known (otherwise data.vocab_size stands for it)."""
    from forja.models.config import run_model_args

    args = args or run_model_args(cfg.model, cfg.data.vocab_size)
    t, p = cfg.train, cfg.parallel
    bf16 = t.precision == "bf16" or (t.precision == "auto" and gpu) or p.mixed_precision == "bf16"
    return Job(shape=model_shape(args, t.seq_len), seq_len=t.seq_len, seq_lens=cfg.run_seq_lens(),
               global_batch_size=cfg.ft.group_batch(t.global_batch_size), micro_batch_size=t.micro_batch_size,
               optimizer=cfg.optim.name, gpu=gpu, bf16=bf16, bf16_params=p.mixed_precision == "bf16",
               fused=frozenset(args.fused_ops) if gpu else frozenset(), float8=t.float8 != "none",
               # aot_eager and eager trace the graphs but fuse nothing: priced as eager
               compiled=p.compile and p.compile_backend == "inductor", async_tp=gpu and p.async_tp and p.compile,
               parallel=p, document_mask=cfg.model.document_mask, float8_recipe=t.float8, precision=t.precision,
               qk_clip_tau=cfg.optim.qk_clip_tau, max_logit_metric=cfg.optim.max_logit_metric, ft=cfg.ft.enabled,
               check_interval=cfg.ft.check_interval,
               ft_replicas=cfg.ft.groups if cfg.ft.shares_checkpoints else 1,
               fla=gpu and importlib.util.find_spec("fla") is not None)
