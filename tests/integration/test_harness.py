"""lm-evaluation-harness on a forja run: the "forja" model against the harness's own "hf" model
on the run's Hugging Face export, on the local tasks of tests/data/eval/harness."""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from forja.cli import main
from forja.errors import ForjaError

from .conftest import train_args

lm_eval = pytest.importorskip("lm_eval")
pytest.importorskip("transformers")
pytest.importorskip("accelerate")  # lm_eval's hf model imports it

from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402

from forja.eval.harness import ForjaLM, _sampling, add_cli  # noqa: E402
from forja.generate import SamplingConfig, generate  # noqa: E402

HARNESS = Path(__file__).parents[1] / "data" / "eval" / "harness"
MC, TEXT = "forja_python_mc", "forja_python_text"
# The harness must never reach a hub: the tasks build their datasets from local files.
OFFLINE = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false"}


@pytest.fixture(scope="module")
def offline(tmp_path_factory):
    """Offline, with Hugging Face caches in a temporary directory rather than $HOME."""
    home = tmp_path_factory.mktemp("hf-home")
    env = {**OFFLINE, "HF_HOME": str(home), "HF_DATASETS_CACHE": str(home / "datasets")}
    with pytest.MonkeyPatch.context() as mp:
        for key, value in env.items():
            mp.setenv(key, value)
        yield env


@pytest.fixture(scope="module")
def run_and_export(tmp_path_factory, train_data, offline):
    root = tmp_path_factory.mktemp("harness")
    run, hf = root / "run", root / "hf"
    assert main(train_args(run, train_data, **{"train.steps": "12", "checkpoint.interval": "12",
                                                "train.val_interval": "12"})) == 0
    assert main(["export", str(run), "--hf", str(hf)]) == 0
    return run, hf


@pytest.fixture(scope="module")
def task_manager(offline):
    # Only the local tasks: indexing the harness's thousands of built-in ones takes ~10 s here.
    return TaskManager(include_path=str(HARNESS), include_defaults=False)


def evaluate(task_manager, model: str, model_args: str, tasks: list[str]) -> dict:
    return lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=tasks, task_manager=task_manager,
                                   device="cpu", log_samples=True, bootstrap_iters=0)


@pytest.fixture(scope="module")
def both(run_and_export, task_manager):
    """The forja and hf models' results on both tasks: with the models' own lengths, and in
    windows of 40 tokens (so long requests are cut and documents span several windows)."""
    run, hf = run_and_export
    out = {}
    for extra in ("", ",max_length=40"):
        out["forja" + extra] = evaluate(task_manager, "forja", f"run={run}{extra}", [MC, TEXT])
        out["hf" + extra] = evaluate(task_manager, "hf", f"pretrained={hf},dtype=float32{extra}", [MC, TEXT])
    return out


def responses(result: dict, task: str) -> list:
    """Per request, in document order: (loglikelihood, is_greedy) or a rolling loglikelihood."""
    samples = sorted(result["samples"][task], key=lambda s: s["doc_id"])
    return [resp[0] for s in samples for resp in s["resps"]]


@pytest.mark.parametrize("extra", ["", ",max_length=40"])
def test_multiple_choice_agrees_with_the_hf_model_on_the_export(both, extra):
    ours, theirs = both["forja" + extra], both["hf" + extra]
    for metric in ("acc,none", "acc_norm,none"):
        assert ours["results"][MC][metric] == theirs["results"][MC][metric]
    a, b = responses(ours, MC), responses(theirs, MC)
    assert len(a) == len(b) == 11  # 5 questions, 11 choices
    assert max(abs(x[0] - y[0]) for x, y in zip(a, b)) < 1e-4  # measured 1.5e-5 (sums of ~100 nats)
    assert [x[1] for x in a] == [y[1] for y in b]  # is_greedy
    assert len({round(x[0], 3) for x in a}) == len(a)  # real scores, each its own


