"""Name-and-layout rules between forja and Hugging Face state dicts.

A family's adapter lists `TensorRule`s: one Hugging Face tensor <-> one or more forja
tensors, with the transforms between layouts (GPT-2's Conv1D weights are transposed;
its fused q/k/v projection is split in three). `{i}` in a name stands for a layer
index. A rule may also map many Hugging Face tensors to slices of one forja tensor:
a mixture of experts holds one (E, H, D) tensor per projection where the published
checkpoints hold one (H, D) tensor per expert, so `{e}` in the name stands for the
slice along dim 0 (`stacked=E`), and each expert is streamed into, or cut from, its own
slice. The generic loader in `forja/models/hf.py` uses these rules both ways and to
say, for a bad checkpoint, which Hugging Face tensor is missing, extra or misshapen.

Most families are the same decoder under other names, so the rows they share are written
here once: the embedding, final norm and output head (`decoder_rules`), attention, MLP and
norm rows (`renamed` over `attention_pairs`, `MLP_PAIRS`, `NORM_PAIRS`), a mixture's routed
experts in either layout (`expert_rules`); the config.json keys every decoder reads and
writes alike (`decoder_args`, `decoder_config`); and the refusals families make alike
(`refusal`, `check_config`, `check_exportable`). A family's hf.py keeps what is its own.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from forja.errors import ForjaError
from forja.models.common.rope import ROPE_NAMES, ROPE_TYPES, rope_scaling_from_hf, rope_scaling_to_hf


def _one(ts: tuple[torch.Tensor, ...]) -> torch.Tensor:
    return ts[0]


@dataclass(frozen=True)
class TensorRule:
    hf: str
    """Hugging Face name, e.g. "model.layers.{i}.self_attn.q_proj.weight"."""
    forja: tuple[str, ...]
    """forja name(s) the tensor becomes, e.g. ("layers.{i}.attention.wq.weight",)."""
    to_forja: Callable[[torch.Tensor], tuple[torch.Tensor, ...]] = field(default=lambda t: (t,))
    """Hugging Face tensor -> forja tensors (same order as `forja`)."""
    to_hf: Callable[[tuple[torch.Tensor, ...]], torch.Tensor] = field(default=_one)
    """forja tensors -> Hugging Face tensor."""
    optional: bool = False
    """May be absent from a checkpoint (a tied lm_head)."""
    stacked: int = 0
    """Above 0: the forja tensors stack this many Hugging Face tensors along dim 0, the
    one `{e}` in `hf` names going to slice e ("mlp.experts.{e}.gate_proj.weight" is
    slice e of "feed_forward.experts.w1"). `expand` makes one rule per slice."""
    index: int | None = None
    """Set by `expand` on a stacked rule: the slice of the forja tensors this rule covers."""

    def expand(self, n_layers: int) -> list[TensorRule]:
        """One rule per layer for `{i}`, then one per slice for `{e}`: rules that each name
        one Hugging Face tensor."""
        rules = [self]
        if "{i}" in self.hf:
            # "{e}" is formatted as itself here, and replaced below.
            rules = [replace(self, hf=self.hf.format(i=i, e="{e}"), forja=tuple(f.format(i=i) for f in self.forja))
                     for i in range(n_layers)]
        if self.stacked:
            rules = [replace(r, hf=r.hf.replace("{e}", str(e)), stacked=0, index=e)
                     for r in rules for e in range(self.stacked)]
        return rules

    def forja_views(self, tensors: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """The forja tensors this (expanded) rule reads and writes, from a state dict by
        name: whole, or their slice `index` (a view, so copying into it fills the tensor)."""
        ts = tuple(tensors[n] for n in self.forja)
        return ts if self.index is None else tuple(t[self.index] for t in ts)


def transposed(t: torch.Tensor) -> tuple[torch.Tensor]:
    """Conv1D (in, out) -> Linear (out, in)."""
    return (t.t().contiguous(),)


def untransposed(ts: tuple[torch.Tensor, ...]) -> torch.Tensor:
    return ts[0].t().contiguous()


def split3(t: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """GPT-2's fused c_attn: a (in, 3*out) weight or (3*out,) bias -> q, k, v in Linear layout."""
    if t.dim() == 1:
        return tuple(p.contiguous() for p in t.chunk(3))
    return tuple(p.t().contiguous() for p in t.chunk(3, dim=1))


