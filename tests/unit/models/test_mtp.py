"""Multi-token prediction (forja/models/common/mtp.py): the losses against an independent
computation, packed documents, gradients, depth 0 unchanged, counts, the step engine's
metrics and a short training run, and DeepSeek-V3 checkpoints with their MTP layer."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from forja.config import config_from_dict
from forja.errors import ForjaError
from forja.models import build_from_args, load_hf_checkpoint, model_args, save_hf_checkpoint
from forja.models.common.mtp import IGNORE, mtp_targets
from forja.models.config import ModelConfig, run_model_args
from tests.helpers import max_logit_diff

# A small DeepSeek-V3: a dense block, then experts (the MTP blocks are MoE blocks, as published).
_TINY = dict(dim=64, n_layers=2, n_heads=4, ffn_dim=128, vocab_size=256, max_seq_len=64, q_lora_rank=32,
             kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, n_experts=4, top_k=2,
             moe_ffn_dim=32, n_shared_experts=1, n_expert_groups=1, topk_groups=1)


def _model(depth: int, seed: int = 0, weight: float = 0.3):
    model = build_from_args(model_args("deepseek_v3", "debug", **_TINY, mtp_depth=depth, mtp_loss_weight=weight),
                            seed=seed)
    with torch.no_grad():  # a trained-looking balancing bias, so that routing differs per token
        for name, buf in model.named_buffers():
            buf.normal_(0.0, 0.1, generator=torch.Generator().manual_seed(len(name)))
    return model


def _batch(T: int = 24, seed: int = 1):
    gen = torch.Generator().manual_seed(seed)
    stream = torch.randint(0, 256, (2, T + 1), generator=gen)
    docs = torch.tensor([[0] * 10 + [1] * (T - 10), [0] * T])  # (2, T): row 0 packs two documents
    return stream[:, :-1], stream[:, 1:], docs


def _final_hidden(model, tokens, docs) -> torch.Tensor:
    """The main model's normalized final hidden states (B, T, d), read off its final norm."""
    seen = []
    handle = model.norm.register_forward_hook(lambda mod, args, out: seen.append(out))
    model(tokens, docs)
    handle.remove()
    return seen[0]


def _reference_losses(model, tokens, labels, docs) -> list[torch.Tensor]:
    """Each depth's loss written out: the rows cut to the positions that still have an input
    token, the concatenated projection as two matmuls, the targets gathered position by
    position and the cross-entropy as log-softmax."""
    d = model.args.dim
    h = _final_hidden(model, tokens, docs)  # (B, T, d)
    B, T = tokens.shape
    out = []
    for k, module in enumerate(model.mtp.layers.values(), start=1):
        n = T - k  # positions i with a token t_{i+k} in the row
        rope = model.rope_tables_for("full_attention", torch.arange(n))
        mask = model.mask_for("full_attention", docs[:, :n], n, 0, tokens.device)
        w = module.proj.weight  # (d, 2d): embedding columns first
        emb = model.tok_embeddings(tokens[:, k:])  # (B, n, d)
        x = module.enorm(emb) @ w[:, :d].T + module.hnorm(h[:, :n]) @ w[:, d:].T  # (B, n, d)
        h = module.norm(module.block(x, rope, mask))  # (B, n, d)
        logp = torch.log_softmax(model.output(h).float(), dim=-1)  # (B, n, V)
        terms = [-logp[b, i, labels[b, i + k]] for b in range(B) for i in range(n)
                 if i + k + 1 < T and docs[b, i + k + 1] == docs[b, i]]
        out.append(torch.stack(terms).mean())
    return out


@pytest.fixture(scope="module")
def depth2():
    return _model(2)


