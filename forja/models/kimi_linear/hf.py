"""Hugging Face `KimiLinearForCausalLM` <-> forja Kimi Linear.

config.json: the published checkpoints' keys (moonshotai/Kimi-Linear-48B-A3B-*: `num_experts`,
`num_experts_per_token`, `moe_renormalize`, `model_max_length`, the KDA blocks in
`linear_attn_config` {kda_layers, full_attn_layers (1-based), head_dim, num_heads,
short_conv_kernel_size}, `first_k_dense_replace`) and transformers' aliases and attributes
(`num_local_experts`, `num_experts_per_tok`, `norm_topk_prob`, `max_position_embeddings`,
`layer_types`, `mlp_layer_types`, `linear_head_dim`, ...), with transformers' precedence and
defaults. Keys transformers ignores are ignored too (the MLA is NoPE whatever `mla_use_nope`,
`rope_theta` or `rope_scaling` say; routing is by sigmoid scores whatever
`moe_router_activation_func` says). Refused: attention biases, another activation than SiLU,
no shared expert, a null v_head_dim. `num_key_value_heads` is read as transformers runs it:
the latent attention has a key and value per query head whatever it says; and
`tie_word_embeddings` too: transformers' KimiLinearForCausalLM never ties its output head.

Layouts: the published one, which forja writes (KDA's q_conv1d / k_conv1d / v_conv1d and its
forget gate's f_a_proj, f_b_proj, dt_bias, A_log under self_attn; mixtures of experts under
block_sparse_moe, one w1 / w2 / w3 per expert; dense MLPs under mlp); the same as
transformers' save_pretrained writes it (dense MLPs under block_sparse_moe too); and
transformers 5's module layout (one conv1d over q | k | v, the gate under
self_attn.forget_gate, mlp.experts.gate_up_proj / down_proj fused). All three are read.
A_log is stored (1, 1, H, 1) and kept (H,) here. The latent attention rotates nothing, so
its rows are read as stored (DeepSeek-V3's rope-row permutation does not apply).
"""

from __future__ import annotations

from forja.models.common import hf_rules
from forja.models.common.hf_rules import HFAdapter, TensorRule, renamed, split_rows
from forja.models.kimi_linear.model import KimiLinearArgs

ARCHITECTURES = ("KimiLinearForCausalLM",)
FAMILY = "Kimi Linear"
_refuse = hf_rules.refusal(FAMILY)


def _get(cfg: dict, names: tuple[str, ...], default):
    """The first of `names` config.json sets (not null), else `default`."""
    for name in names:
        if cfg.get(name) is not None:
            return cfg[name]
    return default


def _layer_types(cfg: dict, n_layers: int) -> tuple[str, ...]:
    """transformers' precedence: `layer_types`, then linear_attn_config's 1-based lists, then
    latent attention in every fourth block after the first."""
    linear = cfg.get("linear_attn_config") or {}
    if cfg.get("layer_types"):
        kinds = list(cfg["layer_types"])
    elif "full_attn_layers" in linear and "kda_layers" in linear:
        kinds = [None] * n_layers
        for i in linear["full_attn_layers"]:
            kinds[i - 1] = "full_attention"
        for i in linear["kda_layers"]:
            kinds[i - 1] = "linear_attention"
    else:
        kinds = ["full_attention" if i and i % 4 == 0 else "linear_attention" for i in range(n_layers)]
    bad = [k for k in kinds if k not in ("full_attention", "linear_attention")]
    if bad or len(kinds) != n_layers:
        raise _refuse("layer_types", bad[0] if bad else kinds, "each of num_hidden_layers blocks is "
                      "'full_attention' or 'linear_attention'")
    return tuple(kinds)


def _dense_layers(cfg: dict, n_layers: int) -> tuple[int, ...]:
    kinds = cfg.get("mlp_layer_types")
    if not kinds:
        first = cfg.get("first_k_dense_replace", 1)
        return tuple(range(min(first, n_layers)))
    bad = [k for k in kinds if k not in ("dense", "sparse")]
    if bad:
        raise _refuse("mlp_layer_types", bad[0], "each block's MLP is 'dense' or 'sparse'")
    return tuple(i for i, kind in enumerate(kinds) if kind == "dense")


def _check_supported(cfg: dict) -> None:
    unsupported = hf_rules.Unsupported
    hf_rules.check_config(cfg, [
        hf_rules.no_attention_bias("forja's latent attention has no biases"),
        hf_rules.activation("silu", "Kimi Linear's experts, MLPs and convolutions use 'silu'"),
        unsupported("v_head_dim", lambda v: v is not None and v > 0, "set the value width", default=128),
        unsupported("num_shared_experts", lambda v: v is None or v > 0,
                    "forja's mixture has at least one shared expert here", default=1),
        unsupported("n_shared_experts", lambda v: v is None or v > 0,
                    "forja's mixture has at least one shared expert here", default=None),
    ], _refuse)


