"""Qwen3-Next against transformers: the conformance CASE (its own fusion of the Gated
DeltaNet's projections written back tensor for tensor, float32 and float64; the published
size; refusals) and what is Qwen3-Next's own: MoE blocks chosen by decoder_sparse_step /
mlp_only_layers, the projections' head order, packed documents, the checkpoints' multi-token
prediction tensors."""

from __future__ import annotations

import functools
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from forja.errors import ForjaError
from forja.models import build_model, load_hf_checkpoint, save_hf_checkpoint
from forja.models.qwen3_next.hf import config_from_args
from tests.helpers import max_logit_diff
from tests.unit.models import family_checks as checks

transformers = pytest.importorskip("transformers")

TOL_EXPERTS = 3e-5  # a model with experts in float32: 2.4e-5 (moe, below), 1.06e-5 (the MTP checkpoint's, 20 tokens)

_SHAPE = dict(hidden_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
              vocab_size=2048, max_position_embeddings=2048, rms_norm_eps=1e-6, linear_num_key_heads=2,
              linear_num_value_heads=4, linear_key_head_dim=32, linear_value_head_dim=32, linear_conv_kernel_dim=4,
              intermediate_size=256, tie_word_embeddings=False,
              rope_parameters={"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25})

CASE = checks.FamilyCase(
    family="qwen3_next",
    configs={
        # Block 1 dense (mlp_only_layers), blocks 0, 2, 3 8 experts top 2 and a gated shared expert.
        "moe": checks.HFConfig("Qwen3NextForCausalLM", dict(_SHAPE, num_experts=8, num_experts_per_tok=2,
                                                     moe_intermediate_size=64, shared_expert_intermediate_size=64,
                                                     norm_topk_prob=True, mlp_only_layers=[1]), "debug"),
        # No experts: every block a SwiGLU of intermediate_size.
        "dense": checks.HFConfig("Qwen3NextForCausalLM", dict(_SHAPE, num_experts=0, tie_word_embeddings=True)),
        # Every second block a mixture (a shared expert 1.5 experts wide, top-3 weights not
        # renormalized), full attention every other block.
        "sparse_step": checks.HFConfig("Qwen3NextForCausalLM", dict(
            _SHAPE, num_hidden_layers=5, num_experts=8, num_experts_per_tok=3, moe_intermediate_size=32,
            shared_expert_intermediate_size=48, decoder_sparse_step=2, norm_topk_prob=False,
            layer_types=["linear_attention", "full_attention"] * 2 + ["linear_attention"])),
    },
    # zero-centered norms start at 0 (scale 1): give them values of their own
    pick=lambda key, p: p.dim() == 1, draw=lambda p: p.add_(torch.randn_like(p) * 0.1),
    # Bounds on max |logit difference| against transformers 5.25, torch 2.13, CPU (checks.hybrid_logits,
    # as Qwen3.5's). Measured in float32: 2.4e-5 (moe), 7.6e-6 (dense), 3.4e-5 (sparse_step, its
    # shared expert 1.5 experts wide), where transformers' own float32 logits are 1.2e-4, 7.6e-5
    # and 7.9e-5 from its float64 ones. In float64: 0 on every config (with experts 1.5e-5 and
    # 3.3e-5 as they were), the delta rule, its decay, the RMSNorms and the router's softmax in
    # float64 on both sides (tests/unit/models/float64_casts.py), as Qwen3.5's.
    tol=1e-5, logits=checks.hybrid_logits,
    float64_kept=("qwen3_next.Qwen3NextRMSNorm.forward", "qwen3_next.Qwen3NextRMSNormGated.forward",
                  "qwen3_next.Qwen3NextGatedDeltaNet.forward", "qwen3_next.torch_chunk_gated_delta_rule",
                  "qwen3_next.Qwen3NextTopKRouter.forward"),
    tokens=80,  # two 64-token chunks of the delta rule (padded to whole chunks: 65 would cost the same)
    same_tensors=True,  # the regrouped in_proj_qkvz / in_proj_ba included
    greedy={"moe": 20},  # every kind of block: Gated DeltaNet, attention, dense and MoE feed-forwards
    # The debug flavor exported: measured 7.2e-7 (forja's init keeps logits small), within tol.
    # (total, active per token); equal to transformers' count for the same config.json (which
    # builds no MTP module).
    published={"80b-a3b": (79_674_391_296, 3_874_929_408)},
    fused={"moe": ("model.layers.2.mlp.experts.gate_up_proj",)},
    refusal_prefix="",
    refusals=(
        ("moe", dict(attention_bias=True), "attention_bias=True is not supported by forja's Qwen3-Next"),
        ("moe", dict(hidden_act="gelu"), "hidden_act='gelu'"),
        ("moe", dict(layer_types=["sliding_attention"] * 4), "layer_types='sliding_attention'"),
        ("moe", dict(rope_parameters={"rope_type": "longrope", "factor": 4.0, "rope_theta": 1e7}),
         "rope_type='longrope'"),
        ("moe", dict(decoder_sparse_step=0), "decoder_sparse_step=0"),
        ("moe", dict(mtp_num_hidden_layers=2), "mtp_num_hidden_layers=2 is not supported by forja's Qwen3-Next"),
    ),
    export_refusals=(
        (dict(attention_sinks=True), "Qwen3-Next with attention_sinks=True has no equivalent in transformers"),
        (dict(mtp_depth=2), "Qwen3-Next with mtp_depth=2 has no equivalent in its checkpoints"),
    ),
)

checkpoints, loaded = checks.family_fixtures(CASE)
_tokens = functools.partial(checks.random_tokens, vocab_size=_SHAPE["vocab_size"])


@pytest.mark.parametrize("name", list(CASE.configs))
def test_the_blocks_with_experts_are_transformers(checkpoints, loaded, name):
    args = loaded[name].args
    moe_blocks = [args.is_moe_layer(i) for i in range(args.n_layers)]
    assert moe_blocks == [hasattr(layer.mlp, "experts") for layer in checkpoints[name][1].model.layers]


def test_the_published_config_names_its_architecture():
    cfg = config_from_args(build_model("qwen3_next", "80b-a3b", device="meta").args)
    assert cfg["architectures"] == ["Qwen3NextForCausalLM"] and cfg["model_type"] == "qwen3_next"


def _stored(path) -> dict[str, torch.Tensor]:
    return load_file(path / "model.safetensors")


def test_grouped_projections_land_in_forjas_head_order(checkpoints, loaded):
    """Head by head: forja's wq/wk/wv/wz/wb/wa rows are the rows transformers'
    fix_query_key_value_ordering gives each head (key group g holds value heads g r .. g r + r - 1)."""
    hf = checkpoints["moe"][1]
    mixer = loaded["moe"].layers["0"].attention
    x = torch.randn(1, 3, _SHAPE["hidden_size"])
    lin = hf.model.layers[0].linear_attn
    with torch.no_grad():
        q, k, v, z, b, a = lin.fix_query_key_value_ordering(lin.in_proj_qkvz(x), lin.in_proj_ba(x))
        ours = (mixer.wq(x), mixer.wk(x), mixer.wv(x), mixer.wz(x), mixer.wb(x), mixer.wa(x))
    for theirs, mine in zip((q, k, v, z, b, a), ours, strict=True):
        assert torch.equal(theirs.reshape(1, 3, -1), mine)


# -- the multi-token prediction module ----------------------------------------------------------

@pytest.fixture(scope="module")
def mtp_checkpoint(checkpoints, tmp_path_factory):
    """(directory, transformers' main model, the donor of the MTP block): the "moe" checkpoint
    plus the published checkpoints' MTP module, which transformers neither builds nor reads;
    its block is a second model's block 3 (full attention with experts), its fc and norms random."""
    path, hf = checkpoints["moe"]
    donor = checks.make_hf_model(CASE, "moe", seed=1)
    donor_path = tmp_path_factory.mktemp("donor")
    donor.save_pretrained(donor_path)
    tensors = _stored(path)
    tensors |= {k.replace("model.layers.3.", "mtp.layers.0.", 1): v for k, v in _stored(donor_path).items()
                if k.startswith("model.layers.3.")}
    gen = torch.Generator().manual_seed(2)
    tensors["mtp.fc.weight"] = 0.1 * torch.randn(128, 256, generator=gen)
    for name in ("pre_fc_norm_hidden", "pre_fc_norm_embedding", "norm"):
        tensors[f"mtp.{name}.weight"] = 0.1 * torch.randn(128, generator=gen)
    out = tmp_path_factory.mktemp("mtp")
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "mtp_num_hidden_layers": 1}))
    return out, hf, donor