def test_losses_equal_an_independent_computation(depth2):
    tokens, labels, docs = _batch()
    ref = _reference_losses(depth2, tokens, labels, docs)
    depth2.mtp.take_stats()
    depth2(tokens, docs, labels=labels)
    stats = depth2.mtp.take_stats()
    ours = [s / stats.forwards for s in stats.losses]
    diffs = [abs(a.item() - b.item()) for a, b in zip(ours, ref, strict=True)]
    print(f"reference vs module: |diff| per depth = {diffs}")  # measured: 0.0 at both depths (fp32, CPU)
    assert max(diffs) < 2e-6 and all(r.item() > 4.0 for r in ref)  # ~ln(256) at random init


def test_targets_stop_at_the_document_and_the_row():
    tokens = torch.arange(10, 18)[None]  # (1, 8)
    labels = torch.arange(11, 19)[None]
    docs = torch.tensor([[0, 0, 0, 0, 0, 1, 1, 1]])
    inputs, targets = mtp_targets(tokens, labels, docs, 2)
    assert inputs.tolist() == [[12, 13, 14, 15, 16, 17, 0, 0]]
    # Position i's target t_{i+3} counts while position i+3 is in i's document (0..4) and the row.
    assert targets.tolist() == [[13, 14, IGNORE, IGNORE, IGNORE, IGNORE, IGNORE, IGNORE]]
    _, targets = mtp_targets(tokens, labels, None, 2)
    assert targets.tolist() == [[13, 14, 15, 16, 17, IGNORE, IGNORE, IGNORE]]


def test_a_packed_row_scores_each_document_as_if_alone(depth2):
    """Two documents packed in a row give each depth the loss of the two run as rows of their
    own: no target past a document's end is counted, no position sees the other document."""
    tokens, labels, docs = _batch()
    T = tokens.shape[1]

    def losses(t, y, d=None):
        depth2.mtp.take_stats()
        depth2(t, d, labels=y)
        return torch.stack(depth2.mtp.take_stats().losses)  # (depth,)

    packed = losses(tokens[:1], labels[:1], docs[:1])
    alone_a = losses(tokens[:1, :10], labels[:1, :10])
    alone_b = losses(tokens[:1, 10:], labels[:1, 10:])
    k = torch.tensor([1.0, 2.0])
    n_a, n_b = 10 - k - 1, T - 10 - k - 1  # positions whose target is inside the document
    expected = (alone_a * n_a + alone_b * n_b) / (n_a + n_b)
    print(f"packed vs alone: max |diff| = {(packed - expected).abs().max():.2e}")
    assert (packed - expected).abs().max() < 1e-5
    unmasked = losses(tokens[:1], labels[:1])  # the same row read as one document: differs
    assert (unmasked - expected).abs().min() > 1e-3


def test_gradients_reach_the_modules_and_the_shared_embedding_as_the_weighted_sum():
    model = _model(2, weight=0.5)
    tokens, labels, docs = _batch()
    model(tokens, docs, labels=labels).backward()
    ours = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    main = F.cross_entropy(model(tokens, docs).flatten(0, 1).float(), labels.flatten())
    (main + 0.5 / 2 * sum(_reference_losses(model, tokens, labels, docs))).backward()
    for name in ("mtp.layers.2.proj.weight", "mtp.layers.3.block.attention.wkv_b.weight",
                 "mtp.layers.3.enorm.weight", "tok_embeddings.weight", "output.weight"):
        assert ours[name].abs().sum() > 0, name
    worst = max((ours[n] - p.grad).abs().max().item() for n, p in model.named_parameters() if n in ours)
    print(f"gradients vs main + weighted reference: max |diff| = {worst:.2e}")
    assert worst < 1e-5


