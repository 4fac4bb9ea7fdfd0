"""The goodput model under failures: the closed forms against their own Monte-Carlo, and each
policy's behaviour where it should win or lose; `forja plan --goodput` prints and --json's it."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from forja.cli import main
from forja.errors import ForjaError
from forja.plan.goodput import (
    FailureModel,
    diloco_goodput,
    ft_goodput,
    restart_goodput,
    restart_goodput_exact,
    simulate,
    table,
    young_interval,
)

CLOSED = {"restart": restart_goodput, "ft": ft_goodput, "diloco": diloco_goodput}


@pytest.mark.parametrize("gpus, rate", [(4096, 2e-5), (16384, 2e-5), (1024, 2e-4)])
@pytest.mark.parametrize("policy", ["restart", "ft", "diloco"])
def test_simulation_agrees_with_the_closed_form(policy, gpus, rate):
    m = FailureModel(failure_rate=rate)
    hours = 3000 / m.job_rate(gpus) / 3600  # about 3,000 failures
    assert simulate(policy, m, gpus, hours=hours, seed=1) == pytest.approx(CLOSED[policy](m, gpus), rel=0.02)


def test_first_order_restart_is_close_to_dalys_exact_one_where_failures_are_rare():
    m = FailureModel()
    for gpus in (64, 4096, 16384):
        assert restart_goodput(m, gpus) == pytest.approx(restart_goodput_exact(m, gpus), rel=0.01)
    often = FailureModel(failure_rate=1e-3)  # lambda (R + tau / 2) near 1: first order is no longer enough
    assert abs(restart_goodput(often, 16384) - restart_goodput_exact(often, 16384)) > 0.01


def test_no_failures_cost_only_the_checkpoint_saves():
    m = FailureModel(failure_rate=0.0)
    saving = 1 / (1 + m.checkpoint_save_s / (m.checkpoint_interval * m.step_s))
    for gpus in (8, 16384):
        assert restart_goodput(m, gpus) == restart_goodput_exact(m, gpus) == pytest.approx(saving)
        assert ft_goodput(m, gpus) in (None, pytest.approx(saving))
    assert restart_goodput(replace(m, checkpoint_save_s=0.0), 16384) == 1.0
    assert simulate("restart", m, 512, hours=10) == pytest.approx(saving)
    assert simulate("ft", m, 512, hours=10) == pytest.approx(saving)
    assert young_interval(m, 512) == 0


def test_goodput_falls_with_the_failure_rate_and_the_job_size():
    for policy, f in CLOSED.items():
        rates = [f(FailureModel(failure_rate=r), 4096) for r in (1e-6, 1e-5, 1e-4)]
        assert rates[0] > rates[1] > rates[2], policy
        sizes = [f(FailureModel(), n) for n in (64, 4096, 16384)]
        assert sizes[0] > sizes[1] > sizes[2], policy


def test_groups_beat_restarting_at_thousands_of_gpus_and_not_on_one_node():
    m = FailureModel()
    assert ft_goodput(m, 8) is None and diloco_goodput(m, 8) is None  # one group: nobody to heal from
    assert ft_goodput(m, 16384) > restart_goodput(m, 16384) + 0.05
    assert ft_goodput(m, 4096) > restart_goodput(m, 4096)
    # a group's restart as slow as the job's and a heal as slow: groups still win, by the 1/G
    slow = replace(m, heal_s=m.restart_s)
    assert ft_goodput(slow, 16384) > restart_goodput(slow, 16384)


def test_young_interval_is_the_best_one():
    m = FailureModel()
    best = young_interval(m, 16384)
    at = lambda k: restart_goodput(replace(m, checkpoint_interval=k), 16384)  # noqa: E731
    assert at(best) >= max(at(best // 2), at(best * 2))
    assert young_interval(m, 4 * 16384) == pytest.approx(best / 2, rel=0.01)  # sqrt(1 / lambda)


def test_diloco_is_faster_per_step_and_loses_more_per_failure():
    m = FailureModel(sync_s=0.4)
    assert m.diloco_step_s() == pytest.approx(2.0 - 0.4 + 0.4 / 20)
    row = table(m, [4096])[0]
    assert row["diloco_throughput"] == pytest.approx(row["diloco"] * 2.0 / m.diloco_step_s())
    assert row["diloco_throughput"] > row["ft"]
    # a long period between syncs: a failure throws more of the failed group's work away
    assert diloco_goodput(replace(m, inner_steps=500), 4096) < diloco_goodput(m, 4096)


def test_bad_inputs_say_which():
    with pytest.raises(ForjaError, match="failure rate"):
        FailureModel(failure_rate=-1)
    with pytest.raises(ForjaError, match="restart_s"):
        FailureModel(restart_s=-1)
    with pytest.raises(ForjaError, match="policy"):
        simulate("pray", FailureModel(), 8, hours=1)


def test_cli_table_and_json(capsys):
    assert main(["plan", "--goodput", "64,16384", "--mtbf-hours", "50000", "--restart-s", "600"]) == 0
    out = capsys.readouterr().out
    assert "16,384" in out and "restart at Young" in out
    assert main(["plan", "--goodput", "--failure-rate", "1e-5", "--step-time", "4", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)["goodput"]
    assert [r["gpus"] for r in data["rows"]] == [8, 64, 512, 4096, 16384]
    assert data["model"]["failure_rate"] == 1e-5 and data["model"]["step_s"] == 4
    assert data["rows"][-1]["ft"] > data["rows"][-1]["restart"]
    assert main(["plan", "--goodput", "many"]) != 0
    assert "give job sizes as GPU counts" in capsys.readouterr().err


def test_a_recipe_sizes_the_sync_and_the_heal_from_its_model():
    from types import SimpleNamespace as NS

    from forja.plan.goodput import GROUP_RESTART_S, recipe_model
    from forja.plan.hardware import get_hardware

    hw = get_hardware("h100")
    cfg = NS(checkpoint=NS(interval=250), ft=NS(timeout_s=10.0, inner_steps=50))
    job = NS(shape=NS(n_params=8e9), state_per_param=2.0)
    m = recipe_model(cfg, job, 6.0, hw)
    shard = 8e9 * 4 / hw.gpus_per_node  # a rank's fp32 weights
    assert (m.step_s, m.checkpoint_interval, m.detect_s, m.inner_steps) == (6.0, 250, 10.0, 50)
    assert m.sync_s == pytest.approx(2 * shard / hw.inter_node_bytes_per_s)
    assert m.heal_s == pytest.approx(GROUP_RESTART_S + 3 * shard / hw.inter_node_bytes_per_s)
