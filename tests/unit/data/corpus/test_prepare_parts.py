"""Preparation across many machines: N parts then a merge write exactly what one prepare writes."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from forja.data import prepare, train_tokenizer
from forja.data.corpus import parts as parts_module
from forja.data.corpus.parts import MARKER, PARTS_DIR, PartDone, block_counts, file_range, file_ranges, split_kind
from forja.data.corpus.sources import SourceStats, parse_source, register_source
from forja.errors import ForjaError

from .test_small_corpus import TEXTS as SMALL_TEXTS
from .test_small_corpus import split_hash


def tree_bytes(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def in_parts(source: str, tokenizer, out: Path, n: int, **options) -> list[PartDone]:
    """What N workers do, one after the other here: each its own part of the same ARGS."""
    return [prepare(source, tokenizer, out, part=k, parts=n, workers=1, **options) for k in range(n)]


def assert_merge_is_exact(source: str, tokenizer, tmp_path: Path, n: int, **options) -> dict[str, bytes]:
    single = prepare(source, tokenizer, tmp_path / "single", workers=1, **options)
    done = in_parts(source, tokenizer, tmp_path / "parted", n, **options)
    assert [d.part for d in done] == list(range(n)) and (tmp_path / "parted" / PARTS_DIR).is_dir()
    merged = prepare(source, tokenizer, tmp_path / "parted", merge=True, **options)
    expected, got = tree_bytes(tmp_path / "single"), tree_bytes(tmp_path / "parted")
    assert sorted(got) == sorted(expected)  # the parts are gone, nothing else was added
    for name in expected:  # cmp, file by file: shards, offsets, meta.json, tokenizer.json
        assert got[name] == expected[name], name
    assert merged.fingerprint == single.fingerprint
    return expected


@pytest.fixture(scope="module")
def rows_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One JSONL file: split in blocks of documents, with bad lines to skip and count."""
    path = tmp_path_factory.mktemp("rows") / "rows.jsonl"
    lines = [json.dumps({"text": f"row {i}: " + "λ data " * (i % 5)}) for i in range(230)]
    lines[17], lines[150] = "{not json", json.dumps({"other": 1})
    path.write_text("\n".join(lines) + "\n{also bad\n")
    return path


