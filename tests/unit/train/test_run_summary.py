"""The lines `forja train` ends with: the next commands, each of which runs as printed; no
`forja export --hf` for a model transformers cannot hold (the export would refuse it)."""

from pathlib import Path
from types import SimpleNamespace

from forja.checkpoint.states import TrainerCounters
from forja.config import load_config
from forja.train.callbacks import RunSummaryCallback


def _summary(capsys, sets: list[str]) -> str:
    cfg = load_config("configs/debug.toml", sets)
    counters = TrainerCounters()
    counters.step = 3
    trainer = SimpleNamespace(rank=0, cfg=cfg, counters=counters, tokenizer=SimpleNamespace(vocab_size=2048))
    summary = RunSummaryCallback()
    summary.loss = 5.0
    summary.on_checkpoint(trainer, 3, Path("runs/x/checkpoints/step-00000003"))
    summary.on_train_end(trainer)
    return capsys.readouterr().out


def test_the_export_is_suggested_for_a_model_transformers_holds(capsys):
    out = _summary(capsys, [])
    assert "forja export" in out and "no Hugging Face export" not in out


def test_no_export_is_suggested_for_one_it_cannot_hold_and_the_reason_is_given(capsys):
    out = _summary(capsys, ["model.overrides={qk_norm = true}"])
    assert "forja export" not in out and "forja generate" in out
    assert "no Hugging Face export: a Llama with qk_norm has no LlamaForCausalLM equivalent" in out
