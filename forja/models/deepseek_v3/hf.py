"""Hugging Face `DeepseekV3ForCausalLM` <-> forja DeepSeek-V3.

Reads the published config.json (DeepSeek's own keys: `rope_scaling` of type yarn,
`topk_method`, `scoring_func`, ...) and the transformers 5.x dialect (`rope_parameters`);
writes one both read. Everything transformers' DeepseekV3ForCausalLM computes is
represented exactly; what it cannot compute, or forja does not, is refused naming the
field: another `topk_method` or `scoring_func` (V2's softmax routing belongs to
DeepseekV2ForCausalLM, which forja does not read), rope types other than default/yarn,
attention biases, FP8-quantized weights (convert them to bf16 first).

Layouts:
- Rotary rows: DeepSeek's checkpoints rotate interleaved pairs (x0, x1), (x2, x3), ... of
  each head's rope part; forja rotates (x_i, x_{i + d/2}) pairs. Loading permutes the rope
  rows of q_proj / q_b_proj (per head) and of kv_a_proj_with_mqa (its last
  qk_rope_head_dim rows) from interleaved to halves; saving permutes them back, so forja
  writes the published layout (`rope_interleave: true`). Both orders rotate the same pairs
  by the same angles with the same products, so logits are bit-equal.
- Experts: published checkpoints hold one tensor per expert and projection
  (`mlp.experts.{e}.gate_proj.weight`); forja stacks them as experts.w1/w3 (E, H, D) and
  w2 (E, D, H). transformers 5's fused layout (`mlp.experts.gate_up_proj`, saved with
  `save_original_format=False`) loads too.
- Multi-token prediction: V3's checkpoints carry its MTP module as an extra layer
  (model.layers.61.*, num_nextn_predict_layers = 1): enorm, hnorm, eh_proj, shared_head.norm
  and a full decoder block, plus copies of the embedding (embed_tokens) and of the output
  head (shared_head.head). With num_nextn_predict_layers = D > 0 forja loads the module k
  (layer n_layers + k - 1) into mtp.layers.{n_layers + k - 1} (proj, hnorm, enorm, norm,
  block) and saves it under the same names; the copies are written from forja's one shared
  embedding and head, and when loading the main model's own tensors win (they are read
  after the copies). transformers 5 builds no MTP layers (it skips their tensors), so a
  checkpoint with them still loads there as the main model. With D = 0 the MTP tensors a
  checkpoint may hold are skipped.
"""

from __future__ import annotations

import dataclasses

import torch

from forja.errors import ForjaError
from forja.models.common import hf_rules
from forja.models.common.hf_rules import HFAdapter, TensorRule
from forja.models.common.rope import (
    ROPE_NAMES,
    ROPE_TYPES,
    LinearScaling,
    RopeScaling,
    YarnScaling,
    rope_scaling_from_hf,
    rope_scaling_to_hf,
    yarn_from_hf,
)
from forja.models.deepseek_v3.model import DeepSeekV3Args

ARCHITECTURES = ("DeepseekV3ForCausalLM",)
# The MTP layer of the published V3/R1 checkpoints (61 main layers; transformers skips the
# same name). Its MTP-only parts are named too, for checkpoints with other layer counts.
IGNORED: tuple[str, ...] = (r"model\.layers\.61\..*",
                            r"model\.layers\.\d+\.(enorm|hnorm|eh_proj|shared_head|embed_tokens)\..*")


def _refuse(key: str, value, why: str) -> ForjaError:
    return ForjaError(f"config.json: {key}={value!r} is not supported; {why}")


def _yarn(cfg: dict) -> tuple[float, YarnScaling | RopeScaling | None]:
    params = cfg.get("rope_parameters") or {}
    scaling = cfg.get("rope_scaling") or params
    theta = float(params.get("rope_theta", cfg.get("rope_theta", 10_000.0)))
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind != "default" and kind not in ROPE_TYPES:
        raise _refuse("rope type", kind, f"forja reads {ROPE_NAMES}")
    if kind != "yarn":  # DeepSeek's YaRN defaults are its own (below); every other kind is common/rope.py's
        return theta, rope_scaling_from_hf(scaling, cfg.get("max_position_embeddings", 4096))
    return theta, yarn_from_hf(scaling, cfg.get("max_position_embeddings"), cfg.get("max_position_embeddings", 4096))