@pytest.mark.parametrize("n", [1, 3])
def test_directory_source_merges_byte_identical(corpus_dir: Path, tokenizer, tmp_path: Path, n: int,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    # The merge reads its parts in small pieces (5 documents, or 200 tokens but for one long
    # document): the writer cuts the same shards whatever the pieces.
    monkeypatch.setattr(parts_module, "_MERGE_DOCUMENTS", 5)
    monkeypatch.setattr(parts_module, "_MERGE_TOKENS", 200)
    files = assert_merge_is_exact(str(corpus_dir), tokenizer, tmp_path, n, val_fraction=0.2, shard_tokens=997)
    assert len([f for f in files if f.startswith("train/tokens-")]) > 5  # shards re-cut across part boundaries


def test_jsonl_file_in_blocks_merges_byte_identical(rows_file: Path, tokenizer, tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(parts_module, "BLOCK_DOCUMENTS", 16)  # 228 documents: 15 blocks over 4 parts
    src = parse_source(f"jsonl:{rows_file}", skip_bad_lines=True)
    assert split_kind(src, 4) == "blocks"
    assert_merge_is_exact(f"jsonl:{rows_file}", tokenizer, tmp_path, 4, val_fraction=0.1, shard_tokens=300,
                          skip_bad_lines=True)
    meta = json.loads((tmp_path / "parted" / "meta.json").read_text())
    assert meta["source"]["documents"] == 228 and meta["source"]["skipped_bad_lines"] == 3


def test_mixture_merges_byte_identical(corpus_dir: Path, rows_file: Path, tokenizer, tmp_path: Path) -> None:
    spec = f"{corpus_dir}/doc00*.txt:0.25,jsonl:{rows_file}:0.75"
    files = assert_merge_is_exact(spec, tokenizer, tmp_path, 2, val_fraction=0.05, skip_bad_lines=True)
    assert {"mixture.json", "0/meta.json", "1/meta.json", "tokenizer.json"} <= set(files)


@pytest.mark.parametrize("n", [3, 5])
def test_small_corpus_moves_the_lowest_hash_document_across_parts(tokenizer, tmp_path: Path, n: int) -> None:
    small = tmp_path / "small"
    small.mkdir()
    for i, text in enumerate(SMALL_TEXTS):
        (small / f"f{i}.py").write_text(text)
    # The lowest hash is the third file: in a later part than the first, so the merge must find it there.
    assert min(range(5), key=lambda i: split_hash(SMALL_TEXTS[i])) == 2
    assert file_range(parse_source(str(small)), 0, n)[1] <= 2
    assert_merge_is_exact(str(small), tokenizer, tmp_path, n, val_fraction=0.01, shard_tokens=150)
    meta = json.loads((tmp_path / "parted" / "meta.json").read_text())
    assert (meta["splits"]["train"]["documents"], meta["splits"]["val"]["documents"]) == (4, 1)


def test_more_parts_than_files_leaves_parts_empty(corpus_dir: Path, tokenizer, tmp_path: Path) -> None:
    assert_merge_is_exact(f"{corpus_dir}/doc000[0-2].txt", tokenizer, tmp_path, 5, val_fraction=0.0)


def test_file_ranges_are_contiguous_and_balanced(corpus_dir: Path, tmp_path: Path) -> None:
    src = parse_source(str(corpus_dir))
    ranges = [file_range(src, k, 4) for k in range(4)]
    assert ranges[0][0] == 0 and ranges[-1][1] == len(src.files)
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
    sizes = [sum(f.stat().st_size for f in src.files[lo:hi]) for lo, hi in ranges]
    largest = max(f.stat().st_size for f in src.files)
    assert all(abs(size - sum(sizes) / 4) <= largest for size in sizes), sizes  # balanced to within a file
    empty_last = tmp_path / "e"
    empty_last.mkdir()
    for name, text in (("a", "x" * 10), ("b", "y" * 30), ("c", "")):
        (empty_last / name).write_text(text)
    assert file_ranges(parse_source(str(empty_last)), 2) == [(0, 1), (1, 3)]
    assert file_ranges(parse_source(f"{empty_last}/c"), 3) == [(0, 1), (1, 1), (1, 1)]  # no bytes: by count
    assert block_counts(100, 3, 16) == [16 + 16 + 4, 16 + 16, 16 + 16] and sum(block_counts(5, 4, 16)) == 5


def test_a_missing_part_is_refused_by_number_before_any_write(corpus_dir: Path, tokenizer, tmp_path: Path) -> None:
    out = tmp_path / "out"
    for k in (0, 2):
        prepare(str(corpus_dir), tokenizer, out, part=k, parts=4, workers=1)
    before = tree_bytes(out)
    with pytest.raises(ForjaError) as caught:
        prepare(str(corpus_dir), tokenizer, out, merge=True)
    assert str(caught.value) == (
        f"parts 1, 3 of 4 under {out / PARTS_DIR} are missing or unfinished; run `forja prepare ARGS --part K "
        f"--parts 4` for K in 1, 3 (the same ARGS as the other parts), then --merge again")
    assert tree_bytes(out) == before and sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    # A worker killed before writing part.json: its part is unfinished, whatever files it left.
    prepare(str(corpus_dir), tokenizer, out, part=1, parts=4, workers=1)
    (out / PARTS_DIR / "00001" / MARKER).unlink()
    with pytest.raises(ForjaError, match=r"^parts 1, 3 of 4 .* missing or unfinished"):
        prepare(str(corpus_dir), tokenizer, out, merge=True)
    with pytest.raises(ForjaError, match=r"holds no finished part to merge"):
        prepare(str(corpus_dir), tokenizer, tmp_path / "never", merge=True)
    assert not (tmp_path / "never").exists()


def test_a_part_from_another_tokenizer_is_refused_before_any_write(corpus_dir: Path, tokenizer,
                                                                    tmp_path: Path) -> None:
    other = train_tokenizer(f"{corpus_dir}/doc01*.txt", vocab_size=300)
    out = tmp_path / "out"
    prepare(str(corpus_dir), tokenizer, out, part=0, parts=2, workers=1)
    prepare(str(corpus_dir), other, out, part=1, parts=2, workers=1)
    before = tree_bytes(out)
    with pytest.raises(ForjaError) as caught:
        prepare(str(corpus_dir), tokenizer, out, merge=True)
    assert str(caught.value) == (
        f"part 1 of 2 under {out / PARTS_DIR} was tokenized with the tokenizer of fingerprint "
        f"{other.fingerprint[:12]}, not --tokenizer's {tokenizer.fingerprint[:12]}; rerun it with `forja prepare "
        f"ARGS --part 1 --parts 2` and the merge's ARGS, or merge with the tokenizer it used")
    assert tree_bytes(out) == before and sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_other_options_or_sources_at_merge_are_refused(corpus_dir: Path, tokenizer, tmp_path: Path) -> None:
    out = tmp_path / "out"
    in_parts(str(corpus_dir), tokenizer, out, 2, val_fraction=0.2)
    with pytest.raises(ForjaError, match=r"^part 0 of 2 .* with --val-fraction 0.2, but the merge is given 0.01;"):
        prepare(str(corpus_dir), tokenizer, out, merge=True)
    with pytest.raises(ForjaError, match=r"^part 0 of 2 .* prepared from source .*, not 'stdlib:json:1'"):
        prepare("stdlib:json", tokenizer, out, merge=True, val_fraction=0.2)
    with pytest.raises(ForjaError, match=r"^parts 0, 1 under .* another --parts than 3;"):
        prepare(str(corpus_dir), tokenizer, out, merge=True, parts=3, val_fraction=0.2)
    (corpus_dir / "doc0003.txt").touch()  # the inputs changed under the workers
    try:
        with pytest.raises(ForjaError, match=r"^source .* changed .* since part 0 of 2 .*; run every part again"):
            prepare(str(corpus_dir), tokenizer, out, merge=True, val_fraction=0.2)
    finally:
        os.utime(corpus_dir / "doc0000.txt")
        (corpus_dir / "doc0003.txt").write_bytes((corpus_dir / "doc0003.txt").read_bytes())
    assert (out / PARTS_DIR / "00000" / MARKER).is_file() and not (out / "meta.json").exists()


def test_rerun_of_one_part_replaces_only_it(corpus_dir: Path, tokenizer, tmp_path: Path) -> None:
    out = tmp_path / "out"
    in_parts(str(corpus_dir), tokenizer, out, 3, val_fraction=0.2)
    kept = {p: p.stat().st_mtime_ns for p in (out / PARTS_DIR / "00000").iterdir()}
    (out / PARTS_DIR / "00001" / "tokens.bin").write_bytes(b"damaged by a dying worker")
    done = prepare(str(corpus_dir), tokenizer, out, part=1, parts=3, workers=2, batch_chars=3000, val_fraction=0.2)
    assert done.path == out / PARTS_DIR / "00001" and done.documents > 0 and done.tokens > done.documents
    assert {p: p.stat().st_mtime_ns for p in (out / PARTS_DIR / "00000").iterdir()} == kept
    prepare(str(corpus_dir), tokenizer, out, merge=True, val_fraction=0.2)
    prepare(str(corpus_dir), tokenizer, tmp_path / "single", workers=1, val_fraction=0.2)
    assert tree_bytes(out) == tree_bytes(tmp_path / "single")


@pytest.mark.parametrize(("part", "parts", "merge", "message"), [
    (1, None, False, r"^--part 1 needs --parts N, the number of workers \(parts 0 to N-1\)$"),
    (None, 4, False, r"^--parts 4 needs --part K, this worker's number from 0 to 3 \(or --merge"),
    (4, 4, False, r"^--part 4 is out of range for --parts 4; give 0 to 3$"),
    (-1, 4, False, r"^--part -1 is out of range for --parts 4; give 0 to 3$"),
    (0, 0, False, r"^--parts 0 must be at least 1 \(the number of workers\)$"),
    (0, 2, True, r"^--merge takes no --part \(it was given --part 0\)"),
])
def test_bad_part_options_are_one_sentence(corpus_dir: Path, tokenizer, tmp_path: Path, part, parts, merge,
                                           message: str) -> None:
    with pytest.raises(ForjaError, match=message):
        prepare(str(corpus_dir), tokenizer, tmp_path / "out", part=part, parts=parts, merge=merge)
    assert not (tmp_path / "out").exists()


def test_a_prepared_out_is_not_written_into_without_overwrite(prepared_dir: Path, corpus_dir: Path, tokenizer,
                                                               tmp_path: Path) -> None:
    with pytest.raises(ForjaError, match="already exists; choose another --out or pass --overwrite"):
        prepare(str(corpus_dir), tokenizer, prepared_dir, part=0, parts=2)
    assert not (prepared_dir / PARTS_DIR).exists()
    out = tmp_path / "out"  # with --overwrite, parts go inside the old copy, and the merge replaces it
    prepare(str(corpus_dir), tokenizer, tmp_path / "out", val_fraction=0.0, workers=1)
    in_parts(str(corpus_dir), tokenizer, out, 2, val_fraction=0.2, overwrite=True)
    prepare(str(corpus_dir), tokenizer, out, merge=True, val_fraction=0.2, overwrite=True)
    assert tree_bytes(out) == tree_bytes(prepared_dir)


@register_source("test-interrupt-parts")
class _Interrupting:
    """A record source interrupted (Ctrl-C) after some documents: split in blocks."""

    def __init__(self, rest: str, skip_bad_lines: bool):
        self.spec = f"test-interrupt-parts:{rest}"

    def documents(self, stats: SourceStats):
        for i in range(300):
            yield stats.count(f"document {i}")
        raise KeyboardInterrupt

    def stat_fingerprint(self) -> str:
        return self.spec


def test_an_interrupted_worker_leaves_no_part(tokenizer, tmp_path: Path) -> None:
    with pytest.raises(KeyboardInterrupt):
        prepare("test-interrupt-parts:x", tokenizer, tmp_path / "out", part=1, parts=2, workers=1, batch_chars=100)
    assert list((tmp_path / "out" / PARTS_DIR).iterdir()) == []


def test_jsonl_files_are_split_by_files(rows_file: Path, tokenizer, tmp_path: Path) -> None:
    folder = tmp_path / "rows"
    folder.mkdir()
    lines = rows_file.read_text().splitlines()
    for i in range(3):
        (folder / f"r{i}.jsonl").write_text("\n".join(lines[i * 80:(i + 1) * 80]) + "\n")
    spec = f"jsonl:{folder}/*.jsonl"
    assert split_kind(parse_source(spec), 2) == "files" and split_kind(parse_source(spec), 4) == "blocks"
    assert_merge_is_exact(spec, tokenizer, tmp_path, 2, val_fraction=0.1, skip_bad_lines=True)
