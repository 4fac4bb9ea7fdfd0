"""The on-disk format: damaged shards are named, memory maps keep big corpora out of RAM."""

from __future__ import annotations

import json
import resource
import shutil
from pathlib import Path

import numpy as np
import pytest

from forja.data import DataLoader, open_prepared
from forja.data.corpus.shards import ShardWriter, token_dtype
from forja.errors import ForjaError


@pytest.fixture
def copy(prepared_sharded_dir: Path, tmp_path: Path) -> Path:
    out = tmp_path / "copy"
    shutil.copytree(prepared_sharded_dir, out)
    return out


def test_truncated_shard_names_the_file(copy: Path) -> None:
    shard = copy / "train" / "tokens-00003.bin"
    shard.write_bytes(shard.read_bytes()[:-2])
    with pytest.raises(ForjaError, match=r"shard .*train/tokens-00003\.bin has \d+ bytes but its offsets need"):
        open_prepared(copy)


def test_missing_shard_and_damaged_offsets_are_named(copy: Path) -> None:
    (copy / "val" / "tokens-00000.bin").unlink()
    with pytest.raises(ForjaError, match=r"val/tokens-00000\.bin is missing"):
        open_prepared(copy)
    (copy / "train" / "offsets-00001.npy").write_bytes(b"garbage")
    with pytest.raises(ForjaError, match=r"offsets file .*train/offsets-00001\.npy is missing or damaged"):
        open_prepared(copy)


def test_meta_that_disagrees_with_shards(copy: Path) -> None:
    meta = json.loads((copy / "meta.json").read_text())
    meta["splits"]["train"]["tokens"] += 1
    (copy / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(ForjaError, match="counts .* but the shards hold"):
        open_prepared(copy)
    (copy / "meta.json").write_text("{")
    with pytest.raises(ForjaError, match="meta.json is not valid JSON"):
        open_prepared(copy)


def test_not_a_prepared_directory(tmp_path: Path) -> None:
    with pytest.raises(ForjaError, match="not a prepared data directory.*forja prepare"):
        open_prepared(tmp_path)


def test_writer_never_splits_a_document(tmp_path: Path) -> None:
    writer = ShardWriter(tmp_path, "train", token_dtype(100), shard_tokens=10)
    lengths = np.array([4, 4, 4, 25, 1, 1])
    writer.add(np.arange(lengths.sum()) % 100, lengths)
    entry = writer.close()
    assert [s["documents"] for s in entry["shards"]] == [2, 1, 1, 2]  # 8 | 4 | 25 alone | 2
    assert entry["tokens"] == lengths.sum() and entry["documents"] == 6


def test_a_corpus_larger_than_ram_is_memory_mapped(tmp_path: Path) -> None:
    """A 6 GiB sparse shard: opening and sampling it reads only the pages touched."""
    n = 3 << 30  # tokens, uint16
    (tmp_path / "train").mkdir()
    (tmp_path / "val").mkdir()
    with open(tmp_path / "train" / "tokens-00000.bin", "wb") as f:
        f.truncate(n * 2)
    np.save(tmp_path / "train" / "offsets-00000.npy", np.array([0, n // 2, n], dtype=np.int64))
    meta = {"format": "forja-prepared", "format_version": 1, "dtype": "uint16", "val_fraction": 0.0,
            "tokenizer": {"fingerprint": "f", "vocab_size": 512, "eos_id": 1},
            "source": {"fingerprint": "s"},
            "splits": {"train": {"documents": 2, "tokens": n, "shards": [
                {"tokens": "train/tokens-00000.bin", "offsets": "train/offsets-00000.npy",
                 "documents": 2, "num_tokens": n}]},
                "val": {"documents": 0, "tokens": 0, "shards": []}}}
    (tmp_path / "meta.json").write_text(json.dumps(meta))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    loader = DataLoader(tmp_path, seq_len=1024, global_batch_size=8, micro_batch_size=8, prefetch=0)
    for _ in range(3):
        (batch,) = loader.next_step()
    grown_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    assert batch.input_ids.shape == (8, 1024) and loader.samples_per_epoch == (n - 1) // 1024
    assert set(batch.document_ids.unique().tolist()) <= {0, 1}
    assert grown_mib < 200, f"reading samples grew the process by {grown_mib:.0f} MiB"