def args_from_config(cfg: dict) -> KimiLinearArgs:
    _check_supported(cfg)
    n_layers = cfg.get("num_hidden_layers", 27)
    linear = cfg.get("linear_attn_config") or {}
    return KimiLinearArgs(
        dim=cfg.get("hidden_size", 2304), n_layers=n_layers, n_heads=cfg.get("num_attention_heads", 32),
        ffn_dim=cfg.get("intermediate_size", 9216), vocab_size=cfg.get("vocab_size", 163_840),
        max_seq_len=_get(cfg, ("model_max_length", "max_position_embeddings"), 1_048_576),
        norm_eps=cfg.get("rms_norm_eps", 1e-5), tie_embeddings=False,  # transformers never ties Kimi's head
        layer_types=_layer_types(cfg, n_layers), dense_layers=_dense_layers(cfg, n_layers),
        q_lora_rank=cfg.get("q_lora_rank") or 0, kv_lora_rank=cfg.get("kv_lora_rank", 512),
        qk_nope_head_dim=cfg.get("qk_nope_head_dim", 128), qk_rope_head_dim=cfg.get("qk_rope_head_dim", 64),
        v_head_dim=cfg.get("v_head_dim", 128),
        linear_n_heads=linear.get("num_heads", cfg.get("linear_num_heads", 32)),
        linear_head_dim=linear.get("head_dim", cfg.get("linear_head_dim", 128)),
        linear_conv_kernel=linear.get("short_conv_kernel_size", cfg.get("linear_conv_kernel_dim", 4)),
        n_experts=_get(cfg, ("num_experts", "num_local_experts"), 256),
        top_k=_get(cfg, ("num_experts_per_token", "num_experts_per_tok"), 8),
        moe_ffn_dim=cfg.get("moe_intermediate_size", 1024),
        n_shared_experts=_get(cfg, ("num_shared_experts", "n_shared_experts"), 1),
        score_func="sigmoid", expert_bias=True, group_score="top2_sum",
        norm_topk_prob=bool(_get(cfg, ("moe_renormalize", "norm_topk_prob"), True)),
        route_scale=float(cfg.get("routed_scaling_factor", 2.446)),
        n_expert_groups=_get(cfg, ("num_expert_group", "n_group"), 1), topk_groups=cfg.get("topk_group") or 1,
    )


def config_from_args(a: KimiLinearArgs) -> dict:
    hf_rules.check_exportable(a, "a Kimi Linear", {
        "score_func": (a.score_func != "sigmoid", "its router scores by sigmoids"),
        "expert_bias": (not a.expert_bias, "its router has the balancing bias"),
        "group_score": (a.group_score != "top2_sum", "its groups score by their two best experts"),
        "n_shared_experts": (a.n_shared_experts < 1 or a.shared_ffn_dim not in (0, a.shared_width),
                             "it has whole shared experts"),
        "n_experts": (a.n_experts < 1, "its sparse blocks are a mixture of experts"),
        "tie_embeddings": (a.tie_embeddings, "its output head is never tied to the embedding"),
        "qk_norm": (a.qk_norm, "its attention has no QK-norm"),
        "attention_sinks": (a.attention_sinks, "its attention has no sinks"),
        "sliding_window": (a.sliding_window is not None, "its attention sees every position"),
    })
    full = [i + 1 for i, kind in enumerate(a.layer_types) if kind == "full_attention"]
    kda = [i + 1 for i, kind in enumerate(a.layer_types) if kind == "linear_attention"]
    cfg = {
        "architectures": list(ARCHITECTURES), "model_type": "kimi_linear",
        "vocab_size": a.vocab_size, "hidden_size": a.dim, "intermediate_size": a.ffn_dim,
        "moe_intermediate_size": a.moe_ffn_dim, "num_hidden_layers": a.n_layers, "num_attention_heads": a.n_heads,
        "num_key_value_heads": a.n_heads, "model_max_length": a.max_seq_len, "rms_norm_eps": a.norm_eps,
        "tie_word_embeddings": False, "pad_token_id": None, "hidden_act": "silu", "attention_bias": False,
        "q_lora_rank": a.q_lora_rank or None, "kv_lora_rank": a.kv_lora_rank,
        "qk_nope_head_dim": a.qk_nope_head_dim, "qk_rope_head_dim": a.qk_rope_head_dim, "v_head_dim": a.v_head_dim,
        "mla_use_nope": True,
        "linear_attn_config": {"full_attn_layers": full, "kda_layers": kda, "head_dim": a.linear_head_dim,
                               "num_heads": a.linear_n_heads, "short_conv_kernel_size": a.linear_conv_kernel},
        "mlp_layer_types": ["dense" if i in a.dense_layers else "sparse" for i in range(a.n_layers)],
        "num_experts": a.n_experts, "num_experts_per_token": a.top_k, "num_shared_experts": a.n_shared_experts,
        "moe_renormalize": a.norm_topk_prob, "routed_scaling_factor": a.route_scale,
        "num_expert_group": a.n_expert_groups, "topk_group": a.topk_groups, "moe_router_activation_func": "sigmoid",
    }
    if a.dense_layers == tuple(range(len(a.dense_layers))):  # the published key, for the original code
        cfg["first_k_dense_replace"] = len(a.dense_layers)
    return cfg


