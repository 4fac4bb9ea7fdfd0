"""The [metrics] config, the JSONL and console sinks, and how a SinkGroup contains failures."""

import io
import json
import sys
import warnings

import pytest
import torch
from rich.console import Console

from forja.errors import ForjaError
from forja.files import read_records
from forja.metrics.config import MetricsConfig
from forja.metrics.console import ConsoleSink
from forja.metrics.sinks import JsonlSink, Sink, SinkGroup, build_sinks, tracker_key


def read_jsonl(path):
    return read_records(path, strict=True)


# -- config -----------------------------------------------------------------------------------

def test_config_defaults():
    cfg = MetricsConfig()
    assert cfg.interval == 10 and cfg.sinks == ["console", "jsonl"]
    assert (cfg.wandb_project, cfg.wandb_mode) == ("kode-pretraining", "offline")


@pytest.mark.parametrize("kwargs, words", [
    ({"interval": 0}, ["metrics.interval"]),
    ({"sinks": ["console", "graphite"]}, ["metrics.sinks", "graphite", "tensorboard, wandb, mlflow"]),
    ({"sinks": "console"}, ["metrics.sinks", "list"]),
    ({"sinks": ["jsonl", "jsonl"]}, ["metrics.sinks", "twice"]),
    ({"wandb_mode": "cloud"}, ["metrics.wandb_mode", "offline, online, disabled"]),
    ({"wandb_project": ""}, ["metrics.wandb_project"]),
    ({"comet_project": ""}, ["metrics.comet_project"]),
    ({"peak_tflops": 0.0}, ["metrics.peak_tflops"]),
])
def test_config_errors_name_the_key(kwargs, words):
    with pytest.raises(ForjaError) as err:
        MetricsConfig(**kwargs)
    for word in words:
        assert word in str(err.value)


def test_tracker_keys():
    assert tracker_key("loss") == "train/loss"
    assert tracker_key("val_loss") == "val/loss"
    assert tracker_key("custom/thing") == "custom/thing"


# -- JSONL ------------------------------------------------------------------------------------

def test_jsonl_writes_one_object_per_call_step_first(tmp_path):
    sink = JsonlSink(tmp_path)
    sink.start(total_steps=100, start_step=0)
    sink.log(10, {"loss": 2.5, "mfu": None, "tokens_per_sec": 1000.0})
    sink.log(10, {"val_loss": 2.7})
    sink.log_text(10, "sample", "once upon\na time")
    sink.close()
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [next(iter(json.loads(line))) for line in lines] == ["step", "step"]
    first, second = map(json.loads, lines)
    assert first["loss"] == 2.5 and first["mfu"] is None and "time" in first
    assert second["val_loss"] == 2.7 and "loss" not in second
    [sample] = read_jsonl(tmp_path / "samples.jsonl")
    assert (sample["step"], sample["name"], sample["text"]) == (10, "sample", "once upon\na time")


def test_jsonl_resume_drops_what_a_crashed_run_wrote_after_the_checkpoint(tmp_path):
    sink = JsonlSink(tmp_path)
    sink.start(total_steps=100, start_step=0)
    for step in (10, 20, 30, 40):
        sink.log(step, {"loss": 1.0 / step})
    sink.log_text(30, "sample", "late")
    sink.close()
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 50, "loss": 0.0')  # torn by the crash

    resumed = JsonlSink(tmp_path)
    resumed.start(total_steps=100, start_step=20)  # the checkpoint was at step 20
    for step in (30, 40, 50):
        resumed.log(step, {"loss": 2.0 / step})
    resumed.close()
    records = read_jsonl(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records] == [10, 20, 30, 40, 50]
    assert records[2]["loss"] == pytest.approx(2.0 / 30)  # the resumed run's value, not the old one
    assert read_jsonl(tmp_path / "samples.jsonl") == []
    assert not list(tmp_path.glob(".*tmp"))


