"""DeepSeek-V4's multi-token prediction (forja/models/deepseek_v4/model.py, HyperConnectedMTP):
each depth's loss against the published forward written out by hand, gradients, a pipeline's
last stage, checkpoints under DeepSeek's release names (transformers builds no MTP and reads
forja's save as the main model), and a short training run that lowers both losses."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from forja.errors import ForjaError
from forja.models import build_from_args, load_hf_checkpoint, model_args, save_hf_checkpoint
from tests.helpers import max_logit_diff


def _model(depth: int, seed: int = 0):
    model = build_from_args(model_args("deepseek_v4", "debug", mtp_depth=depth), seed=seed)
    gen = torch.Generator().manual_seed(seed + 7)
    with torch.no_grad():  # norms and gains away from one, biases from zero: a swapped tensor shows
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.add_(0.3 * torch.randn(p.shape, generator=gen))
        for name, b in model.named_buffers():
            if name.endswith("expert_bias"):
                b.normal_(0.0, 0.1, generator=gen)
    return model


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def _reference_losses(model, tokens: torch.Tensor, labels: torch.Tensor) -> list[torch.Tensor]:
    """DeepSeek's MTPBlock.forward and ParallelHead written out: e = enorm(embed(next ids)),
    x = e_proj(e) added to h_proj(hnorm(streams)) of every stream, the block, then the
    module's own stream collapse (sigmoid weights of the rms-normalized flat streams), its
    norm and the shared head; rows cut to the positions that still have an input token."""
    a = model.args
    seen = []
    handle = model.hc_head.register_forward_hook(lambda mod, args, out: seen.append(args[0]))
    model(tokens)
    handle.remove()
    streams = seen[0]  # (B, T, n, D): the main model's streams before their collapse
    B, T = tokens.shape
    out = []
    for k, m in enumerate(model.mtp.layers.values(), start=1):
        n = T - k
        rope = model.rope_tables_for("sliding_attention", torch.arange(n))
        mask = model.mask_for("sliding_attention", None, n, 0, tokens.device)
        e = _rms(model.tok_embeddings(tokens[:, k:]), m.enorm.weight, a.norm_eps)  # (B, n, D)
        h = _rms(streams[:, :n], m.hnorm.weight, a.norm_eps)  # (B, n, hc, D)
        streams = m.block(F.linear(e, m.e_proj.weight)[:, :, None] + F.linear(h, m.h_proj.weight), rope, mask)
        flat = streams.flatten(2)  # (B, n, hc D)
        mixes = F.linear(flat * torch.rsqrt(flat.pow(2).mean(-1, keepdim=True) + a.norm_eps), m.hc_head.fn)
        pre = torch.sigmoid(mixes * m.hc_head.scale + m.hc_head.base) + a.hc_eps  # (B, n, hc)
        y = _rms((pre[..., None] * streams).sum(2), m.norm.weight, a.norm_eps)  # (B, n, D)
        logp = torch.log_softmax(model.output(y), dim=-1)  # (B, n, V)
        terms = [-logp[b, i, labels[b, i + k]] for b in range(B) for i in range(n) if i + k + 1 < T]
        out.append(torch.stack(terms).mean())
    return out


def _batch(T: int = 24, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    stream = torch.randint(0, 2048, (2, T + 1), generator=torch.Generator().manual_seed(seed))
    return stream[:, :-1], stream[:, 1:]


@pytest.fixture(scope="module")
def depth2():
    return _model(2).train()


def test_each_depth_is_the_published_forward(depth2):
    tokens, labels = _batch()
    with torch.no_grad():
        depth2(tokens, labels=labels)
        got = depth2.mtp.take_stats().losses
        expected = _reference_losses(depth2, tokens, labels)
    print("V4 MTP losses", [round(x.item(), 4) for x in got], [round(x.item(), 4) for x in expected])
    torch.testing.assert_close(torch.stack(got), torch.stack(expected), rtol=0, atol=1e-5)


def test_the_modules_sit_after_the_main_layers_with_sliding_attention_and_top_k_experts(depth2):
    assert list(depth2.mtp.layers) == ["4", "5"]
    block = depth2.mtp.layers["4"].block
    assert block.attention.kind == "sliding_attention" and not block.feed_forward.router.hashed
    assert depth2.args.layer_type(4) == "sliding_attention"


def test_gradients_reach_every_module_tensor_and_the_value_stays_the_main_loss():
    model = _model(1).train()
    tokens, labels = _batch()
    loss = model(tokens, labels=labels)
    model.eval()
    with torch.no_grad():
        main = model(tokens, labels=labels)
    assert loss.item() == pytest.approx(main.item(), abs=1e-6)
    loss.backward()
    missing = [n for n, p in model.mtp.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
    assert missing == []


def test_a_last_stage_computes_the_losses_the_whole_model_does():
    """Stage 1 gets stage 0's streams, flattened: its MTP inputs come from the labels."""
    from forja.parallel.pp_split import stage_part

    whole = _model(2, seed=3).train()
    first, last = (stage_part(whole, s, [2, 2]) for s in (0, 1))
    assert first.mtp is None and list(last.mtp.layers) == ["4", "5"]
    last.mtp.embed.weight = whole.tok_embeddings.weight  # what the copy's init and gradient sum keep
    tokens, labels = _batch(T=20, seed=5)
    with torch.no_grad():
        whole(tokens, labels=labels)
        expected = torch.stack(whole.mtp.take_stats().losses)
        last(first(tokens), labels=labels, token_ids=tokens)
    torch.testing.assert_close(torch.stack(last.mtp.take_stats().losses), expected, rtol=0, atol=1e-6)