def test_rolling_perplexity_agrees_and_windows_change_it(both):
    for extra in ("", ",max_length=40"):
        a, b = responses(both["forja" + extra], TEXT), responses(both["hf" + extra], TEXT)
        assert len(a) == len(b) == 4
        assert all(abs(x - y) <= 1e-4 * abs(y) for x, y in zip(a, b))  # measured 4e-8 relative
        assert both["forja" + extra]["results"][TEXT]["bits_per_byte,none"] == pytest.approx(
            both["hf" + extra]["results"][TEXT]["bits_per_byte,none"], rel=1e-6)
    # 40-token windows give most tokens less context than one whole-document window.
    assert responses(both["forja"], TEXT) != responses(both["forja,max_length=40"], TEXT)


def gen_instance(context: str, until: list[str], max_gen_toks: int = 8) -> Instance:
    return Instance(request_type="generate_until", doc={}, idx=0,
                    arguments=(context, {"until": until, "max_gen_toks": max_gen_toks, "do_sample": False}))


def test_generate_until_is_forja_greedy_generation_cut_at_stop_strings(run_and_export):
    run, _ = run_and_export
    lm = ForjaLM(run=str(run), device="cpu")
    contexts = ["import json\n\ndata = json.", "def dumps(obj):\n    return "]
    texts = lm.generate_until([gen_instance(c, []) for c in contexts])
    for context, text in zip(contexts, texts):
        prompt = torch.tensor([lm.tok.encode(context)])
        new = generate(lm.model, prompt, SamplingConfig(max_new_tokens=8, stop_token=lm.tok.eos_id))[0, prompt.shape[1]:]
        ids = new.tolist()
        ids = ids[: ids.index(lm.tok.eos_id)] if lm.tok.eos_id in ids else ids
        assert text == lm.tok.decode(ids) and text
    # A stop string taken from inside the first output: the text ends just before it.
    stop = texts[0][1:3]
    assert lm.generate_until([gen_instance(contexts[0], [stop])]) == [texts[0].split(stop)[0]]
    with pytest.raises(ForjaError, match="max_gen_toks=4096 leaves no room for a prompt"):
        lm.generate_until([gen_instance(contexts[0], [], max_gen_toks=4096)])


def test_the_command_line_runs_lm_eval_with_the_forja_model(run_and_export, both, offline, tmp_path):
    run, _ = run_and_export
    out = tmp_path / "out"
    env = {**os.environ, **offline}
    proc = subprocess.run([sys.executable, "-m", "forja.eval.harness", "--model", "forja", "--model_args",
                           f"pretrained={run}", "--tasks", MC, "--include_path", str(HARNESS), "--output_path",
                           str(out), "--device", "cpu", "--batch_size", "8"],
                          capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (path,) = out.rglob("results_*.json")
    results = json.loads(path.read_text())
    assert results["results"][MC]["acc,none"] == both["forja"]["results"][MC]["acc,none"]
    assert results["config"]["forja_source"] == str(run) and results["config"]["model"] == "forja"
    # `forja lm-eval ...` (add_cli) hands every argument, -h included, to lm_eval untouched.
    parser = argparse.ArgumentParser()
    add_cli(parser.add_subparsers(dest="command"))
    assert parser.parse_args(["lm-eval", "--model", "forja", "-h"]).args == ["--model", "forja", "-h"]


def test_bad_inputs_are_one_forja_error_sentence(tmp_path, task_manager):
    with pytest.raises(ForjaError, match=r"run=\S*missing does not exist; give a run directory"):
        evaluate(task_manager, "forja", f"run={tmp_path / 'missing'}", [MC])
    with pytest.raises(ForjaError, match="needs run=DIR"):
        ForjaLM()
    with pytest.raises(ForjaError, match="generation_kwargs num_beams are not supported"):
        _sampling({"num_beams": 4}, 8, stop=1)


def test_int8_scores_close_to_float32(run_and_export, both):
    run, _ = run_and_export
    lm = ForjaLM(run=str(run), device="cpu", quantize="int8")
    requests = [Instance(request_type="loglikelihood", doc={}, idx=0, arguments=("import json\n\ndata = json.", c))
                for c in ("loads(text)", "sing(text)", "purple(text)")]
    int8 = [ll for ll, _ in lm.loglikelihood(requests)]
    fp32 = [x[0] for x in responses(both["forja"], MC)[:3]]
    assert all(math.isclose(a, b, rel_tol=0.05) for a, b in zip(int8, fp32)), (int8, fp32)