def join3(ts: tuple[torch.Tensor, ...]) -> torch.Tensor:
    if ts[0].dim() == 1:
        return torch.cat(ts)
    return torch.cat([t.t() for t in ts], dim=1).contiguous()


@dataclass(frozen=True)
class HFAdapter:
    """A family's Hugging Face conversion: the functions forja/models/hf.py calls."""

    architectures: tuple[str, ...]
    """`architectures` entries of config.json this family reads ("LlamaForCausalLM")."""
    args_from_config: Callable[[dict], Any]
    """config.json -> the family's typed args; refuses what forja cannot represent."""
    config_from_args: Callable[[Any], dict]
    """Typed args -> config.json; refuses models transformers has no equivalent for."""
    rules: Callable[[Any], list[TensorRule]]
    """The tensor rules for a model of these args: the layout forja saves."""
    ignored: tuple[str, ...] = ()
    """Patterns of stored tensors forja does not need (old causal-mask buffers)."""
    normalize_name: Callable[[str], str] = str
    """A stored tensor's name as the rules spell it (adds a missing prefix, say)."""
    other_layouts: Callable[[Any], list[list[TensorRule]]] = lambda args: []
    """Further layouts a checkpoint may hold the same model in, each a full list of rules
    (transformers 5 can save experts fused into one tensor per layer). Loading follows
    whichever of `rules` and these names the most stored tensors; saving writes `rules`."""
    held_args: Callable[[Any, set[str]], Any] = lambda args, names: args
    """The args from config.json fitted to the stored tensor names before the layout is read
    (DeepSeek-V3: transformers writes num_nextn_predict_layers = 1 with no MTP tensors, so
    the count holds only when its modules are stored)."""


# -- the decoder's rows ------------------------------------------------------------------------
LAYER, OURS = "model.layers.{i}.", "layers.{i}."  # a block's prefixes, "{i}" expanded per layer

SWIGLU_PAIRS = (("gate_proj.weight", "w1.weight"), ("up_proj.weight", "w3.weight"), ("down_proj.weight", "w2.weight"))
"""A SwiGLU's (or GeGLU's) gate, up and down projections, within the MLP."""
MLP_PAIRS = tuple((f"mlp.{h}", f"feed_forward.{f}") for h, f in SWIGLU_PAIRS)
"""A block's SwiGLU (or GeGLU)."""

NORM_PAIRS = {
    "pre": (("input_layernorm.weight", "attention_norm.weight"),
            ("post_attention_layernorm.weight", "ffn_norm.weight")),
    "post": (("post_attention_layernorm.weight", "post_attention_norm.weight"),
             ("post_feedforward_layernorm.weight", "post_ffn_norm.weight")),
    "sandwich": (("input_layernorm.weight", "attention_norm.weight"),
                 ("post_attention_layernorm.weight", "post_attention_norm.weight"),
                 ("pre_feedforward_layernorm.weight", "ffn_norm.weight"),
                 ("post_feedforward_layernorm.weight", "post_ffn_norm.weight")),
}
"""A block's norms by where they sit (BlockStructure.norms): before each sublayer, on each
sublayer's output (OLMo 2/3), or both (Gemma)."""


def attention_pairs(*, qk_norm: bool = False, bias: bool = False) -> list[tuple[str, str]]:
    """self_attn.{q,k,v,o}_proj -> attention.w{q,k,v,o} (weights, and biases with `bias`),
    and with `qk_norm` self_attn.{q,k}_norm -> attention.{q,k}_norm."""
    params = ("weight", "bias") if bias else ("weight",)
    out = [(f"self_attn.{p}_proj.{kind}", f"attention.w{p}.{kind}") for p in "qkvo" for kind in params]
    if qk_norm:
        out += [(f"self_attn.{n}.weight", f"attention.{n}.weight") for n in ("q_norm", "k_norm")]
    return out


def renamed(pairs: Iterable[tuple[str, str]], hf: str = LAYER, ours: str = OURS) -> list[TensorRule]:
    """One-to-one rules for (Hugging Face name, forja name) pairs under the prefixes `hf` and `ours`."""
    return [TensorRule(hf + h, (ours + f,)) for h, f in pairs]


