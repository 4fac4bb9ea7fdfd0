"""`forja report` end to end: metrics written by the JSONL sink in, PNG charts and a summary out."""

import json
import warnings

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


def test_one_run_charts_go_to_its_directory(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "120")  # the table's cells whole, whatever runs the test (rich reads COLUMNS)
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


def write_moe_run(run_dir, *, steps=5, layers=(1, 2, 3), dropped=0.0, aux=0.0):
    """A run with the expert-load metrics forja/train/step/experts.py logs (every record also
    has the dense keys)."""
    sink = JsonlSink(run_dir)
    sink.start(total_steps=steps * 10, start_step=0)
    for i in range(1, steps + 1):
        metrics = {"loss": 5.0 / i, "lr": 1e-3, "grad_norm": 1.0, "tokens_per_sec": 1000.0, "step_time": 0.5,
                   "moe/load_max_mean": 1.0 + 2.0 / i, "moe/load_cv": 0.5 / i, "moe/dropped": dropped,
                   "moe/aux_loss": aux, "moe/z_loss": 0.0}
        for layer in layers:
            metrics.update({f"moe/layer{layer}/load_max_mean": 1.0 + layer / i,
                            f"moe/layer{layer}/load_cv": layer / (10 * i), f"moe/layer{layer}/dropped": dropped,
                            f"moe/layer{layer}/aux_loss": aux, f"moe/layer{layer}/z_loss": 0.0})
        sink.log(10 * i, metrics)
    sink.close()
    return run_dir


def test_a_moe_run_gets_an_expert_load_chart_and_table(tmp_path, capsys):
    from forja.report import expert_panels, load_run

    run = write_moe_run(tmp_path / "moe", layers=(1, 2, 3, 10), aux=1.02)
    assert main(["report", str(run)]) == 0
    for name in [*CHARTS, "expert_load.png"]:
        assert_png(run / name)
    out = capsys.readouterr().out
    assert "expert load" in out
    # layers, last load max/mean 1 + 2/5, last CV 0.5/5, nothing dropped, last aux loss
    for text in ("4", "1.400", "0.100", "0.00%", "1.0200"):
        assert text in out
    panels = expert_panels([load_run(run)])
    assert list(panels) == [
        "expert load: busiest / mean, worst layer (dashed: CV, mean over layers)",
        "load CV per MoE layer",
        "router losses, unweighted: load balancing (dashed: z-loss)",  # dropped and z-loss are all 0
    ]
    by_title = [by_run["moe"] for by_run in panels.values()]
    assert by_title[0] == ["moe/load_max_mean", "moe/load_cv"]
    assert by_title[1] == [f"moe/layer{i}/load_cv" for i in (1, 2, 3, 10)]  # by layer index, one line each
    assert by_title[2] == ["moe/aux_loss"]


def test_dropped_slots_are_drawn_and_runs_overlaid(tmp_path, capsys):
    from forja.report import expert_panels, load_run

    a = write_moe_run(tmp_path / "a", dropped=0.03)
    b = write_run(tmp_path / "dense")
    out_dir = tmp_path / "charts"
    assert main(["report", str(a), str(b), "--out", str(out_dir)]) == 0
    assert_png(out_dir / "expert_load.png")
    panels = expert_panels([load_run(a), load_run(b)])
    assert "token-slots dropped by the capacity limit (share)" in panels
    assert all(list(by_run) == ["a"] for by_run in panels.values())  # the dense run draws nothing
    assert "3.00%" in capsys.readouterr().out


def test_a_dense_run_has_no_expert_load_chart(tmp_path, capsys):
    run = write_run(tmp_path / "dense")
    assert main(["report", str(run)]) == 0
    assert not (run / "expert_load.png").exists()
    assert "expert load" not in capsys.readouterr().out


def test_goodput_and_health_events_are_summarized(tmp_path, capsys):
    run = write_run(tmp_path / "healed")
    sink = JsonlSink(run)
    sink.start(total_steps=50, start_step=50)
    sink.log(30, {"event": "nonfinite", "action": "rollback", "metric": "loss", "health/value": float("nan")})
    sink.log(30, {"event": "replay", "verdict": "transient"})
    sink.log(40, {"event": "spike", "action": "skip", "metric": "loss", "health/value": 9.0})
    sink.log(50, {"goodput": 0.873, "restarts": 2, "rollbacks": 1})
    sink.close()
    assert main(["report", str(run)]) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if "87.3%" in line)
    assert [cell.strip() for cell in row.split("│")[2:7]] == ["87.3%", "2", "1", "1", "0"], out


def test_in_loop_evaluation_is_charted(tmp_path, capsys):
    run = write_run(tmp_path / "evaluated")
    sink = JsonlSink(run)
    sink.start(total_steps=50, start_step=50)
    for step, acc, bpb in ((20, 0.25, 4.1), (40, 0.5, 3.6)):
        sink.log(step, {"eval/mc/acc": acc, "eval/mc/acc_norm": acc, "eval/mc/n": 4, "eval/text/bits_per_byte": bpb})
    sink.close()
    assert main(["report", str(run)]) == 0
    assert_png(run / "eval.png")
    height, _, _ = imread(run / "eval.png").shape
    assert height > 1.5 * imread(run / "loss.png").shape[0]  # three panels (acc, acc_norm, bits/byte), not one
    plain = write_run(tmp_path / "plain")
    assert main(["report", str(plain)]) == 0
    assert (plain / "loss.png").is_file() and not (plain / "eval.png").exists()


def test_data_chart_says_a_share_that_never_moves_instead_of_drawing_it(tmp_path):
    """Window packing cuts every document longer than a window: documents cut = 1.0 at every
    step is one sentence on data.png, not a flat line; a share that moves is drawn."""
    from forja.report import flat_notes, load_run, share_lines

    runs = []
    shares = (("window", lambda i: 1.0, lambda i: 0.0), ("best-fit", lambda i: 0.1 * i, lambda i: 0.02 * i))
    for name, cut, padding in shares:
        sink = JsonlSink(tmp_path / name)
        sink.start(total_steps=40, start_step=0)
        for i in range(1, 5):
            sink.log(10 * i, {"loss": 5.0 / i, "data/padding": padding(i), "data/cut_docs": cut(i),
                              "tokens/stdlib:json": 1000 * i})
        sink.close()
        runs.append(load_run(tmp_path / name))
    window, best_fit = runs
    assert share_lines(window) == []
    assert flat_notes(window) == ["window: padding 0% at every step", "window: documents cut 100% at every step "
                                  "(window packing cuts documents at the windows' edges)"]
    assert [key for key, _, _ in share_lines(best_fit)] == ["data/padding", "data/cut_docs"]
    assert flat_notes(best_fit) == []
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # matplotlib's "No artists with labels" when nothing is drawn
        assert main(["report", str(tmp_path / "window")]) == 0
    assert_png(tmp_path / "window" / "data.png")
