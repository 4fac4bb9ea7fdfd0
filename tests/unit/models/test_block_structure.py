"""Every block declares a structure record (forja/models/common/blocks.py) that agrees with the
modules it holds: the planner prices blocks by that record alone, so a record that lied would
misprice a block silently. Checked for every family's every kind of block (its debug flavors,
with a multi-token prediction module where the family builds one)."""

from __future__ import annotations

import pytest
from torch import nn

from forja.errors import ForjaError
from forja.models import FAMILIES, build_model
from forja.models.common.attention import Attention
from forja.models.common.blocks import BlockStructure
from forja.models.common.compressed_attention import CompressedAttention
from forja.models.common.gated_deltanet import GatedDeltaNet
from forja.models.common.kimi_delta_attention import KimiDeltaAttention
from forja.models.common.mamba2 import Mamba2
from forja.models.common.mla import MLA
from forja.models.common.mlp import GeGLU, GeluMLP, SquaredReLUMLP, SwiGLU
from forja.models.common.moe import MoE
from forja.models.common.norms import RMSNorm
from forja.models.gemma4.attention import Gemma4Block

MIXERS = {Attention: "attention", MLA: "latent_attention", GatedDeltaNet: "gated_deltanet",
          KimiDeltaAttention: "kimi_delta_attention", Mamba2: "mamba2", CompressedAttention: "compressed_attention",
          type(None): "none"}
LINEAR_MIXERS = ("gated_deltanet", "kimi_delta_attention")  # the mixers of linear_attention blocks
FFNS = {MoE: "moe", SwiGLU: "swiglu", GeGLU: "geglu", GeluMLP: "gelu", SquaredReLUMLP: "relu2", type(None): "none"}
NORM_NAMES = ("attention_norm", "ffn_norm", "post_attention_norm", "post_ffn_norm")


def _blocks(family: str):
    """(layer type, block) of each block of the family's debug flavors, MTP blocks included."""
    for flavor in (f for f in FAMILIES[family].flavors if f.startswith("debug")):
        for mtp_depth in (0, 1):
            try:
                model = build_model(family, flavor, device="meta", mtp_depth=mtp_depth)
            except ForjaError:  # a family that refuses multi-token prediction
                continue
            yield from ((model.args.layer_type(int(i)), b) for i, b in model.layers.items())
            if model.mtp is not None:
                yield from (("full_attention", m.block) for m in model.mtp.layers.values())


def _norm_kind(norm: nn.Module) -> str:
    if isinstance(norm, nn.LayerNorm):
        return "layer"
    assert isinstance(norm, RMSNorm), type(norm)
    return "zero_centered" if norm.zero_centered else "rms"


def _gemma4(block: nn.Module) -> tuple[int, ...]:
    """A Gemma 4 block's own shapes, read off its projections: (query heads, key/value heads it
    projects, head width, values = keys, dense GeGLU width, per-layer input width)."""
    if not isinstance(block, Gemma4Block):
        return ()
    attn, dense = block.attention, block.mlp or block.feed_forward
    hd = attn.q_norm.weight.numel()
    kv = 0 if attn.wk is None else attn.wk.weight.shape[0] // hd
    ple = 0 if block.ple_proj is None else block.ple_proj.weight.shape[1]
    return attn.wq.weight.shape[0] // hd, kv, hd, int(kv > 0 and attn.wv is None), dense.w3.weight.shape[0], ple


def _expected(block: nn.Module) -> BlockStructure:
    """The record the block's modules call for, read off the modules themselves."""
    norms = [getattr(block, n) for n in NORM_NAMES if hasattr(block, n)]
    pre, post = hasattr(block, "attention_norm") or hasattr(block, "ffn_norm"), hasattr(block, "post_attention_norm")
    mixer, ff = getattr(block, "attention", None), getattr(block, "feed_forward", None)  # one may be absent
    attention = isinstance(mixer, Attention)
    kinds = {_norm_kind(n) for n in norms}
    assert len(kinds) == 1, kinds  # a block's norms are alike
    linear = ()
    if isinstance(mixer, (GatedDeltaNet, KimiDeltaAttention)):
        linear = (mixer.wq.out_features // mixer.head_k_dim, mixer.wv.out_features // mixer.head_v_dim,
                  mixer.head_k_dim, mixer.head_v_dim, mixer.conv_q.weight.shape[-1], mixer.chunk_size)
    moe = isinstance(ff, MoE)
    from forja.models.common.sparse_attention import DSA_STAGES, SparseMLA  # latent attention with an indexer

    sparse = isinstance(mixer, SparseMLA)
    indexer = (mixer.indexer.weights_proj.out_features, mixer.indexer.wk.out_features,
               mixer.topk, DSA_STAGES.index(mixer.stage)) if sparse else ()
    return BlockStructure(
        norms={(True, False): "pre", (False, True): "post", (True, True): "sandwich"}[(pre, post)],
        norm=kinds.pop(), ffn=FFNS[next(c for c in type(ff).__mro__ if c in FFNS)],  # DeepSeek-V4's ScoredMoE: an MoE
        mixer=MIXERS[MLA if sparse else next(c for c in type(mixer).__mro__ if c in MIXERS)],  # a subclass as its base
        output_gate=attention and mixer.wg is not None,
        sinks=isinstance(mixer, (Attention, CompressedAttention)) and mixer.sinks is not None,
        gated_deltanet=linear, expert_activation=ff.experts.activation if moe else "",
        shared_expert_gate=moe and ff.shared_gate is not None, indexer=indexer,
        mamba2=mixer.shape if isinstance(mixer, Mamba2) else (), unit_qk=attention and getattr(mixer, "unit_qk", False),
        gemma4=_gemma4(block))


@pytest.mark.parametrize("family", list(FAMILIES))
def test_every_kind_of_block_declares_the_structure_of_its_modules(family):
    seen = set()
    for kind, block in _blocks(family):
        assert block.structure == _expected(block), (kind, type(block).__name__)
        assert (block.structure.mixer in LINEAR_MIXERS) == (kind == "linear_attention")
        seen.add((kind, block.structure))
    print(f"{family}: {len(seen)} kinds of block")
    assert seen


def test_the_records_tell_the_kinds_apart():
    """Each placement, norm, mixer and feed-forward occurs in some family: the record is not
    one constant."""
    records = {block.structure for family in FAMILIES for _, block in _blocks(family)}
    for field, values in (("norms", {"pre", "post", "sandwich"}), ("norm", {"rms", "zero_centered", "layer"}),
                          ("mixer", {"attention", "latent_attention", "gated_deltanet", "kimi_delta_attention",
                                     "mamba2", "compressed_attention", "none"}),
                          ("ffn", {"swiglu", "geglu", "gelu", "relu2", "moe", "none"})):
        assert {getattr(r, field) for r in records} == values, field
    assert any(r.sinks for r in records) and any(r.output_gate for r in records)
    assert {r.expert_activation for r in records} == {"", "swiglu", "clamped_swiglu", "relu2", "limited_swiglu",
                                                      "geglu"}
