"""Sources: spec parsing, file order, binary and bad-UTF-8 handling, records, stdlib, mixtures."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

import forja.data
from forja.data.corpus.sources import SourceStats, parse_mixture, parse_source, stdlib_files, stdlib_root
from forja.errors import ForjaError


def read(spec: str, **kwargs) -> tuple[list[str], SourceStats]:
    stats = SourceStats()
    return list(parse_source(spec, **kwargs).documents(stats)), stats


def test_directory_and_glob_give_sorted_files_and_skip_hidden(tmp_path: Path) -> None:
    (tmp_path / "sub").mkdir()
    (tmp_path / ".git").mkdir()
    for name, text in [("b.txt", "B"), ("a.txt", "A"), ("sub/c.py", "C"), (".hidden", "H"), (".git/x", "X")]:
        (tmp_path / name).write_text(text)
    assert read(str(tmp_path))[0] == ["A", "B", "C"]
    assert read(str(tmp_path / "*.txt"))[0] == ["A", "B"]
    assert read(str(tmp_path / "**" / "*.py"))[0] == ["C"]
    assert read(str(tmp_path / "a.txt"))[0] == ["A"]


def test_binary_files_are_skipped_and_counted(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("text")
    (tmp_path / "b.bin").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00")
    docs, stats = read(str(tmp_path))
    assert docs == ["text"] and stats.skipped_binary == 1 and stats.documents == 1


def test_invalid_utf8_is_replaced_and_counted(tmp_path: Path) -> None:
    (tmp_path / "latin1.txt").write_bytes("café".encode("latin-1"))
    docs, stats = read(str(tmp_path))
    assert docs == ["caf\ufffd"] and stats.replaced_utf8 == 1


@pytest.mark.parametrize("spec", ["missing/dir", "missing/*.txt", "jsonl:missing.jsonl", "parquet:nope.parquet"])
def test_missing_paths_are_one_clear_error(spec: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ForjaError, match="missing|nope"):
        parse_source(spec)


def test_jsonl_default_and_named_field(tmp_path: Path) -> None:
    path = tmp_path / "d.jsonl"
    path.write_text('{"text": "one", "body": "uno"}\n\n{"text": "two \\ud800", "body": "dos"}\n')
    docs, stats = read(f"jsonl:{path}")
    assert docs == ["one", "two \ufffd"] and stats.replaced_utf8 == 1  # lone surrogate replaced
    assert read(f"jsonl:{path}:body")[0] == ["uno", "dos"]


def test_jsonl_bad_line_names_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "d.jsonl"
    path.write_text('{"text": "ok"}\n{"text": oops}\n{"other": 1}\n{"text": "end"}\n')
    with pytest.raises(ForjaError, match=r"d\.jsonl line 2 is not valid JSON.*--skip-bad-lines"):
        read(f"jsonl:{path}")
    docs, stats = read(f"jsonl:{path}", skip_bad_lines=True)
    assert docs == ["ok", "end"] and stats.skipped_bad_lines == 2


def test_jsonl_missing_field_names_line(tmp_path: Path) -> None:
    path = tmp_path / "d.jsonl"
    path.write_text('{"text": "ok"}\n{"content": "x"}\n')
    with pytest.raises(ForjaError, match=r"line 2 has no text field 'text'"):
        read(f"jsonl:{path}")


def test_jsonl_invalid_utf8_is_replaced(tmp_path: Path) -> None:
    path = tmp_path / "d.jsonl"
    path.write_bytes(b'{"text": "caf\xe9"}\n')
    docs, stats = read(f"jsonl:{path}")
    assert docs == ["caf\ufffd"] and stats.replaced_utf8 == 1


def test_parquet_column(tmp_path: Path) -> None:
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    path = tmp_path / "d.parquet"
    pq.write_table(pa.table({"text": ["α", "β", None], "id": [1, 2, 3]}), path)
    with pytest.raises(ForjaError, match="row 2 holds NoneType"):
        read(f"parquet:{path}")
    docs, stats = read(f"parquet:{path}", skip_bad_lines=True)
    assert docs == ["α", "β"] and stats.skipped_bad_lines == 1
    with pytest.raises(ForjaError, match="no column 'body'"):
        read(f"parquet:{path}:body")


def test_hf_local_dataset_directory(tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets")
    saved = tmp_path / "saved"
    datasets.DatasetDict({
        "train": datasets.Dataset.from_dict({"content": ["première", "second"]}),
        "test": datasets.Dataset.from_dict({"content": ["t"]}),
    }).save_to_disk(str(saved))
    assert read(f"hf:{saved}:train:content")[0] == ["première", "second"]
    assert read(f"hf:{saved}:test:content")[0] == ["t"]
    with pytest.raises(ForjaError, match="no column 'text'"):
        parse_source(f"hf:{saved}")
    files = tmp_path / "files"  # a plain directory of data files, loaded by load_dataset
    files.mkdir()
    (files / "train.jsonl").write_text(json.dumps({"text": "from files"}) + "\n")
    assert read(f"hf:{files}")[0] == ["from files"]


def test_stdlib_is_sorted_complete_and_without_site_packages() -> None:
    files = stdlib_files()
    rel = [f.relative_to(stdlib_root()).as_posix() for f in files]
    assert rel == sorted(rel) and len(files) > 500
    assert not any("site-packages" in r for r in rel)
    assert "os.py" in rel and "json/decoder.py" in rel
    docs, stats = read("stdlib:json")
    assert len(docs) == len(stdlib_files("json")) and any("class JSONDecoder" in d for d in docs)


def test_mixture_spec_parsing() -> None:
    assert parse_mixture("stdlib") == [("stdlib", 1.0)]
    assert parse_mixture("stdlib:0.7,jsonl:x.jsonl:0.3") == [("stdlib", 0.7), ("jsonl:x.jsonl", 0.3)]
    assert parse_mixture("jsonl:x.jsonl:body:2, data/*.txt") == [("jsonl:x.jsonl:body", 2.0), ("data/*.txt", 1.0)]
    assert parse_mixture([("stdlib", 3)]) == [("stdlib", 3.0)]
    with pytest.raises(ForjaError, match="empty part"):
        parse_mixture("stdlib,,a")
    with pytest.raises(ForjaError, match="positive"):
        parse_mixture("stdlib:0")


def test_source_modules_import_one_way() -> None:
    """sources -> records -> source_base: the base knows no format, the formats no parser."""

    def imports(module: str) -> set[str]:
        tree = ast.parse((Path(forja.data.__file__).parent / "corpus" / f"{module}.py").read_text())
        return {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}

    assert not {m for m in imports("source_base") if m.startswith("forja.data")}
    assert not {m for m in imports("records") if m.startswith("forja.data")} - {"forja.data.corpus.source_base"}
    assert "forja.data.corpus.records" in imports("sources")
