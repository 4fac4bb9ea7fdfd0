"""`forja report` end to end: metrics written by the JSONL sink in, PNG charts and a summary out."""

import json

import pytest
from matplotlib.image import imread

from forja.cli import main
from forja.metrics.sinks import JsonlSink

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
CHARTS = ["loss.png", "lr.png", "tokens_per_sec.png", "grad_norm.png"]


def write_run(run_dir, *, steps=5, scale=1.0, mfu=0.4):
    sink = JsonlSink(run_dir)
    sink.start(total_steps=steps * 10, start_step=0)
    for i in range(1, steps + 1):
        step = 10 * i
        sink.log(step, {"loss": scale * 5.0 / i, "lr": 1e-3 * i / steps, "grad_norm": 1.0 / i,
                        "tokens_per_sec": 1000.0 * i, "mfu": mfu, "step_time": 0.5})
        if i % 2 == 0:
            sink.log(step, {"val_loss": scale * 5.5 / i})
    sink.close()
    return run_dir


def assert_png(path):
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC and len(data) > 1000
    height, width, _ = imread(path).shape
    assert height > 100 and width > 100


def test_one_run_charts_go_to_its_directory(tmp_path, capsys):
    run = write_run(tmp_path / "tiny-llama")
    assert main(["report", str(run)]) == 0
    for name in CHARTS:
        assert_png(run / name)
    out = capsys.readouterr().out
    # steps, final loss, best val, last val, mean tokens/s, MFU, 5 logs x 10 steps x 0.5 s
    for text in ("tiny-llama", "50", "1.0000", "1.3750", "3,000", "40.0%", "0:00:25"):
        assert text in out


def test_several_runs_overlaid_into_out_dir_named_from_run_json(tmp_path, capsys):
    a = write_run(tmp_path / "a", scale=1.0)
    b = write_run(tmp_path / "b", scale=0.9, steps=3, mfu=None)
    (b / "run.json").write_text(json.dumps({"name": "wider"}))
    out_dir = tmp_path / "charts"
    assert main(["report", str(a), str(b), "--out", str(out_dir)]) == 0
    for name in CHARTS:
        assert_png(out_dir / name)
    assert not (a / "loss.png").exists()
    out = capsys.readouterr().out
    assert "wider" in out and "n/a" in out  # run b has no MFU


def test_several_runs_default_to_report_in_the_current_directory(tmp_path, monkeypatch):
    a, b = write_run(tmp_path / "a"), write_run(tmp_path / "b")
    monkeypatch.chdir(tmp_path)
    assert main(["report", str(a), str(b)]) == 0
    assert_png(tmp_path / "report" / "loss.png")


def test_a_run_without_metrics_is_an_error_naming_the_file(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["report", str(empty)]) == 2
    assert f"{empty / 'metrics.jsonl'} does not exist" in capsys.readouterr().err
    (empty / "metrics.jsonl").write_text("")
    good = write_run(tmp_path / "good")
    assert main(["report", str(good), str(empty)]) == 2
    assert f"{empty / 'metrics.jsonl'} holds no metrics" in capsys.readouterr().err
    assert not (tmp_path / "report").exists() and not (good / "loss.png").exists()  # checked before writing


def test_a_corrupt_line_is_an_error_but_a_torn_last_line_is_not(tmp_path, capsys):
    run = write_run(tmp_path / "run")
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"step": 60, "lo')  # the run died mid-write
    assert main(["report", str(run)]) == 0
    lines = (run / "metrics.jsonl").read_text().splitlines()
    (run / "metrics.jsonl").write_text("\n".join(["garbage", *lines]) + "\n")
    assert main(["report", str(run)]) == 2
    assert "line 1 is not JSON" in capsys.readouterr().err


def test_report_needs_a_run_dir(capsys):
    with pytest.raises(SystemExit):
        main(["report"])