def _hf_mtp_reference(donor, stored, h, emb) -> torch.Tensor:
    """The MTP module's output (B, T, D) from transformers' pieces, given the main model's
    final normed state h and the next tokens' embeddings emb (B, T, D): zero-centered norms
    holding the stored weights, the donor's block 3 (whose tensors mtp.layers.0 holds), the final norm."""
    def norm(name):
        n = transformers.models.qwen3_next.modeling_qwen3_next.Qwen3NextRMSNorm(128, eps=1e-6)
        n.weight.data.copy_(stored[f"mtp.{name}.weight"])
        return n

    T = h.shape[1]
    x = torch.cat([norm("pre_fc_norm_embedding")(emb), norm("pre_fc_norm_hidden")(h)], -1) @ stored["mtp.fc.weight"].T
    positions = torch.arange(T)[None]
    causal = torch.full((T, T), float("-inf")).triu(1)[None, None]  # (1, 1, T, T) additive
    y = donor.model.layers[3](x, position_embeddings=donor.model.rotary_emb(x, positions), attention_mask=causal)
    return norm("norm")(y)


@torch.no_grad()
def test_the_mtp_module_loads_computes_transformers_pieces_and_saves_bit_exact(mtp_checkpoint, tmp_path):
    path, hf, donor = mtp_checkpoint
    model = load_hf_checkpoint(path)
    assert model.args.mtp_depth == 1 and list(model.mtp.layers) == ["4"]
    stored, mtp = _stored(path), model.mtp.layers["4"]
    for hf_name, ours in [("fc", mtp.proj), ("pre_fc_norm_hidden", mtp.hnorm), ("pre_fc_norm_embedding", mtp.enorm),
                          ("norm", mtp.norm), ("layers.0.self_attn.o_proj", mtp.block.attention.wo),
                          ("layers.0.mlp.shared_expert_gate", mtp.block.feed_forward.shared_gate)]:
        assert torch.equal(ours.weight, stored[f"mtp.{hf_name}.weight"]), hf_name
    assert torch.equal(mtp.block.feed_forward.experts.w2[5], stored["mtp.layers.0.mlp.experts.5.down_proj.weight"])
    tokens = _tokens(25, seed=7)
    T = tokens.shape[1] - 1
    rope, mask = model.rope_tables_for("full_attention", torch.arange(T)), model.mask_for(
        "full_attention", None, T, 0, tokens.device)
    # The same inputs for both (in training forja's module reads forja's own final state, whose
    # parity test_load_matches_transformers_logits checks): transformers' main state, after its final
    # norm, and the next tokens' embeddings.
    h, emb = hf.model(tokens[:, :T]).last_hidden_state, hf.model.embed_tokens(tokens[:, 1:])  # (B, T, D) each
    diff = (mtp(h, emb, rope, mask) - _hf_mtp_reference(donor, stored, h, emb)).abs().max().item()
    print(f"MTP module output: max |diff| from transformers' pieces {diff:.2e}")
    assert diff < CASE.tol
    assert max_logit_diff(hf, model, _tokens(20)) < TOL_EXPERTS  # the main model's logits are unchanged
    out = save_hf_checkpoint(model, tmp_path / "export")
    saved = _stored(out)
    assert sorted(saved) == sorted(stored)
    for key, value in stored.items():
        assert torch.equal(saved[key], value), key
    assert json.loads((out / "config.json").read_text())["mtp_num_hidden_layers"] == 1
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out).eval()  # skips mtp.*
    assert max_logit_diff(reloaded, model, _tokens(20)) < TOL_EXPERTS


