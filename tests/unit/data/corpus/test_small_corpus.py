"""A small corpus: validation gets a document even at 1%, and errors name the source as given."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from forja.data import ValidationLoader, cache_key, open_dataset, prepare
from forja.data.corpus.encoding import DIGEST_BYTES
from forja.errors import ForjaError

# Five short documents: at a 1% fraction, a hash falls below the threshold with probability
# 1 - 0.99^5 ~ 5%, and for these texts none does (asserted below, so the test means something).
_MADE = [f"def f{i}(x):\n    return x * {i} + {i * i}  # document {i}\n" * (i + 1) for i in range(5)]
# In source (file name) order; the lowest-hash one, _MADE[4], third: taking it out of a shard
# moves the documents after it.
TEXTS = [_MADE[(i + 2) % 5] for i in range(5)]


def split_hash(text: str) -> int:
    """The 64-bit hash that places a document in a split (forja/data/corpus/encoding.py)."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=DIGEST_BYTES).digest()[:8], "little")


def decoded(ds, tokenizer, split: str) -> list[str]:
    return [tokenizer.decode(ds.document(split, i)[:-1]) for i in range(ds.num_documents(split))]


@pytest.fixture
def small(tmp_path: Path) -> Path:
    folder = tmp_path / "small"
    folder.mkdir()
    for i, text in enumerate(TEXTS):
        (folder / f"f{i}.py").write_text(text)
    return folder


@pytest.mark.parametrize("shard_tokens", [1, 150, 1 << 20])  # a shard per document, a few, one
def test_small_corpus_validates_on_its_lowest_hash_document(small: Path, tokenizer, tmp_path: Path,
                                                             shard_tokens: int) -> None:
    assert all(split_hash(t) >= 0.01 * 2**64 for t in TEXTS)  # none would go to validation by hash
    ds = prepare(str(small), tokenizer, tmp_path / "out", val_fraction=0.01, workers=1, shard_tokens=shard_tokens)
    lowest = min(TEXTS, key=split_hash)
    assert lowest == TEXTS[2]
    assert decoded(ds, tokenizer, "val") == [lowest]
    assert decoded(ds, tokenizer, "train") == [t for t in TEXTS if t != lowest]  # source order kept
    counts = ds.meta["splits"]
    assert (counts["train"]["documents"], counts["val"]["documents"]) == (4, 1)
    assert counts["train"]["tokens"] + counts["val"]["tokens"] == sum(len(tokenizer.encode(t)) + 1 for t in TEXTS)
    assert sum(s["documents"] for s in counts["train"]["shards"]) == 4


def test_the_choice_does_not_depend_on_workers_or_batches(small: Path, tokenizer, tmp_path: Path) -> None:
    one = prepare(str(small), tokenizer, tmp_path / "a", workers=1)
    other = prepare(str(small), tokenizer, tmp_path / "b", workers=2, batch_chars=50)
    files = sorted(p.relative_to(one.path) for p in one.path.rglob("*") if p.is_file())
    assert files and all((one.path / f).read_bytes() == (other.path / f).read_bytes() for f in files)


def test_a_fraction_of_zero_still_means_no_validation(small: Path, tokenizer, tmp_path: Path) -> None:
    ds = prepare(str(small), tokenizer, tmp_path / "out", val_fraction=0.0, workers=1)
    assert ds.num_documents("val") == 0 and ds.num_documents("train") == len(TEXTS)
    with pytest.raises(ForjaError, match=r"validation split of .* is empty \(it was prepared with a validation "
                                         r"fraction of 0\); prepare it with one above 0, or set train.val_interval"):
        ValidationLoader(ds, seq_len=4, micro_batch_size=1, num_batches=1)


def test_a_single_document_says_what_to_do(small: Path, tokenizer, tmp_path: Path) -> None:
    only = tmp_path / "only"
    only.mkdir()
    (only / "f.py").write_text(TEXTS[4])
    ds = prepare(str(only), tokenizer, tmp_path / "out", workers=1)
    assert ds.num_documents("train") == 1 and ds.num_documents("val") == 0
    with pytest.raises(ForjaError) as caught:
        ValidationLoader(ds, seq_len=4, micro_batch_size=1, num_batches=1)
    assert str(caught.value) == (f"the validation split of {tmp_path / 'out'} is empty (its only document went to "
                                 "training); add documents, or set train.val_interval = 0 to train without validation")


def test_errors_name_the_source_not_the_cache(small: Path, tokenizer, tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FORJA_CACHE", str(tmp_path / "cache"))
    spec = str(small) + "/*.py"
    ds = open_dataset(spec, tokenizer, workers=1)
    key = cache_key(spec, tokenizer)
    assert ds.path.name == key and ds.num_documents("val") == 1
    with pytest.raises(ForjaError) as caught:
        ValidationLoader(ds, seq_len=10_000, micro_batch_size=1, num_batches=1)
    message = str(caught.value)
    assert message.startswith(f"the validation split of {spec} has ") and key not in message
    assert "lower train.seq_len" in message and "train.val_interval = 0" in message
    (ds.path / "val" / "tokens-00000.bin").write_bytes(b"")  # the cache damaged: delete it, and how
    with pytest.raises(ForjaError, match=rf"truncated or damaged\); delete {ds.path} \(the cached copy of "
                                         rf"{spec.replace('*', '[*]')}\) and it is prepared again on next use"):
        open_dataset(spec, tokenizer)


def test_a_cached_copy_without_validation_is_prepared_again(small: Path, tokenizer, tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """What a forja before this fix left in the cache: 1% asked, no validation document."""
    monkeypatch.setenv("FORJA_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "cache" / "prepared" / cache_key(str(small), tokenizer)
    prepare(str(small), tokenizer, out, val_fraction=0.0, workers=1)
    meta = json.loads((out / "meta.json").read_text())
    (out / "meta.json").write_text(json.dumps({**meta, "val_fraction": 0.01}))
    ds = open_dataset(str(small), tokenizer, workers=1)
    assert ds.path == out and ds.num_documents("val") == 1 and ds.num_documents("train") == len(TEXTS) - 1
