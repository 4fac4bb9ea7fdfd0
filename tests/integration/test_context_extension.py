"""The context-extension drill: a run trained at seq_len 32 is stopped, resumed at seq_len 64 with
YaRN (model.rope_scaling) and carries on: step counter, optimizer state and LR schedule continue,
the data continues at the next token position of the stream, the token counts stay right."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from forja.config import load_config
from forja.optim.schedules import lr_multiplier
from forja.train.callbacks import Callback
from forja.train.trainer import Trainer

from .conftest import base_overrides, read_metrics

STEPS, STOP, G = 10, 6, 8
YARN = '{rope_type = "yarn", factor = 2.0, original_max_seq_len = 32}'


class StopAfter(Callback):
    """Asks the run to stop after step `step`, as a preemption would (a checkpoint is saved)."""

    def __init__(self, step: int):
        self.step = step

    def on_step_end(self, trainer, record) -> None:
        if record.step == self.step:
            trainer.request_stop("the drill")


class FirstBatch(Callback):
    """The token ids of the first step this launch trains (rank 0's micro-batches)."""

    def __init__(self):
        self.batches = None

    def on_train_start(self, trainer) -> None:
        state = trainer.loader.state_dict()
        self.batches = trainer.loader.build_step(trainer.loader.cursor)
        assert trainer.loader.state_dict() == state  # looking does not consume


def _cfg(run, data, seq_len: int, **changes):
    return load_config("debug", base_overrides(run, data, **{
        "train.steps": str(STEPS), "train.seq_len": str(seq_len), "train.global_batch_size": str(G),
        "train.val_interval": "0", "checkpoint.interval": "100", "train.sample_tokens": "0",
        "model.overrides": f"{{max_seq_len = {seq_len}}}", **changes}))


def test_a_run_resumed_at_twice_the_length_with_yarn_carries_on(tmp_path, train_data):
    run = tmp_path / "run"
    pretrain = _cfg(run, train_data, 32)
    Trainer(pretrain, callbacks=[StopAfter(STOP)]).run()
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == [f"step-{STOP:08d}"]

    first = FirstBatch()
    extended = Trainer(_cfg(run, train_data, 64, **{"model.rope_scaling": YARN}), callbacks=[first])
    extended.setup()
    try:
        assert extended.counters.step == STOP
        assert extended.model.args.rope_scaling.factor == 2.0 and extended.model.rope_scale() > 1
        adam = extended.optimizers.optimizers[0]
        assert all(int(s["step"]) == STOP for s in adam.state.values())  # moments carried, not restarted
        loader = extended.loader
        assert loader.tokens == STOP * G * 32 and loader.next_seq_len() == 64
        extended.fit()
    finally:
        extended.close()

    # The first batch after the resume: the 64-token windows of the same seed's order from
    # position STOP * G * 32 / 64, read here straight from the token stream.
    start = STOP * G * 32 // 64
    m = first.batches[0].input_ids.shape[0]
    assert first.batches[0].input_ids.shape == (m, 64)
    datasets, windows = loader.samples.locate(np.arange(start, start + m), seed=0)
    stream = loader.samples.streams[0]
    for row, (d, w) in enumerate(zip(datasets.tolist(), windows.tolist(), strict=True)):
        assert d == 0
        assert first.batches[0].input_ids[row].tolist() == stream.read(w * 64, 64).tolist()
    unshuffled = loader.samples.locate(np.array([start]), seed=None)[1][0]
    assert unshuffled * 64 == STOP * G * 32  # in the stream's own order: the next token, exactly

    records = [r for r in read_metrics(run) if "loss" in r]
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    assert [r["seq_len"] for r in records] == [32] * STOP + [64] * (STEPS - STOP)
    assert all(math.isfinite(r["loss"]) for r in records)
    # The learning rate of every step, before and after the resume, is the uninterrupted schedule's.
    schedule = lr_multiplier(pretrain.schedule, STEPS)
    assert [r["lr"] for r in records] == pytest.approx([pretrain.optim.lr * schedule(s) for s in range(STEPS)],
                                                       rel=1e-12)
    assert len({r["lr"] for r in records[STOP - 1:]}) > 1  # the resumed steps are in the decay: it moves
    assert extended.counters.tokens_seen == STOP * G * 32 + (STEPS - STOP) * G * 64
    assert extended.loader.tokens == extended.counters.tokens_seen
    assert torch.isfinite(torch.tensor(records[-1]["grad_norm"]))


def test_a_seq_len_schedule_trains_and_resumes_across_its_boundary_bit_exact(tmp_path, train_data):
    """train.seq_len_schedule through the trainer: 16 tokens for 3 steps, then 32; a run stopped
    before the boundary and resumed gives the uninterrupted run's losses bit for bit."""
    changes = {"train.steps": "6", "train.seq_len_schedule": "[[0, 16], [3, 32]]"}
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    uninterrupted = Trainer(_cfg(whole, train_data, 32, **changes))
    uninterrupted.run()
    assert uninterrupted.counters.tokens_seen == G * (3 * 16 + 3 * 32)
    Trainer(_cfg(parts, train_data, 32, **changes), callbacks=[StopAfter(2)]).run()
    Trainer(_cfg(parts, train_data, 32, **changes)).run()
    expected = [r["loss"] for r in read_metrics(whole) if "loss" in r]
    assert [r["loss"] for r in read_metrics(parts) if "loss" in r] == expected and len(expected) == 6
    assert [r["seq_len"] for r in read_metrics(parts) if "loss" in r] == [16] * 3 + [32] * 3
