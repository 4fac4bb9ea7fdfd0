"""forja.storage against a real S3-compatible server (moto on localhost): retries through a proxy
that fails requests, one sentence for each bad setup, atomic commits, lazy imports."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest

from forja import storage
from forja.errors import ForjaError
from forja.storage import check_reachable, commit, committed, is_url, join, read_bytes, retrying, write_bytes_atomic


def test_what_counts_as_a_url() -> None:
    for url in ("s3://b/x", "gs://b", "memory://x", "https://h/x", "S3://B/x", "abfs://c/x"):
        assert is_url(url), url
    for path in ("/data", "data/x", "file:///data", "jsonl:x.jsonl", "jsonl:s3://b/x", "stdlib", "C:\\x", "~/d"):
        assert not is_url(path), path
    assert join("s3://b/x/", "train", "a.bin") == "s3://b/x/train/a.bin"
    assert storage.local_path("file:///tmp/x").as_posix() == "/tmp/x"


def test_the_endpoint_comes_from_aws_endpoint_url(s3_bucket, moto_endpoint, monkeypatch) -> None:
    fs, path = storage.filesystem(join(s3_bucket, "a"))
    assert fs.endpoint_url == moto_endpoint and path == join(s3_bucket, "a")[len("s3://"):]
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", "http://127.0.0.1:9")  # the service-specific one wins
    assert storage.filesystem(s3_bucket)[0].endpoint_url == "http://127.0.0.1:9"


def test_write_read_and_ranges(s3_bucket) -> None:
    url = join(s3_bucket, "d", "a.bin")
    write_bytes_atomic(url, b"0123456789")
    assert read_bytes(url) == b"0123456789" and read_bytes(url, 2, 5) == b"234"
    assert storage.size(url) == 10 and storage.exists(url)
    check_reachable(join(s3_bucket, "d"), write=True)
    fs, path = storage.filesystem(join(s3_bucket, "d"))
    assert [p.rsplit("/", 1)[-1] for p in fs.ls(path, refresh=True)] == ["a.bin"]  # the probe is gone


def test_a_directory_is_trusted_once_its_marker_is_written_last(s3_bucket, tmp_path) -> None:
    (tmp_path / "sub").mkdir()
    for name in ("b.bin", "sub/c.bin", "meta.json"):
        (tmp_path / name).write_bytes(name.encode())
    url = join(s3_bucket, "dir")
    assert storage.upload_dir(tmp_path, url, last=["meta.json"]) == ["b.bin", "sub/c.bin", "meta.json"]
    assert read_bytes(join(url, "sub/c.bin")) == b"sub/c.bin"
    assert not committed(url)
    commit(url)
    assert committed(url)
    storage.remove_tree(url)
    assert not storage.exists(join(url, "b.bin"))


def test_retries_get_through_a_flaky_server(flaky_s3) -> None:
    flaky_s3.share = 0.3
    url = join(flaky_s3.url, "f.bin")
    for i in range(20):
        write_bytes_atomic(url, bytes([i]) * 1000)
        assert read_bytes(url, 0, 4) == bytes([i]) * 4
    assert flaky_s3.failed >= 5, (flaky_s3.failed, flaky_s3.forwarded)


def test_a_server_that_always_fails_is_one_sentence(flaky_s3, monkeypatch) -> None:
    flaky_s3.share = 1.0
    monkeypatch.setenv("FORJA_STORAGE_ATTEMPTS", "3")
    url = join(flaky_s3.url, "g.bin")
    with pytest.raises(ForjaError, match=r"^reading s3://.*/g\.bin failed 3 times at http://127\.0\.0\.1:\d+ "
                                         r"\(.*\); the store is unreachable or overloaded"):
        read_bytes(url)
    # forja's 3 attempts, each one request (botocore and s3fs do not retry below), and at most one
    # more each where aiohttp resends a request whose kept-alive connection was reset
    assert 3 <= flaky_s3.failed <= 6


def test_lasting_errors_are_not_retried() -> None:
    calls = []

    def missing() -> None:
        calls.append(1)
        raise FileNotFoundError("no such key")

    with pytest.raises(FileNotFoundError):
        retrying(missing, what="reading x")
    assert len(calls) == 1


def test_a_missing_bucket_is_one_sentence(s3_bucket) -> None:
    for write in (False, True):
        with pytest.raises(ForjaError, match=r"^bucket forja-test-\w+-nope of s3://forja-test-\w+-nope/x does not "
                                             r"exist at http://127\.0\.0\.1:\d+; create it or fix the URL$"):
            check_reachable(s3_bucket + "-nope/x", write=write)


def test_missing_credentials_are_one_sentence(s3_bucket, monkeypatch) -> None:
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    storage.clear_cache()
    with pytest.raises(ForjaError, match=r"^no credentials for s3://forja-test-\w+/x; set AWS_ACCESS_KEY_ID and "
                                         r"AWS_SECRET_ACCESS_KEY"):
        check_reachable(join(s3_bucket, "x"), write=True)


def test_an_unreachable_endpoint_is_one_sentence(s3_bucket, monkeypatch) -> None:
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")  # nothing listens on the discard port
    storage.clear_cache()
    with pytest.raises(ForjaError, match=r"^s3://forja-test-\w+/x cannot be reached: http://127\.0\.0\.1:9 does "
                                         r"not answer \(\w+\); check AWS_ENDPOINT_URL and the network$"):
        check_reachable(join(s3_bucket, "x"), write=False)


def test_a_store_whose_package_is_missing_is_one_sentence() -> None:
    if importlib.util.find_spec("gcsfs") is not None:
        pytest.skip("gcsfs is installed here")
    with pytest.raises(ForjaError, match=r"^gs://b/x needs a package that is not installed \(.*gcsfs.*\); install "
                                         r"that package and run again$"):
        storage.filesystem("gs://b/x")


def test_importing_forja_storage_loads_neither_fsspec_nor_s3fs() -> None:
    code = ("import sys, forja.storage, forja.data.corpus.shards; "
            "print(sorted({'fsspec', 's3fs', 'boto3'} & set(sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_bad_settings_are_one_sentence(monkeypatch, tmp_path) -> None:
    from forja.storage.blocks import BlockCache

    monkeypatch.setenv("FORJA_CACHE_GB", "lots")
    with pytest.raises(ForjaError, match=r"^FORJA_CACHE_GB=lots is not a number of at least 0; set it"):
        BlockCache(tmp_path)
    monkeypatch.setenv("FORJA_CACHE_GB", "0.001")
    with pytest.raises(ForjaError, match=r"cannot hold one block \(FORJA_BLOCK_MB, 8388608 bytes\)"):
        BlockCache(tmp_path)
    monkeypatch.setenv("FORJA_STORAGE_ATTEMPTS", "0")
    with pytest.raises(ForjaError, match=r"^FORJA_STORAGE_ATTEMPTS=0 is not a number of at least 1"):
        retrying(lambda: None, what="x")
