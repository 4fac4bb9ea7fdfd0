"""The [model] section of a config."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from forja.errors import ForjaError, unknown_key
from forja.ops.names import FUSED_OPS

if TYPE_CHECKING:
    from forja.models.common.transformer import TransformerArgs


@dataclass(kw_only=True)
class MTPConfig:
    """[model.mtp]: multi-token prediction (DeepSeek-V3's sequential MTP modules,
    forja/models/common/mtp.py), a training objective; the modules are not needed to generate."""

    depth: int = 0
    """Modules, each predicting one token further ahead (DeepSeek-V3: 1); 0: off."""
    loss_weight: float = 0.3
    """lambda: the training loss adds (lambda / depth) x the sum of the depths' cross-entropies
    (DeepSeek-V3: 0.3, then 0.1). The reported `loss` stays the main one; each depth's is `mtp/loss_{k}`."""

    def __post_init__(self) -> None:
        if self.depth < 0 or self.loss_weight < 0:
            raise ForjaError(f"model.mtp.depth = {self.depth} and model.mtp.loss_weight = {self.loss_weight} "
                             "must be at least 0 (depth = 0 turns multi-token prediction off)")


@dataclass(kw_only=True)
class ModelConfig:
    """Which model to train."""

    family: str = "llama"
    """Model family: llama, gpt2, qwen3, deepseek_v3 or mixtral."""
    flavor: str = "debug"
    """A size from the family's FLAVORS (forja/models/<family>/__init__.py: debug, tiny, 3.2-1b, 124m, ...)."""
    attention: Literal["sdpa", "flex"] = "sdpa"
    """Attention kernel: sdpa, or flex (FlexAttention block masks for documents and windows, CUDA)."""
    document_mask: bool = True
    """Keep attention within each document of a packed sequence."""
    fused_ops: bool = False
    """Run RMSNorm, RoPE, SwiGLU and the output projection + loss through forja.ops: Triton
    kernels on CUDA (the PyTorch reference elsewhere); the loss never holds full logits."""
    fused_ops_overrides: dict[str, bool] = field(default_factory=dict)
    """Per-op exceptions to fused_ops, e.g. {cross_entropy = false} or {rms_norm = true}."""
    overrides: dict[str, Any] = field(default_factory=dict)
    """Fields of the flavor to change, e.g. {n_layers = 2, qk_norm = true, sliding_window = 512}."""
    rope_scaling: dict[str, Any] | None = None
    """Rotary frequency scaling, replacing the flavor's, as Hugging Face writes it: {rope_type = "yarn",
    factor = 8.0, original_max_seq_len = 4096} (YaRN) or {rope_type = "llama3", factor = 8.0,
    low_freq_factor = 1.0, high_freq_factor = 4.0, original_max_seq_len = 8192} (Llama 3's rule);
    {rope_type = "default"}: plain RoPE; unset: the flavor's. For rotary families (llama, qwen3, mixtral,
    olmo3, deepseek_v3, gpt_oss, gemma3); a resume may change it (context extension, docs/training.md)."""
    mup_base_dim: int = 0
    """0: off; else the width (model.dim) the hyperparameters were tuned at: the model is
    parametrized (muP) so the best learning rate found at that width holds at larger widths."""
    mtp: MTPConfig = field(default_factory=MTPConfig)
    """[model.mtp]: multi-token prediction modules and their loss weight (depth 0: off)."""
    init_from: str | None = None
    """Start from these weights instead of random ones: a Hugging Face directory, or a forja
    run directory or checkpoint (weights only; the optimizer and data start afresh)."""

    def __post_init__(self) -> None:
        if self.mup_base_dim < 0:
            raise ForjaError(f"model.mup_base_dim = {self.mup_base_dim} must be 0 (off) or a width (model.dim)")
        unknown = sorted(set(self.fused_ops_overrides) - set(FUSED_OPS))
        if unknown:
            raise ForjaError(f"model.fused_ops_overrides has no op {unknown[0]!r}; ops: {', '.join(FUSED_OPS)}")
        self._check_overrides()
        self.scaling()  # a bad table stops at load, naming model.rope_scaling

    def scaling(self) -> Any:
        """model.rope_scaling as the family's args take it (RopeScaling, YarnScaling or None for
        plain RoPE); refused for a family without rotary scaling, or set twice."""
        from forja.models.common.rope import rope_scaling_from
        from forja.models.registry import FAMILIES

        if self.rope_scaling is None:
            return None
        if "rope_type" not in self.rope_scaling:
            raise ForjaError("model.rope_scaling needs a rope_type: \"yarn\", \"llama3\" or \"default\" (plain RoPE)")
        scaling = rope_scaling_from(self.rope_scaling, key="model.rope_scaling")
        spec = FAMILIES.get(self.family)
        if spec is not None and "rope_scaling" not in {f.name for f in dataclasses.fields(spec.args_cls)}:
            with_it = sorted(n for n, f in FAMILIES.items()
                             if "rope_scaling" in {x.name for x in dataclasses.fields(f.args_cls)})
            raise ForjaError(f"model.rope_scaling: the {self.family} family has no rotary scaling; remove the key, "
                             f"or use one of {', '.join(with_it)}")
        if "rope_scaling" in self.overrides:
            raise ForjaError("model.rope_scaling and model.overrides.rope_scaling are both set; "
                             "keep model.rope_scaling")
        return scaling

    def _check_overrides(self) -> None:
        """Every key of model.overrides must be a field of the family's args, caught at load rather
        than when the model is built. An unknown family is left to the registry's own error."""
        from forja.models.registry import FAMILIES  # the registry imports every family: only when asked

        spec = FAMILIES.get(self.family)
        if spec is None or not self.overrides:
            return
        fields = sorted(f.name for f in dataclasses.fields(spec.args_cls))
        for key in self.overrides:
            if key not in fields:
                raise unknown_key(f"model.overrides.{key}", fields, f"(the fields of {self.family}'s model)")

    def enabled_fused_ops(self) -> tuple[str, ...]:
        """The ops to fuse: fused_ops for every op, except where fused_ops_overrides says."""
        return tuple(op for op in FUSED_OPS if self.fused_ops_overrides.get(op, self.fused_ops))


def run_model_args(model_cfg: ModelConfig, vocab_size: int) -> TransformerArgs:
    """The model's typed args from the [model] section and the tokenizer's vocabulary."""
    from forja.models.registry import model_args  # the registry imports every family: only when asked

    overrides = dict(model_cfg.overrides)
    if model_cfg.rope_scaling is not None:
        overrides["rope_scaling"] = model_cfg.scaling()
    args = model_args(model_cfg.family, model_cfg.flavor, attention=model_cfg.attention,
                      fused_ops=model_cfg.enabled_fused_ops(), **{"vocab_size": vocab_size, **overrides})
    if args.vocab_size < vocab_size:
        raise ForjaError(f"model.overrides.vocab_size = {args.vocab_size} is smaller than the tokenizer's "
                         f"{vocab_size} tokens; remove the override or make it larger")
    if model_cfg.mtp.depth:  # [model.mtp] wins over the flavor (and a Hugging Face config's count)
        args.mtp_depth, args.mtp_loss_weight = model_cfg.mtp.depth, model_cfg.mtp.loss_weight
    if model_cfg.mup_base_dim:  # muP: parametrize relative to the width the lr was tuned at
        args.mup_width_mult = args.dim / model_cfg.mup_base_dim
    return args
