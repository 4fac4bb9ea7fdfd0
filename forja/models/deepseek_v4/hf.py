"""Hugging Face `DeepseekV4ForCausalLM` (transformers 5.25) <-> forja DeepSeek-V4.

Config: every key transformers' DeepseekV4Config reads, with its defaults for absent ones
(V4-Flash's shapes), and its legacy spellings (`compress_ratios`, `compress_rate_csa/hca`,
`num_hash_layers`, `qk_rope_head_dim`). Two rotary tables: "main" (sliding blocks, plain
RoPE of base `rope_theta`) and "compress" (compressed blocks, base `compress_rope_theta`,
optionally scaled: YaRN with its attention factor 1, linear or llama3), both over the last
head_dim x partial_rotary_factor channels; config.json names them either nested
(rope_parameters.main / .compress, as transformers writes) or flat (the scaling keys alone,
which go to "compress"). transformers truncates YaRN's ramp whatever `truncate` says, and so
does forja. Refused, naming the key: quantized weights (FP8/FP4 checkpoints: convert to bf16
first), another activation, MLP biases, a main table other than plain RoPE, a YaRN attention
factor other than 1, per-table rotary widths that differ, hash-routed blocks after top-k ones.
Keys transformers builds nothing from are ignored: num_key_value_heads (one shared key/value
head always), n_shared_experts (one shared expert always), norm_topk_prob (always
renormalized), attention_bias, router_jitter_noise and the aux-loss keys.

Multi-token prediction: `num_nextn_predict_layers` = D builds D modules (forja's own; the
release holds one, transformers none) from DeepSeek's release names "mtp.{k}." (e_proj,
h_proj, enorm, hnorm, norm, hc_head_{fn,base,scale}, and a block's tensors named as the main
layers' are in DeepSeek's spelling, each expert apart), and forja saves them so. transformers
skips every `mtp.*` tensor, so it reads forja's save as the main model. A checkpoint whose
config says D but holds no `mtp.0.e_proj.weight` (transformers' own saves) loads with none.

Layouts: forja writes what transformers' save_pretrained writes (DeepSeek's own names under
"model.layers.{i}.": attn.wq_a, ffn.experts.{e}.w1, hc_attn_fn, ...; "head.weight"), and
reads that, transformers' module names (`save_original_format=False`: self_attn.q_a_proj,
mlp.experts.gate_up_proj fused, ...) and DeepSeek's release names without the "model."
prefix (embed.weight, layers.{i}.*, hc_head_fn).
"""

from __future__ import annotations

import dataclasses
import re

from forja.errors import ForjaError
from forja.models.common import hf_rules
from forja.models.common.hf_rules import HFAdapter, TensorRule
from forja.models.common.rope import LinearScaling, RopeScaling, YarnScaling, rope_scaling_from_hf, rope_scaling_to_hf
from forja.models.deepseek_v4.model import DeepSeekV4Args

ARCHITECTURES = ("DeepseekV4ForCausalLM",)
IGNORED = (r"mtp\..*",)  # multi-token prediction modules the args do not hold (num_nextn_predict_layers = 0)
CSA, HCA, SLIDING = "compressed_sparse_attention", "heavily_compressed_attention", "sliding_attention"
_RATIO_KIND = {0: SLIDING, 4: CSA, 128: HCA}  # transformers' legacy `compress_ratios` values


def _refuse(key: str, value, why: str) -> ForjaError:
    return ForjaError(f"config.json: {key}={value!r} is not supported; {why}")


def _get(cfg: dict, key: str, default):
    value = cfg.get(key)
    return default if value is None else value


def _layer_types(cfg: dict, n: int) -> tuple[tuple[str, ...], int]:
    """(attention kinds, hash-routed blocks) as transformers derives them."""
    kinds = cfg.get("layer_types")
    if kinds is None and cfg.get("compress_ratios") is not None:
        kinds = [_RATIO_KIND[r] for r in cfg["compress_ratios"]]
    if kinds is None:
        kinds = [HCA] * min(n, 2) + [CSA if i % 2 else HCA for i in range(max(n - 2, 0))]
    mlp = cfg.get("mlp_layer_types")
    if mlp is None:
        mlp = ["hash_moe"] * min(n, _get(cfg, "num_hash_layers", 3)) + ["moe"] * n
    mlp = list(mlp[:n])
    n_hash = mlp.count("hash_moe")
    if mlp[:n_hash] != ["hash_moe"] * n_hash:
        raise _refuse("mlp_layer_types", mlp, "forja's DeepSeek-V4 routes the first blocks by hash and the rest by "
                      "top-k; list every 'hash_moe' before every 'moe'")
    return tuple(kinds[:n]), n_hash