def test_depth_0_is_the_model_and_loss_of_before():
    plain, with_mtp = _model(0), _model(1)
    assert plain.mtp is None and not any(n.startswith("mtp") for n in plain.state_dict())
    main = {n: p for n, p in with_mtp.state_dict().items() if not n.startswith("mtp.")}
    assert list(main) == list(plain.state_dict())
    assert all(torch.equal(p, main[n]) for n, p in plain.state_dict().items())  # init is per name
    tokens, labels, docs = _batch()
    before = F.cross_entropy(plain(tokens, docs).flatten(0, 1).float(), labels.flatten())
    assert torch.equal(plain(tokens, docs, labels=labels), before)
    assert torch.equal(with_mtp(tokens, docs, labels=labels), before)  # the reported loss stays the main one
    with_mtp.eval()
    with_mtp.mtp.take_stats()
    with_mtp(tokens, docs, labels=labels)
    assert with_mtp.mtp.take_stats().forwards == 0  # validation does not run the modules


def test_counts_include_the_modules():
    plain, with_mtp = _model(0), _model(2)
    extra = sum(p.numel() for p in with_mtp.mtp.parameters())
    block = sum(p.numel() for p in plain.layers["1"].parameters())
    assert extra == 2 * (block + 3 * 64 + 2 * 64 * 64)  # a block, three norms and the 2d -> d projection
    assert with_mtp.num_params() == plain.num_params() + extra
    active_block = block - (plain.num_params() - plain.num_active_params())  # plain's one MoE block is layer 1
    a = plain.args
    per_depth = 6 * (active_block + 3 * 64 + 2 * 64 * 64) + plain.mixer_flops("full_attention", 32) \
        + 6 * a.vocab_size * a.dim
    assert with_mtp.flops_per_token(32) == plain.flops_per_token(32) + 2 * per_depth


def test_config_section_and_hf_name():
    cfg = config_from_dict({"model": {"family": "deepseek_v3", "mtp": {"depth": 2, "loss_weight": 0.1}}}).model
    args = run_model_args(cfg, 2048)
    assert (args.mtp_depth, args.mtp_loss_weight) == (2, 0.1)
    assert run_model_args(ModelConfig(family="deepseek_v3"), 2048).mtp_depth == 0
    with pytest.raises(ForjaError, match="model.mtp.deepth"):
        config_from_dict({"model": {"mtp": {"deepth": 1}}})
    with pytest.raises(ForjaError, match="model.mtp.depth = -1"):
        config_from_dict({"model": {"mtp": {"depth": -1}}})


# -- the step engine ------------------------------------------------------------------------

@dataclass
class Batch:
    input_ids: torch.Tensor
    labels: torch.Tensor
    document_ids: torch.Tensor


def _engine(dims, depth: int, parallel=None):
    from forja.optim import OptimizerGroup, SchedulerGroup
    from forja.optim.config import OptimConfig, ScheduleConfig
    from forja.parallel import ParallelConfig
    from forja.train.build import build_model_parts
    from forja.train.step.build import build_engine

    args = model_args("deepseek_v3", "debug", **_TINY, mtp_depth=depth)
    parts = build_model_parts(args, dims, parallel or ParallelConfig(), device=torch.device("cpu"), seed=0).parts
    optimizers = OptimizerGroup(parts, OptimConfig(lr=3e-3))
    scheduler = SchedulerGroup(optimizers.optimizers, ScheduleConfig(name="constant", warmup_steps=0), 10)
    return build_engine(parts, None, optimizers, scheduler, dims, precision="fp32", device=torch.device("cpu"),
                        grad_clip=1.0, document_mask=True)


def test_engine_logs_each_depth_and_reports_the_main_loss(dims):
    engine = _engine(dims, depth=2)
    tokens, labels, docs = _batch()
    batches = [Batch(tokens, labels, docs), Batch(tokens.flip(0), labels.flip(0), docs.flip(0))]
    with torch.no_grad():
        engine.model.eval()
        main = sum(engine.eval_loss(b) for b in batches) / 2
        engine.model.train()
        expected = []
        for b in batches:
            engine.model(b.input_ids, b.document_ids, labels=b.labels)
            expected.append(torch.stack(engine.model.mtp.take_stats().losses))
    out = engine.train_step(batches)
    assert out.loss == pytest.approx(main.item(), abs=1e-6)  # the MTP losses are not in `loss`
    for k in (1, 2):
        assert out.metrics[f"mtp/loss_{k}"] == pytest.approx(((expected[0] + expected[1]) / 2)[k - 1].item(),
                                                              abs=1e-6)


