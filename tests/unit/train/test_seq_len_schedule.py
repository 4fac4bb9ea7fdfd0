"""train.seq_len_schedule, and what lets a run resume at a longer context: the run directory's
comparison, the checkpoint's model identity and the learned-position check."""

from __future__ import annotations

import pytest

from forja.checkpoint.identity import check_model_identity, model_identity
from forja.config import load_config
from forja.errors import ForjaError
from forja.models.registry import model_args
from forja.train.config import TrainConfig
from forja.train.launch.preflight import check_positions
from forja.train.launch.run_dir import config_differences


def test_stepwise_lengths_hold_from_their_step():
    t = TrainConfig(steps=2000, seq_len=4096, seq_len_schedule=[[0, 1024], [1000, 4096]])
    assert [t.seq_len_at(s) for s in (0, 999, 1000, 1999)] == [1024, 1024, 4096, 4096]
    assert t.seq_lens() == (1024, 4096)


def test_linear_lengths_ramp_in_multiples_of_the_listed_gcd():
    t = TrainConfig(steps=200, seq_len=4096, seq_len_schedule=[[0, 1024], [100, 4096]], seq_len_schedule_kind="linear")
    assert t.seq_len_at(0) == 1024 and t.seq_len_at(100) == t.seq_len_at(199) == 4096
    ramp = [t.seq_len_at(s) for s in range(101)]
    assert ramp == sorted(ramp) and all(n % 1024 == 0 for n in ramp)
    assert t.seq_lens() == (1024, 2048, 3072, 4096)


def test_without_a_schedule_one_length():
    assert TrainConfig(seq_len=256).seq_lens() == (256,) and TrainConfig(seq_len=256).seq_len_at(10) == 256


@pytest.mark.parametrize("table, match", [
    ([[1, 64], [10, 128]], "must start at 0 and increase"),
    ([[0, 64], [0, 128]], "must start at 0 and increase"),
    ([[0, 0], [10, 128]], "must be positive"),
    ([[0, 64, 1], [10, 128]], r"each entry must be \[step, length\]"),
    ([[0, 64], [10, 256]], "ends at length 256 but train.seq_len = 128"),
])
def test_bad_schedules_stop_at_load(table, match):
    with pytest.raises(ForjaError, match=match):
        TrainConfig(seq_len=128, seq_len_schedule=table)


def test_the_schedule_comes_from_toml_and_set():
    cfg = load_config("debug", ["train.seq_len=128", "train.seq_len_schedule=[[0, 32], [5, 128]]",
                                'train.seq_len_schedule_kind="linear"'])
    assert cfg.train.seq_len_schedule == [[0, 32], [5, 128]] and cfg.train.seq_lens()[0] == 32


def test_a_run_dir_resumes_at_a_longer_context_but_not_another_model():
    old = load_config("debug", ["train.seq_len=64"])
    longer = load_config("debug", ["train.seq_len=256", "model.overrides={max_seq_len = 256}",
                                   'model.rope_scaling={rope_type = "yarn", factor = 4.0, original_max_seq_len = 64}',
                                   "train.seq_len_schedule=[[0, 64], [10, 256]]"])
    assert config_differences(old, longer) == []
    wider = load_config("debug", ["train.seq_len=256", "model.overrides={max_seq_len = 256, dim = 256}"])
    assert config_differences(old, wider) == ["model.overrides.dim: None -> 256"]


def test_the_identity_lets_a_rotary_model_change_its_positions_only():
    saved = model_identity("llama", "debug", model_args("llama", "debug", max_seq_len=64))
    extended = model_identity("llama", "debug", model_args("llama", "debug", max_seq_len=256, rope_theta=5e5,
                                                           rope_scaling={"rope_type": "yarn", "factor": 4.0}))
    check_model_identity(saved, extended)
    with pytest.raises(ForjaError, match="n_layers"):
        check_model_identity(saved, model_identity("llama", "debug", model_args("llama", "debug", n_layers=3)))


def test_a_learned_position_table_cannot_be_extended():
    saved = model_identity("gpt2", "debug", model_args("gpt2", "debug", max_seq_len=64))
    with pytest.raises(ForjaError, match="learned position table has one row per position and cannot be extended"):
        check_model_identity(saved, model_identity("gpt2", "debug", model_args("gpt2", "debug", max_seq_len=128)))
    with pytest.raises(ForjaError, match=r"train.seq_len = 128 is longer than the model's learned position table"):
        check_positions(model_args("gpt2", "debug", max_seq_len=64), 128)
    check_positions(model_args("llama", "debug", max_seq_len=64), 128)  # rotary: positions are computed
