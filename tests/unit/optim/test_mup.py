"""muP: nothing changes when off; when on, activations after a few AdamW steps keep their
size across widths (the "coordinate check" of Yang et al. 2021), unlike the standard
parametrization, whose logits grow with width at a fixed learning rate."""

from __future__ import annotations

import pytest
import torch

from forja.models import build_model
from forja.models.config import ModelConfig, run_model_args
from forja.optim import build_optimizer
from forja.optim.config import OptimConfig
from forja.optim.mup import mup_lr_scale

BASE = 64
WIDTHS = (64, 128, 256)


def _model(width: int, mup: bool, **extra) -> torch.nn.Module:
    heads = width // 32  # widen by adding heads: head_dim stays 32
    return build_model("llama", "debug", n_layers=2, vocab_size=256, dim=width, n_heads=heads,
                       n_kv_heads=heads // 2, ffn_dim=3 * width, mup_width_mult=width / BASE if mup else 1.0,
                       **extra)


def test_off_is_today() -> None:
    plain, off = build_model("llama", "debug"), build_model("llama", "debug", mup_width_mult=1.0)
    for (name, a), (_, b) in zip(plain.named_parameters(), off.named_parameters(), strict=True):
        assert torch.equal(a, b), name
    tokens = torch.randint(0, 2048, (2, 16))
    assert torch.equal(plain(tokens), off(tokens))
    for name in ("adamw", "muon"):
        ours, today = (build_optimizer(m, OptimConfig(name=name)).param_groups for m in (off, plain))
        assert [(g["name"], g["lr"], len(g["params"])) for g in ours] == \
            [(g["name"], g["lr"], len(g["params"])) for g in today]
    args = run_model_args(ModelConfig(), vocab_size=2048)
    assert args.mup_width_mult == 1.0
    assert run_model_args(ModelConfig(mup_base_dim=32), vocab_size=2048).mup_width_mult == 4.0


def test_lr_scale_and_groups() -> None:
    assert mup_lr_scale("layers.0.attention.wq.weight", 2, 4.0) == 0.25
    assert mup_lr_scale("layers.0.moe.experts.w1", 3, 4.0) == 0.25
    for name, ndim in (("tok_embeddings.weight", 2), ("output.weight", 2), ("norm.weight", 1)):
        assert mup_lr_scale(name, ndim, 4.0) == 1.0
    model = _model(256, mup=True, tie_embeddings=False)
    groups = build_optimizer(model, OptimConfig(lr=1e-2)).param_groups
    lrs = {id(p): g["lr"] for g in groups for p in g["params"]}
    assert lrs[id(model.layers["0"].attention.wq.weight)] == 1e-2 / 4
    assert lrs[id(model.output.weight)] == lrs[id(model.tok_embeddings.weight)] == 1e-2
    assert {g["name"] for g in groups} == {"matrices", "vectors"}  # schedule.groups still apply
    muon = build_optimizer(model, OptimConfig(name="muon", lr=1e-2)).param_groups
    assert [g["lr"] for g in muon if g["use_muon"]] == [1e-2]  # Muon's own update is left alone


def test_tied_logits_and_fused_loss_carry_the_multiplier() -> None:
    model = _model(128, mup=True)  # debug ties the embeddings
    assert model.output.weight is model.tok_embeddings.weight
    assert model.tok_embeddings.weight.std().item() == pytest.approx(0.02, rel=0.05)  # embedding init unchanged
    tokens = torch.randint(0, 256, (2, 16))
    h = model(tokens, labels=None)
    plain = model.output(model.norm(_last_hidden(model, tokens)))
    torch.testing.assert_close(h, plain / 2)
    fused = _model(128, mup=True, fused_ops=("cross_entropy",))
    labels = torch.randint(0, 256, (2, 16))
    torch.testing.assert_close(fused(tokens, labels=labels), model(tokens, labels=labels))


def _last_hidden(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    out = {}
    handle = model.layers[str(len(model.layers) - 1)].register_forward_hook(lambda m, i, o: out.setdefault("h", o))
    model(tokens)
    handle.remove()
    return out["h"]


def _sizes_after_training(mup: bool) -> tuple[list[float], list[float]]:
    """Mean |logits| and mean |last block output| per width after 5 AdamW steps at one lr."""
    logits_size, hidden_size = [], []
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 256, (4, 32), generator=gen)
    labels = torch.randint(0, 256, (4, 32), generator=gen)
    for width in WIDTHS:
        model = _model(width, mup)
        opt = build_optimizer(model, OptimConfig(lr=1e-2, weight_decay=0.0))
        for _ in range(5):
            opt.zero_grad()
            model(tokens, labels=labels).backward()
            opt.step()
        with torch.no_grad():
            logits_size.append(model(tokens).abs().mean().item())
            hidden_size.append(_last_hidden(model, tokens).abs().mean().item())
    return logits_size, hidden_size


def test_coordinate_check() -> None:
    torch.manual_seed(0)
    mup_logits, mup_hidden = _sizes_after_training(mup=True)
    sp_logits, sp_hidden = _sizes_after_training(mup=False)
    print(f"\nwidths {WIDTHS}\nmuP logits {mup_logits}\nmuP hidden {mup_hidden}\n"
          f"SP  logits {sp_logits}\nSP  hidden {sp_hidden}")
    assert max(mup_logits) / min(mup_logits) < 2 and max(mup_hidden) / min(mup_hidden) < 2
    growth_sp, growth_mup = sp_logits[-1] / sp_logits[0], mup_logits[-1] / mup_logits[0]
    assert growth_sp > 1.5 * growth_mup


def test_a_mup_model_is_not_exported_to_hugging_face(tmp_path):
    from forja.errors import ForjaError
    from forja.models import build_model
    from forja.models.hf import save_hf_checkpoint

    model = build_model("llama", "debug", mup_width_mult=2.0)
    with pytest.raises(ForjaError, match="trained with muP"):
        save_hf_checkpoint(model, tmp_path / "hf")
    assert not (tmp_path / "hf").exists()