def test_training_with_depth_1_lowers_both_losses(dims):
    engine = _engine(dims, depth=1)
    tokens, labels, docs = _batch(T=32)
    batch = [Batch(tokens, labels, docs)]
    outs = [engine.train_step(batch) for _ in range(8)]
    losses, mtp = [o.loss for o in outs], [o.metrics["mtp/loss_1"] for o in outs]
    print(f"loss {[round(x, 3) for x in losses]}\nmtp/loss_1 {[round(x, 3) for x in mtp]}")
    assert losses[-1] < losses[0] - 0.5 and mtp[-1] < mtp[0] - 0.3


# -- DeepSeek-V3 checkpoints with their MTP layer -----------------------------------------

transformers = pytest.importorskip("transformers")

_HF = dict(vocab_size=256, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_attention_heads=4,
           num_key_value_heads=4, q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8,
           v_head_dim=12, max_position_embeddings=128, n_routed_experts=4, n_shared_experts=1,
           num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=1, routed_scaling_factor=2.5,
           norm_topk_prob=True, initializer_range=0.1, rope_parameters={"rope_type": "default", "rope_theta": 1e4})


def _hf_model(n_layers: int, seed: int):
    torch.manual_seed(seed)
    model = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(num_hidden_layers=n_layers,
                                                                             num_nextn_predict_layers=1, **_HF))
    with torch.no_grad():
        for layer in model.model.layers:
            if hasattr(layer.mlp, "gate"):
                layer.mlp.gate.e_score_correction_bias.normal_(0.0, 0.1)
    return model.eval()


@pytest.fixture(scope="module")
def mtp_checkpoint(tmp_path_factory):
    """(directory, transformers' main model, the directory of a 3-layer model whose layer 2 is
    the MTP layer's block): a 2-layer checkpoint plus the published MTP tensors of layer 2."""
    hf = _hf_model(2, seed=0)
    path = tmp_path_factory.mktemp("mtp")
    hf.save_pretrained(path)
    donor = _hf_model(3, seed=1)
    donor_path = tmp_path_factory.mktemp("donor")
    donor.save_pretrained(donor_path)
    tensors = load_file(path / "model.safetensors")
    gen = torch.Generator().manual_seed(2)
    tensors |= {k: v for k, v in load_file(donor_path / "model.safetensors").items()
                if k.startswith("model.layers.2.")}  # a full MoE decoder block
    tensors |= {f"model.layers.2.{name}": 1 + 0.1 * torch.randn(64, generator=gen)
                for name in ("enorm.weight", "hnorm.weight", "shared_head.norm.weight")}
    tensors["model.layers.2.eh_proj.weight"] = 0.1 * torch.randn(64, 128, generator=gen)
    # The published layer's copies of the shared embedding and head.
    tensors["model.layers.2.embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()
    tensors["model.layers.2.shared_head.head.weight"] = tensors["lm_head.weight"].clone()
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    return path, hf, donor_path


def test_mtp_layer_loads_saves_bit_exact_and_main_logits_match(mtp_checkpoint, tmp_path):
    path, hf, donor_path = mtp_checkpoint
    model = load_hf_checkpoint(path)
    assert model.args.mtp_depth == 1 and list(model.mtp.layers) == ["2"]
    stored = load_file(path / "model.safetensors")
    mtp = model.mtp.layers["2"]
    for hf_name, ours in [("eh_proj", mtp.proj), ("enorm", mtp.enorm), ("hnorm", mtp.hnorm),
                          ("shared_head.norm", mtp.norm), ("self_attn.o_proj", mtp.block.attention.wo),
                          ("mlp.gate", mtp.block.feed_forward.router.gate)]:
        assert torch.equal(ours.weight, stored[f"model.layers.2.{hf_name}.weight"]), hf_name
    assert torch.equal(mtp.block.feed_forward.experts.w2[3], stored["model.layers.2.mlp.experts.3.down_proj.weight"])
    # The block computes what the same tensors compute as a main layer (whose parity with transformers
    # test_deepseek_v3.py checks): rotary rows were permuted as in the main layers.
    donor = load_hf_checkpoint(donor_path)
    x = torch.randn(2, 16, 64, generator=torch.Generator().manual_seed(3))
    rope, mask = model.rope_tables_for("full_attention", torch.arange(16)), model.mask_for(
        "full_attention", None, 16, 0, x.device)
    with torch.no_grad():
        assert torch.equal(mtp.block(x, rope, mask), donor.layers["2"](x, rope, mask))
    tokens = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(4))
    diff = max_logit_diff(hf, model, tokens)
    print(f"main logits with the MTP layer loaded: max |diff| = {diff:.2e}")  # measured: 0.0
    assert diff < 1e-5
    out = save_hf_checkpoint(model, tmp_path / "export")
    saved = load_file(out / "model.safetensors")
    assert sorted(saved) == sorted(stored)
    for key, value in stored.items():
        assert torch.equal(saved[key], value), key
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out).eval()  # skips the MTP layer
    assert max_logit_diff(reloaded, model, tokens) < 1e-5


