"""Llama 4 (the text model) against transformers: the conformance CASE (NoPE blocks with
attention temperature tuning, chunked attention, the weightless QK-norm after RoPE, the
complex-pair RoPE layout permuted at load, llama3 rope scaling, the sigmoid router scaling each
expert's input, the shared expert, dense blocks between; published sizes; refusals) and what
is Llama 4's own: each feature mattering, the chunked mask against its definition, packed
documents, the MoE math piece by piece, the checkpoint layout, a packed training step.
Tensor parallelism: test_tp_families.py."""

from __future__ import annotations

import functools

import pytest
import torch

from forja.errors import ForjaError
from forja.models import build_model, load_hf_checkpoint, model_args
from forja.models.common.attention import build_mask
from tests.unit.models import family_checks as checks
from tests.unit.models import float64_casts

transformers = pytest.importorskip("transformers")

_SHAPE = dict(hidden_size=128, intermediate_size=64, intermediate_size_mlp=256, num_hidden_layers=4,
              num_attention_heads=4, num_key_value_heads=2, head_dim=32, vocab_size=2048,
              max_position_embeddings=2048, num_local_experts=4, num_experts_per_tok=1, no_rope_layer_interval=2,
              moe_layers=[1, 2], interleave_moe_layer_step=2, attention_chunk_size=16, floor_scale=8, attn_scale=0.1,
              rope_parameters={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                               "original_max_position_embeddings": 64, "rope_theta": 500_000.0})
# Each pairing transformers' defaults never make: a NoPE block that is chunked, a rotary one that is global.
_VARIANT_TYPES = ["chunked_attention", "full_attention", "chunked_attention"]


@torch.no_grad()
def _biases(model) -> None:
    """forja and transformers start attention biases at 0: give each a value."""
    for key, p in model.named_parameters():
        if key.endswith(".bias"):
            p.normal_(0.0, 0.1)


def _make(name: str, config: checks.HFConfig, seed: int):
    """transformers' model on random weights, its norms away from 1 and its biases from 0."""
    model = checks.random_hf_model(config.cls, config.config, seed, pick=lambda key, p: "norm" in key,
                                   draw=lambda p: p.normal_(1.0, 0.3))
    _biases(model)
    return model


