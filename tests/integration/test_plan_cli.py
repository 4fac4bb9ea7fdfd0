"""`forja plan` end to end: the ranked table, --json, --layout, --check on a finished run, and
`forja train`'s own use of the planner (parallel.auto, the memory check)."""

from __future__ import annotations

import json
import re
import shlex

import pytest

from forja.cli import main
from forja.config import load_config
from forja.files import read_records

from .conftest import train_args

KEYS = {"layout", "peak_memory_bytes", "memory_breakdown", "step_time_s", "tokens_per_sec",
        "tokens_per_sec_per_device", "mfu", "fits"}


def test_json_lists_candidates_best_first(capsys):
    assert main(["plan", "llama3-8b", "--gpus", "16", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    cands = out["candidates"]
    assert cands and KEYS <= set(cands[0])
    assert cands[0]["fits"] and not cands[-1]["fits"]
    fitting = [c for c in cands if c["fits"]]
    assert fitting[0]["tokens_per_sec"] >= 0.99 * max(c["tokens_per_sec"] for c in fitting)
    assert set(cands[0]["layout"]) >= {"parallel.dp_shard", "parallel.tp", "parallel.pp", "train.micro_batch_size"}
    assert cands[0]["tokens_per_sec"] == pytest.approx(16 * cands[0]["tokens_per_sec_per_device"])


def test_table_and_one_layout(capsys):
    """The table fits 100 columns and has exactly --top rows, all layouts that fit, then one line
    counting the rest; the best layout is a `forja train` command (backslash-continued lines)
    whose --set values select it; --wide spells the layouts out with every key on one line."""
    assert main(["plan", "llama3-8b", "--gpus", "16", "--top", "3", "--set", "train.seed=7"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert max(len(line) for line in lines) <= 100, "\n".join(lines)
    assert "layouts fit" in lines[0] and "GB usable each" in lines[0]
    rows = [line for line in lines if line.split(" ", 1)[0].isdigit() and "%" in line]
    assert [int(r.split()[0]) for r in rows] == [1, 2, 3]
    (rest,) = [line for line in lines if "more fit;" in line]
    fit, total = (int(n.replace(",", "")) for n in re.findall(r"([\d,]+) (?:of|layouts)", lines[0])[:2])
    counts = [int(n.replace(",", "")) for n in re.findall(r"[\d,]+(?= more| need| refused)", rest)]
    assert counts[0] == fit - 3 and sum(counts) == total - 3
    at = lines.index(next(line for line in lines if line.startswith("best, as a command")))
    command = " ".join(line.strip().removesuffix("\\") for line in lines[at + 1:at + 6]
                       if line.startswith("  ")).split(" memory")[0]
    words = shlex.split(command)
    assert words[:3] == ["forja", "train", "llama3-8b"] and "train.seed=7" in words
    cfg = load_config("llama3-8b", words[4::2])
    assert main(["plan", "llama3-8b", "--gpus", "16", "--json"]) == 0
    best = json.loads(capsys.readouterr().out)["candidates"][0]["layout"]
    assert {k: getattr(getattr(cfg, k.split(".")[0]), k.split(".")[1]) for k in best} == best
    assert main(["plan", "llama3-8b", "--gpus", "16", "--top", "3", "--wide"]) == 0
    wide = capsys.readouterr().out
    best = next(line for line in wide.splitlines() if line.startswith("best: "))
    assert best.count("--set ") == 17 and "--set parallel.ac_matmuls=" in best  # the whole line, unwrapped
    assert "| zero-3 |" in wide and "refused by forja train:" in wide  # spelled out, and the reasons listed
    every_key = "parallel.dp_replicate=1,parallel.dp_shard=8,parallel.tp=2,parallel.pp=1,parallel.cp=1,parallel.ep=1," \
                "parallel.reshard_after_forward=true,parallel.cpu_offload=false,parallel.ac=full,train.micro_batch_size=1"
    assert main(["plan", "llama3-8b", "--gpus", "16", "--json", "--layout", every_key]) == 0
    (only,) = json.loads(capsys.readouterr().out)["candidates"]
    assert only["layout"]["parallel.tp"] == 2 and only["layout"]["parallel.ac"] == "full"
    assert main(["plan", "llama3-8b", "--gpus", "16", "--layout", "parallel.dp_shard=3,parallel.tp=2"]) == 2
    assert "no layout of 16 ranks with parallel.dp_shard=3,parallel.tp=2" in capsys.readouterr().err


def test_layout_reads_values_as_set_does_and_refuses_bad_ones(capsys):
    for value in ('"selective"', "selective"):  # the quoting --set wants, and a bare word: one value
        assert main(["plan", "debug", "--gpus", "2", "--gpu", "cpu", "--json", "--layout", f"parallel.ac={value}"]) == 0
        cands = json.loads(capsys.readouterr().out)["candidates"]
        assert cands and {c["layout"]["parallel.ac"] for c in cands} == {"selective"} and cands[0]["runs"]
    assert main(["plan", "debug", "--gpus", "2", "--gpu", "cpu", "--layout", "parallel.ac=bogus"]) == 2
    assert capsys.readouterr().err.strip() == ("forja plan: error: parallel.ac = 'bogus' is not valid: it must be one "
                                               "of 'none', 'full', 'selective'")


def test_a_partial_layout_holds_its_keys_and_searches_the_rest(capsys):
    """torchtitan's Llama 3.1 8B on 8 H100s is FSDP 8 with selective AC: given only dp_shard = 8,
    the search finds the AC that makes it fit instead of fixing every other key to the recipe's."""
    assert main(["plan", "llama3-8b", "--gpus", "8", "--gpu", "h100", "--json", "--layout", "parallel.dp_shard=8"]) == 0
    cands = json.loads(capsys.readouterr().out)["candidates"]
    assert len(cands) > 1 and all(c["layout"]["parallel.dp_shard"] == 8 for c in cands)
    assert cands[0]["fits"] and cands[0]["layout"]["parallel.ac"] != "none"
    assert {c["layout"]["parallel.ac"] for c in cands} == {"none", "selective", "full"}


def test_check_compares_a_finished_run_with_its_prediction(tmp_path, train_data, capsys):
    run = tmp_path / "run"
    assert main(train_args(run, train_data, **{"train.steps": "4"})) == 0
    capsys.readouterr()
    assert main(["plan", "--check", str(run), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["hardware"] == "cpu" and out["world_size"] == 1
    assert out["measured"]["tokens_per_sec"] > 0 and out["predicted"]["peak_memory_bytes"] > 0
    assert out["ratios"]["tokens_per_sec"] == pytest.approx(
        out["measured"]["tokens_per_sec"] / out["predicted"]["tokens_per_sec"])
    assert main(["plan", "--check", str(tmp_path)]) == 2
    assert "has no config.toml" in capsys.readouterr().err


def test_auto_writes_its_choice_and_the_run_trains_with_it(tmp_path, train_data):
    run = tmp_path / "auto"
    assert main(train_args(run, train_data, **{"train.steps": "2", "parallel.auto": "true"})) == 0
    chosen = json.loads((run / "plan.json").read_text())["chosen"]
    assert chosen["fits"] and chosen["layout"]["parallel.tp"] == 1
    assert any("loss" in r for r in read_records(run / "metrics.jsonl"))


def test_a_run_that_cannot_fit_stops_before_allocating(tmp_path, train_data, capsys):
    # 64 sequences of 256k tokens in one micro-batch: terabytes of activations on a CPU host.
    sets = {"train.seq_len": "262144", "train.global_batch_size": "64", "train.micro_batch_size": "64",
            "model.overrides.max_seq_len": "262144"}
    assert main(train_args(tmp_path / "big", train_data, **sets)) == 2
    err = capsys.readouterr().err
    assert "is predicted to need" in err and "activations" in err and "parallel.memory_check = 'warn'" in err
    assert not (tmp_path / "big" / "checkpoints").exists()
