"""DeepSeek-V4 (forja/models/deepseek_v4) against transformers' DeepseekV4ForCausalLM on random
weights. test_conformance.py checks the CASE (load, save back tensor for tensor, export, greedy
decoding, refusals); here: the model built from copied weights, its debug flavor's training and
cached decoding, and what the model refuses. Tensor parallelism: test_tp_families.py."""

from __future__ import annotations

import pytest
import torch

from forja.models.deepseek_v4.hf import args_from_config
from forja.models.deepseek_v4.model import DeepSeekV4, DeepSeekV4Args
from tests.unit.models import family_checks as checks
from tests.unit.models.deepseek_v4_reference import ATTENTION_RENAMES

CONFIG = dict(vocab_size=97, hidden_size=32, num_attention_heads=4, head_dim=16, q_lora_rank=16,
              partial_rotary_factor=0.5, o_groups=2, o_lora_rank=8, index_n_heads=2, index_head_dim=8,
              index_topk=2, sliding_window=5, hc_mult=3, hc_sinkhorn_iters=6, n_routed_experts=6,
              num_experts_per_tok=2, moe_intermediate_size=16, num_hidden_layers=4, swiglu_limit=3.0,
              compress_rates={"compressed_sparse_attention": 2, "heavily_compressed_attention": 4},
              layer_types=["heavily_compressed_attention", "compressed_sparse_attention", "sliding_attention",
                           "compressed_sparse_attention"],
              num_hash_layers=2, compress_rope_theta=1000.0,
              rope_theta=100.0, max_position_embeddings=128, eos_token_id=None, bos_token_id=None)
# transformers' default attention schedule (HCA, HCA, then CSA/HCA alternating), YaRN on the
# compressed blocks (original context 16 < the tests' 48 tokens), sigmoid scores, tied
# embeddings, two streams.
YARN_TIED = dict(vocab_size=89, hidden_size=32, num_attention_heads=2, head_dim=32, q_lora_rank=8,
                 partial_rotary_factor=0.25, o_groups=1, o_lora_rank=16, index_n_heads=2, index_head_dim=16,
                 index_topk=3, sliding_window=7, hc_mult=2, hc_sinkhorn_iters=4, n_routed_experts=4,
                 num_experts_per_tok=1, moe_intermediate_size=24, num_hidden_layers=4, swiglu_limit=2.0,
                 mlp_layer_types=["hash_moe", "moe", "moe", "moe"], scoring_func="sigmoid", routed_scaling_factor=2.0,
                 tie_word_embeddings=True,
                 compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 3},
                 rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16,
                                  "beta_fast": 16.0, "beta_slow": 2.0},
                 rms_norm_eps=1e-5, max_position_embeddings=256, eos_token_id=None, bos_token_id=None)


def _randomize(model, seed: int) -> None:
    """Constants at init (norms, sinks, position biases, the hyper-connections' biases, the hash
    table, the balancing bias) drawn afresh: they would hide a misplaced weight."""
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1 or name.endswith(("position_bias", "hc_base", ".base")):
                p.add_(torch.randn(p.shape, generator=g) * 0.3)
        for name, b in model.named_buffers():
            if name.endswith("tid2eid"):
                b.copy_(torch.randint(0, model.config.n_routed_experts, b.shape, generator=g))
            elif name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape, generator=g) * 0.1)


def _make(name: str, config: checks.HFConfig, seed: int):
    model = checks.random_hf_model(config.cls, config.config, seed)
    model.config._attn_implementation = "eager"
    _randomize(model, seed)
    return model


def _noisy(model) -> None:
    """The exported flavor off its init: its indexer scores tie at init (ReLU of zeros), and a tie
    may break differently in transformers."""
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for _, p in model.named_parameters():
            p.add_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.05)


