"""What [ft] refuses before any step, one sentence each."""

from __future__ import annotations

import pytest

from forja.config import load_config
from forja.errors import ForjaError
from forja.parallel.checks import check_layout
from forja.train.ft.checks import check_ft, checkpoint_rounding
from forja.train.ft.config import checkpoint_due
from forja.train.launch.preflight import Preflight


@pytest.mark.parametrize("overrides, words", [
    (["train.global_batch_size=9"], "does not divide into ft.groups = 2"),
    (["ft.mode=\"diloco\"", "ft.inner_steps=4", "train.steps=10"],
     "train.steps = 10 with ft.mode = 'diloco': a sync lands every ft.inner_steps = 4 steps"),
    (["train.on_nonfinite=\"rollback\""], "heals a restarted one instead"),
    (["run.dir=\"s3://bucket/runs/x\""], "ft.enabled with run.dir = s3://bucket/runs/x in an object store: the "
                                         "replica groups share one run directory"),
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


def test_diloco_takes_each_checkpoint_at_the_first_sync_after_its_interval():
    """checkpoint.interval = 25 with syncs every 4 steps: steps 28, 52, 76, 100 (the first sync at or
    after 25, 50, 75, 100), said in one line; a whole number of periods, or no DiLoCo, changes nothing."""
    assert [s for s in range(1, 101) if checkpoint_due(s, 25, 4)] == [28, 52, 76, 100]
    assert [s for s in range(1, 31) if checkpoint_due(s, 10, 1)] == [10, 20, 30]
    assert [s for s in range(1, 25) if checkpoint_due(s, 3, 8)] == [8, 16, 24]  # interval shorter than a period
    cfg = load_config("debug", ["ft.enabled=true", "ft.groups=2", "ft.mode=\"diloco\"", "ft.inner_steps=4",
                                "train.steps=100", "checkpoint.interval=25"])
    check_ft(cfg)  # no longer refused
    assert checkpoint_rounding(cfg) == (
        "checkpoint.interval = 25 with ft.mode = 'diloco': a sync lands every 4 steps, so each checkpoint is "
        "taken at the first sync at or after its interval (steps 28, 52, 76, ...)")
    assert checkpoint_rounding(load_config("debug", ["ft.enabled=true", "ft.groups=2", "ft.mode=\"diloco\"",
                                                     "ft.inner_steps=4", "train.steps=100",
                                                     "checkpoint.interval=24"])) is None
    assert checkpoint_rounding(load_config("debug", ["checkpoint.interval=25"])) is None


def test_a_fingerprint_check_with_no_replicas_to_compare_is_refused_before_launch():
    """ft.check_interval on FSDP alone (or one process, or DiLoCo groups, whose weights differ) would
    compare nothing; with DDP/HSDP replicas or [ft] hsdp groups it has something to compare."""
    def request(sets, world):
        return Preflight(load_config("debug", ["ft.check_interval=2", "train.micro_batch_size=2", *sets]),
                         world_size=world, device_type="cpu").request()

    for sets, world in ([], 1), ([], 2), (["ft.enabled=true", "ft.groups=2", "ft.mode=\"diloco\"",
                                           "ft.inner_steps=4"], 1):
        with pytest.raises(ForjaError, match=r"^ft.check_interval = 2 compares the weights of replicas, but this "
                                             r"layout has none"):
            check_layout(request(sets, world))
    check_layout(request(["parallel.dp_replicate=2", "parallel.dp_shard=1"], 2))
    check_layout(request(["ft.enabled=true", "ft.groups=2"], 1))
