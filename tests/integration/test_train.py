"""`forja train` end to end: the loss falls, runs resume exactly, signals save."""

from __future__ import annotations

import json
import shlex
import signal

from forja import host
from forja.cli import main

from .conftest import forja_process, kill_then_resume, losses, read_metrics, train_args, wait_for


def test_short_run_learns_and_leaves_a_readable_run_dir(tmp_path, train_data):
    run = tmp_path / "run"
    assert main(train_args(run, train_data, **{"train.steps": "30", "train.val_interval": "10"})) == 0
    records = read_metrics(run)
    train = [r for r in records if "loss" in r]
    val = [r["val_loss"] for r in records if "val_loss" in r]
    assert [r["step"] for r in train] == list(range(1, 31))
    assert train[-1]["loss"] < train[0]["loss"] - 1.0  # 512-token vocabulary: starts near ln 512 = 6.2
    assert len(val) == 3 and val[-1] < val[0]
    for key in ("lr", "grad_norm", "tokens_per_sec", "tflops", "step_time", "data_wait", "mem_peak_gb"):
        assert train[-1][key] is not None and train[-1][key] >= 0, key
    assert train[-1]["mfu"] is None  # no peak is known for a CPU: never a guess
    assert {"config.toml", "run.json", "tokenizer.json", "samples.txt"} <= {p.name for p in run.iterdir()}
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-00000024", "step-00000028",
                                                                      "step-00000030"]
    launch = json.loads((run / "run.json").read_text())["launches"][0]
    assert launch["versions"]["torch"] and launch["hardware"]["cpu_count"] >= 1
    assert host.malloc_applied() == "retain"  # train.host_malloc's default, applied at setup


def test_kill_9_then_resume_gives_bit_identical_losses(tmp_path, train_data, card):
    # Killed as step 4's checkpoint lands: 12 steps (about a second) before the run would end.
    steps = {"train.steps": "16", "checkpoint.interval": "4"}
    reference = tmp_path / "uninterrupted"
    assert main(train_args(reference, train_data, **steps)) == 0

    run = tmp_path / "killed"
    kill_then_resume(run, train_args(run, train_data, **steps), kill_at=4, last=16)
    assert losses(run) == losses(reference)  # every step, bit for bit (floats compare exactly)
    card("llama", "resume", "kill -9")


def test_sigterm_saves_a_checkpoint_and_exits_0(tmp_path, train_data):
    run = tmp_path / "run"
    proc = forja_process(train_args(run, train_data, **{"train.steps": "100000", "checkpoint.interval": "0"}))
    wait_for(lambda: (run / "metrics.jsonl").is_file() and len(read_metrics(run)) >= 3, proc)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out
    assert "stopped by SIGTERM" in out
    saved = sorted((run / "checkpoints").iterdir())
    assert len(saved) == 1 and int(saved[0].name.split("-")[1]) == max(losses(run))


def test_ctrl_c_in_setup_or_in_the_loop_prints_one_line_and_exits_130(tmp_path, train_data):
    """Ctrl-C while the run sets up (after its directory is written, before a step): one line, no
    traceback. The same command again, Ctrl-C during training: the step ends, a checkpoint is
    saved, one line says so. Both exit 130, as a shell reports a Ctrl-C."""
    run = tmp_path / "run"
    args = train_args(run, train_data, **{"train.steps": "100000", "checkpoint.interval": "0"})
    for ready in (lambda: (run / "config.toml").is_file(),
                  lambda: (run / "metrics.jsonl").is_file() and len(read_metrics(run)) >= 3):
        # As from a terminal: a test runner's worker may ignore SIGINT, and a child inherits that.
        proc = forja_process(args, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        try:
            wait_for(ready, proc)
            proc.send_signal(signal.SIGINT)
            out, _ = proc.communicate(timeout=120)
        finally:
            proc.kill()
        assert proc.returncode == 130 and "Traceback" not in out, out
        said = [line for line in out.splitlines() if "interrupted (Ctrl-C)" in line or "stopped by SIGINT" in line]
        assert len(said) == 1, out
    assert "checkpoint saved" in said[0] and len(list((run / "checkpoints").iterdir())) == 1


def test_resume_with_more_steps_continues(tmp_path, train_data, capsys):
    run = tmp_path / "run"
    assert main(train_args(run, train_data, **{"train.steps": "8"})) == 0
    assert main(train_args(run, train_data, **{"train.steps": "14"})) == 0
    out = capsys.readouterr().out
    assert "resumed from" in out
    # The run's last lines: where it is, its model, and next commands that run as printed.
    assert f"forja: done at step 14 (loss {losses(run)[14]:.4f}, val_loss " in out
    assert f"its model: {run / 'checkpoints' / 'step-00000014'}" in out
    export = next(line.split("#")[0] for line in out.splitlines() if line.strip().startswith("forja export"))
    assert main(shlex.split(export)[1:]) == 0 and (run / "hf" / "config.json").is_file()
    assert sorted(losses(run)) == list(range(1, 15))
    assert (run / "checkpoints" / "step-00000014").is_dir()


def test_profiler_callback_writes_a_trace(tmp_path, train_data):
    run = tmp_path / "run"
    assert main(train_args(run, train_data, **{"train.steps": "6", "train.profile_at": "2"})) == 0
    traces = list((run / "profile").glob("rank0*.json*"))
    assert len(traces) == 1 and traces[0].stat().st_size > 1000


def test_float8_training_runs_close_to_fp32(tmp_path, train_data):
    fp32, fp8 = tmp_path / "fp32", tmp_path / "fp8"
    steps = {"train.steps": "4", "model.overrides": "{tie_embeddings = false}"}
    assert main(train_args(fp32, train_data, **steps)) == 0
    assert main(train_args(fp8, train_data, **steps, **{"train.float8": '"tensorwise"',
                                                        "train.float8_min_features": "0"})) == 0
    a, b = losses(fp32), losses(fp8)
    assert max(abs(a[s] - b[s]) for s in a) < 5e-2 and a != b  # emulated float8: close, not equal


def test_fused_ops_train_like_the_plain_model(tmp_path, train_data):
    """On CPU the fused ops run their PyTorch references (Triton is for CUDA): the run must
    match the unfused one, the chunked cross-entropy included."""
    plain, fused = tmp_path / "plain", tmp_path / "fused"
    assert main(train_args(plain, train_data, **{"train.steps": "4"})) == 0
    assert main(train_args(fused, train_data, **{"train.steps": "4", "model.fused_ops": "true"})) == 0
    a, b = losses(plain), losses(fused)
    assert max(abs(a[s] - b[s]) for s in a) < 1e-5
