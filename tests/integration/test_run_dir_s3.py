"""A run.dir in an object store: `forja train` with run.dir = "s3://bucket/runs/x" against a real
S3 server (moto's, on localhost; tests/storage_server.py), resumed from the store, through a
proxy that fails a share of the requests, refused in one sentence when the bucket or the
credentials are missing, and `forja export` from and to the store."""

from __future__ import annotations

import json
import os
import shutil

import pytest
from safetensors.torch import load_file

from forja import storage
from forja.cli import main
from forja.files import read_records
from tests.storage_server import make_bucket, set_s3_env

from .conftest import forja_process, losses, train_args

STEPS = 6
COMMON = {"train.steps": str(STEPS), "checkpoint.interval": "2", "checkpoint.keep": "2", "train.val_interval": "0",
          "train.sample_tokens": "0"}


def _train(run, data, **changes) -> int:
    return main(train_args(run, data, **{**COMMON, **changes}))


@pytest.fixture(scope="module")
def s3(moto_endpoint, tmp_path_factory):  # noqa: F811
    """The environment of these tests: AWS_* at the moto server, FORJA_CACHE (the mirrors) apart."""
    root = tmp_path_factory.mktemp("s3env")
    with pytest.MonkeyPatch.context() as mp:
        set_s3_env(mp, moto_endpoint, root)
        mp.setenv("FORJA_CACHE", str(root / "cache"))
        yield moto_endpoint


def _objects(url: str) -> list[str]:
    """The keys under `url`, relative to it."""
    fs, path = storage.filesystem(url)
    fs.invalidate_cache()
    return sorted(p[len(path) + 1:] for p in fs.find(path))


def _remote_losses(url: str, tmp_path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in _remote_records(url, tmp_path) if "loss" in r}


def _forget_mirrors() -> None:
    """Drop every local mirror: the next launch is as on another machine, with the store alone."""
    shutil.rmtree(os.path.join(os.environ["FORJA_CACHE"], "runs"), ignore_errors=True)


@pytest.fixture(scope="module")
def local_run(tmp_path_factory, train_data):
    """The same run on a local run.dir, uninterrupted: the loss curve the others must reproduce."""
    run = tmp_path_factory.mktemp("local") / "run"
    assert _train(run, train_data) == 0
    return run


@pytest.fixture(scope="module")
def s3_run(s3, train_data):
    """A run trained whole into the store."""
    url = f"s3://{make_bucket(s3)}/runs/x"
    assert _train(url, train_data) == 0
    return url


def test_a_run_in_the_store_holds_its_checkpoints_and_metrics_and_matches_a_local_run(s3_run, local_run, tmp_path):
    objects = _objects(s3_run)
    for name in ("config.toml", "run.json", "tokenizer.json", "metrics.jsonl", "goodput.json"):
        assert name in objects
    steps = sorted({o.split("/")[1] for o in objects if o.startswith("checkpoints/")})
    assert steps == ["step-00000004", "step-00000006"]  # keep = 2: step 2 deleted
    for step in steps:
        assert {f"checkpoints/{step}/forja.json", f"checkpoints/{step}/.metadata"} <= set(objects)
    assert _remote_losses(s3_run, tmp_path) == losses(local_run)  # bit for bit
    assert "goodput" in _remote_records(s3_run, tmp_path)[-1]  # uploaded again at the very end
    assert json.loads(storage.read_bytes(storage.join(s3_run, "run.json")))["launches"]
    assert not [o for o in objects if ".forja-write-test" in o]  # the preflight's probes are gone


def _killed_then_resumed(url: str, data, capsys) -> str:
    """Train into the store until SIGKILL as step 5 begins (checkpoint 4 committed; a child
    process, nothing of it runs after the signal), plant a newer partial checkpoint (objects
    without forja.json: a save cut short), forget the local mirror, and train again: the rerun
    has only the store to resume from. Returns the rerun's output."""
    proc = forja_process(train_args(url, data, **{**COMMON, "debug.inject": '["kill@5"]'}))
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == -9, out
    fs, path = storage.filesystem(url)
    fs.copy(f"{path}/checkpoints/step-00000004", f"{path}/checkpoints/step-00000006", recursive=True)
    fs.rm_file(f"{path}/checkpoints/step-00000006/forja.json")
    _forget_mirrors()
    capsys.readouterr()
    assert _train(url, data) == 0
    return capsys.readouterr().out


def _check_resumed(url: str, out: str, local_run, tmp_path) -> None:
    assert "resumed from" in out and "(step 4)" in out, out
    records = _remote_records(url, tmp_path)
    assert [r["step"] for r in records if "loss" in r] == list(range(1, STEPS + 1))  # none twice, none lost
    assert _remote_losses(url, tmp_path) == losses(local_run)  # bit for bit
    assert len(json.loads(storage.read_bytes(storage.join(url, "run.json")))["launches"]) == 2
    steps = sorted({o.split("/")[1] for o in _objects(url) if o.startswith("checkpoints/")})
    assert steps == ["step-00000004", "step-00000006"]  # the partial 6 was removed, then written whole
    assert storage.exists(storage.join(url, "checkpoints/step-00000006/forja.json"))