CASE = checks.FamilyCase(
    family="deepseek_v4",
    configs={"all_kinds": checks.HFConfig("DeepseekV4ForCausalLM", CONFIG),
             "yarn_tied": checks.HFConfig("DeepseekV4ForCausalLM", YARN_TIED)},
    make=_make,
    # Bound on max |logit difference| in float32; measured (transformers 5.25, torch 2.13, CPU): see the report.
    tol=1e-5,
    # float64: both sides compute the hyper-connections, the rotary tables, the compressors' softmax
    # and the indexer's scores in float32 whatever the dtype (transformers' modeling file casts
    # them; forja follows). The RMSNorms (the weightless one of the queries too) forja computes at
    # least in float32, transformers on x.float(): those run in float64 on both sides
    # (tests/unit/models/float64_casts.py), and forja's attention with sinks scores at least in
    # float32 as transformers' in the model's dtype. Measured 0 (1.2e-6 as they were).
    float64_kept=("deepseek_v4.DeepseekV4RMSNorm.forward", "deepseek_v4.DeepseekV4UnweightedRMSNorm.forward"),
    same_tensors=True,
    greedy={"all_kinds": 16, "yarn_tied": 16},
    prepare_export=_noisy,
    # DeepSeek-V4-Flash's shape (forja/models/deepseek_v4/__init__.py): 284B total and 13B
    # active as published; (total, active, active without the embedding).
    published={"flash": (284_332_230_231, 13_799_622_231, 13_270_091_351),
               "pro": (1_572_997_179_491, 49_779_058_787, 48_852_379_747)},
    fused={"all_kinds": ("model.layers.1.mlp.experts.gate_up_proj",)},
    refusals=(
        ("all_kinds", {"hidden_act": "gelu"}, r"hidden_act='gelu' is not supported"),
        ("all_kinds", {"mlp_bias": True}, r"mlp_bias=True is not supported"),
        ("all_kinds", {"quantization_config": {"quant_method": "fp8"}},
         r"quantization_config\.quant_method='fp8' is not supported; convert"),
        ("all_kinds", {"mlp_layer_types": ["moe", "hash_moe", "moe", "moe"]}, r"mlp_layer_types=.* is not supported"),
        ("all_kinds", {"rope_parameters": {"main": {"rope_type": "linear", "factor": 2.0, "rope_theta": 100.0,
                                                    "partial_rotary_factor": 0.5},
                                           "compress": {"rope_type": "default", "rope_theta": 1e3,
                                                        "partial_rotary_factor": 0.5}}},
         r"rope_parameters\.main\.rope_type='linear' is not supported"),
        ("yarn_tied", {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "attention_factor": 1.5,
                                           "original_max_position_embeddings": 16}},
         r"rope_parameters\.compress\.attention_factor=1\.5 is not supported"),
    ),
    export_refusals=(
        (dict(n_shared_experts=2), r"n_shared_experts=2 has no equivalent in transformers"),
        (dict(expert_bias=False), r"expert_bias=False has no equivalent in transformers"),
    ),
)

checkpoints, loaded = checks.family_fixtures(CASE)


def forja_state(hf_state: dict, inter: int) -> dict:
    """transformers' DeepseekV4ForCausalLM state -> forja's DeepSeekV4 names."""
    out = {}
    top = {"model.embed_tokens.weight": "tok_embeddings.weight", "model.norm.weight": "norm.weight",
           "lm_head.weight": "output.weight", "model.hc_head.hc_fn": "hc_head.fn",
           "model.hc_head.hc_base": "hc_head.base", "model.hc_head.hc_scale": "hc_head.scale"}
    for key, v in hf_state.items():
        if key in top:
            out[top[key]] = v
            continue
        key = key.removeprefix("model.")
        layer, rest = key.split(".", 2)[1], key.split(".", 2)[2]
        pre = f"layers.{layer}."
        if rest.startswith("self_attn."):
            rest = "attention." + rest.removeprefix("self_attn.")
            for old, new in ATTENTION_RENAMES:
                rest = rest.replace(old, new, 1)
        elif rest == "mlp.experts.gate_up_proj":
            out[pre + "feed_forward.experts.w1"], out[pre + "feed_forward.experts.w3"] = v[:, :inter], v[:, inter:]
            continue
        elif rest.startswith("mlp."):
            rest = "feed_forward." + rest.removeprefix("mlp.")
            for old, new in (("experts.down_proj", "experts.w2"), ("gate.e_score_correction_bias",
                             "router.expert_bias"), ("gate.tid2eid", "router.tid2eid"), ("gate.weight",
                             "router.gate.weight"), ("gate_proj", "w1"), ("up_proj", "w3"), ("down_proj", "w2")):
                rest = rest.replace(old, new, 1)
        else:
            rest = rest.replace("input_layernorm", "attention_norm").replace("post_attention_layernorm", "ffn_norm")
        out[pre + rest] = v
    return out


def _pair(seed: int = 0):
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    torch.manual_seed(seed)
    config = DeepseekV4Config(initializer_range=0.3, **CONFIG)
    config._attn_implementation = "eager"
    ref = DeepseekV4ForCausalLM(config).eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():  # constants at init would hide a misplaced weight
        for name, p in ref.named_parameters():
            if p.dim() == 1 or name.endswith(("position_bias", "hc_base", ".base")):
                p.add_(torch.randn(p.shape, generator=g) * 0.3)
        for name, b in ref.named_buffers():
            if name.endswith("tid2eid"):
                b.copy_(torch.randint(0, config.n_routed_experts, b.shape, generator=g))
            elif name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape, generator=g) * 0.1)
    # transformers' config says one MTP module (num_nextn_predict_layers = 1) and builds none
    ours = DeepSeekV4(args_from_config({**config.to_dict(), "num_nextn_predict_layers": 0})).eval()
    ours.load_state_dict(forja_state(ref.state_dict(), config.moe_intermediate_size))
    return ref, ours