def _check_supported(cfg: dict) -> None:
    if cfg.get("quantization_config"):
        method = cfg["quantization_config"].get("quant_method", "?")
        raise _refuse("quantization_config.quant_method", method,
                      "convert the weights to bf16 first (DeepSeek's inference/fp8_cast_bf16.py)")
    unsupported = hf_rules.Unsupported
    hf_rules.check_config(cfg, [
        hf_rules.no_attention_bias("MLA here has no biases"), hf_rules.activation("silu", "DeepSeek-V3 uses 'silu'"),
        unsupported("rope_interleave", bool, "forja reads DeepSeek's interleaved rotary layout (the published one)",
                    default=True),
        unsupported("scoring_func", lambda v: v == "sigmoid", "DeepseekV3ForCausalLM routes by sigmoid scores (V2's "
                    "softmax is DeepseekV2ForCausalLM, not read)", default="sigmoid"),
        unsupported("topk_method", lambda v: v == "noaux_tc" or (v == "greedy" and (cfg.get("n_group") or 1) == 1),
                    "DeepseekV3ForCausalLM routes as 'noaux_tc' (which is 'greedy' when n_group is 1)",
                    default="noaux_tc"),
        unsupported("moe_layer_freq", lambda v: v == 1, "every block after the dense ones is a mixture of experts in "
                    "DeepseekV3ForCausalLM", default=1),
        unsupported("n_shared_experts", lambda v: v and v > 0, "forja's DeepSeek-V3 has at least one shared expert",
                    default=1),
    ], _refuse)


def args_from_config(cfg: dict) -> DeepSeekV3Args:
    _check_supported(cfg)
    theta, scaling = _yarn(cfg)
    return DeepSeekV3Args(
        dim=cfg["hidden_size"],
        n_layers=cfg["num_hidden_layers"],
        n_heads=cfg["num_attention_heads"],
        ffn_dim=cfg["intermediate_size"],
        vocab_size=cfg["vocab_size"],
        max_seq_len=cfg.get("max_position_embeddings", 4096),
        norm_eps=cfg.get("rms_norm_eps", 1e-6),
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        rope_theta=theta,
        rope_scaling=scaling,
        n_dense_layers=cfg.get("first_k_dense_replace") or 0,
        q_lora_rank=cfg.get("q_lora_rank") or 0,
        kv_lora_rank=cfg["kv_lora_rank"],
        qk_nope_head_dim=cfg["qk_nope_head_dim"],
        qk_rope_head_dim=cfg["qk_rope_head_dim"],
        v_head_dim=cfg["v_head_dim"],
        n_experts=cfg["n_routed_experts"],
        top_k=cfg["num_experts_per_tok"],
        moe_ffn_dim=cfg["moe_intermediate_size"],
        n_shared_experts=cfg["n_shared_experts"],
        score_func="sigmoid",
        expert_bias=True,
        norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
        route_scale=float(cfg.get("routed_scaling_factor", 1.0)),
        n_expert_groups=cfg.get("n_group") or 1,
        topk_groups=cfg.get("topk_group") or 1,
        group_score="top2_sum",
        mtp_depth=cfg.get("num_nextn_predict_layers") or 0,
    )


