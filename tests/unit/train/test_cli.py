"""`forja train --nproc/--nnodes/--rdzv-endpoint`: the torchrun command each machine runs,
and the sentence a collective timeout becomes. (The launches themselves are tested in
tests/distributed/: test_torchrun.py, test_multinode.py, test_timeouts.py.)"""

from __future__ import annotations

import pytest

from forja.cli import build_parser
from forja.errors import ForjaError
from forja.parallel.process_group import timeout_error
from forja.train.cli import launch_needed, torchrun_command


def parse(*flags: str):
    return build_parser("train").parse_args(["train", "debug", "--set", "train.steps=3", *flags])


def torchrun_flags(cmd: list[str]) -> list[str]:
    """The launcher's own flags: those between `torch.distributed.run` and `-m forja`."""
    return cmd[cmd.index("torch.distributed.run") + 1:cmd.index("-m", 3)]


def test_one_machine_uses_a_standalone_rendezvous():
    cmd = torchrun_command(parse("--nproc", "4"), "runs/a")
    assert torchrun_flags(cmd) == ["--nproc-per-node=4", "--standalone"]
    assert cmd[-5:] == ["forja", "train", "debug", "--set", "train.steps=3"]


def test_max_restarts_goes_to_torchrun_and_launches_even_one_process():
    args = parse("--max-restarts", "2")
    assert launch_needed(args)
    assert torchrun_flags(torchrun_command(args, "runs/a")) == ["--nproc-per-node=1", "--max-restarts=2",
                                                               "--standalone"]
    with pytest.raises(ForjaError, match="--max-restarts -1"):
        torchrun_command(parse("--max-restarts", "-1"), "runs/a")


def test_several_machines_meet_at_the_c10d_endpoint():
    args = parse("--nproc", "8", "--nnodes", "2", "--rdzv-endpoint", "node0:29500", "--rdzv-id", "job7")
    assert launch_needed(args)
    assert torchrun_flags(torchrun_command(args, "runs/a")) == [
        "--nproc-per-node=8", "--nnodes=2", "--rdzv-backend=c10d", "--rdzv-endpoint=node0:29500", "--rdzv-id=job7"]


def test_the_default_rendezvous_id_comes_from_the_run_directory():
    """Every machine runs the same command, so it must agree on the id; two runs meeting
    at one endpoint must not."""
    args = parse("--nnodes", "2", "--rdzv-endpoint", "node0:29500")
    ids = [next(f for f in torchrun_command(args, d) if f.startswith("--rdzv-id=")) for d in ("runs/a", "runs/a",
                                                                                               "runs/b")]
    assert ids[0] == ids[1] != ids[2]


def test_launching_is_for_several_processes_only(monkeypatch):
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert not launch_needed(parse())
    assert not launch_needed(parse("--nproc", "1"))
    assert launch_needed(parse("--nproc", "2"))
    monkeypatch.setenv("LOCAL_RANK", "0")  # already a torchrun worker: train, don't launch again
    assert not launch_needed(parse("--nproc", "2"))


@pytest.mark.parametrize(("flags", "words"), [
    (("--nnodes", "2"), "--rdzv-endpoint"),
    (("--nproc", "0"), "--nproc 0"),
    (("--nnodes", "0", "--rdzv-endpoint", "h:1"), "--nnodes 0"),
])
def test_bad_launch_flags_are_refused_before_anything_starts(flags, words):
    with pytest.raises(ForjaError, match=words):
        torchrun_command(parse(*flags), "runs/a")


def test_a_collective_timeout_becomes_a_sentence_naming_the_setting():
    gloo = RuntimeError("[/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] "
                        "Timed out waiting 5000ms for recv operation to complete")
    error = timeout_error(gloo, 5.0)
    assert "parallel.timeout_s = 5 s" in str(error)
    assert str(error).endswith("[Timed out waiting 5000ms for recv operation to complete]")
    assert timeout_error(RuntimeError("CUDA out of memory"), 5.0) is None
    assert timeout_error(ValueError("timed out"), 5.0) is None