def _rope_tables(cfg: dict, factor: float) -> tuple[dict, dict]:
    """(main, compress) rotary dicts as transformers' DeepseekV4Config builds them."""
    rp = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if isinstance(rp.get("main"), dict) and isinstance(rp.get("compress"), dict):
        return rp["main"], rp["compress"]
    main = {"rope_type": "default", "rope_theta": _get(cfg, "rope_theta", 10_000.0), "partial_rotary_factor": factor}
    compress = {**{k: v for k, v in rp.items() if k not in ("main", "compress")},
                "rope_theta": _get(cfg, "compress_rope_theta", 160_000.0), "partial_rotary_factor": factor}
    compress.setdefault("rope_type", compress.pop("type", "default"))
    if compress["rope_type"] == "yarn":
        compress.setdefault("attention_factor", 1.0)
    return main, compress


def _rope(cfg: dict, head_dim: int, factor: float) -> dict:
    """The args' rotary fields: rope_dim, both bases, the compressed table's scaling."""
    main, compress = _rope_tables(cfg, factor)
    kind = main.get("rope_type", main.get("type", "default"))
    if kind != "default":
        raise _refuse("rope_parameters.main.rope_type", kind, "sliding blocks rotate by plain RoPE here ('default')")
    widths = {int(head_dim * t.get("partial_rotary_factor", 1.0)) for t in (main, compress)}
    if widths != {int(head_dim * factor)}:
        raise _refuse("rope_parameters.*.partial_rotary_factor", sorted(widths), "both rotary tables must turn the "
                      "qk_rope_head_dim channels (partial_rotary_factor x head_dim)")
    max_len = _get(cfg, "max_position_embeddings", 1_048_576)
    kind = compress.get("rope_type", compress.get("type", "default"))
    scaling = rope_scaling_from_hf(compress, max_len)
    if kind == "yarn":
        if compress.get("attention_factor") != 1.0:
            raise _refuse("rope_parameters.compress.attention_factor", compress.get("attention_factor"),
                          "forja's compressed blocks keep cos and sin unscaled; set it to 1.0")
        scaling = YarnScaling(factor=scaling.factor, original_max_seq_len=scaling.original_max_seq_len,
                              beta_fast=scaling.beta_fast, beta_slow=scaling.beta_slow, attention_factor=1.0)
    return dict(rope_dim=int(head_dim * factor), rope_theta=float(main.get("rope_theta", 10_000.0)),
                compress_rope_theta=float(compress["rope_theta"]), rope_scaling=scaling)


def _check_supported(cfg: dict) -> None:
    if cfg.get("quantization_config"):
        method = cfg["quantization_config"].get("quant_method", "?")
        raise _refuse("quantization_config.quant_method", method, "convert DeepSeek-V4's FP8/FP4 weights to bf16 first")
    hf_rules.check_config(cfg, [
        hf_rules.activation("silu", "DeepSeek-V4's experts are (limited) SwiGLUs"),
        hf_rules.Unsupported("mlp_bias", lambda v: not v, "DeepSeek-V4's experts here have no biases", default=False),
    ], _refuse)


def _check_mtp(cfg: dict, n: int) -> None:
    """The release lists its MTP layer's ratio after the main layers' (`compress_ratios`, 0:
    sliding-window only, the one kind forja builds such a module with)."""
    depth = _get(cfg, "num_nextn_predict_layers", 0)
    extra = list(cfg.get("compress_ratios") or [])[n:n + depth]
    if any(r != 0 for r in extra):
        raise _refuse("compress_ratios", extra, "forja's DeepSeek-V4 multi-token prediction modules attend "
                      "within the sliding window only (ratio 0)")