def test_a_checkpoint_counting_mtp_layers_it_does_not_hold(mtp_checkpoint, tmp_path):
    """transformers writes num_nextn_predict_layers = 1 without MTP tensors: the main model
    loads; a checkpoint with part of a module names the missing tensor."""
    path, hf, _ = mtp_checkpoint
    tensors = load_file(path / "model.safetensors")
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    save_file({k: v for k, v in tensors.items() if not k.startswith("model.layers.2.")},
              tmp_path / "model.safetensors", metadata={"format": "pt"})
    model = load_hf_checkpoint(tmp_path)
    assert model.mtp is None and model.args.mtp_depth == 0
    save_file({k: v for k, v in tensors.items() if k != "model.layers.2.hnorm.weight"},
              tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ForjaError, match="model.layers.2.hnorm.weight is missing"):
        load_hf_checkpoint(tmp_path)


def test_the_planner_counts_the_modules():
    from forja.plan.shape import model_shape

    plain, with_mtp = _model(0), _model(2)
    before, after = model_shape(plain.args, 32), model_shape(with_mtp.args, 32)
    assert len(after.blocks) == 2 + 2 and after.n_params == with_mtp.num_params()
    # What the modules add, as the model counts it (the planner leaves the final norm's 6 x 64 out either way).
    added = with_mtp.flops_per_token(32) - plain.flops_per_token(32)
    assert after.flops_per_token - before.flops_per_token == added > 0


@pytest.mark.parametrize("parallel", [dict(tp=2, dp_shard=1), dict(cp=2), dict(ep=2)])
def test_the_layout_validator_refuses_model_splits_with_mtp(parallel):
    from forja.parallel.checks import LayoutRequest, layout_errors
    from forja.parallel.config import ParallelConfig

    def errors(depth):
        args = model_args("deepseek_v3", "debug", mtp_depth=depth)
        return layout_errors(LayoutRequest(args=args, parallel=ParallelConfig(**parallel), world_size=2, seq_len=64,
                                           global_batch_size=8, micro_batch_size=2))

    name = next(iter(parallel))
    mtp = [e for e in errors(1) if "multi-token prediction" in e]
    assert mtp == [f"parallel.{name} = 2 with multi-token prediction (model.mtp.depth = 1) is not supported yet; "
                   f"set parallel.{name} = 1 (data parallel, FSDP and pipelines run it) or model.mtp.depth = 0"]
    assert not [e for e in errors(0) if "multi-token prediction" in e]
    for runs in (dict(dp_shard=2), dict(pp=2, dp_shard=1)):
        assert layout_errors(LayoutRequest(args=model_args("deepseek_v3", "debug", mtp_depth=1),
                                           parallel=ParallelConfig(**runs), world_size=2, seq_len=64,
                                           global_batch_size=8, micro_batch_size=2)) == []