# -- tensors ---------------------------------------------------------------------------------
def _a_log_to_forja(t):
    return (t.reshape(-1).contiguous(),)


def _a_log_to_hf(ts):
    return ts[0].reshape(1, 1, -1, 1).contiguous()


_KDA_PAIRS = (("q_proj.weight", "wq.weight"), ("k_proj.weight", "wk.weight"), ("v_proj.weight", "wv.weight"),
              ("b_proj.weight", "wb.weight"), ("g_a_proj.weight", "wg_a.weight"), ("g_b_proj.weight", "wg_b.weight"),
              ("o_norm.weight", "norm.weight"), ("o_proj.weight", "wo.weight"))
_GATE_PAIRS = (("f_a_proj.weight", "wf_a.weight"), ("f_b_proj.weight", "wf_b.weight"), ("dt_bias", "dt_bias"))


def _kda_rules(a: KimiLinearArgs, hf: str, ours: str, fused: bool) -> list[TensorRule]:
    """A KDA block's tensors: published (fused False) or transformers' module layout."""
    gate = hf + ("forget_gate." if fused else "")
    out = renamed(_KDA_PAIRS, hf, ours) + renamed(_GATE_PAIRS, gate, ours)
    out.append(TensorRule(gate + "A_log", (ours + "A_log",), to_forja=_a_log_to_forja, to_hf=_a_log_to_hf))
    convs = tuple(ours + f"conv_{p}.weight" for p in "qkv")
    if fused:
        width = a.linear_n_heads * a.linear_head_dim
        to_forja, to_hf = split_rows([width] * 3)
        return out + [TensorRule(hf + "conv1d.weight", convs, to_forja=to_forja, to_hf=to_hf)]
    return out + [TensorRule(hf + f"{p}_conv1d.weight", (conv,)) for p, conv in zip("qkv", convs)]


def _mla_rules(a: KimiLinearArgs, hf: str, ours: str) -> list[TensorRule]:
    if a.q_lora_rank:
        pairs = [("q_a_proj.weight", "wq_a.weight"), ("q_a_layernorm.weight", "q_norm.weight"),
                 ("q_b_proj.weight", "wq_b.weight")]
    else:
        pairs = [("q_proj.weight", "wq.weight")]
    pairs += [("kv_a_proj_with_mqa.weight", "wkv_a.weight"), ("kv_a_layernorm.weight", "kv_norm.weight"),
              ("kv_b_proj.weight", "wkv_b.weight"), ("o_proj.weight", "wo.weight")]
    return renamed(pairs, hf, ours)


_ROUTER = (("gate.weight", "router.gate.weight"), ("gate.e_score_correction_bias", "router.expert_bias"))
_EXPERT_NAMES = (("w1", "w1"), ("w3", "w3"), ("w2", "w2"))


def _block_rules(a: KimiLinearArgs, i: int, fused: bool, dense: str) -> list[TensorRule]:
    """Block i's tensors; `dense`: the prefix of a dense block's MLP ("mlp.", or "block_sparse_moe."
    where transformers' save_pretrained renames every mlp)."""
    hf, ours = f"model.layers.{i}.", f"layers.{i}."
    out = renamed(hf_rules.NORM_PAIRS["pre"], hf, ours)
    if a.layer_type(i) == "linear_attention":
        out += _kda_rules(a, hf + "self_attn.", ours + "attention.", fused)
    else:
        out += _mla_rules(a, hf + "self_attn.", ours + "attention.")
    if not a.is_moe_layer(i):
        return out + renamed(hf_rules.SWIGLU_PAIRS, hf + dense, ours + "feed_forward.")
    hf, ours = hf + ("mlp." if fused else "block_sparse_moe."), ours + "feed_forward."
    out += renamed(_ROUTER, hf, ours) + renamed(hf_rules.SWIGLU_PAIRS, hf + "shared_experts.", ours + "shared_experts.")
    return out + hf_rules.expert_rules(a, hf, ours, fused=fused, names=_EXPERT_NAMES)


def _rules(a: KimiLinearArgs, fused: bool, dense: str = "mlp.") -> list[TensorRule]:
    return hf_rules.decoder_rules(a, lambda i: _block_rules(a, i, fused, dense))


ADAPTER = HFAdapter(ARCHITECTURES, args_from_config, config_from_args, rules=lambda a: _rules(a, False),
                    other_layouts=lambda a: [_rules(a, False, "block_sparse_moe."), _rules(a, True)])

