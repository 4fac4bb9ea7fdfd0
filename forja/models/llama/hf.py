"""Hugging Face `LlamaForCausalLM` <-> forja Llama.

Reads both config.json dialects: transformers 4.x (`rope_theta` and `rope_scaling`,
as the published Llama 3 checkpoints have) and 5.x (`rope_parameters`). Both use
RoPE's rotate-half layout, as forja does, so q/k weights load unpermuted.
"""

from __future__ import annotations

from forja.errors import ForjaError
from forja.models.common.hf_rules import HFAdapter, TensorRule
from forja.models.common.rope import RopeScaling, YarnScaling, rope_scaling_from_hf, rope_scaling_to_hf
from forja.models.llama.model import LlamaArgs

ARCHITECTURES = ("LlamaForCausalLM",)
IGNORED: tuple[str, ...] = ()  # patterns of Hugging Face tensors forja does not need


def _rope(cfg: dict) -> tuple[float, RopeScaling | YarnScaling | None]:
    params = cfg.get("rope_parameters") or {}
    theta = params.get("rope_theta", cfg.get("rope_theta", 10_000.0))
    return float(theta), rope_scaling_from_hf(cfg.get("rope_scaling") or params, cfg.get("max_position_embeddings", 2048))


def args_from_config(cfg: dict) -> LlamaArgs:
    for key in ("attention_bias", "mlp_bias"):
        if cfg.get(key):
            raise ForjaError(f"config.json: {key}=true is not supported by forja's Llama (it has no biases)")
    if cfg.get("hidden_act", "silu") != "silu":
        raise ForjaError(f"config.json: hidden_act={cfg['hidden_act']!r} is not supported; Llama uses 'silu'")
    theta, scaling = _rope(cfg)
    return LlamaArgs(
        dim=cfg["hidden_size"],
        n_layers=cfg["num_hidden_layers"],
        n_heads=cfg["num_attention_heads"],
        n_kv_heads=cfg.get("num_key_value_heads") or cfg["num_attention_heads"],
        head_dim=cfg.get("head_dim"),
        ffn_dim=cfg["intermediate_size"],
        vocab_size=cfg["vocab_size"],
        max_seq_len=cfg.get("max_position_embeddings", 2048),
        norm_eps=cfg.get("rms_norm_eps", 1e-6),
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        rope_theta=theta,
        rope_scaling=scaling,
    )


def config_from_args(a: LlamaArgs) -> dict:
    if a.qk_norm or a.sliding_window is not None:
        raise ForjaError("a Llama with qk_norm or sliding_window has no LlamaForCausalLM equivalent in "
                         "transformers; export a model trained without them")
    cfg = {
        "architectures": list(ARCHITECTURES),
        "model_type": "llama",
        "hidden_size": a.dim,
        "num_hidden_layers": a.n_layers,
        "num_attention_heads": a.n_heads,
        "num_key_value_heads": a.n_kv_heads,
        "head_dim": a.head_dim,
        "intermediate_size": a.ffn_dim,
        "vocab_size": a.vocab_size,
        "max_position_embeddings": a.max_seq_len,
        "rms_norm_eps": a.norm_eps,
        "tie_word_embeddings": a.tie_embeddings,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        # The 4.x dialect: what published Llama 3 checkpoints use, and 5.x still reads.
        "rope_theta": a.rope_theta,
        "rope_scaling": None,
    }
    if a.rope_scaling is not None:
        cfg["rope_scaling"] = rope_scaling_to_hf(a.rope_scaling)
    return cfg


def rules(a: LlamaArgs) -> list[TensorRule]:
    layer = "model.layers.{i}."
    ours = "layers.{i}."
    pairs = [
        ("self_attn.q_proj.weight", "attention.wq.weight"),
        ("self_attn.k_proj.weight", "attention.wk.weight"),
        ("self_attn.v_proj.weight", "attention.wv.weight"),
        ("self_attn.o_proj.weight", "attention.wo.weight"),
        ("mlp.gate_proj.weight", "feed_forward.w1.weight"),
        ("mlp.up_proj.weight", "feed_forward.w3.weight"),
        ("mlp.down_proj.weight", "feed_forward.w2.weight"),
        ("input_layernorm.weight", "attention_norm.weight"),
        ("post_attention_layernorm.weight", "ffn_norm.weight"),
    ]
    out = [TensorRule("model.embed_tokens.weight", ("tok_embeddings.weight",)),
           TensorRule("model.norm.weight", ("norm.weight",))]
    out += [TensorRule(layer + hf, (ours + fj,)) for hf, fj in pairs]
    if not a.tie_embeddings:
        out.append(TensorRule("lm_head.weight", ("output.weight",)))
    return out


ADAPTER = HFAdapter(ARCHITECTURES, args_from_config, config_from_args, rules, IGNORED)