def test_a_pipeline_split_puts_the_modules_on_the_last_stage():
    from forja.parallel.pp_split import stage_part

    model = build_from_args(model_args("deepseek_v3", "debug", **_TINY, mtp_depth=1), device="meta")
    first, last = stage_part(model, 0, [1, 1]), stage_part(model, 1, [1, 1])
    assert first.mtp is None and last.mtp is not None and list(last.mtp.layers) == ["2"]
    # The last stage embeds the next tokens with its own copy, kept as the embedding is.
    assert last.mtp.embed is not None and last.tok_embeddings is None
    assert last.tied_parameters()["mtp.embed.weight"] == first.tied_parameters()["tok_embeddings.weight"]
    assert model.tied_parameters() == {}  # the whole (untied) model holds the embedding once


def test_a_last_stage_computes_the_losses_the_whole_model_does():
    """Stage 1 gets stage 0's hidden states, not ids: its MTP inputs come from the labels."""
    from forja.parallel.pp_split import stage_part

    whole = build_from_args(model_args("deepseek_v3", "debug", **_TINY, mtp_depth=2), seed=3).train()
    first, last = (stage_part(whole, s, [1, 1]) for s in (0, 1))
    last.mtp.embed.weight = whole.tok_embeddings.weight  # what the copy's init and gradient sum keep
    tokens = torch.randint(0, whole.args.vocab_size, (2, 17), generator=torch.Generator().manual_seed(0))
    docs = torch.tensor([[0] * 9 + [1] * 7, [0] * 16])
    x, y = tokens[:, :-1], tokens[:, 1:]
    whole(x, docs, labels=y)
    expected = torch.stack(whole.mtp.take_stats().losses)
    last(first(x, docs), docs, labels=y)
    torch.testing.assert_close(torch.stack(last.mtp.take_stats().losses), expected, rtol=0, atol=1e-6)


def test_checkpoint_identity_ignores_the_loss_weight_and_depth_0():
    from forja.checkpoint.identity import check_model_identity, model_identity, plain_args

    before_mtp = plain_args(model_args("deepseek_v3", "debug"))
    assert "mtp_depth" not in before_mtp and "mtp_loss_weight" not in before_mtp  # as checkpoints from before
    a = model_identity("deepseek_v3", "debug", model_args("deepseek_v3", "debug", mtp_depth=1, mtp_loss_weight=0.3))
    b = model_identity("deepseek_v3", "debug", model_args("deepseek_v3", "debug", mtp_depth=1, mtp_loss_weight=0.1))
    check_model_identity(a, b)  # lowering lambda mid-run resumes
    with pytest.raises(ForjaError, match="use the same model.. settings"):  # a checkpoint with modules, a run without
        check_model_identity(a, model_identity("deepseek_v3", "debug", model_args("deepseek_v3", "debug")))


def test_fused_cross_entropy_ignores_the_same_targets():
    """With model.fused_ops' cross_entropy (the op forja.ops dispatches: its PyTorch reference
    here) the depths' losses are those of the plain loss: the IGNORE targets count for nothing."""
    tokens, labels, docs = _batch()
    out = []
    for fused in ((), ("cross_entropy",)):
        model = build_from_args(model_args("deepseek_v3", "debug", **_TINY, mtp_depth=2, fused_ops=fused), seed=0)
        model(tokens, docs, labels=labels)
        out.append(torch.stack(model.mtp.take_stats().losses))
    assert (out[0] - out[1]).abs().max() < 1e-5