CASE = checks.FamilyCase(
    family="llama4",
    configs={
        # The `debug` flavor: rotary-chunked-dense, NoPE-full-MoE, rotary-chunked-MoE, NoPE-full-dense;
        # a 16-token chunk, temperature floor 8, QK-norm, Llama 3 scaling over 64 tokens (5.x dialect).
        "base": checks.HFConfig("Llama4ForCausalLM", _SHAPE, "debug"),
        # Maverick's switches (no QK-norm) with attention biases, tied embeddings, explicit
        # no_rope_layers and layer_types (a NoPE chunked block, a rotary global one), an 8-token
        # chunk, a stronger temperature from position 3 on, every block MoE with top 2 of 4,
        # GQA 4:1, plain RoPE base 10,000 in the 4.x dialect.
        "variant": checks.HFConfig("Llama4ForCausalLM", dict(
            _SHAPE, num_hidden_layers=3, num_attention_heads=8, head_dim=16, layer_types=_VARIANT_TYPES,
            no_rope_layers=[0, 1, 1], attention_chunk_size=8, moe_layers=None, interleave_moe_layer_step=1,
            num_experts_per_tok=2, use_qk_norm=False, attention_bias=True, tie_word_embeddings=True,
            floor_scale=4, attn_scale=0.5, rms_norm_eps=1e-6, rope_parameters=None, rope_theta=10_000.0)),
    },
    make=_make,
    # Bound on max |logit difference| in float32, against transformers 5.25, torch 2.13, CPU.
    # Measured: 6.7e-6 for "base", 4.4e-6 for "variant", 5.9e-6 to 9.2e-6 for the 8 random
    # configs (test_random_configs.py), each below transformers' own float32 error from its
    # float64 logits (7.1e-6 for "base"; 6.8e-6 to 1.04e-5 for the random draws): these tiny
    # peaked models sit near float32's floor whatever the feature (none of NoPE, chunks,
    # QK-norm, temperature or experts moves that error). transformers turns q and k as
    # complex64 pairs, forja as rotate-half halves; its MoE runs every expert on every token.
    tol=1e-5,
    # float64: transformers turns q and k through complex64 whatever the dtype (apply_rotary_emb
    # casts to float32), takes its router's sigmoid and its norms of x.float(); forja's norms
    # (the QK-norm over its rotate-half layout, so summed in another order) and router compute
    # at least in float32. In the float64 comparison all of them run in float64
    # (tests/unit/models/float64_casts.py), and transformers' rotary table, float32 on both
    # sides, takes cos and sin where it took torch.polar (an ulp apart): measured 0 (2.2e-6
    # as they were).
    float64_kept=("llama4.Llama4TextRMSNorm.forward", "llama4.Llama4TextWeightlessRMSNorm.forward",
                  "llama4.Llama4Router.forward", "llama4.apply_rotary_emb"),
    float64_fix=float64_casts.polar_as_cos_sin("llama4.Llama4TextRotaryEmbedding.forward"),
    tokens=40,  # 2.5 chunks of the base's 16, 5 of the variant's 8
    layout=checks.stored_shapes,
    # The 9-token prompt and 8 new tokens cross the base's 16-token chunk boundary and the
    # variant's 8 and 16, through transformers' chunked cache.
    greedy={"base": 8, "variant": 8},
    prepare_export=_biases,
    # (total, active per token, active without the input embedding); the totals equal
    # transformers' Llama4ForCausalLM for the same config.json (built on the meta device).
    # Meta's 109B / 400B totals include the vision encoder; 17B active.
    published={"scout-17b-16e": (107_769_861_120, 17_172_894_720, 16_138_408_960),
               "maverick-17b-128e": (400_711_848_960, 17_184_691_200, 16_150_205_440)},
    refusals=(
        ("base", dict(architectures=["Llama4ForConditionalGeneration"], model_type="llama4"),
         r"architectures=\['Llama4ForConditionalGeneration'\] is not supported .*only the text model"),
        ("base", dict(quantization_config={"quant_method": "fbgemm_fp8"}),
         r"quantization_config\.quant_method='fbgemm_fp8' is not supported"),
        ("base", dict(hidden_act="gelu"), r"hidden_act='gelu' is not supported"),
        ("base", dict(attention_dropout=0.1), r"attention_dropout=0\.1 is not supported"),
        ("base", dict(layer_types=["sliding_attention"] * 4), r"layer_types='sliding_attention' is not supported"),
        ("base", dict(rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}),
         r"rope_parameters\.rope_type='dynamic' is not supported"),
    ),
    export_refusals=tuple((overrides, f"a Llama 4 with {field}=") for overrides, field in [
        (dict(qk_norm=True), "qk_norm"), (dict(score_func="softmax"), "score_func"),
        (dict(scale_expert_input=False), "scale_expert_input"), (dict(n_shared_experts=0), "n_shared_experts"),
        (dict(norm_topk_prob=True), "norm_topk_prob"), (dict(attention_sinks=True), "attention_sinks"),
        (dict(capacity_factor=1.25), "capacity_factor")]),
)

checkpoints, loaded = checks.family_fixtures(CASE)
_tokens = functools.partial(checks.random_tokens, vocab_size=_SHAPE["vocab_size"])


def test_the_configs_reach_the_args(loaded):
    a = loaded["base"].args
    assert a.nope_layers == (1, 3) and a.moe_layers == (1, 2) and a.use_qk_norm
    assert [a.layer_type(i) for i in range(4)] == ["chunked_attention", "full_attention"] * 2
    v = loaded["variant"].args
    assert v.nope_layers == (0,) and v.moe_layers == (0, 1, 2) and not v.use_qk_norm and v.attention_bias
    assert [v.layer_type(i) for i in range(3)] == _VARIANT_TYPES and v.rope_scaling is None


@pytest.mark.parametrize(("name", "change"), [
    ("base", dict(layer_types=["full_attention"] * 4)),  # no chunks
    ("base", dict(attn_temperature_tuning=False)),
    ("base", dict(use_qk_norm=False)),
    ("base", dict(nope_layers=())),  # RoPE on every block
    ("base", dict(scale_expert_input=False)),  # each expert's output scaled instead
    ("variant", dict(layer_types=["full_attention"] * 3)),
    ("variant", dict(attn_temperature_tuning=False)),
])
@torch.no_grad()
def test_each_feature_changes_the_logits(checkpoints, loaded, name, change):
    """The comparison in test_conformance.py could not pass with any of them missing."""
    hf, model, tokens = checkpoints[name][1], loaded[name], _tokens(40)
    other = build_model("llama4", "debug", **{**_fields(model.args), **change})
    other.load_state_dict(model.state_dict())
    assert (other(tokens) - hf(tokens).logits).abs().max() > 1e-2


def _fields(args) -> dict:
    import dataclasses

    return {f.name: getattr(args, f.name) for f in dataclasses.fields(args)}