def args_from_config(cfg: dict) -> DeepSeekV4Args:
    _check_supported(cfg)
    n, head_dim = cfg.get("num_hidden_layers", 43), _get(cfg, "head_dim", 512)
    _check_mtp(cfg, n)
    kinds, n_hash = _layer_types(cfg, n)
    factor = cfg.get("partial_rotary_factor")
    if factor is None:
        factor = cfg["qk_rope_head_dim"] / head_dim if cfg.get("qk_rope_head_dim") else 64 / 512
    rates = {CSA: 4, HCA: 128, **(cfg.get("compress_rates") or {})}
    rates[CSA], rates[HCA] = _get(cfg, "compress_rate_csa", rates[CSA]), _get(cfg, "compress_rate_hca", rates[HCA])
    width = _get(cfg, "moe_intermediate_size", _get(cfg, "intermediate_size", 2048))
    g = lambda key, default: _get(cfg, key, default)  # noqa: E731
    return DeepSeekV4Args(
        dim=g("hidden_size", 4096), n_layers=n, n_heads=g("num_attention_heads", 64), head_dim=head_dim,
        ffn_dim=width, moe_ffn_dim=width, vocab_size=g("vocab_size", 129_280),
        max_seq_len=g("max_position_embeddings", 1_048_576), norm_eps=g("rms_norm_eps", 1e-6),
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)), sliding_window=g("sliding_window", 128),
        layer_types=kinds, q_lora_rank=g("q_lora_rank", 1024), **_rope(cfg, head_dim, factor),
        csa_ratio=rates[CSA], hca_ratio=rates[HCA], o_groups=g("o_groups", 8), o_lora_rank=g("o_lora_rank", 1024),
        index_n_heads=g("index_n_heads", 64), index_head_dim=g("index_head_dim", 128),
        index_topk=g("index_topk", 512), hc_mult=g("hc_mult", 4), hc_sinkhorn_iters=g("hc_sinkhorn_iters", 20),
        hc_eps=float(g("hc_eps", 1e-6)), n_hash_layers=n_hash,
        n_experts=g("n_routed_experts", g("num_local_experts", 256)), top_k=g("num_experts_per_tok", 6),
        n_shared_experts=1, score_func=g("scoring_func", "sqrtsoftplus"),
        route_scale=float(g("routed_scaling_factor", 1.5)), expert_bias=True,
        swiglu_limit=float(g("swiglu_limit", 10.0)), mtp_depth=g("num_nextn_predict_layers", 0))


def _rope_config(a: DeepSeekV4Args) -> dict:
    factor = a.rope_dim / a.head_dim
    if int(a.head_dim * factor) != a.rope_dim:
        raise ForjaError(f"a DeepSeek-V4 with rope_dim={a.rope_dim} of head_dim={a.head_dim} has no exact "
                         "partial_rotary_factor in transformers; export one whose rope_dim divides evenly")
    main = {"rope_type": "default", "rope_theta": a.rope_theta, "partial_rotary_factor": factor}
    compress = {"rope_type": "default", "rope_theta": a.compress_rope_theta, "partial_rotary_factor": factor}
    s = a.rope_scaling
    if isinstance(s, (LinearScaling, RopeScaling)):
        compress.update(rope_scaling_to_hf(s))
    elif s is not None:
        compress.update(rope_type="yarn", factor=s.factor, original_max_position_embeddings=s.original_max_seq_len,
                        beta_fast=s.beta_fast, beta_slow=s.beta_slow, attention_factor=1.0)
    return {"rope_theta": a.rope_theta, "compress_rope_theta": a.compress_rope_theta, "partial_rotary_factor": factor,
            "rope_parameters": {"main": main, "compress": compress}}