def config_from_args(a: DeepSeekV3Args) -> dict:
    routing = dict(score_func=("sigmoid", "sigmoid scores"), expert_bias=(True, "the balancing bias"),
                   group_score=("top2_sum" if a.n_expert_groups > 1 else a.group_score, "groups scored by "
                                "their top two experts"))
    for key, (want, what) in routing.items():
        if getattr(a, key) != want:
            raise ForjaError(f"a DeepSeek-V3 with {key}={getattr(a, key)!r} has no DeepseekV3ForCausalLM "
                             f"equivalent in transformers (it routes with {what}); export one with {key}={want!r}")
    if a.qk_norm or a.sliding_window is not None or (a.n_experts and a.n_shared_experts < 1):
        raise ForjaError("a DeepSeek-V3 with qk_norm, sliding_window or no shared expert has no "
                         "DeepseekV3ForCausalLM equivalent in transformers; export a model without them")
    cfg = {
        "architectures": list(ARCHITECTURES), "model_type": "deepseek_v3",
        "vocab_size": a.vocab_size, "hidden_size": a.dim, "intermediate_size": a.ffn_dim,
        "num_hidden_layers": a.n_layers, "num_attention_heads": a.n_heads, "num_key_value_heads": a.n_heads,
        "max_position_embeddings": a.max_seq_len, "rms_norm_eps": a.norm_eps,
        "tie_word_embeddings": a.tie_embeddings, "hidden_act": "silu", "attention_bias": False,
        "q_lora_rank": a.q_lora_rank or None, "kv_lora_rank": a.kv_lora_rank,
        "qk_nope_head_dim": a.qk_nope_head_dim, "qk_rope_head_dim": a.qk_rope_head_dim,
        "v_head_dim": a.v_head_dim, "rope_interleave": True,
        # A dense forja model (n_experts = 0) is one whose every block is "first_k_dense".
        "first_k_dense_replace": a.n_dense_layers if a.n_experts else a.n_layers,
        "n_routed_experts": a.n_experts or 1, "num_experts_per_tok": a.top_k,
        "moe_intermediate_size": a.moe_ffn_dim or 1, "n_shared_experts": a.n_shared_experts or 1,
        "routed_scaling_factor": a.route_scale, "norm_topk_prob": a.norm_topk_prob,
        "n_group": a.n_expert_groups, "topk_group": a.topk_groups,
        "topk_method": "noaux_tc", "scoring_func": "sigmoid", "num_nextn_predict_layers": a.mtp_depth,
        # The 4.x dialect, as DeepSeek's checkpoints write it; 5.x reads it too.
        "rope_theta": a.rope_theta, "rope_scaling": None,
    }
    if isinstance(a.rope_scaling, (RopeScaling, LinearScaling)):
        cfg["rope_scaling"] = rope_scaling_to_hf(a.rope_scaling)
    elif a.rope_scaling is not None:
        s = a.rope_scaling
        cfg["rope_scaling"] = {"rope_type": "yarn", "factor": s.factor,
                               "original_max_position_embeddings": s.original_max_seq_len,
                               "beta_fast": s.beta_fast, "beta_slow": s.beta_slow, "mscale": s.mscale,
                               "mscale_all_dim": s.mscale_all_dim}
        if not s.truncate:
            cfg["rope_scaling"]["truncate"] = False
        if s.attention_factor is not None:
            cfg["rope_scaling"]["attention_factor"] = s.attention_factor
    return cfg


def held_args(a: DeepSeekV3Args, names: set[str]) -> DeepSeekV3Args:
    """`a` without MTP modules when the checkpoint holds none: transformers writes
    num_nextn_predict_layers = 1 by default and saves no MTP layer. When the first module's
    projection is stored the count holds, and a missing tensor of it is reported by name."""
    if a.mtp_depth and f"model.layers.{a.n_layers}.eh_proj.weight" not in names:
        return dataclasses.replace(a, mtp_depth=0)
    return a


def _row_order(before: int, rope_dim: int, to_hf: bool) -> torch.Tensor:
    """Row order of a block of `before` unrotated rows then `rope_dim` rotated ones: forja's
    row j is DeepSeek's row halves[j] (halves = 0, 2, 4, ..., 1, 3, 5, ...)."""
    halves = torch.cat([torch.arange(0, rope_dim, 2), torch.arange(1, rope_dim, 2)])
    rope = torch.argsort(halves) if to_hf else halves
    return torch.cat([torch.arange(before), before + rope])


def _permute_rows(block: int, before: int, rope_dim: int, to_hf: bool):
    """A transform reordering the rope rows of every `block` rows of a (rows, in) weight."""
    order = _row_order(before, rope_dim, to_hf)

    def permute(t: torch.Tensor) -> torch.Tensor:
        return t.view(-1, block, t.shape[-1])[:, order.to(t.device)].reshape(t.shape)

    return permute


def _rope_rule(hf: str, forja: str, block: int, before: int, rope_dim: int) -> TensorRule:
    to_forja, to_hf = (_permute_rows(block, before, rope_dim, d) for d in (False, True))
    return TensorRule(hf, (forja,), to_forja=lambda t: (to_forja(t),), to_hf=lambda ts: to_hf(ts[0]))


