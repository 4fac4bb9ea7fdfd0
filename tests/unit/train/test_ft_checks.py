"""What [ft] refuses before any step, one sentence each."""

from __future__ import annotations

import pytest

from forja.config import load_config
from forja.errors import ForjaError
from forja.parallel.checks import check_layout
from forja.train.ft.checks import check_ft
from forja.train.launch.preflight import Preflight


@pytest.mark.parametrize("overrides, words", [
    (["train.global_batch_size=9"], "does not divide into ft.groups = 2"),
    (["ft.mode=\"diloco\"", "ft.inner_steps=4", "train.steps=10"],
     "train.steps = 10 with ft.mode = 'diloco': a sync lands every ft.inner_steps = 4 steps"),
    (["ft.mode=\"streaming-diloco\"", "ft.inner_steps=8", "ft.fragments=2", "train.steps=16",
      "checkpoint.interval=6"], "checkpoint.interval = 6 with ft.mode = 'streaming-diloco': a sync lands every "
                                "ft.inner_steps / ft.fragments = 4 steps"),
    (["train.on_nonfinite=\"rollback\""], "heals a restarted one instead"),
    (["train.seq_len=64", "train.seq_len_schedule=[[0, 32], [4, 64]]"], "train.seq_len_schedule with ft.enabled"),
])
def test_settings_replica_groups_cannot_serve_are_refused(overrides, words):
    cfg = load_config("debug", ["ft.enabled=true", "ft.groups=2", *overrides])
    with pytest.raises(ForjaError, match="^.*" + words.replace("(", r"\(").replace("[", r"\[")):
        check_ft(cfg)


def test_replicas_beside_the_groups_are_refused_by_the_layout_validator():
    """The replica groups are the replicas: a layout with HSDP's outer dimension is refused
    where every layout is judged (so forja plan and parallel.auto never choose one)."""
    cfg = load_config("debug", ["ft.enabled=true", "ft.groups=2", "parallel.dp_replicate=2",
                                "train.micro_batch_size=2"])
    with pytest.raises(ForjaError, match="^.*parallel.dp_replicate = 2 with ft.enabled"):
        check_layout(Preflight(cfg, world_size=2, device_type="cpu").request())
    sharded = load_config("debug", ["ft.enabled=true", "ft.groups=2", "train.micro_batch_size=2"])
    check_layout(Preflight(sharded, world_size=2, device_type="cpu").request())


def test_a_plain_ft_config_passes_and_ft_off_checks_nothing():
    check_ft(load_config("debug", ["ft.enabled=true", "ft.groups=2"]))
    check_ft(load_config("debug", ["ft.enabled=true", "ft.mode=\"streaming-diloco\"", "ft.inner_steps=8",
                                   "ft.fragments=2", "train.steps=16", "checkpoint.interval=8"]))
    check_ft(load_config("debug", ["parallel.dp_replicate=2", "train.global_batch_size=9"]))


@pytest.mark.parametrize("overrides, words", [
    (["ft.min_groups=3"], "ft.min_groups = 3 must be between 1 and ft.groups = 2"),
    (["ft.fragments=3"], "must be 1 or more and divide ft.inner_steps"),
])
def test_bad_ft_values_fail_at_load(overrides, words):
    with pytest.raises(ForjaError, match=words):
        load_config("debug", overrides)
