"""lm-evaluation-harness on a forja run: the "forja" model against the harness's own "hf" model
on the run's Hugging Face export, on the local tasks of tests/data/eval/harness."""

from __future__ import annotations

import json
import math
import os
import shutil
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

from forja.cli import build_parser  # noqa: E402
from forja.eval.harness import ForjaLM, _sampling  # noqa: E402
from forja.eval.tasks import SHIPPED  # noqa: E402
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


def add_bos_post_processor(hf: Path) -> None:
    """Make the exported tokenizer.json put its BOS before every text, as many HF tokenizers do."""
    path = hf / "tokenizer.json"
    config = json.loads(path.read_text())
    bos, seq = {"SpecialToken": {"id": "<|bos|>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}
    bos_id = next(t["id"] for t in config["added_tokens"] if t["content"] == "<|bos|>")
    special = {"<|bos|>": {"id": "<|bos|>", "ids": [bos_id], "tokens": ["<|bos|>"]}}
    config["post_processor"] = {"type": "TemplateProcessing", "single": [bos, seq], "pair": [bos, seq],
                                "special_tokens": special}
    path.write_text(json.dumps(config))


@pytest.fixture(scope="module")
def hf_with_bos(run_and_export, tmp_path_factory):
    _, hf = run_and_export
    out = tmp_path_factory.mktemp("hf-bos") / "hf"
    shutil.copytree(hf, out)
    add_bos_post_processor(out)
    return out


@pytest.fixture(scope="module")
def both(run_and_export, hf_with_bos, task_manager):
    """The forja and hf models' results on both tasks. "run": forja on the run directory, hf on
    its export, each at its own length. "hf-dir": both on a Hugging Face directory whose tokenizer
    adds a BOS, in windows of 40 tokens (so long requests are cut and documents span windows)."""
    run, hf = run_and_export
    return {
        "forja/run": evaluate(task_manager, "forja", f"run={run}", [MC, TEXT]),
        "hf/run": evaluate(task_manager, "hf", f"pretrained={hf},dtype=float32", [MC, TEXT]),
        "forja/hf-dir": evaluate(task_manager, "forja", f"run={hf_with_bos},max_length=40", [MC, TEXT]),
        "hf/hf-dir": evaluate(task_manager, "hf", f"pretrained={hf_with_bos},dtype=float32,max_length=40",
                              [MC, TEXT]),
    }


def responses(result: dict, task: str) -> list:
    """Per request, in document order: (loglikelihood, is_greedy) or a rolling loglikelihood."""
    samples = sorted(result["samples"][task], key=lambda s: s["doc_id"])
    return [resp[0] for s in samples for resp in s["resps"]]


@pytest.mark.parametrize("source", ["run", "hf-dir"])
def test_multiple_choice_agrees_with_the_hf_model(both, source):
    ours, theirs = both["forja/" + source], both["hf/" + source]
    for metric in ("acc,none", "acc_norm,none"):
        assert ours["results"][MC][metric] == theirs["results"][MC][metric]
    a, b = responses(ours, MC), responses(theirs, MC)
    assert len(a) == len(b) == 11  # 5 questions, 11 choices
    print(f"{source}: acc {ours['results'][MC]['acc,none']} / {theirs['results'][MC]['acc,none']}, acc_norm "
          f"{ours['results'][MC]['acc_norm,none']} / {theirs['results'][MC]['acc_norm,none']}, max |ll diff| "
          f"{max(abs(x[0] - y[0]) for x, y in zip(a, b)):.2e}")
    assert max(abs(x[0] - y[0]) for x, y in zip(a, b)) < 1e-4  # measured 1.5e-5 (sums of ~100 nats)
    assert [x[1] for x in a] == [y[1] for y in b]  # is_greedy
    assert len({round(x[0], 3) for x in a}) == len(a)  # real scores, each its own


@pytest.mark.parametrize("source", ["run", "hf-dir"])
def test_rolling_perplexity_agrees_with_the_hf_model(both, source):
    ours, theirs = both["forja/" + source], both["hf/" + source]
    a, b = responses(ours, TEXT), responses(theirs, TEXT)
    assert len(a) == len(b) == 4
    print(f"{source}: rolling max relative diff {max(abs(x - y) / abs(y) for x, y in zip(a, b)):.1e}, bits/byte "
          f"{ours['results'][TEXT]['bits_per_byte,none']:.5f} / {theirs['results'][TEXT]['bits_per_byte,none']:.5f}")
    assert all(abs(x - y) <= 1e-4 * abs(y) for x, y in zip(a, b))  # measured 4e-8 relative
    assert ours["results"][TEXT]["bits_per_byte,none"] == pytest.approx(theirs["results"][TEXT]["bits_per_byte,none"],
                                                                         rel=1e-6)


def test_rolling_windows_and_the_tokenizers_bos_change_the_scores(run_and_export, hf_with_bos):
    """What the agreement above exercises: 40-token windows and the post-processor's BOS both
    change a document's score, so a forja model that ignored either would disagree with hf."""
    run, _ = run_and_export
    docs = [Instance(request_type="loglikelihood_rolling", doc={}, idx=0, arguments=(json.loads(line)["text"],))
            for line in (SHIPPED / "python_text.jsonl").read_text().splitlines()]
    whole = ForjaLM(run=str(run), device="cpu").loglikelihood_rolling(docs)
    windowed = ForjaLM(run=str(run), device="cpu", max_length=40).loglikelihood_rolling(docs)
    with_bos = ForjaLM(run=str(hf_with_bos), device="cpu").loglikelihood_rolling(docs)
    assert all(abs(w - x) > 1e-3 for w, x in zip(windowed, whole))  # each document spans windows
    assert all(abs(b - x) > 1e-3 for b, x in zip(with_bos, whole))


def gen_instance(context: str, until: list[str], max_gen_toks: int = 8) -> Instance:
    return Instance(request_type="generate_until", doc={}, idx=0,
                    arguments=(context, {"until": until, "max_gen_toks": max_gen_toks, "do_sample": False}))


def test_generate_until_is_forja_greedy_generation_cut_at_stop_strings(run_and_export):
    run, _ = run_and_export
    lm = ForjaLM(run=str(run), device="cpu")
    contexts = ["import json\n\ndata = json.", "def dumps(obj):\n    return "]
    texts = lm.generate_until([gen_instance(c, []) for c in contexts])
    generated = []
    for context, text in zip(contexts, texts):
        prompt = torch.tensor([lm.tok.encode(context)])
        greedy = SamplingConfig(max_new_tokens=8, stop_token=lm.tok.eos_id)
        ids = generate(lm.model, prompt, greedy)[0, prompt.shape[1]:].tolist()
        ids = ids[: ids.index(lm.tok.eos_id)] if lm.tok.eos_id in ids else ids
        assert text == lm.tok.decode(ids) and text
        generated.append(ids)
    # is_greedy: the generated tokens are each the argmax; with the last one changed they are not.
    context, ids = lm.tok.encode(contexts[0]), generated[0]
    changed = ids[:-1] + [(ids[-1] + 1) % lm.tok.vocab_size]
    (ll, greedy), (ll_changed, changed_greedy) = lm._loglikelihood_tokens([(("", ""), context, ids),
                                                                           (("", ""), context, changed)])
    assert greedy and not changed_greedy and ll > ll_changed
    # A stop string taken from inside the first output: the text ends just before it.
    stop = texts[0][1:3]
    assert lm.generate_until([gen_instance(contexts[0], [stop])]) == [texts[0].split(stop)[0]]
    with pytest.raises(ForjaError, match="max_gen_toks=4096 leaves no room for a prompt"):
        lm.generate_until([gen_instance(contexts[0], [], max_gen_toks=4096)])


@pytest.mark.slow  # ~20 s: lm_eval's CLI indexes its thousands of built-in task files on every start
def test_the_command_line_runs_lm_eval_with_the_forja_model(run_and_export, both, offline, tmp_path):
    run, _ = run_and_export
    out = tmp_path / "out"
    env = {**os.environ, **offline}
    proc = subprocess.run([sys.executable, "-m", "forja", "lm-eval", "--model", "forja", "--model_args",
                           f"pretrained={run}", "--tasks", MC, "--include_path", str(HARNESS), "--output_path",
                           str(out), "--device", "cpu", "--batch_size", "8"],
                          capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (path,) = out.rglob("results_*.json")
    results = json.loads(path.read_text())
    assert results["results"][MC]["acc,none"] == both["forja/run"]["results"][MC]["acc,none"]
    assert results["config"]["forja_source"] == str(run) and results["config"]["model"] == "forja"
    # `forja lm-eval ...` hands every argument, -h included, to lm_eval untouched.
    parser = build_parser("lm-eval")
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
    fp32 = [x[0] for x in responses(both["forja/run"], MC)[:3]]
    assert all(math.isclose(a, b, rel_tol=0.05) for a, b in zip(int8, fp32)), (int8, fp32)