# -- checkpoints under DeepSeek's release names ----------------------------------------------

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    model = _model(1, seed=2).eval()
    return model, save_hf_checkpoint(model, tmp_path_factory.mktemp("v4_mtp"))


def test_the_module_saves_under_release_names_and_loads_back_bit_exact(saved, tmp_path):
    model, out = saved
    stored = load_file(out / "model.safetensors")
    mtp = {k for k in stored if k.startswith("mtp.")}
    for name in ("mtp.0.e_proj.weight", "mtp.0.h_proj.weight", "mtp.0.enorm.weight", "mtp.0.hnorm.weight",
                 "mtp.0.norm.weight", "mtp.0.hc_head_fn", "mtp.0.hc_head_base", "mtp.0.hc_head_scale",
                 "mtp.0.hc_attn_fn", "mtp.0.attn_norm.weight", "mtp.0.attn.attn_sink", "mtp.0.attn.wq_a.weight",
                 "mtp.0.attn.wo_a.weight", "mtp.0.ffn.gate.bias", "mtp.0.ffn.experts.5.w2.weight",
                 "mtp.0.ffn.shared_experts.w1.weight"):
        assert name in mtp, name
    assert not any("compressor" in k or "indexer" in k or "tid2eid" in k for k in mtp)
    assert torch.equal(stored["mtp.0.e_proj.weight"], model.mtp.layers["4"].e_proj.weight)
    back = load_hf_checkpoint(out)
    assert back.args.mtp_depth == 1
    theirs = back.state_dict()
    for name, value in model.state_dict().items():
        assert torch.equal(theirs[name], value), name


def test_transformers_reads_the_save_as_the_main_model(saved):
    model, out = saved
    hf = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert hf.config.num_nextn_predict_layers == 1
    tokens = torch.randint(0, 2048, (2, 40), generator=torch.Generator().manual_seed(4))
    diff = max_logit_diff(hf, model, tokens)
    print(f"main logits beside the MTP module: max |diff| = {diff:.2e}")
    assert diff < 1e-5


def test_a_checkpoint_counting_a_module_it_does_not_hold(saved, tmp_path):
    """transformers' saves say num_nextn_predict_layers = 1 with no mtp.* tensor: the main
    model loads; a module with a tensor missing is named."""
    _, out = saved
    tensors = load_file(out / "model.safetensors")
    (tmp_path / "config.json").write_text((out / "config.json").read_text())
    save_file({k: v for k, v in tensors.items() if not k.startswith("mtp.")}, tmp_path / "model.safetensors",
              metadata={"format": "pt"})
    model = load_hf_checkpoint(tmp_path)
    assert model.mtp is None and model.args.mtp_depth == 0
    save_file({k: v for k, v in tensors.items() if k != "mtp.0.hnorm.weight"}, tmp_path / "model.safetensors",
              metadata={"format": "pt"})
    with pytest.raises(ForjaError, match=r"mtp\.0\.hnorm\.weight is missing"):
        load_hf_checkpoint(tmp_path)


# -- the step engine ------------------------------------------------------------------------

def test_training_with_depth_1_lowers_both_losses(dims):
    from types import SimpleNamespace

    from forja.optim import OptimizerGroup, SchedulerGroup
    from forja.optim.config import OptimConfig, ScheduleConfig
    from forja.parallel import ParallelConfig
    from forja.train.build import build_model_parts
    from forja.train.step.build import build_engine

    args = model_args("deepseek_v4", "debug", mtp_depth=1)
    parts = build_model_parts(args, dims, ParallelConfig(), device=torch.device("cpu"), seed=0).parts
    optimizers = OptimizerGroup(parts, OptimConfig(lr=3e-3))
    scheduler = SchedulerGroup(optimizers.optimizers, ScheduleConfig(name="constant", warmup_steps=0), 10)
    engine = build_engine(parts, None, optimizers, scheduler, dims, precision="fp32", device=torch.device("cpu"),
                          grad_clip=1.0, document_mask=False)
    tokens, labels = _batch(T=32)
    batch = [SimpleNamespace(input_ids=tokens, labels=labels, document_ids=None)]
    outs = [engine.train_step(batch) for _ in range(8)]
    losses, mtp = [o.loss for o in outs], [o.metrics["mtp/loss_1"] for o in outs]
    print(f"loss {[round(x, 3) for x in losses]}\nmtp/loss_1 {[round(x, 3) for x in mtp]}")
    assert losses[-1] < losses[0] - 0.5 and mtp[-1] < mtp[0] - 0.3


def test_a_module_with_compressed_attention_is_refused():
    from forja.models.deepseek_v4.hf import args_from_config

    base = dict(num_hidden_layers=2, num_nextn_predict_layers=1, compress_ratios=[4, 128, 0])
    assert args_from_config(base).mtp_depth == 1  # the release's trailing 0: sliding window only
    with pytest.raises(ForjaError, match=r"compress_ratios=\[4\] is not supported"):
        args_from_config({**base, "compress_ratios": [4, 128, 4]})