def test_logits_match_transformers():
    ref, ours = _pair()
    tokens = torch.randint(0, CONFIG["vocab_size"], (2, 29), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        diff = (ours(tokens) - ref(tokens).logits).abs().max().item()
    print(f"deepseek_v4 fp32 max |logit diff| {diff:.2e}")
    assert diff < 1e-5


def test_greedy_decoding_matches_generate():
    from forja.generate import SamplingConfig, generate

    ref, ours = _pair(seed=1)
    prompt = torch.randint(0, CONFIG["vocab_size"], (2, 7), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        expected = ref.generate(prompt, max_new_tokens=14, do_sample=False)
    got = generate(ours, prompt, SamplingConfig(max_new_tokens=14))
    assert torch.equal(got, expected)


def _debug_model(**overrides) -> DeepSeekV4:
    from forja.models.deepseek_v4 import FLAVORS

    model = DeepSeekV4(DeepSeekV4Args(**{**FLAVORS["debug"], **overrides}))
    model.init_weights(seed=0)
    return model


def test_debug_flavor_trains_and_decodes_as_it_prefills():
    """The debug flavor (~1-2M parameters) initializes, every parameter but the indexers' gets a
    gradient (the top-k picks are not differentiable, and transformers trains no indexer loss),
    and logits decoded token by token through the KV cache equal the whole prefill's (the indexer
    keeping every entry here: at init its scores tie, at 0 after the ReLU, and a tie may break
    differently in a row of another length, in transformers as here)."""
    model = _debug_model(index_topk=16)
    assert 1_000_000 < model.num_params() < 2_000_000
    tokens = torch.randint(0, 2048, (2, 40), generator=torch.Generator().manual_seed(0))
    model(tokens[:, :-1], labels=tokens[:, 1:]).backward()
    missing = {n for n, p in model.named_parameters() if p.grad is None or p.grad.abs().max() == 0}
    assert missing == {n for n, _ in model.named_parameters() if ".indexer." in n}
    model.eval()
    with torch.no_grad():
        whole = model(tokens)
        cache = model.new_kv_cache(2, 40)
        parts = [model(tokens[:, :13], cache=cache)] + [model(tokens[:, t:t + 1], cache=cache) for t in range(13, 40)]
    assert (torch.cat(parts, dim=1) - whole).abs().max() < 1e-4


def _packed_and_alone(model, rows: list[list[int]], seed: int):
    """(the packed rows' logits (B, T, V), each document's logits run as its own row, in place)."""
    T = sum(rows[0])
    tokens = torch.randint(0, 2048, (len(rows), T), generator=torch.Generator().manual_seed(seed))
    docs = torch.tensor([[d for d, n in enumerate(lengths) for _ in range(n)] for lengths in rows])
    alone = []
    for b, lengths in enumerate(rows):
        starts = [sum(lengths[:d]) for d in range(len(lengths))]
        alone.append(torch.cat([model(tokens[b:b + 1, s:s + n]) for s, n in zip(starts, lengths)], dim=1))
    return model(tokens, docs), torch.cat(alone)


def test_a_packed_row_computes_each_document_as_if_alone():
    """Documents shorter and longer than the window (16), of lengths no ratio (4, 8) divides:
    the compressors pool each document's windows from its first token, its first CSA window has
    none before it, the indexer picks and a query sees only its own document's entries. The
    logits and every trained gradient equal each document's run alone. 16 indexer heads: an
    entry scores exactly 0 only when every head's ReLU is 0, and such ties at the k-th place
    would be broken by topk differently in the two layouts (transformers' model has the same
    ambiguity); with 4 heads the debug flavor meets one."""
    model = _debug_model(index_n_heads=16)
    gen = torch.Generator().manual_seed(9)
    with torch.no_grad():  # position biases, sinks and gains off their init: a shifted slot shows
        for name, p in model.named_parameters():
            if p.dim() == 1 or name.endswith("position_bias"):
                p.add_(0.3 * torch.randn(p.shape, generator=gen))
    rows = [[13, 30, 5, 21], [40, 29]]
    packed, alone = _packed_and_alone(model, rows, seed=4)
    diff = (packed - alone).abs().max().item()
    print(f"deepseek_v4 packed against alone: max |logit diff| {diff:.2e}")
    assert diff < 1e-5
    # Gradients in float64: a gain's gradient sums ~140 tokens' small terms that cancel, and the
    # two layouts sum them in another order (the hyper-connections stay float32 inside).
    packed, alone = _packed_and_alone(model.double(), rows, seed=4)
    weights = torch.randn(packed.shape, generator=gen, dtype=torch.float64)
    grads = []
    for out in (packed, alone):
        model.zero_grad()
        (out * weights).sum().backward(retain_graph=True)
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys() and len(grads[0]) > 50
    worst = max(((g - grads[1][n]).abs().max() / grads[1][n].abs().max()).item() for n, g in grads[0].items())
    print(f"worst gradient difference, relative to the tensor's largest: {worst:.1e}")  # measured 1.4e-6
    assert worst < 1e-5


def test_pipeline_stages_in_a_row_compute_the_whole_models_loss_and_gradients():
    """Stages as forja/parallel/pp_split.py cuts them, run one after the other: each hands the
    next its hc_mult streams flattened (stage_widths), reads the token ids for its hash-routed
    blocks, and only the last holds the streams' head; the loss and every gradient equal the
    whole model's."""
    from forja.errors import ForjaError
    from forja.parallel.pp_split import stage_part

    model = _debug_model(n_hash_layers=2)  # blocks 0 and 1 hash-routed: one on the middle stage
    counts = [1, 2, 1]
    tokens = torch.randint(0, 2048, (2, 33), generator=torch.Generator().manual_seed(5))
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    model(inputs, labels=labels).backward()
    parts = [stage_part(model, s, counts) for s in range(3)]
    for part in parts:
        part.zero_grad()
    assert [part.hc_head is not None for part in parts] == [False, False, True]
    with pytest.raises(ForjaError, match="needs the token ids"):
        parts[1](parts[0](inputs))
    h = inputs
    for part in parts[:-1]:
        h = part(h, token_ids=inputs)
        assert h.shape == (2, 32, part.stage_widths()[1]) == (2, 32, 4 * 128)
    loss = parts[-1](h, labels=labels, token_ids=inputs)
    loss.backward()
    assert loss.item() == model(inputs, labels=labels).item()
    grads = {n: p.grad for part in parts for n, p in part.named_parameters() if p.grad is not None}
    assert set(grads) == {n for n, p in model.named_parameters() if p.grad is not None}
    assert max((grads[n] - p.grad).abs().max().item() for n, p in model.named_parameters() if n in grads) < 1e-6


def test_the_layout_validator_takes_tensor_parallelism_that_splits_whole_heads_and_groups():
    """TP splits the query heads and the output projection's groups with them (parallelize.py):
    the validator takes a tp that divides both, and names the field that a tp does not divide."""
    from forja.models import model_args
    from forja.parallel.checks import LayoutRequest, layout_errors
    from forja.parallel.config import ParallelConfig

    def errors(tp: int, **overrides) -> list[str]:
        args = model_args("deepseek_v4", "debug", **overrides)
        return layout_errors(LayoutRequest(args=args, parallel=ParallelConfig(tp=tp, dp_shard=1), world_size=tp,
                                           seq_len=64, global_batch_size=2, micro_batch_size=2))

    assert errors(2) == []  # 4 heads in 2 groups, 6 experts: one key/value head, whole on each rank
    assert any("model o_groups = 1 (parallel.tp = 2)" in e for e in errors(2, o_groups=1))
    assert any("model n_heads = 6 (parallel.tp = 4)" in e for e in errors(4, n_heads=6, o_groups=2))


def test_the_layout_validator_takes_context_and_pipeline_parallelism_and_document_masks_but_not_both():
    """All-to-all context parallelism keeps every query head on its rank (forja/parallel/cp/
    compressed.py), so its degree need not divide n_heads; both kinds and pipelines pass, with
    each other and with tensor parallelism; packed documents with their masks pass but under
    context parallelism (its chunks count the compressors' windows from the row's start)."""
    from forja.models import model_args
    from forja.parallel.checks import LayoutRequest, layout_errors
    from forja.parallel.config import ParallelConfig

    def errors(documents: bool = False, **degrees) -> list[str]:
        world = degrees.get("cp", 1) * degrees.get("pp", 1) * degrees.get("tp", 1)
        request = LayoutRequest(args=model_args("deepseek_v4", "debug"), world_size=world,
                                parallel=ParallelConfig(dp_shard=1, **degrees), seq_len=64, global_batch_size=4,
                                micro_batch_size=2, document_mask=documents)
        return layout_errors(request)

    assert errors(cp=8, cp_kind="all-to-all") == []  # 4 query heads, 8 ranks
    assert errors(cp=2, cp_kind="ring", pp=2) == [] and errors(cp=2, cp_kind="all-to-all", tp=2) == []
    assert errors(documents=True) == [] and errors(documents=True, pp=2, tp=2) == []
    assert set(model_args("deepseek_v4", "debug").layout_limits()) == {"cp_documents"}
    assert any("model.document_mask = true with parallel.cp = 2" in e for e in errors(documents=True, cp=2))
