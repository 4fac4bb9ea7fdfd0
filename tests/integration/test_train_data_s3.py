"""`forja train` with data.path = "s3://bucket/prepared" (a real moto server on localhost): the
same losses as the local copy, its tokenizer read from the store; a missing bucket or missing
credentials stop the preflight in one sentence before the run directory is written."""

from __future__ import annotations

import re

import pytest

from forja.cli import main
from forja.data.corpus.store import upload
from forja.storage import join

from .conftest import losses, train_args

SHORT = {"train.steps": "4", "checkpoint.interval": "0", "train.val_interval": "2", "train.sample_tokens": "0"}


def test_train_on_prepared_data_in_s3_matches_the_local_copy(train_data, s3_bucket, tmp_path, monkeypatch,
                                                             capsys) -> None:
    monkeypatch.setenv("FORJA_CACHE", str(tmp_path / "cache"))
    url = join(s3_bucket, "prepared")
    upload(train_data, url, replace=False)
    assert main(train_args(tmp_path / "local", train_data, **SHORT)) == 0
    assert main(train_args(tmp_path / "remote", url, **SHORT)) == 0  # type: ignore[arg-type]
    assert losses(tmp_path / "remote") == losses(tmp_path / "local")
    assert (tmp_path / "remote" / "tokenizer.json").read_bytes() == (train_data / "tokenizer.json").read_bytes()
    assert any((tmp_path / "cache" / "blocks").iterdir())  # the shards were read by blocks, into the cache


def _error(capsys) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err  # one line, no traceback
    return err


@pytest.mark.parametrize("problem", ["bucket", "credentials"])
def test_a_bad_data_url_stops_before_any_write(problem, s3_bucket, tmp_path, monkeypatch, capsys) -> None:
    url = join(s3_bucket + ("-missing" if problem == "bucket" else ""), "prepared")
    if problem == "credentials":
        for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
            monkeypatch.delenv(key)
    expected = (rf"^forja train: error: bucket {s3_bucket[5:]}-missing of data.path {url} does not exist at "
                r"http://127\.0\.0\.1:\d+; create it or fix the URL$" if problem == "bucket" else
                rf"^forja train: error: no credentials for {url}; set AWS_ACCESS_KEY_ID")
    run = tmp_path / "run"
    assert main(train_args(run, url, **SHORT)) == 2  # type: ignore[arg-type]
    assert re.match(expected, _error(capsys))
    assert not run.exists()


def test_a_url_without_prepared_data_is_one_sentence(s3_bucket, tmp_path, capsys) -> None:
    url = join(s3_bucket, "nothing-here")
    assert main(train_args(tmp_path / "run", url, **SHORT)) == 2  # type: ignore[arg-type]
    assert (f"data.path {url} holds no prepared data (no meta.json or mixture.json there); write it with "
            f"`forja prepare --out {url}`") in _error(capsys)
    assert not (tmp_path / "run").exists()