def config_from_args(a: DeepSeekV4Args) -> dict:
    hf_rules.check_exportable(a, "a DeepSeek-V4", {
        "n_shared_experts": (a.n_shared_experts != 1 or a.shared_width != a.moe_ffn_dim,
                             "transformers builds one shared expert as wide as a routed one"),
        "expert_bias": (not a.expert_bias, "its top-k routers always hold the balancing bias"),
        "n_expert_groups": (a.n_expert_groups != 1, "it routes without expert groups"),
        "qk_norm": (a.qk_norm, "it has no such norm"),
    })
    hash_types = ["hash_moe"] * min(a.n_hash_layers, a.n_layers)
    return {
        "architectures": list(ARCHITECTURES), "model_type": "deepseek_v4",
        "vocab_size": a.vocab_size, "hidden_size": a.dim, "moe_intermediate_size": a.moe_ffn_dim,
        "num_hidden_layers": a.n_layers, "num_attention_heads": a.n_heads, "num_key_value_heads": 1,
        "head_dim": a.head_dim, "q_lora_rank": a.q_lora_rank, "max_position_embeddings": a.max_seq_len,
        "rms_norm_eps": a.norm_eps, "tie_word_embeddings": a.tie_embeddings, "hidden_act": "silu",
        "sliding_window": a.sliding_window, "layer_types": list(a.layer_types),
        "mlp_layer_types": hash_types + ["moe"] * (a.n_layers - len(hash_types)),
        "compress_rates": {CSA: a.csa_ratio, HCA: a.hca_ratio}, **_rope_config(a),
        "o_groups": a.o_groups, "o_lora_rank": a.o_lora_rank, "index_n_heads": a.index_n_heads,
        "index_head_dim": a.index_head_dim, "index_topk": a.index_topk, "hc_mult": a.hc_mult,
        "hc_sinkhorn_iters": a.hc_sinkhorn_iters, "hc_eps": a.hc_eps, "n_routed_experts": a.n_experts,
        "num_experts_per_tok": a.top_k, "n_shared_experts": 1, "scoring_func": a.score_func,
        "norm_topk_prob": True, "routed_scaling_factor": a.route_scale, "swiglu_limit": a.swiglu_limit,
        "num_nextn_predict_layers": a.mtp_depth, "bos_token_id": None, "eos_token_id": None,
    }


# (forja name under "attention.", DeepSeek's under "attn.", transformers' module's under "self_attn.")
_ATTENTION = (("sinks", "attn_sink", "sinks"), ("wq_a.weight", "wq_a.weight", "q_a_proj.weight"),
              ("q_norm.weight", "q_norm.weight", "q_a_norm.weight"), ("wq_b.weight", "wq_b.weight", "q_b_proj.weight"),
              ("wkv.weight", "wkv.weight", "kv_proj.weight"), ("kv_norm.weight", "norm.weight", "kv_norm.weight"),
              ("wo.wo_a", "wo_a.weight", "o_a_proj.weight"), ("wo.wo_b.weight", "wo_b.weight", "o_b_proj.weight"))
_COMPRESSOR = (("position_bias", "ape", "position_bias"), ("norm.weight", "norm.weight", "kv_norm.weight"),
               ("wgate.weight", "wgate.weight", "gate_proj.weight"), ("wkv.weight", "wkv.weight", "kv_proj.weight"))
_INDEXER = (("wq_b.weight", "indexer.wq_b.weight", "compressor.indexer.q_b_proj.weight"),
            ("weights_proj.weight", "indexer.weights_proj.weight", "compressor.indexer.scorer.weights_proj.weight"))


def _attention_rules(a: DeepSeekV4Args, i: int, fused: bool, hf: str, ours: str) -> list[TensorRule]:
    kind = a.layer_type(i)
    hf, ours = hf + ("self_attn." if fused else "attn."), ours + "attention."
    pairs = [(f, h if fused else d) for f, d, h in _ATTENTION]
    if kind != SLIDING:
        pairs += [("compressor." + f, "compressor." + (h if fused else d)) for f, d, h in _COMPRESSOR]
    if kind == CSA:
        inner = "compressor.indexer." if fused else "indexer.compressor."
        pairs += [("indexer.compressor." + f, inner + (h if fused else d)) for f, d, h in _COMPRESSOR]
        pairs += [("indexer." + f, h if fused else d) for f, d, h in _INDEXER]
    return [TensorRule(hf + h, (ours + f,)) for f, h in pairs]


