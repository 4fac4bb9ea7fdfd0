"""`forja train` with data stages and packings: three stages (a mixture from step 4, an anneal
with the lr decay and a shorter length from step 7), resumed across a boundary bit-exact; every
record carries the stage and the tokens per source; bad stages stop before any write; best-fit
padding gives the same loss however the step is cut into micro-batches."""

from __future__ import annotations

import json
import random

import pytest

from forja.config import load_config
from forja.data import load_tokenizer, prepare
from forja.errors import ForjaError
from forja.train.trainer import Trainer

from .conftest import base_overrides, losses, read_metrics
from .test_context_extension import StopAfter

STEPS = 9


@pytest.fixture(scope="module")
def sources(train_data, tmp_path_factory):
    """Two more prepared sources with the run's tokenizer: tomllib's and wsgiref's code."""
    root = tmp_path_factory.mktemp("stage-data")
    tok = load_tokenizer(train_data / "tokenizer.json")
    for name in ("tomllib", "wsgiref"):
        prepare(f"stdlib:{name}", tok, root / name, val_fraction=0.2, workers=1)
    return root / "tomllib", root / "wsgiref"


def stages(train_data, sources, **decay) -> str:
    toml, wsgi = sources
    return (f'[{{start_step = 4, path = "{train_data}:1,{toml}:1"}}, '
            f'{{start_step = 7, path = "{wsgi}", seq_len = 32, lr_phase = "decay"}}]')


def config(run, data, stage_list: str, **changes):
    return load_config("debug", base_overrides(run, data, **{
        "train.steps": str(STEPS), "train.val_interval": "0", "checkpoint.interval": "100",
        "train.sample_tokens": "0", "schedule.name": '"wsd"', "data.stages": stage_list, **changes}))


@pytest.fixture(scope="module")
def uninterrupted(train_data, sources, tmp_path_factory):
    run = tmp_path_factory.mktemp("stages") / "run"
    Trainer(config(run, train_data, stages(train_data, sources))).run()
    return run


def test_records_carry_the_stage_and_the_tokens_of_each_source(uninterrupted):
    records = [r for r in read_metrics(uninterrupted) if "loss" in r]
    assert [r["stage"] for r in records] == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert [r["seq_len"] for r in records] == [64] * 6 + [32] * 3
    last = records[-1]
    per_source = {k: v for k, v in last.items() if k.startswith("tokens/")}
    assert set(per_source) == {"tokens/stdlib:json", "tokens/stdlib:tomllib", "tokens/stdlib:wsgiref"}
    assert sum(per_source.values()) == 8 * (6 * 64 + 3 * 32)
    assert per_source["tokens/stdlib:wsgiref"] == 8 * 3 * 32  # stage 2 alone
    lrs = [r["lr"] for r in records]
    assert lrs[6] == max(lrs) and lrs[6] > lrs[7] > lrs[8]  # the anneal decays over stage 2


def test_a_resume_across_a_stage_boundary_continues_bit_exact(uninterrupted, train_data, sources, tmp_path):
    run = tmp_path / "run"
    cfg = config(run, train_data, stages(train_data, sources))
    Trainer(cfg, callbacks=[StopAfter(5)]).run()  # inside stage 1; the next launch crosses into stage 2
    Trainer(cfg).run()
    assert losses(run) == losses(uninterrupted)
    # A begun stage edited: the next launch stops, naming it.
    toml, wsgi = sources
    edited = (f'[{{start_step = 4, path = "{train_data}:3,{toml}:1"}}, '
              f'{{start_step = 7, path = "{wsgi}", seq_len = 32, lr_phase = "decay"}}]')
    before = {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()}
    with pytest.raises(ForjaError, match=r"data.stages\[0\] \(stage 1\) has path .*:3,.* but this run trained on "
                                         r"it with .*:1,.* a stage already begun cannot change"):
        Trainer(config(run, train_data, edited, **{"train.steps": "12"})).run()
    assert {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()} == before  # the preflight wrote nothing


def test_a_stage_naming_an_unknown_source_stops_before_any_write(train_data, tmp_path):
    run = tmp_path / "run"
    bad = '[{start_step = 4, path = "jsonl:/nowhere/web.jsonl"}]'
    with pytest.raises(ForjaError, match=r"data.stages\[0\] \(from step 4\): .*nowhere"):
        Trainer(config(run, train_data, bad)).run()
    assert not run.exists()
    zero = f'[{{start_step = 4, path = "{train_data}:0,{train_data}:0"}}]'
    with pytest.raises(ForjaError, match=r"data.stages\[0\] \(from step 4\): source .* has weight 0.0; weights must "
                                         r"be positive numbers"):
        Trainer(config(run, train_data, zero)).run()
    with pytest.raises(ForjaError, match=r"data.stages\[0\] \(from step 4\) has seq_len = 128, longer than "
                                         r"train.seq_len = 64"):
        Trainer(config(run, train_data, f'[{{start_step = 4, path = "{train_data}", seq_len = 128}}]')).run()
    with pytest.raises(ForjaError, match=r"lr_phase = \"decay\", which needs schedule.name = \"wsd\""):
        Trainer(config(run, train_data, f'[{{start_step = 4, path = "{train_data}", lr_phase = "decay"}}]',
                       **{"schedule.name": '"cosine"'})).run()
    assert not run.exists()


@pytest.fixture(scope="module")
def short_documents(train_data, tmp_path_factory):
    """Documents of 6 to 18 words (about 20 to 50 tokens): best-fit leaves a different padding in each sample."""
    root = tmp_path_factory.mktemp("short-docs")
    rng = random.Random(0)
    words = "def return class import value index token shard loader step".split()
    lines = [json.dumps({"text": " ".join(rng.choice(words) for _ in range(rng.randint(6, 18)))}) for _ in range(400)]
    (root / "docs.jsonl").write_text("\n".join(lines) + "\n")
    tok = load_tokenizer(train_data / "tokenizer.json")
    prepare(f"jsonl:{root / 'docs.jsonl'}", tok, root / "prepared", val_fraction=0.2, workers=1)
    return root / "prepared"


def test_best_fit_padding_gives_the_same_loss_however_the_step_is_cut(short_documents, tmp_path):
    def run_with(micro: int):
        run = tmp_path / f"m{micro}"
        Trainer(config(run, short_documents, "[]", **{"train.steps": "3", "train.micro_batch_size": str(micro),
                                                     "data.packing": '"best-fit"', "data.pack_buffer": "16"})).run()
        return run

    whole, cut = run_with(8), run_with(2)
    records = [r for r in read_metrics(whole) if "loss" in r]
    assert all(0 < r["data/padding"] < 0.5 and r["data/cut_docs"] == 0 for r in records)  # whole documents
    assert len(losses(whole)) == 3
    # Each micro-batch weighs by its labels: the mean over the step's labels either way (micro-batch
    # means averaged alike would differ in the third decimal here).
    assert losses(whole) == pytest.approx(losses(cut), rel=1e-5, abs=0)