def _attention_rules(a: DeepSeekV3Args, hf: str, ours: str) -> list[TensorRule]:
    qk = a.qk_nope_head_dim + a.qk_rope_head_dim
    q_rows = dict(block=qk, before=a.qk_nope_head_dim, rope_dim=a.qk_rope_head_dim)
    if a.q_lora_rank:
        out = [TensorRule(hf + "q_a_proj.weight", (ours + "wq_a.weight",)),
               TensorRule(hf + "q_a_layernorm.weight", (ours + "q_norm.weight",)),
               _rope_rule(hf + "q_b_proj.weight", ours + "wq_b.weight", **q_rows)]
    else:
        out = [_rope_rule(hf + "q_proj.weight", ours + "wq.weight", **q_rows)]
    return out + [
        _rope_rule(hf + "kv_a_proj_with_mqa.weight", ours + "wkv_a.weight", block=a.kv_lora_rank + a.qk_rope_head_dim,
                   before=a.kv_lora_rank, rope_dim=a.qk_rope_head_dim),
        TensorRule(hf + "kv_a_layernorm.weight", (ours + "kv_norm.weight",)),
        TensorRule(hf + "kv_b_proj.weight", (ours + "wkv_b.weight",)),
        TensorRule(hf + "o_proj.weight", (ours + "wo.weight",)),
    ]


_ROUTER = (("gate.weight", "router.gate.weight"), ("gate.e_score_correction_bias", "router.expert_bias"))


def _block_rules(a: DeepSeekV3Args, i: int, hf: str, ours: str, fused_experts: bool) -> list[TensorRule]:
    """Decoder layer i's tensors, under the prefixes `hf` ("model.layers.{i}.") and `ours`."""
    out = hf_rules.renamed(hf_rules.NORM_PAIRS["pre"], hf, ours)
    out += _attention_rules(a, hf + "self_attn.", ours + "attention.")
    if not a.is_moe_layer(i):
        return out + hf_rules.renamed(hf_rules.MLP_PAIRS, hf, ours)
    hf, ours = hf + "mlp.", ours + "feed_forward."
    out += hf_rules.renamed(_ROUTER, hf, ours) + hf_rules.renamed(hf_rules.SWIGLU_PAIRS, hf + "shared_experts.",
                                                                 ours + "shared_experts.")
    return out + hf_rules.expert_rules(a, hf, ours, fused=fused_experts)


def _mtp_copies(a: DeepSeekV3Args) -> list[TensorRule]:
    """Each MTP layer's copies of the shared embedding and output head. Listed before the main
    model's tensors, so that loading reads the main ones last and they win."""
    head = "tok_embeddings.weight" if a.tie_embeddings else "output.weight"
    out = []
    for i in range(a.n_layers, a.n_layers + a.mtp_depth):
        out += [TensorRule(f"model.layers.{i}.embed_tokens.weight", ("tok_embeddings.weight",)),
                TensorRule(f"model.layers.{i}.shared_head.head.weight", (head,))]
    return out


def _mtp_rules(a: DeepSeekV3Args, fused_experts: bool) -> list[TensorRule]:
    """The MTP layers' own tensors (forja/models/common/mtp.py's MTPModule), numbered after the main layers."""
    out = []
    for i in range(a.n_layers, a.n_layers + a.mtp_depth):
        hf, ours = f"model.layers.{i}.", f"mtp.layers.{i}."
        out += [TensorRule(hf + "enorm.weight", (ours + "enorm.weight",)),
                TensorRule(hf + "hnorm.weight", (ours + "hnorm.weight",)),
                TensorRule(hf + "eh_proj.weight", (ours + "proj.weight",)),
                TensorRule(hf + "shared_head.norm.weight", (ours + "norm.weight",))]
        out += _block_rules(a, i, hf, ours + "block.", fused_experts)
    return out


def _rules(a: DeepSeekV3Args, fused_experts: bool) -> list[TensorRule]:
    out = _mtp_copies(a) + [TensorRule("model.embed_tokens.weight", ("tok_embeddings.weight",)),
                            TensorRule("model.norm.weight", ("norm.weight",))]
    if not a.tie_embeddings:
        out.append(TensorRule("lm_head.weight", ("output.weight",)))
    for i in range(a.n_layers):  # layers differ (dense or experts): one set of rules each
        out += _block_rules(a, i, f"model.layers.{i}.", f"layers.{i}.", fused_experts)
    return out + _mtp_rules(a, fused_experts)


ADAPTER = HFAdapter(ARCHITECTURES, args_from_config, config_from_args, ignored=IGNORED,
                    **hf_rules.expert_layouts(_rules), held_args=held_args)