def test_a_killed_run_resumes_from_the_store_alone_and_skips_a_partial_checkpoint(s3, train_data, local_run,
                                                                                  tmp_path, capsys):
    url = f"s3://{make_bucket(s3)}/runs/y"
    out = _killed_then_resumed(url, train_data, capsys)
    _check_resumed(url, out, local_run, tmp_path)


def test_a_store_that_fails_a_share_of_requests_still_trains_and_resumes(s3, flaky_s3, train_data,  # noqa: F811
                                                                         local_run, tmp_path):
    flaky_s3.share = 0.2  # 1 request in 5 answered 503 Slow Down or its connection reset
    url = f"{flaky_s3.url}/runs/z"
    assert _train(url, train_data) == 0
    # A crash while the last checkpoint was saved: its objects are there, its forja.json is not.
    fs, path = storage.filesystem(url)
    storage.retrying(lambda: fs.rm_file(f"{path}/checkpoints/step-00000006/forja.json"), what="test")
    _forget_mirrors()
    assert _train(url, train_data) == 0
    failed = flaky_s3.failed
    flaky_s3.share = 0.0  # the checks below read the store through the same proxy
    records = _remote_records(url, tmp_path)
    assert [r["step"] for r in records if "loss" in r] == list(range(1, STEPS + 1))
    assert _remote_losses(url, tmp_path) == losses(local_run)  # bit for bit
    assert storage.exists(storage.join(url, "checkpoints/step-00000006/forja.json"))
    assert failed >= 20, (failed, flaky_s3.forwarded)  # the run met many failures, not a lucky few


def _refused(args: list[str], capsys) -> str:
    """The one sentence of a command that must stop before writing anything."""
    capsys.readouterr()
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


def _buckets(endpoint: str) -> list[str]:
    import boto3

    client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1", aws_access_key_id="testing",
                          aws_secret_access_key="testing")
    return sorted(b["Name"] for b in client.list_buckets()["Buckets"])


def test_a_missing_bucket_or_missing_credentials_stop_in_one_sentence_before_any_write(s3, train_data, capsys,
                                                                                      monkeypatch):
    _forget_mirrors()
    before = _buckets(s3)
    err = _refused(train_args("s3://forja-no-such-bucket/runs/x", train_data, **COMMON), capsys)
    assert "bucket forja-no-such-bucket" in err and "does not exist" in err, err
    assert _buckets(s3) == before
    bucket = make_bucket(s3)
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    storage.clear_cache()
    err = _refused(train_args(f"s3://{bucket}/runs/x", train_data, **COMMON), capsys)
    assert "no credentials" in err, err
    monkeypatch.undo()
    storage.clear_cache()
    assert _objects(f"s3://{bucket}") == []  # not even a write probe left
    assert not os.path.exists(os.path.join(os.environ["FORJA_CACHE"], "runs"))  # no local mirror either


def _tensors(folder) -> dict:
    return load_file(str(folder / "model.safetensors"))


def test_export_reads_a_run_in_the_store_and_writes_to_the_store(s3, s3_run, local_run, tmp_path, capsys):
    reference = tmp_path / "reference"
    assert main(["export", str(local_run), "--hf", str(reference)]) == 0
    out = f"s3://{make_bucket(s3)}/models/x"
    assert main(["export", s3_run, "--hf", out]) == 0
    assert set(_objects(out)) == {p.name for p in reference.iterdir()}
    fs, path = storage.filesystem(out)
    fs.get(path, str(tmp_path / "downloaded"), recursive=True)
    got, want = _tensors(tmp_path / "downloaded"), _tensors(reference)
    assert got.keys() == want.keys() and all((got[k] == want[k]).all() for k in want)  # the same weights
    err = _refused(["export", s3_run, "--hf", out], capsys)  # an export is there: not replaced silently
    assert "--overwrite" in err, err
    # A checkpoint of the store, by name, to a local directory; then over the store's export.
    local = tmp_path / "from-checkpoint"
    assert main(["export", f"{s3_run}/checkpoints/step-00000004", "--hf", str(local)]) == 0
    assert (local / "config.json").is_file() and (local / "tokenizer.json").is_file()
    assert main(["export", f"{s3_run}/checkpoints/step-00000004", "--hf", out, "--overwrite"]) == 0
    assert set(_objects(out)) == {p.name for p in reference.iterdir()}
    err = _refused(["export", s3_run, "--hf", "s3://forja-no-such-bucket/models/x"], capsys)
    assert "does not exist" in err, err


def _remote_records(url: str, tmp_path) -> list[dict]:
    local = tmp_path / "records.jsonl"
    local.write_bytes(storage.read_bytes(storage.join(url, "metrics.jsonl")))
    return read_records(local, strict=True)
