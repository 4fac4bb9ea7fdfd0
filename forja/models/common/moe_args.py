"""A mixture of experts' typed args (`MoEArgs`): its experts, routing and balancing, each
checked at load time. The layer itself is forja/models/common/moe.py, which re-exports these."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from forja.errors import ForjaError
from forja.ops.grouped_mm import GROUPED_MM_IMPLS

EXPERT_ACTIVATIONS = ("swiglu", "clamped_swiglu", "relu2", "geglu")
"""`MoEArgs.expert_activation`'s values; "relu2" alone has no gate (no w3)."""


@dataclass(kw_only=True)
class MoEArgs:
    """Mixture-of-experts fields, mixed into a family's args."""

    n_experts: int = 0
    """Routed experts per MoE layer; 0 makes a dense model."""
    top_k: int = 1
    """Experts each token is sent to."""
    moe_ffn_dim: int = 0
    """Hidden width of one expert."""
    n_shared_experts: int = 0
    """Experts every token goes through (DeepSeek), run as one SwiGLU n_shared x moe_ffn_dim wide."""
    shared_ffn_dim: int = 0
    """The shared experts' SwiGLU width when it is not a whole number of experts (Qwen's
    `shared_expert_intermediate_size`, any width); 0: n_shared_experts x moe_ffn_dim."""
    shared_expert_gate: bool = False
    """Scale the shared experts' output per token by sigmoid of a learned projection of it
    (Qwen3-Next, Qwen3.5-MoE: `shared_expert_gate`)."""
    score_func: Literal["softmax", "sigmoid", "topk_softmax"] = "softmax"
    """Router scores: softmax over experts (Qwen, Mixtral), independent sigmoids (DeepSeek-V3),
    or "topk_softmax": the top_k logits chosen first, then a softmax over those k only
    (gpt-oss; the weights sum to 1 already, so norm_topk_prob has nothing to do)."""
    norm_topk_prob: bool = True
    """Rescale the chosen experts' scores to sum to 1."""
    router_bias: bool = False
    """The router's linear layer adds a learned bias to its logits (gpt-oss). Unlike
    `expert_bias` it is trained by gradients and it weighs the chosen experts too."""
    expert_proj_bias: bool = False
    """Each routed expert's gate, up and down projections add a learned bias (gpt-oss)."""
    expert_activation: Literal["swiglu", "clamped_swiglu", "relu2", "geglu"] = "swiglu"
    """The routed experts' activation: silu(gate) * up, or gpt-oss's clamped variant
    (up + 1) * g * sigmoid(swiglu_alpha * g), g = gate clamped above at swiglu_limit and up
    clamped to +-swiglu_limit; shared experts are then SwiGLU. Or "relu2", no gate: relu(up)^2
    (Nemotron 3), the shared experts too (`SquaredReLUMLP`). Or "geglu": gelu_tanh(gate) * up
    (Gemma 4, whose experts have no shared ones)."""
    swiglu_limit: float = 7.0
    """Clamp of the clamped SwiGLU (gpt-oss's `swiglu_limit`)."""
    swiglu_alpha: float = 1.702
    """Sigmoid gain of the clamped SwiGLU (gpt-oss's `swiglu_alpha`; 1.702: the sigmoid
    approximation of GELU)."""
    scale_expert_input: bool = False
    """Multiply each routed expert's input by its routing weight instead of its output (Llama
    4: the expert sees w * x); with a gated expert the two differ."""
    route_scale: float = 1.0
    """Factor on the routed experts' weights (DeepSeek's routed_scaling_factor)."""
    n_expert_groups: int = 1
    """Group-limited routing: experts fall into this many equal groups..."""
    topk_groups: int = 1
    """...and each token chooses among the experts of its best `topk_groups` groups only."""
    group_score: Literal["top2_sum", "max"] = "top2_sum"
    """A group's score: the sum of its two best experts' (DeepSeek-V3) or its best one's (V2)."""
    expert_bias: bool = False
    """A per-expert bias on the scores used to choose experts (auxiliary-loss-free balancing)."""
    bias_update_rate: float = 0.0
    """Step of the bias update after each optimizer step (DeepSeek-V3: 0.001); 0 freezes it."""
    aux_loss_weight: float = 0.0
    """Weight of the Switch/GShard load-balancing loss; 0 turns it off."""
    z_loss_weight: float = 0.0
    """Weight of the router z-loss; 0 turns it off."""
    capacity_factor: float = 0.0
    """Token-slots an expert takes, as a multiple of an even share; 0 is dropless."""
    moe_impl: Literal["auto", "grouped", "loop"] = "auto"
    """Expert matmuls: torch._grouped_mm where supported (auto), always, or a per-expert loop."""

    @property
    def shared_width(self) -> int:
        """Hidden width of the one SwiGLU the shared experts run as (0: none)."""
        return self.shared_ffn_dim if self.n_shared_experts and self.shared_ffn_dim else \
            self.n_shared_experts * self.moe_ffn_dim

    def is_moe_layer(self, layer: int) -> bool:
        """Whether block `layer` has a mixture of experts (families refine this)."""
        return self.n_experts > 0

    def check_moe(self) -> None:
        """Refuse routing options that contradict each other, naming the field."""
        if self.n_experts <= 0:
            return
        e = self.n_experts
        rules = [
            (1 <= self.top_k <= e, f"top_k = {self.top_k} must be between 1 and n_experts = {e}"),
            (self.moe_ffn_dim > 0, f"moe_ffn_dim = {self.moe_ffn_dim} must be positive"),
            (self.shared_ffn_dim >= 0 and (self.n_shared_experts > 0 or not self.shared_ffn_dim),
             f"shared_ffn_dim = {self.shared_ffn_dim} needs n_shared_experts >= 1 (and must not be negative)"),
            (self.score_func in ("softmax", "sigmoid", "topk_softmax"),
             f"score_func = {self.score_func!r} must be softmax, sigmoid or topk_softmax"),
            (self.expert_activation in EXPERT_ACTIVATIONS,
             f"expert_activation = {self.expert_activation!r} must be one of {', '.join(EXPERT_ACTIVATIONS)}"),
            (self.expert_activation != "geglu" or not self.n_shared_experts,
             f"n_shared_experts = {self.n_shared_experts}: GeGLU experts (Gemma 4's) have no shared ones, so "
             "it must be 0"),
            (self.swiglu_limit > 0, f"swiglu_limit = {self.swiglu_limit} must be positive"),
            (self.n_expert_groups >= 1 and e % self.n_expert_groups == 0,
             f"n_experts = {e} must split into n_expert_groups = {self.n_expert_groups} equal groups"),
            (1 <= self.topk_groups <= self.n_expert_groups,
             f"topk_groups = {self.topk_groups} must be between 1 and n_expert_groups = {self.n_expert_groups}"),
            (self.top_k <= self.topk_groups * e // self.n_expert_groups,
             f"top_k = {self.top_k} is more than the experts in topk_groups = {self.topk_groups} groups"),
            (self.group_score in ("top2_sum", "max"), f"group_score = {self.group_score!r} must be top2_sum or max"),
            (self.capacity_factor >= 0, f"capacity_factor = {self.capacity_factor} must be >= 0 (0: dropless)"),
            (min(self.aux_loss_weight, self.z_loss_weight, self.bias_update_rate) >= 0,
             "aux_loss_weight, z_loss_weight and bias_update_rate must be >= 0"),
            (self.expert_bias or self.bias_update_rate == 0,
             f"bias_update_rate = {self.bias_update_rate} needs expert_bias = true"),
            (self.moe_impl in GROUPED_MM_IMPLS, f"moe_impl = {self.moe_impl!r} must be one of {GROUPED_MM_IMPLS}"),
        ]
        for ok, message in rules:
            if not ok:
                raise ForjaError(f"model {message}; change it in model.overrides")
        if self.n_expert_groups > 1 and self.group_score == "top2_sum" and e // self.n_expert_groups < 2:
            raise ForjaError("model group_score = 'top2_sum' needs at least 2 experts per group; "
                             "use group_score = 'max' or fewer n_expert_groups")