def test_the_chunked_mask_is_its_definition():
    """Causal within each chunk of the row, and within each document; a cache's queries see
    their own chunk's cached keys only."""
    T, chunk = 23, 5
    docs = torch.tensor([[0] * 7 + [1] * 11 + [2] * 5, [0] * 23])
    q, k = torch.arange(T)[:, None], torch.arange(T)[None, :]
    want = (q >= k) & (q // chunk == k // chunk) & (docs[:, :, None] == docs[:, None, :])
    assert torch.equal(build_mask(docs, q_len=T, kv_len=T, chunk=chunk).dense[:, 0], want)
    decode = build_mask(None, q_len=3, kv_len=T, chunk=chunk).dense[0, 0]  # the last 3 positions
    assert torch.equal(decode, ((q >= k) & (q // chunk == k // chunk))[-3:])
    assert build_mask(None, q_len=T, kv_len=T, chunk=T).is_causal  # one chunk: plain causal


def test_the_chunked_flex_mask_mod_is_the_dense_mask():
    from forja.models.common.attention import flex_mask_mod

    T, chunk = 19, 4
    docs = torch.tensor([[0] * 9 + [1] * 10])
    b, h = torch.zeros(1, 1, dtype=torch.long), torch.zeros(1, 1, dtype=torch.long)
    got = flex_mask_mod(docs, None, chunk)(b, h, torch.arange(T)[:, None], torch.arange(T)[None, :])
    assert torch.equal(got, build_mask(docs, q_len=T, kv_len=T, chunk=chunk).dense[0, 0])


@pytest.mark.parametrize("name", list(CASE.configs))
@torch.no_grad()
def test_packed_documents_match_transformers(checkpoints, loaded, name):
    hf, model = checkpoints[name][1], loaded[name]
    docs = torch.tensor([[0] * 13 + [1] * 9 + [2] * 18, [0] * 40])
    tokens = _tokens(40, seed=5)
    chunk = model.args.attention_chunk_size
    masks = checks.hf_document_masks(docs, "chunked_attention", lambda q, k: q // chunk == k // chunk)
    ref = hf(tokens, attention_mask=masks).logits
    diff = (ref - model(tokens, document_ids=docs)).abs().max().item()
    print(f"{name} packed: max |logit diff| = {diff:.3e}")
    assert diff < CASE.tol
    assert (ref - model(tokens)).abs().max() > 1e-2  # the documents do matter


def test_transformers_saves_its_module_layout_and_forja_permutes_q_and_k(checkpoints, loaded):
    from safetensors.torch import load_file

    path = checkpoints["base"][0]
    shapes = checks.stored_shapes(path)
    E, D, H = 4, 128, 64
    assert shapes["model.layers.1.feed_forward.experts.gate_up_proj"] == [E, D, 2 * H]  # x @ W, gate then up
    assert shapes["model.layers.1.feed_forward.experts.down_proj"] == [E, H, D]
    assert shapes["model.layers.2.feed_forward.shared_expert.gate_proj.weight"] == [H, D]
    assert shapes["model.layers.0.feed_forward.gate_proj.weight"] == [256, D]  # dense: intermediate_size_mlp
    stored = load_file(path / "model.safetensors")["model.layers.0.self_attn.q_proj.weight"]  # (H * 32, D)
    ours = loaded["base"].state_dict()["layers.0.attention.wq.weight"]
    assert torch.equal(ours[:16], stored[0:32:2]) and torch.equal(ours[16:32], stored[1:32:2])  # head 0's pairs
    gate_up = load_file(path / "model.safetensors")["model.layers.1.feed_forward.experts.gate_up_proj"]
    assert torch.equal(loaded["base"].state_dict()["layers.1.feed_forward.experts.w3"][2], gate_up[2, :, H:].T)


# -- the expert and router math, piece by piece --------------------------------------------

def test_the_mixture_of_experts_equals_transformers():
    """Llama4TextMoe on its own: top-k sigmoid routing, each expert's input scaled, the shared expert."""
    from forja.models.common.moe import MoE

    cfg = transformers.Llama4TextConfig(hidden_size=16, intermediate_size=24, num_local_experts=6,
                                        num_experts_per_tok=2, num_hidden_layers=1)
    torch.manual_seed(0)
    ref = transformers.models.llama4.modeling_llama4.Llama4TextMoe(cfg)
    with torch.no_grad():
        for p in ref.parameters():
            p.normal_(0.0, 0.5)
    args = model_args("llama4", "debug", dim=16, n_experts=6, top_k=2, moe_ffn_dim=24)
    moe = MoE(16, args).eval()
    sd = ref.state_dict()
    gate, up = sd["experts.gate_up_proj"].chunk(2, dim=-1)
    moe.load_state_dict({"router.gate.weight": sd["router.weight"], "experts.w1": gate.transpose(1, 2),
                         "experts.w3": up.transpose(1, 2), "experts.w2": sd["experts.down_proj"].transpose(1, 2),
                         **{f"shared_experts.{f}.weight": sd[f"shared_expert.{h}.weight"]
                            for h, f in (("gate_proj", "w1"), ("up_proj", "w3"), ("down_proj", "w2"))}})
    x = torch.randn(3, 7, 16)
    with torch.no_grad():
        want, _ = ref(x)
        got = moe(x)
    # float32 rounding against the largest output (weights drawn at std 0.5 make outputs of tens):
    # the experts' sums run in another order than transformers', and an output that cancels to
    # 0.08 carried 2.1e-6 of it on an AMD EPYC (0 on an Intel CPU with AMX).
    torch.testing.assert_close(got.reshape(-1, 16), want, atol=1e-6 * float(want.abs().max()), rtol=1e-6)


# -- training, sizes and refusals -----------------------------------------------------------

def test_a_packed_training_step_equals_its_documents_alone():
    """Chunks and temperatures by row position, so the second document is run alone at its own
    positions: the packed row's gradients are the documents' own."""
    model = build_model("llama4", "debug", seed=0).train()
    tokens, labels = _tokens(40, seed=6)[:1], _tokens(40, seed=7)[:1]
    cut = 16  # a chunk boundary: the second document's chunks are those it has alone
    docs = torch.tensor([[0] * cut + [1] * (40 - cut)])
    model(tokens, docs, labels=labels).backward()
    packed = {k: p.grad.clone() for k, p in model.named_parameters()}
    assert all(g.isfinite().all() for g in packed.values())
    model.zero_grad()
    a = model(tokens[:, :cut], labels=labels[:, :cut]) * (cut / 40)
    b = model(tokens[:, cut:], labels=labels[:, cut:], positions=torch.arange(cut, 40)) * ((40 - cut) / 40)
    (a + b).backward()
    for key, p in model.named_parameters():
        torch.testing.assert_close(packed[key], p.grad, atol=1e-6, rtol=1e-4, msg=key)


def test_debug_flavor_is_the_advertised_size():
    model = build_model("llama4", "debug", device="meta")
    assert 1.0e6 < model.num_params() < 2.0e6
    a = model.args
    kinds = [(a.is_nope_layer(i), a.layer_type(i), a.is_moe_layer(i)) for i in range(4)]
    assert kinds == [(False, "chunked_attention", False), (True, "full_attention", True),
                     (False, "chunked_attention", True), (True, "full_attention", False)]


@pytest.mark.parametrize("documents", [False, True])
def test_under_context_parallelism_chunks_mask_as_documents(documents):
    """Context parallelism masks a chunked block as causal attention within (document, chunk)
    pieces (ContextShards.within_chunks): the same mask as one device's chunked one. Loss parity
    of both kinds of CP: tests/distributed/test_parity_families.py."""
    from forja.parallel.cp import ContextShards
    from forja.parallel.cp.layout import SequenceLayout

    T, chunk = 24, 8
    docs = torch.tensor([[0] * 5 + [1] * 19, [0] * 12 + [1] * 12]) if documents else None
    layout = SequenceLayout("ring", 2, 0, T)
    cut = ContextShards(None, layout, docs, None, torch.device("cpu"), rows=2).within_chunks(chunk)
    same = cut.document_ids[:, :, None] == cut.document_ids[:, None, :]  # (B, T, T)
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    want = build_mask(docs, q_len=T, kv_len=T, chunk=chunk).dense  # (B or 1, 1, T, T)
    assert torch.equal((same & causal)[:, None], want.expand(2, 1, T, T))
    assert torch.equal(cut.local_document_ids, layout.take(cut.document_ids))


def test_args_refuse_chunked_blocks_without_a_chunk():
    with pytest.raises(ForjaError, match=r"chunked_attention blocks but model attention_chunk_size is None"):
        model_args("llama4", "debug", attention_chunk_size=None, layer_types=("chunked_attention",) * 4)
    assert model_args("llama4", "debug", attention_chunk_size=None).layer_types == ("full_attention",) * 4


def test_a_multimodal_checkpoint_is_refused_by_its_text_config(checkpoints, tmp_path):
    dst = checks.edited_checkpoint(checkpoints["base"][0], tmp_path / "ckpt", text_config={"hidden_size": 128})
    with pytest.raises(ForjaError, match=r"only the text model, Llama4ForCausalLM, is a forja family"):
        load_hf_checkpoint(dst)
