"""The [parallel] section of a config: how the model and data are spread over ranks."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Literal

from forja.errors import ForjaError
from forja.parallel.degrees import Axis, Degrees

PP_SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zero-bubble", "dualpipev")
CP_KINDS = ("ring", "all-to-all")


@dataclass(kw_only=True)
class ParallelConfig:
    """Degrees of each kind of parallelism (their product is the world size) and how each
    is applied."""

    dp_replicate: int = 1
    """Data-parallel replicas: DDP-like replication, or the outer dimension of HSDP."""
    dp_shard: int = -1
    """FSDP sharding degree; -1 takes whatever the other degrees leave of the world size."""
    reshard_after_forward: bool = True
    """FSDP: free gathered parameters after forward (ZeRO-3) or keep them for backward (ZeRO-2)."""
    grad_sync: Literal["micro-batch", "step"] = "micro-batch"
    """FSDP with gradient accumulation: reduce-scatter each micro-batch's gradients and regather the
    parameters for the next (the default: sharded gradients between micro-batches), or keep the
    gathered parameters and the whole gradients through the step's micro-batches and reduce once
    after the last ("step": Megatron's distributed optimizer, ZeRO-1/2; one all-gather and one
    reduce-scatter a step for the memory of whole bf16 parameters and fp32 gradients). "step" needs
    reshard_after_forward = false; pipelines already reduce once a step."""
    cpu_offload: bool = False
    """FSDP: keep parameters, gradients and optimizer state in CPU memory (pinned on GPUs; on CPUs, a no-op)."""
    mixed_precision: Literal["fp32", "bf16"] = "fp32"
    """FSDP: bf16 parameters in compute with fp32 gradient reduction, or all fp32."""
    tp: int = 1
    """Tensor-parallel degree (heads and FFN columns split over ranks)."""
    sequence_parallel: bool = True
    """With tp > 1: norms and residuals split along the sequence, activations never replicated."""
    async_tp: bool = False
    """With tp > 1 and parallel.compile on CUDA: overlap TP communication with matmuls (not yet run: needs
    2+ GPUs)."""
    pp: int = 1
    """Pipeline-parallel degree (layers split into stages over ranks)."""
    pp_schedule: Literal["gpipe", "1f1b", "interleaved-1f1b", "zero-bubble", "dualpipev"] = "1f1b"
    """Pipeline schedule; interleaved-1f1b, zero-bubble (ZBV) and dualpipev hold 2 stages per rank."""
    pp_microbatches: int = 0
    """Microbatches per pipeline step; 0 means local batch / train.micro_batch_size."""
    pp_layers: list[int] = field(default_factory=list)
    """Transformer blocks in each stage, e.g. [3, 5]; empty balances them by cost."""
    ep: int = 1
    """Expert-parallel degree: a mixture of experts' routed experts split over this many of the
    dp_shard ranks (it must divide dp_shard and the number of experts)."""
    cp: int = 1
    """Context-parallel degree: each sample's sequence split over this many ranks (any backend)."""
    cp_kind: Literal["ring", "all-to-all"] = "ring"
    """How attention sees the whole sequence under cp > 1: "ring" passes keys and values around
    the ranks (each rank a load-balanced chunk and its mirror), "all-to-all" (Ulysses) re-shards
    activations over heads for each sequence mixer, so the degree must divide the heads."""
    ac: Literal["none", "full", "selective"] = "none"
    """Activation checkpointing: none, every block (full), or selective (see ac_every)."""
    ac_every: int = 0
    """selective: checkpoint every k-th block; 0 means op-level (keep the outputs of matmuls, attention,
    the experts' exchanges and the router's top-k; recompute the rest)."""
    ac_matmuls: Literal["all", "alternate"] = "all"
    """Op-level selective AC's matmuls: keep every one's output ("all"), or every second `mm` of a
    block's, recomputing the others ("alternate", torchtitan's op-level policy: a Llama block's
    wk, wo and w3, a third of its matmul outputs' memory for their forward again). Only op-level
    AC reads it."""
    compile: bool = False
    """torch.compile each transformer block."""
    compile_backend: Literal["inductor", "aot_eager", "eager"] = "inductor"
    """torch.compile's backend: inductor generates fused kernels (the fast one); aot_eager traces the
    same forward and backward graphs but runs them op by op (no code generated: for finding whether
    a problem is inductor's, and quick checks of the traced path); eager only captures the graph."""
    timeout_s: float = 600.0
    """No progress (a step, validation, a checkpoint) for this long: every rank reports where it is
    (docs/training.md, "When things go wrong") and the run fails; collectives time out a grace later."""
    auto: bool = False
    """Let forja plan choose the layout (degrees, ZeRO stage, offload, AC, micro-batch, schedule): the
    fastest predicted to fit; the choice is written to <run.dir>/plan.json and these keys are ignored."""
    memory_check: Literal["stop", "warn", "rehearse", "off"] = "stop"
    """Before allocating, the layout's peak memory per rank against the device's: stop (with the
    breakdown and layouts that fit), warn and go on, or off. "rehearse" stops on the rehearsed peak
    instead of the predicted one: the build and one step run on fake devices first (seconds to a
    minute for an 8B; forja/train/rehearse/), every layout but a capacity factor's."""

    def __post_init__(self) -> None:
        _ = self.degrees  # built to check each degree (dp_shard may be -1)
        if self.pp_microbatches < 0 or self.ac_every < 0:
            raise ForjaError("parallel.pp_microbatches and parallel.ac_every must be >= 0")
        if self.timeout_s <= 0:
            raise ForjaError(f"parallel.timeout_s = {self.timeout_s} must be > 0")

    @property
    def degrees(self) -> Degrees:
        """The degrees these keys give (dp_shard may still be -1: `Degrees.resolve` fills it)."""
        return Degrees(**{axis.value: getattr(self, axis.value) for axis in Axis})

    def with_degrees(self, degrees: Degrees) -> ParallelConfig:
        """This section with `degrees` in place of its own."""
        return replace(self, **degrees.keys())
