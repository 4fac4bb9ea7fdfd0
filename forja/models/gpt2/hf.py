"""Hugging Face `GPT2LMHeadModel` <-> forja GPT-2.

GPT-2's checkpoints store projections as Conv1D, whose weight is (in, out): the
transpose of a Linear's. Its attention projection is one fused (dim, 3 * dim) c_attn,
split here into forja's wq, wk, wv.
"""

from __future__ import annotations

from forja.errors import ForjaError
from forja.models.common.hf_rules import HFAdapter, TensorRule, join3, split3, transposed, untransposed
from forja.models.gpt2.model import GPT2Args

ARCHITECTURES = ("GPT2LMHeadModel",)
# Causal-mask buffers that older transformers versions saved with the weights.
IGNORED = (r"(transformer\.)?h\.\d+\.attn\.(masked_)?bias",)
_GELUS = ("gelu_new", "gelu_pytorch_tanh")


def args_from_config(cfg: dict) -> GPT2Args:
    act = cfg.get("activation_function", "gelu_new")
    if act not in _GELUS:
        raise ForjaError(f"config.json: activation_function={act!r} is not supported; forja's GPT-2 uses "
                         f"the tanh GELU ({' or '.join(_GELUS)})")
    if cfg.get("scale_attn_by_inverse_layer_idx"):
        raise ForjaError("config.json: scale_attn_by_inverse_layer_idx=true is not supported by forja's GPT-2")
    dim = cfg["n_embd"]
    return GPT2Args(
        dim=dim,
        n_layers=cfg["n_layer"],
        n_heads=cfg["n_head"],
        ffn_dim=cfg.get("n_inner") or 4 * dim,
        vocab_size=cfg["vocab_size"],
        max_seq_len=cfg.get("n_positions", 1024),
        norm_eps=cfg.get("layer_norm_epsilon", 1e-5),
        tie_embeddings=bool(cfg.get("tie_word_embeddings", True)),
    )


def config_from_args(a: GPT2Args) -> dict:
    if a.qk_norm or not a.bias or a.n_kv_heads != a.n_heads or a.sliding_window is not None:
        raise ForjaError("this GPT-2 (qk_norm, no biases, grouped-query heads or a sliding window) has no "
                         "GPT2LMHeadModel equivalent in transformers; export one with the published GPT-2 options")
    return {
        "architectures": list(ARCHITECTURES),
        "model_type": "gpt2",
        "n_embd": a.dim,
        "n_layer": a.n_layers,
        "n_head": a.n_heads,
        "n_inner": a.ffn_dim,
        "vocab_size": a.vocab_size,
        "n_positions": a.max_seq_len,
        "n_ctx": a.max_seq_len,
        "layer_norm_epsilon": a.norm_eps,
        "activation_function": "gelu_new",
        "tie_word_embeddings": a.tie_embeddings,
    }


def normalize_name(name: str) -> str:
    """Checkpoints saved from a bare GPT2Model lack the "transformer." prefix."""
    if name.startswith(("h.", "wte.", "wpe.", "ln_f.")):
        return "transformer." + name
    return name


def rules(a: GPT2Args) -> list[TensorRule]:
    h, ours = "transformer.h.{i}.", "layers.{i}."
    conv = dict(to_forja=transposed, to_hf=untransposed)
    qkv = tuple(ours + f"attention.{w}." for w in ("wq", "wk", "wv"))
    out = [
        TensorRule("transformer.wte.weight", ("tok_embeddings.weight",)),
        TensorRule("transformer.wpe.weight", ("pos_embeddings.weight",)),
        TensorRule("transformer.ln_f.weight", ("norm.weight",)),
        TensorRule("transformer.ln_f.bias", ("norm.bias",)),
        TensorRule(h + "attn.c_attn.weight", tuple(p + "weight" for p in qkv), split3, join3),
        TensorRule(h + "attn.c_attn.bias", tuple(p + "bias" for p in qkv), split3, join3),
        TensorRule(h + "attn.c_proj.weight", (ours + "attention.wo.weight",), **conv),
        TensorRule(h + "attn.c_proj.bias", (ours + "attention.wo.bias",)),
        TensorRule(h + "mlp.c_fc.weight", (ours + "feed_forward.w1.weight",), **conv),
        TensorRule(h + "mlp.c_fc.bias", (ours + "feed_forward.w1.bias",)),
        TensorRule(h + "mlp.c_proj.weight", (ours + "feed_forward.w2.weight",), **conv),
        TensorRule(h + "mlp.c_proj.bias", (ours + "feed_forward.w2.bias",)),
    ]
    for hf_norm, our_norm in (("ln_1", "attention_norm"), ("ln_2", "ffn_norm")):
        out += [TensorRule(f"{h}{hf_norm}.{p}", (f"{ours}{our_norm}.{p}",)) for p in ("weight", "bias")]
    if not a.tie_embeddings:
        out.append(TensorRule("lm_head.weight", ("output.weight",)))
    return out


ADAPTER = HFAdapter(ARCHITECTURES, args_from_config, config_from_args, rules, IGNORED, normalize_name=normalize_name)