def decoder_rules(a: Any, layers: list[TensorRule] | Callable[[int], list[TensorRule]]) -> list[TensorRule]:
    """A decoder's rules: the embedding and final norm, the blocks' (`layers`: rules named with
    "{i}", or a function giving block i's), the output head unless tied to the embedding."""
    out = [TensorRule("model.embed_tokens.weight", ("tok_embeddings.weight",)),
           TensorRule("model.norm.weight", ("norm.weight",))]
    out += layers if isinstance(layers, list) else [r for i in range(a.n_layers) for r in layers(i)]
    if not a.tie_embeddings:
        out.append(TensorRule("lm_head.weight", ("output.weight",)))
    return out


def split_rows(sizes: list[int]) -> tuple[Callable, Callable]:
    """Hugging Face's concatenated rows (or conv channels) -> forja's pieces of `sizes` rows, and back."""
    def to_forja(t: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(p.contiguous() for p in t.split(sizes, dim=0))

    def to_hf(ts: tuple[torch.Tensor, ...]) -> torch.Tensor:
        return torch.cat(ts, dim=0)

    return to_forja, to_hf


def split_gate_up(t: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Fused experts' gate_up_proj (E, 2H, D), gate rows then up rows -> w1 (E, H, D), w3 (E, H, D)."""
    return tuple(p.contiguous() for p in t.chunk(2, dim=1))


def join_gate_up(ts: tuple[torch.Tensor, ...]) -> torch.Tensor:
    return torch.cat(ts, dim=1)


EXPERT_NAMES = (("gate_proj", "w1"), ("up_proj", "w3"), ("down_proj", "w2"))


def expert_rules(a: Any, hf: str, ours: str, *, fused: bool,
                 names: tuple[tuple[str, str], ...] = EXPERT_NAMES) -> list[TensorRule]:
    """A mixture's routed experts, `hf` the Hugging Face module's prefix ("model.layers.{i}.mlp.")
    and `ours` the feed-forward's: one tensor per expert and projection (the published layout,
    "experts.{e}.gate_proj.weight" (H, D) by default, `names` giving each projection's name),
    streamed into slice e of forja's stacked experts.w1/w3 (E, H, D), w2 (E, D, H); or, `fused`,
    transformers 5's modules' experts.gate_up_proj (E, 2H, D) and experts.down_proj (E, D, H)."""
    experts = ours + "experts."
    if fused:
        return [TensorRule(hf + "experts.gate_up_proj", (experts + "w1", experts + "w3"),
                           to_forja=split_gate_up, to_hf=join_gate_up),
                TensorRule(hf + "experts.down_proj", (experts + "w2",))]
    return [TensorRule(f"{hf}experts.{{e}}.{h}.weight", (experts + f,), stacked=a.n_experts) for h, f in names]


def expert_layouts(rules_in: Callable[[Any, bool], list[TensorRule]]) -> dict[str, Callable]:
    """An HFAdapter's `rules` and `other_layouts` for a family with a mixture of experts, from
    `rules_in(args, fused)`: the published checkpoints hold one tensor per expert, the layout
    forja writes; transformers 5's modules hold them fused (`save_pretrained(save_original_format=
    False)` writes that), read too when the model has experts."""
    return dict(rules=lambda a: rules_in(a, False), other_layouts=lambda a: [rules_in(a, True)] if a.n_experts else [])


# -- config.json -------------------------------------------------------------------------------
def decoder_config(a: Any) -> dict:
    """The config.json keys every rotary decoder family writes alike, from its args."""
    return {"hidden_size": a.dim, "num_hidden_layers": a.n_layers, "num_attention_heads": a.n_heads,
            "num_key_value_heads": a.n_kv_heads, "head_dim": a.head_dim, "intermediate_size": a.ffn_dim,
            "vocab_size": a.vocab_size, "max_position_embeddings": a.max_seq_len, "rms_norm_eps": a.norm_eps,
            "tie_word_embeddings": a.tie_embeddings}


def decoder_args(cfg: dict, **defaults: Any) -> dict:
    """The args fields every decoder family reads alike from config.json (`decoder_config`'s
    keys), where a key is absent or null the family's default by its Hugging Face name (its
    transformers config class's): max_position_embeddings 2048, rms_norm_eps 1e-6, untied
    embeddings, as many key/value heads as query heads and heads dim / n_heads wide, unless
    `defaults` say otherwise."""
    def get(key: str, default: Any = None) -> Any:
        value = cfg.get(key)
        return defaults.get(key, default) if value is None else value

    dim, heads = get("hidden_size"), get("num_attention_heads")
    return dict(dim=dim, n_layers=cfg["num_hidden_layers"], n_heads=heads,
                n_kv_heads=cfg.get("num_key_value_heads") or defaults.get("num_key_value_heads", heads),
                head_dim=get("head_dim", dim // heads), ffn_dim=get("intermediate_size"),
                vocab_size=get("vocab_size"), max_seq_len=get("max_position_embeddings", 2048),
                norm_eps=get("rms_norm_eps", 1e-6),
                tie_embeddings=bool(cfg.get("tie_word_embeddings", defaults.get("tie_word_embeddings", False))))


def rope_args(cfg: dict, max_len: int, theta: float) -> dict:
    """rope_theta and rope_scaling from either dialect: 4.x's top-level `rope_theta` and
    `rope_scaling`, 5.x's `rope_parameters` (`theta`: the family's default base)."""
    params = cfg.get("rope_parameters") or {}
    return dict(rope_theta=float(params.get("rope_theta", cfg.get("rope_theta", theta))),
                rope_scaling=rope_scaling_from_hf(cfg.get("rope_scaling") or params, max_len))


def rope_config(a: Any) -> dict:
    """The 4.x rope dialect, which the released checkpoints of most families use and 5.x still reads."""
    return {"rope_theta": a.rope_theta,
            "rope_scaling": None if a.rope_scaling is None else rope_scaling_to_hf(a.rope_scaling)}


def rope_by_layer_type(cfg: dict, refuse: Callable[[str, Any, str], ForjaError], family: str, full_theta: float,
                       sliding_theta: float) -> dict[str, dict]:
    """Layer type -> its rope dict, as transformers 5.24's configs with local and global blocks
    (OLMo 3, Gemma 3) build them from either dialect: 5.x's `rope_parameters` keyed by layer
    type, or 4.x's top-level `rope_theta` and `rope_scaling`, which go to the full-attention
    blocks only. `full_theta`, `sliding_theta`: the bases where the file names none."""
    params = cfg.get("rope_parameters")
    if params and not {"full_attention", "sliding_attention"} & set(params):
        raise refuse("rope_parameters", params, f"transformers 5 keys {family}'s rope parameters by layer type")
    params = {kind: dict(v or {}) for kind, v in (params or {}).items()}
    full = params.setdefault("full_attention", {"rope_type": "default"})
    if cfg.get("rope_scaling"):
        full.update(cfg["rope_scaling"])
    full.setdefault("rope_theta", cfg.get("rope_theta", full_theta))
    params.setdefault("sliding_attention", {"rope_type": "default"}).setdefault("rope_theta", sliding_theta)
    return params


def layer_types_config(a: Any, full: dict, local_theta: float) -> dict:
    """config.json's blocks, window and rope parameters keyed by layer type (`full`: the global
    blocks'; the sliding blocks' plain RoPE with base `local_theta`), as transformers 5 writes them."""
    # transformers needs a window even when no block slides; it is unused then.
    return {"sliding_window": a.sliding_window if a.sliding_window is not None else 4096,
            "layer_types": [a.layer_type(i) for i in range(a.n_layers)],
            "rope_parameters": {"full_attention": full,
                                "sliding_attention": {"rope_type": "default", "rope_theta": local_theta}}}


def linear_attention_args(cfg: dict, **defaults: Any) -> dict:
    """The Gated DeltaNet fields (GatedDeltaNetArgs) from config.json's linear_* keys, `defaults`
    by Hugging Face name where a key is absent (Qwen3.5's config class's unless given)."""
    names = {"linear_n_k_heads": ("linear_num_key_heads", 16), "linear_n_v_heads": ("linear_num_value_heads", 32),
             "linear_k_head_dim": ("linear_key_head_dim", 128), "linear_v_head_dim": ("linear_value_head_dim", 128),
             "linear_conv_kernel": ("linear_conv_kernel_dim", 4)}
    return {field: cfg.get(key) or defaults.get(key, default) for field, (key, default) in names.items()}


def linear_attention_config(a: Any) -> dict:
    """config.json's linear_* keys of a model with Gated DeltaNet blocks, and its blocks' kinds."""
    return {"layer_types": [a.layer_type(i) for i in range(a.n_layers)], "linear_conv_kernel_dim": a.linear_conv_kernel,
            "linear_key_head_dim": a.linear_k_head_dim, "linear_value_head_dim": a.linear_v_head_dim,
            "linear_num_key_heads": a.linear_n_k_heads, "linear_num_value_heads": a.linear_n_v_heads}


# -- refusals ----------------------------------------------------------------------------------
def refusal(family: str) -> Callable[[str, Any, str], ForjaError]:
    """The error a family raises for a config.json value it cannot represent, as (key, value, why)."""
    def refuse(key: str, value: Any, why: str) -> ForjaError:
        return ForjaError(f"config.json: {key}={value!r} is not supported by forja's {family} ({why})")

    return refuse


@dataclass(frozen=True)
class Unsupported:
    """A config.json key whose value a family reads only when `ok(value)` (absent: `default`)."""

    key: str
    ok: Callable[[Any], bool]
    why: str
    default: Any = None


def no_attention_bias(why: str) -> Unsupported:
    return Unsupported("attention_bias", lambda v: not v, why)


def activation(name: str, why: str, key: str = "hidden_act", default: str | None = None) -> Unsupported:
    """The activation `name` or none (`default`: what an absent key means; `name` unless given)."""
    return Unsupported(key, lambda v: v == name, why, default=name if default is None else default)


NO_ATTENTION_DROPOUT = Unsupported("attention_dropout", lambda v: not v,
                                   "forja trains without attention dropout; set 0.0")


def neutral(options: dict[str, Any], what: str) -> list[Unsupported]:
    """Options of other families that `what` ("a Mixtral") has no place for: refused unless
    absent, null or their neutral value."""
    return [Unsupported(key, lambda v, n=value: v in (n, None), f"{what} has no such option; it must be {value!r} "
                        "or absent", default=value) for key, value in options.items()]


def check_config(cfg: dict, checks: Iterable[Unsupported], refuse: Callable[[str, Any, str], ForjaError]) -> None:
    """Raise `refuse(key, value, why)` for the first of `checks` config.json fails."""
    for check in checks:
        value = cfg.get(check.key, check.default)
        if not check.ok(value):
            raise refuse(check.key, value, check.why)


def check_linear_layer_types(cfg: dict, refuse: Callable[[str, Any, str], ForjaError]) -> None:
    """Refuse a block kind other than attention and Gated DeltaNet (a hybrid family's)."""
    kinds = [t for t in cfg.get("layer_types") or [] if t not in ("full_attention", "linear_attention")]
    if kinds:
        raise refuse("layer_types", kinds[0], "each block is 'full_attention' or 'linear_attention'")


def check_rope_types(cfg: dict, refuse: Callable[[str, Any, str], ForjaError]) -> None:
    """Refuse a rope type forja does not compute, in either dialect's key."""
    for key in ("rope_scaling", "rope_parameters"):
        scaling = cfg.get(key) or {}
        kind = scaling.get("rope_type", scaling.get("type", "default"))
        if kind != "default" and kind not in ROPE_TYPES:
            raise refuse(f"{key}.rope_type", kind, ROPE_NAMES)


def check_exportable(a: Any, what: str, problems: dict[str, tuple[bool, str]]) -> None:
    """Refuse to export a model transformers' classes cannot express: `problems` maps an args
    field to (whether it is set to what `what`, "a Qwen3", cannot express, why)."""
    for name, (bad, why) in problems.items():
        if bad:
            raise ForjaError(f"{what} with {name}={getattr(a, name)!r} has no equivalent in transformers "
                             f"({why}); export a model trained without it")


def router_problems(a: Any, who: str, whose: str) -> dict[str, tuple[bool, str]]:
    """What a softmax top-k router without groups, bias or scaling cannot express, `who` ("Mixtral",
    "it") naming the family and `whose` ("Mixtral's", "its") its router."""
    return {
        "score_func": (a.score_func != "softmax", f"{whose} router is a softmax"),
        "route_scale": (a.route_scale != 1.0, f"{who} does not scale routing weights"),
        "n_expert_groups": (a.n_expert_groups > 1, f"{who} routes over all experts at once"),
        "expert_bias": (a.expert_bias, f"{whose} router has no bias"),
    }