@pytest.mark.parametrize(("changes", "experts"), [({}, True), (dict(mlp_only_layers=(0,)), False),
                                                  (dict(decoder_sparse_step=2, mlp_only_layers=()), False)])
def test_the_mtp_blocks_experts_follow_its_index_in_mtp_layers(changes, experts):
    """As vLLM builds mtp.layers.0: a mixture of experts where block 0 has one, whatever
    layer n_layers would have (with mlp_only_layers (0,) that one would have experts)."""
    model = build_model("qwen3_next", "debug", device="meta", mtp_depth=1, **changes)
    block = model.mtp.layers["4"].block
    assert hasattr(block.feed_forward, "experts") == experts == model.args.is_moe_layer(0)
    assert type(block.attention).__name__ == "Attention"


def test_a_config_counting_an_mtp_module_it_does_not_hold(mtp_checkpoint, tmp_path):
    """Without mtp.* tensors the main model loads; with part of the module the missing tensor is named."""
    path, hf, _ = mtp_checkpoint
    tensors = _stored(path)
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    save_file({k: v for k, v in tensors.items() if not k.startswith("mtp.")}, tmp_path / "model.safetensors")
    model = load_hf_checkpoint(tmp_path)
    assert model.mtp is None and model.args.mtp_depth == 0
    save_file({k: v for k, v in tensors.items() if k != "mtp.pre_fc_norm_hidden.weight"},
              tmp_path / "model.safetensors")
    with pytest.raises(ForjaError, match="mtp.pre_fc_norm_hidden.weight is missing"):
        load_hf_checkpoint(tmp_path)
