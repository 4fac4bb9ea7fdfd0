"""prepare: exact round trip, byte-identical reruns, stable validation split, atomic output."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
import tokenizers

import forja
from forja.data import Tokenizer, cache_key, load_tokenizer, open_dataset, open_prepared, prepare, prepare_cached
from forja.data.corpus.encoding import DIGEST_BYTES, val_threshold
from forja.data.corpus.mixture import Mixture
from forja.data.corpus.sources import SourceStats, register_source
from forja.data.corpus.tokenizer import new_bpe
from forja.errors import ForjaError


def decoded(ds, tokenizer: Tokenizer, split: str) -> list[str]:
    out = []
    for i in range(ds.num_documents(split)):
        doc = ds.document(split, i)
        assert doc[-1] == tokenizer.eos_id and tokenizer.eos_id not in doc[:-1]
        out.append(tokenizer.decode(doc[:-1]))
    return out


def is_val(text: str, fraction: float) -> bool:
    digest = hashlib.blake2b(text.encode(), digest_size=DIGEST_BYTES).digest()
    return int.from_bytes(digest[:8], "little") < val_threshold(fraction)


def tree_bytes(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_round_trip_gives_back_every_document(prepared_dir: Path, corpus_docs: list[str], tokenizer) -> None:
    ds = open_prepared(prepared_dir)
    expected_val = [d for d in corpus_docs if is_val(d, 0.2)]
    expected_train = [d for d in corpus_docs if not is_val(d, 0.2)]
    assert decoded(ds, tokenizer, "train") == expected_train
    assert decoded(ds, tokenizer, "val") == expected_val
    assert 0 < len(expected_val) < len(corpus_docs) / 2


def test_meta_records_what_made_the_data(prepared_dir: Path, corpus_docs: list[str], tokenizer) -> None:
    ds = open_prepared(prepared_dir, tokenizer)
    meta = ds.meta
    assert meta["tokenizer"]["fingerprint"] == tokenizer.fingerprint
    assert meta["tokenizer"]["vocab_size"] == 512 and meta["dtype"] == "uint16"
    assert meta["forja_version"] == forja.__version__
    assert meta["source"]["documents"] == len(corpus_docs) == ds.num_documents("train") + ds.num_documents("val")
    tokens = sum(len(tokenizer.encode(d)) + 1 for d in corpus_docs)
    assert meta["splits"]["train"]["tokens"] + meta["splits"]["val"]["tokens"] == tokens
    assert len(meta["source"]["fingerprint"]) == 64
    assert ds.split("train").read(0, 3).dtype == np.dtype("<u2")


def test_rerun_is_byte_identical_whatever_the_workers(corpus_dir: Path, tokenizer, tmp_path: Path) -> None:
    one = prepare(str(corpus_dir), tokenizer, tmp_path / "one", val_fraction=0.2, workers=1)
    two = prepare(str(corpus_dir), tokenizer, tmp_path / "two", val_fraction=0.2, workers=2, batch_chars=2000)
    assert tree_bytes(one.path) == tree_bytes(two.path)
    # meta.json, tokenizer.json, and tokens + offsets for train and val
    assert sorted(tree_bytes(one.path)) == ["meta.json", "tokenizer.json", "train/offsets-00000.npy",
                                            "train/tokens-00000.bin", "val/offsets-00000.npy",
                                            "val/tokens-00000.bin"]
    assert load_tokenizer(one.path).fingerprint == tokenizer.fingerprint  # the data carries its tokenizer


def test_sharding_does_not_change_the_documents(prepared_dir: Path, prepared_sharded_dir: Path) -> None:
    single, sharded = open_prepared(prepared_dir), open_prepared(prepared_sharded_dir)
    assert len(sharded.meta["splits"]["train"]["shards"]) > 5
    for split in ("train", "val"):
        n = single.num_tokens(split)
        assert sharded.num_tokens(split) == n
        assert np.array_equal(single.split(split).read(0, n), sharded.split(split).read(0, n))
        for i in range(single.num_documents(split)):
            assert np.array_equal(single.document(split, i), sharded.document(split, i))


def test_validation_split_is_stable_when_the_corpus_grows(corpus_dir: Path, tokenizer, tmp_path: Path) -> None:
    small = tmp_path / "small"
    small.mkdir()
    files = sorted(corpus_dir.iterdir())
    for f in files[::2]:
        (small / f.name).write_bytes(f.read_bytes())
    before = prepare(str(small), tokenizer, tmp_path / "a", val_fraction=0.2, workers=1)
    after = prepare(str(corpus_dir), tokenizer, tmp_path / "b", val_fraction=0.2, workers=1)
    val_before = set(decoded(before, tokenizer, "val"))
    val_after = set(decoded(after, tokenizer, "val"))
    train_after = set(decoded(after, tokenizer, "train"))
    assert val_before and val_before <= val_after and not val_before & train_after


def test_big_vocabulary_uses_uint32(tmp_path: Path) -> None:
    backend = new_bpe()
    vocab = {chr(c): c for c in range(256)} | {f"<x{i}>": 256 + i for i in range(70_000 - 256)}
    backend.model = tokenizers.models.BPE(vocab=vocab, merges=[])
    backend.add_special_tokens([tokenizers.AddedToken("<|eos|>", special=True)])
    tok = Tokenizer(backend)
    assert tok.eos_id == 70_000 and tok.vocab_size == 70_001
    (tmp_path / "a.txt").write_text("abc")
    ds = prepare(str(tmp_path / "a.txt"), tok, tmp_path / "out", val_fraction=0.0, workers=1)
    assert ds.meta["dtype"] == "uint32" and ds.document("train", 0).tolist() == [97, 98, 99, 70_000]


def test_existing_output_needs_overwrite(prepared_dir: Path, corpus_dir: Path, tokenizer, tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(ForjaError, match="already exists.*--overwrite"):
        prepare(str(corpus_dir), tokenizer, out)
    assert (out / "keep.txt").read_text() == "mine"
    prepare(str(corpus_dir), tokenizer, out, val_fraction=0.2, workers=1, overwrite=True)
    assert tree_bytes(out) == tree_bytes(prepared_dir)
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


def _no_trace(parent: Path) -> None:
    assert list(parent.iterdir()) == [], "a failed prepare must leave nothing behind"


def test_empty_source_is_an_error_and_writes_nothing(tokenizer, tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    (src / "empty.txt").write_text("")
    (src / "blob.bin").write_bytes(b"\x00\x01")
    (tmp_path / "out").mkdir()
    with pytest.raises(ForjaError, match="holds no text.*1 binary"):
        prepare(str(src), tokenizer, tmp_path / "out" / "data", workers=1)
    _no_trace(tmp_path / "out")


def test_missing_source_is_an_error_before_any_work(tokenizer, tmp_path: Path) -> None:
    with pytest.raises(ForjaError, match="does not exist"):
        prepare(str(tmp_path / "nope"), tokenizer, tmp_path / "out" / "data")
    assert not (tmp_path / "out").exists()


def test_bad_jsonl_midway_leaves_nothing(tokenizer, tmp_path: Path) -> None:
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps({"text": f"doc {i} " * 50}) + "\n" for i in range(500)) + "{bad\n")
    (tmp_path / "out").mkdir()
    with pytest.raises(ForjaError, match=r"d\.jsonl line 501"):
        prepare(f"jsonl:{path}", tokenizer, tmp_path / "out" / "data", workers=2, batch_chars=5000)
    _no_trace(tmp_path / "out")
    ds = prepare(f"jsonl:{path}", tokenizer, tmp_path / "out" / "data", workers=1, skip_bad_lines=True)
    assert ds.meta["source"]["skipped_bad_lines"] == 1 and ds.meta["source"]["documents"] == 500


@register_source("test-interrupt")
class _Interrupting:
    """A source that is interrupted (Ctrl-C) after some documents."""

    def __init__(self, rest: str, skip_bad_lines: bool):
        self.spec = f"test-interrupt:{rest}"

    def documents(self, stats: SourceStats):
        for i in range(int(self.spec.split(":n")[1])):
            yield stats.count(f"document {i}")
        raise KeyboardInterrupt

    def stat_fingerprint(self) -> str:
        return self.spec


@pytest.mark.parametrize("workers", [1, 2])
def test_interrupted_prepare_leaves_no_directory(tokenizer, tmp_path: Path, workers: int) -> None:
    (tmp_path / "out").mkdir()
    with pytest.raises(KeyboardInterrupt):
        prepare("test-interrupt:n300", tokenizer, tmp_path / "out" / "data", workers=workers, batch_chars=100)
    _no_trace(tmp_path / "out")


def test_stale_partial_of_a_killed_run_is_removed(corpus_dir: Path, tokenizer, tmp_path: Path) -> None:
    stale = tmp_path / ".data.partial-999999999"
    stale.mkdir()
    prepare(str(corpus_dir), tokenizer, tmp_path / "data", workers=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data"]


def test_tokenizer_mismatch_is_caught(prepared_dir: Path, corpus_dir: Path, tokenizer) -> None:
    from forja.data import train_tokenizer

    other_size = train_tokenizer(str(corpus_dir), vocab_size=300)
    with pytest.raises(ForjaError, match="has 300 tokens but .* was prepared with 512"):
        open_prepared(prepared_dir, other_size)
    same_size = train_tokenizer("stdlib:json", vocab_size=512)
    assert same_size.vocab_size == 512
    with pytest.raises(ForjaError, match="fingerprint .* differs .*meta.json"):
        open_prepared(prepared_dir, same_size)


def test_tokenizer_without_eos_is_refused(tmp_path: Path) -> None:
    backend = new_bpe()
    backend.model = tokenizers.models.BPE(vocab={chr(c): c for c in range(256)}, merges=[])
    (tmp_path / "a.txt").write_text("abc")
    with pytest.raises(ForjaError, match="no end-of-document token"):
        prepare(str(tmp_path / "a.txt"), Tokenizer(backend), tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_mixture_prepares_each_part(corpus_dir: Path, tokenizer, tmp_path: Path) -> None:
    spec = f"{corpus_dir}/doc000*.txt:0.25,stdlib:json:0.75"
    mixture = prepare(spec, tokenizer, tmp_path / "mix", workers=1, val_fraction=0.0)
    assert isinstance(mixture, Mixture) and mixture.weights == (0.25, 0.75)
    assert [d.meta["source"]["spec"] for d in mixture.datasets] == [f"{corpus_dir}/doc000*.txt", "stdlib:json"]
    again = open_dataset(tmp_path / "mix", tokenizer)
    assert again.fingerprint == mixture.fingerprint
    with pytest.raises(ForjaError, match="is a mixture"):
        open_prepared(tmp_path / "mix")


def test_cache_prepares_once_under_forja_cache(corpus_dir: Path, tokenizer, tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FORJA_CACHE", str(tmp_path / "cache"))
    key = cache_key(str(corpus_dir), tokenizer)
    assert key == cache_key(str(corpus_dir), tokenizer) and len(key) == 24
    assert key != cache_key(str(corpus_dir), tokenizer, val_fraction=0.5)
    assert key != cache_key("stdlib:json", tokenizer)
    first = open_dataset(str(corpus_dir), tokenizer, workers=1)
    assert first.path == tmp_path / "cache" / "prepared" / key
    mtime = (first.path / "meta.json").stat().st_mtime_ns
    second = prepare_cached(str(corpus_dir), tokenizer, workers=1)
    assert second.path == first.path and (second.path / "meta.json").stat().st_mtime_ns == mtime
    (corpus_dir / "doc0000.txt").touch()  # a changed input is a new key
    try:
        assert cache_key(str(corpus_dir), tokenizer) != key
    finally:
        (corpus_dir / "doc0000.txt").write_bytes((corpus_dir / "doc0000.txt").read_bytes())


def test_open_dataset_needs_a_tokenizer_for_a_source(corpus_dir: Path) -> None:
    with pytest.raises(ForjaError, match="not a prepared data directory.*tokenizer"):
        open_dataset(str(corpus_dir))


def test_data_config_checks_its_values() -> None:
    from forja.data import DataConfig

    assert DataConfig().path == "stdlib" and DataConfig().tokenizer is None
    with pytest.raises(ForjaError, match=r"data\.val_fraction = 1\.5"):
        DataConfig(val_fraction=1.5)
    with pytest.raises(ForjaError, match=r"data\.vocab_size = 100 must be at least 259"):
        DataConfig(vocab_size=100)
    with pytest.raises(ForjaError, match=r"data\.prefetch = -1"):
        DataConfig(prefetch=-1)
