"""Prepared data on S3 (a real moto server on localhost): `prepare --out s3://`, read by ranges.

The remote copy must read byte for byte as the local one, through a block cache that stays
within its limit, and a server failing a share of requests must still give the same batches.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from forja.data import DataLoader, open_dataset, open_prepared, prepare
from forja.data.corpus.remote import RemoteTokens
from forja.errors import ForjaError
from forja.storage import exists, filesystem, join, read_bytes, write_bytes_atomic
from forja.storage.blocks import BlockCache


@pytest.fixture(autouse=True)
def _small_blocks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Tiny blocks in a private cache, so a small corpus spans many of them."""
    monkeypatch.setenv("FORJA_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("FORJA_BLOCK_MB", str(4096 / 2**20))  # 4 KiB blocks
    monkeypatch.setenv("FORJA_CACHE_GB", str(64 * 4096 / 2**30))  # at most 64 of them


def _upload(local: Path, url: str) -> None:
    from forja.data.corpus.store import upload

    upload(local, url, replace=False)


def _loader_steps(data, steps: int = 4) -> list[np.ndarray]:
    loader = DataLoader(data, seq_len=16, global_batch_size=4, micro_batch_size=2, seed=3, prefetch=0)
    try:
        return [np.concatenate([b.input_ids.numpy() for b in loader.next_step()]) for _ in range(steps)]
    finally:
        loader.close()


def test_prepare_to_s3_then_read_ranges_as_the_local_copy(corpus_dir, tokenizer, prepared_sharded_dir,
                                                           s3_bucket) -> None:
    out = join(s3_bucket, "prepared")
    remote = prepare(str(corpus_dir), tokenizer, out, val_fraction=0.2, workers=1, shard_tokens=997)
    assert exists(join(out, "meta.json")) and exists(join(out, "tokenizer.json"))
    assert not list(Path(prepared_sharded_dir.parent).glob(".*partial*"))
    local = open_prepared(prepared_sharded_dir, tokenizer)
    assert isinstance(remote._streams["train"]._shards[0].tokens, RemoteTokens)
    for split in ("train", "val"):
        a, b = local.split(split), remote.split(split)
        assert (a.num_tokens, a.num_documents) == (b.num_tokens, b.num_documents)
        np.testing.assert_array_equal(a.read(0, a.num_tokens), b.read(0, b.num_tokens))
        n = a.num_tokens
        for start, length in ((0, 1), (995, 7), (n // 3, n // 2), (n - 5, 5)):
            np.testing.assert_array_equal(a.read(start, length), b.read(start, length))
            np.testing.assert_array_equal(a.document_ids(start, length), b.document_ids(start, length))
        np.testing.assert_array_equal(a.document(3), b.document(3))
    with pytest.raises(ForjaError, match=r"already exists; choose another --out or pass --overwrite"):
        prepare(str(corpus_dir), tokenizer, out, val_fraction=0.2, workers=1)
    again = prepare(str(corpus_dir), tokenizer, out, val_fraction=0.2, workers=1, overwrite=True)
    assert again.num_tokens("train") == local.num_tokens("train")  # one shard now, the same stream
    fs, path = filesystem(join(out, "train"))
    assert sorted(p.rsplit("/", 1)[-1] for p in fs.ls(path, refresh=True)) == ["offsets-00000.npy",
                                                                                "tokens-00000.bin"]


def test_block_cache_fetches_blocks_and_stays_within_its_limit(prepared_sharded_dir, tmp_path,
                                                               s3_bucket) -> None:
    url = join(s3_bucket, "blocks", "tokens.bin")
    data = np.random.default_rng(0).integers(0, 512, 40_000, dtype=np.uint16)
    write_bytes_atomic(url, data.tobytes())
    fs, path = filesystem(url)
    cache = BlockCache(tmp_path / "blocks", limit_bytes=8 * 4096, block_size=4096)
    tokens = RemoteTokens(url, fs.info(path), np.dtype("<u2"), cache)
    assert len(tokens) == len(data)
    np.testing.assert_array_equal(tokens[100:110], data[100:110])
    assert cache.fetched == 1  # one block of 4 KiB, not the 80 KB object
    np.testing.assert_array_equal(tokens[100:110], data[100:110])
    assert cache.fetched == 1  # served from the cache
    np.testing.assert_array_equal(tokens[2040:2060], data[2040:2060])  # across a block edge
    np.testing.assert_array_equal(tokens[0:len(data)], data)  # all 20 blocks, through 8 of room
    assert cache.usage() <= 8 * 4096
    assert len(list((tmp_path / "blocks").iterdir())) <= 8


def test_a_directory_without_its_marker_is_refused(prepared_dir, s3_bucket) -> None:
    url = join(s3_bucket, "half")
    _upload(prepared_dir, url)
    fs, path = filesystem(join(url, "meta.json"))
    fs.rm_file(path)  # an upload cut short: meta.json is written last
    with pytest.raises(ForjaError, match=r"half is not a prepared data directory \(no meta.json\)"):
        open_dataset(url)


def test_a_truncated_remote_shard_is_named(prepared_sharded_dir, s3_bucket) -> None:
    url = join(s3_bucket, "damaged")
    _upload(prepared_sharded_dir, url)
    shard = join(url, "train", "tokens-00002.bin")
    write_bytes_atomic(shard, read_bytes(shard)[:-2])
    with pytest.raises(ForjaError, match=r"shard s3://.*/damaged/train/tokens-00002\.bin has \d+ bytes but its "
                                         r"offsets need \d+ bytes"):
        open_dataset(url)


def test_a_flaky_server_gives_the_same_batches(prepared_sharded_dir, tokenizer, flaky_s3) -> None:
    url = join(flaky_s3.url, "prepared")
    flaky_s3.share = 0.0
    _upload(prepared_sharded_dir, url)
    flaky_s3.share = 0.25  # from here, one request in four answered 503 or reset
    remote = open_dataset(url, tokenizer)
    np.testing.assert_array_equal(np.stack(_loader_steps(remote)),
                                  np.stack(_loader_steps(open_prepared(prepared_sharded_dir))))
    assert flaky_s3.failed > 3, (flaky_s3.failed, flaky_s3.forwarded)
    assert json.loads(read_bytes(join(url, "meta.json")))["format"] == "forja-prepared"


def test_forja_prepare_out_s3_and_its_refusals(corpus_dir, tokenizer_path, s3_bucket, monkeypatch, capsys) -> None:
    from forja.cli import main
    from forja.storage import clear_cache

    out = join(s3_bucket, "cli")
    args = ["prepare", "--source", str(corpus_dir), "--tokenizer", str(tokenizer_path), "--workers", "1",
            "--no-progress", "--out"]
    assert main(args + [out]) == 0
    assert f"wrote {out}" in capsys.readouterr().out
    assert open_dataset(out).num_tokens("train") > 0

    def refused(extra: list[str]) -> str:
        assert main(args + extra) != 0
        return capsys.readouterr().err

    assert "already exists; choose another --out or pass --overwrite" in refused([out])
    assert refused([s3_bucket + "-missing/x"]).startswith(
        f"forja prepare: error: bucket {s3_bucket[5:]}-missing of --out {s3_bucket}-missing/x does not exist at ")
    assert "--part and --merge need a local or shared-disk --out" in refused([join(out, "p"), "--part", "0",
                                                                              "--parts", "2"])
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    clear_cache()
    assert f"error: no credentials for {join(s3_bucket, 'other')}; set AWS_ACCESS_KEY_ID" in refused(
        [join(s3_bucket, "other")])
    staging = Path(os.environ["FORJA_CACHE"]) / "staging"
    assert not staging.exists() or not any(staging.iterdir())  # nothing was staged, or is left


def test_a_mixture_on_s3_opens_as_the_local_one(corpus_dir, tokenizer, s3_bucket, tmp_path) -> None:
    spec = f"{corpus_dir}:0.7,stdlib:json:0.3"
    local = prepare(spec, tokenizer, tmp_path / "mix", val_fraction=0.2, workers=1)
    remote = prepare(spec, tokenizer, join(s3_bucket, "mix"), val_fraction=0.2, workers=1)
    assert exists(join(s3_bucket, "mix", "mixture.json")) and remote.weights == local.weights
    for a, b in zip(local.datasets, remote.datasets, strict=True):
        np.testing.assert_array_equal(a.split("train").read(0, a.num_tokens("train")),
                                      b.split("train").read(0, b.num_tokens("train")))
    assert open_dataset(join(s3_bucket, "mix"), tokenizer).fingerprint == local.fingerprint


def test_a_corpus_on_s3_is_a_source_as_on_disk(tokenizer, s3_bucket, tmp_path) -> None:
    import gzip

    from forja.data.corpus.sources import SourceStats, parse_source

    lines = b"".join(json.dumps({"text": f"document {i} " * (i + 1)}).encode() + b"\n" for i in range(40))
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "a.jsonl").write_bytes(lines)
    (tmp_path / "c" / "b.jsonl.gz").write_bytes(gzip.compress(lines))
    for name in ("a.jsonl", "b.jsonl.gz"):
        write_bytes_atomic(join(s3_bucket, "corpus", name), (tmp_path / "c" / name).read_bytes())
    write_bytes_atomic(join(s3_bucket, "corpus", ".partial"), b"skipped, as hidden files on disk are")
    remote = parse_source(f"jsonl:{s3_bucket}/corpus")
    assert [f.name for f in remote.files] == ["a.jsonl", "b.jsonl.gz"]
    local = parse_source(f"jsonl:{tmp_path}/c")
    assert list(remote.documents(SourceStats())) == list(local.documents(SourceStats()))
    a = prepare(f"jsonl:{s3_bucket}/corpus/*.jsonl*:text", tokenizer, tmp_path / "from-s3", workers=1)
    b = prepare(f"jsonl:{tmp_path}/c", tokenizer, tmp_path / "from-disk", workers=1)
    assert a.meta["source"]["fingerprint"] == b.meta["source"]["fingerprint"]
    with pytest.raises(ForjaError, match=r"^bucket \S+-missing of JSONL file s3://\S+ does not exist at "):
        parse_source(f"jsonl:{s3_bucket}-missing/corpus")
    with pytest.raises(ForjaError, match=r"JSONL file 's3://\S+/nothing' matches no object"):
        parse_source(f"jsonl:{s3_bucket}/nothing")


def test_a_tokenizer_on_s3_loads_through_the_cache(tokenizer, tokenizer_path, s3_bucket) -> None:
    from forja.data import load_tokenizer

    write_bytes_atomic(join(s3_bucket, "tok", "tokenizer.json"), tokenizer_path.read_bytes())
    for url in (join(s3_bucket, "tok"), join(s3_bucket, "tok", "tokenizer.json")):
        loaded = load_tokenizer(url)
        assert loaded.fingerprint == tokenizer.fingerprint
        assert any((Path(os.environ["FORJA_CACHE"]) / "remote").iterdir())  # the copy the library read
    with pytest.raises(ForjaError, match=r"^tokenizer s3://\S+/none does not exist \(nor a tokenizer.json below it\)"):
        load_tokenizer(join(s3_bucket, "none"))