def test_jsonl_shared_by_replica_groups_loses_no_record_when_one_restarts(tmp_path):
    """[ft]: the live group records steps 1-12; a group restarted from the checkpoint of step 10
    starts its sink on the same file without purging (its peers' records stand). A writer whose
    file is rewritten under it (a purge by a fresh launch) still writes to the file by its name."""
    live = JsonlSink(tmp_path)
    live.start(total_steps=20, start_step=0)
    for step in range(1, 13):
        live.log(step, {"loss": 1.0})
    rejoined = JsonlSink(tmp_path)
    rejoined.start(total_steps=20, start_step=10, purge=False)
    live.log(13, {"loss": 1.0})
    assert [r["step"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == list(range(1, 14))
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 14')
    JsonlSink(tmp_path).start(total_steps=20, start_step=13)  # rewrites the file: the torn line repaired
    live.log(14, {"loss": 1.0})
    assert [r["step"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == list(range(1, 15))


# -- console ----------------------------------------------------------------------------------

def test_console_prints_one_plain_line_per_log_when_not_a_terminal():
    out = io.StringIO()
    sink = ConsoleSink(Console(file=out, force_terminal=False, width=300))
    sink.start(total_steps=100, start_step=0)
    sink.log(10, {"loss": 3.21049, "lr": 3e-4, "tokens_per_sec": 48211.4, "mfu": 0.4131, "grad_norm": None})
    sink.log(20, {"loss": 3.0, "tokens_per_sec": 50000.0, "mfu": None})
    sink.log(20, {"val_loss": 3.3})
    sink.log_text(20, "sample", "the quick brown fox")
    sink.close()
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("step 10/100 | loss 3.2105 | lr 3.00e-04 | 48,211 tok/s | mfu 41.3%")
    assert "grad_norm" not in lines[0]
    assert lines[1].startswith("step 20/100 | loss 3.0000") and "eta " in lines[1] and "mfu" not in lines[1]
    assert lines[2] == "step 20/100 | val_loss 3.3000"
    assert "the quick brown fox" in out.getvalue()
    assert "\x1b[" not in out.getvalue()  # no control codes in a log file


def test_console_draws_a_progress_bar_on_a_terminal():
    out = io.StringIO()
    sink = ConsoleSink(Console(file=out, force_terminal=True, width=160))
    sink.start(total_steps=50, start_step=10)
    sink.log(20, {"loss": 2.0, "tokens_per_sec": 1234.0})
    sink.close()
    text = out.getvalue()
    assert "20/50" in text and "loss 2.0000" in text and "1,234 tok/s" in text


# -- the group --------------------------------------------------------------------------------

class Recorder(Sink):
    name = "recorder"

    def __init__(self):
        self.calls = []

    def start(self, *, total_steps, start_step, purge=True):
        self.calls.append(("start", total_steps, start_step))

    def log(self, step, metrics):
        self.calls.append(("log", step, dict(metrics)))

    def log_text(self, step, name, text):
        self.calls.append(("text", step, name, text))

    def close(self):
        self.calls.append(("close",))


class Broken(Sink):
    name = "broken"

    def __init__(self, fail_start=False):
        self.fail_start = fail_start

    def start(self, *, total_steps, start_step, purge=True):
        if self.fail_start:
            raise ConnectionError("no route to tracker")

    def log(self, step, metrics):
        raise OSError("disk full")


def test_a_failing_sink_warns_once_and_the_others_get_everything():
    first, second = Recorder(), Recorder()
    group = SinkGroup([first, Broken(), second])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        group.start(total_steps=3, start_step=0)
        for step in (1, 2, 3):
            group.log(step, {"loss": torch.tensor(1.5), "mfu": None})
        group.log_text(3, "sample", "hi")
        group.close()
    messages = [str(w.message) for w in caught]
    assert len(messages) == 1 and "broken" in messages[0] and "disk full" in messages[0]
    assert caught[0].category is RuntimeWarning
    expected = [("start", 3, 0), *[("log", s, {"loss": 1.5, "mfu": None}) for s in (1, 2, 3)],
                ("text", 3, "sample", "hi"), ("close",)]
    assert first.calls == expected and second.calls == expected
    assert type(first.calls[1][2]["loss"]) is float  # the tensor arrived as a number


def test_a_sink_that_cannot_start_is_turned_off():
    recorder, broken = Recorder(), Broken(fail_start=True)
    group = SinkGroup([broken, recorder])
    with pytest.warns(RuntimeWarning, match="broken.*start.*no route to tracker.*turned off"):
        group.start(total_steps=1, start_step=0)
    group.log(1, {"loss": 1.0})  # nothing more from the broken sink, not even a warning
    assert len(group) == 1 and recorder.calls[-1] == ("log", 1, {"loss": 1.0})


# -- build_sinks ------------------------------------------------------------------------------

def test_only_rank_zero_gets_sinks(tmp_path):
    cfg = MetricsConfig(sinks=["console", "jsonl"])
    assert len(build_sinks(cfg, run_dir=tmp_path, run_name="r", config={}, rank=1)) == 0
    group = build_sinks(cfg, run_dir=tmp_path, run_name="r", config={}, rank=0)
    assert [type(s).__name__ for s in group.sinks] == ["ConsoleSink", "JsonlSink"]
    assert not (tmp_path / "metrics.jsonl").exists()  # nothing is written before start()


@pytest.mark.parametrize("sink, module, extra", [
    ("wandb", "wandb", "wandb"), ("mlflow", "mlflow", "mlflow"),
    ("tensorboard", "torch.utils.tensorboard", "tensorboard"),
])
def test_a_missing_library_names_the_extra(tmp_path, monkeypatch, sink, module, extra):
    monkeypatch.setitem(sys.modules, module, None)  # what Python does for a module it cannot import
    cfg = MetricsConfig(sinks=["jsonl", sink])
    with pytest.raises(ForjaError, match=rf"pip install 'forja\[{extra}\]'"):
        build_sinks(cfg, run_dir=tmp_path, run_name="r", config={}, rank=0)