def _block_rules(a: DeepSeekV4Args, i: int, fused: bool, hf: str, ours: str) -> list[TensorRule]:
    """Block i's tensors under the prefixes `hf` ("model.layers.{i}.") and `ours` ("layers.{i}.")."""
    if fused:
        pairs = [("input_layernorm.weight", "attention_norm.weight"), ("post_attention_layernorm.weight",
                 "ffn_norm.weight")] + [(f"{s}_hc.{p}", f"{s}_hc.{p}") for s in ("attn", "ffn") for p in ("fn", "base",
                                                                                                        "scale")]
        ffn, gate = hf + "mlp.", [("gate.weight", "router.gate.weight")]
        gate += [("gate.tid2eid", "router.tid2eid")] if i < a.n_hash_layers else \
            [("gate.e_score_correction_bias", "router.expert_bias")]
        shared = [(f"shared_experts.{h}", f"shared_experts.{f}") for h, f in hf_rules.SWIGLU_PAIRS]
    else:
        pairs = [("attn_norm.weight", "attention_norm.weight"), ("ffn_norm.weight", "ffn_norm.weight")]
        pairs += [(f"hc_{s}_{p}", f"{s}_hc.{p}") for s in ("attn", "ffn") for p in ("fn", "base", "scale")]
        ffn, gate = hf + "ffn.", [("gate.weight", "router.gate.weight")]
        gate += [("gate.tid2eid", "router.tid2eid")] if i < a.n_hash_layers else [("gate.bias", "router.expert_bias")]
        shared = [(f"shared_experts.w{k}.weight", f"shared_experts.w{k}.weight") for k in (1, 2, 3)]
    out = hf_rules.renamed(pairs, hf, ours) + _attention_rules(a, i, fused, hf, ours)
    out += hf_rules.renamed(gate + shared, ffn, ours + "feed_forward.")
    names = hf_rules.EXPERT_NAMES if fused else (("w1", "w1"), ("w3", "w3"), ("w2", "w2"))
    return out + hf_rules.expert_rules(a, ffn, ours + "feed_forward.", fused=fused, names=names)


def _rules(a: DeepSeekV4Args, fused: bool) -> list[TensorRule]:
    out = [TensorRule("model.embed_tokens.weight", ("tok_embeddings.weight",)),
           TensorRule("model.norm.weight", ("norm.weight",))]
    out += [TensorRule(f"model.hc_head.hc_{p}", (f"hc_head.{p}",)) for p in ("fn", "base", "scale")]
    if not a.tie_embeddings:
        out.append(TensorRule("lm_head.weight" if fused else "head.weight", ("output.weight",)))
    out += [r for i in range(a.n_layers) for r in _block_rules(a, i, fused, f"model.layers.{i}.", f"layers.{i}.")]
    return out + _mtp_rules(a)


_MTP = (("e_proj.weight", "e_proj.weight"), ("h_proj.weight", "h_proj.weight"), ("enorm.weight", "enorm.weight"),
        ("hnorm.weight", "hnorm.weight"), ("norm.weight", "norm.weight"),
        *((f"hc_head_{p}", f"hc_head.{p}") for p in ("fn", "base", "scale")))


def _mtp_rules(a: DeepSeekV4Args) -> list[TensorRule]:
    """The multi-token prediction modules under DeepSeek's release names, "mtp.{k}." (transformers
    builds none and skips them, so they have no other spelling), its experts one tensor each."""
    out = []
    for k in range(a.mtp_depth):
        hf, ours = f"mtp.{k}.", f"mtp.layers.{a.n_layers + k}."
        out += hf_rules.renamed(_MTP, hf, ours) + _block_rules(a, a.n_layers + k, False, hf, ours + "block.")
    return out


def held_args(a: DeepSeekV4Args, names: set[str]) -> DeepSeekV4Args:
    """`a` without multi-token prediction when the checkpoint holds none: transformers' config
    says num_nextn_predict_layers = 1 by default and its save holds no `mtp.*` tensor. When the
    first module's projection is stored the count holds, and a missing tensor is named."""
    if a.mtp_depth and "mtp.0.e_proj.weight" not in names:
        return dataclasses.replace(a, mtp_depth=0)
    return a


_RELEASE = ((r"^embed\.weight$", "model.embed_tokens.weight"), (r"^norm\.weight$", "model.norm.weight"),
            (r"^hc_head_(fn|base|scale)$", r"model.hc_head.hc_\1"), (r"^layers\.", "model.layers."),
            (r"^model\.mtp\.", "mtp."))


def normalize_name(name: str) -> str:
    """DeepSeek's release names (no "model." prefix) as transformers' save writes them."""
    for pattern, repl in _RELEASE:
        if re.match(pattern, name):
            return re.sub(pattern, repl, name)
    return name


ADAPTER = HFAdapter(ARCHITECTURES, args_from_config, config_from_args, ignored=IGNORED,
                    normalize_name=normalize_name, **hf_rules.expert_layouts(_rules), held_args=held_args)
