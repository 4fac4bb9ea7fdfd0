"""`forja tokenizer` and `forja prepare` end to end, as a user runs them (subprocesses)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from forja.data import load_tokenizer, open_prepared
from forja.data.corpus.sources import SourceStats, parse_source, stdlib_files

TEXTS = {
    "a.txt": "Grüße aus Köln — naïve café, 日本語, emoji 🎉\n",
    "b.py": "def add(a, b):\r\n\treturn a + b  # CRLF and tabs\r\n",
    "c.md": "# Title\n\n* list <|eos|> item\n" * 20,
}


def forja(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONIOENCODING": "utf-8"}
    return subprocess.run([sys.executable, "-m", "forja", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)


def error_line(result: subprocess.CompletedProcess, command: str) -> str:
    assert result.returncode == 2, result.stderr
    lines = [ln for ln in result.stderr.splitlines() if ln.startswith(f"forja {command}: error:")]
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    return lines[0]


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("cli")
    (root / "corpus").mkdir()
    for name, text in TEXTS.items():
        (root / "corpus" / name).write_bytes(text.encode())
    for i in range(60):
        (root / "corpus" / f"gen{i:02d}.txt").write_text(f"document {i}: " + "δοκιμή and test " * (i % 7 + 1))
    done = forja("tokenizer", "train", "--source", "corpus,stdlib:json", "--vocab-size", "1024", "--out", "tok.json",
                 cwd=root)
    assert done.returncode == 0, done.stderr
    assert "trained a tokenizer of 1,024 tokens" in done.stdout
    return root


def test_tokenizer_info(work: Path) -> None:
    done = forja("tokenizer", "info", "tok.json", cwd=work)
    assert done.returncode == 0 and "vocab_size  1024" in done.stdout and "eos_id      1 '<|eos|>'" in done.stdout


def test_prepare_round_trip_and_byte_identical_rerun(work: Path) -> None:
    args = ["--source", "corpus", "--tokenizer", "tok.json", "--val-fraction", "0.1", "--workers", "2"]
    first = forja("prepare", *args, "--out", "data", cwd=work)
    assert first.returncode == 0, first.stderr
    assert "corpus: 63 documents" in first.stdout and "tokens/s" in first.stdout
    assert "documents" in first.stderr and "tokens/s" in first.stderr  # the progress line
    second = forja("prepare", *args, "--out", "data2", "--no-progress", cwd=work)
    assert second.returncode == 0 and second.stderr == ""
    files = sorted(p.relative_to(work / "data") for p in (work / "data").rglob("*") if p.is_file())
    assert files and all((work / "data" / f).read_bytes() == (work / "data2" / f).read_bytes() for f in files)

    ds, tok = open_prepared(work / "data"), load_tokenizer(work / "tok.json")
    docs = list(parse_source(str(work / "corpus")).documents(SourceStats()))
    got = [tok.decode(ds.document(s, i)[:-1]) for s in ("train", "val") for i in range(ds.num_documents(s))]
    assert sorted(got) == sorted(docs) and set(TEXTS.values()) <= set(got)
    assert ds.num_documents("val") > 0


def test_existing_output_is_refused(work: Path) -> None:
    (work / "taken").mkdir()
    done = forja("prepare", "--source", "corpus", "--tokenizer", "tok.json", "--out", "taken", cwd=work)
    assert "already exists" in error_line(done, "prepare")


def test_an_existing_tokenizer_is_not_overwritten_without_overwrite(work: Path) -> None:
    before = (work / "tok.json").read_bytes()
    done = forja("tokenizer", "train", "--source", "corpus", "--vocab-size", "300", "--out", "tok.json", cwd=work)
    assert "tok.json already exists; pass --overwrite to replace it" in error_line(done, "tokenizer")
    assert (work / "tok.json").read_bytes() == before


def test_an_unquoted_pattern_expanded_by_the_shell_gets_a_hint(work: Path) -> None:
    # What `--source corpus/*.txt` becomes in a shell: the first file, then the others as stray arguments.
    files = sorted(str(p.relative_to(work)) for p in (work / "corpus").glob("gen0*.txt"))
    done = forja("prepare", "--source", *files, "--tokenizer", "tok.json", "--out", "globbed", cwd=work)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert f"({len(files) - 1} in all): the shell expanded an unquoted pattern" in done.stderr
    assert "quote the pattern" in done.stderr and not (work / "globbed").exists()


def test_empty_source_writes_nothing(work: Path) -> None:
    (work / "empty").mkdir()
    (work / "empty" / "x.txt").write_text("")
    done = forja("prepare", "--source", "empty", "--tokenizer", "tok.json", "--out", "out-empty", cwd=work)
    assert "holds no text" in error_line(done, "prepare")
    assert not list(work.glob("*out-empty*"))


def test_missing_path_and_missing_tokenizer(work: Path) -> None:
    done = forja("prepare", "--source", "nowhere/*.txt", "--tokenizer", "tok.json", "--out", "o", cwd=work)
    assert "'nowhere/*.txt' matches no file" in error_line(done, "prepare")
    done = forja("prepare", "--source", "corpus", "--tokenizer", "missing.json", "--out", "o", cwd=work)
    assert "missing.json does not exist" in error_line(done, "prepare")
    assert not (work / "o").exists()


def test_bad_jsonl_line_then_skipped(work: Path) -> None:
    lines = [json.dumps({"text": f"row {i}"}) for i in range(5)]
    lines.insert(3, '{"text": "unterminated')
    (work / "rows.jsonl").write_text("\n".join(lines) + "\n")
    done = forja("prepare", "--source", "jsonl:rows.jsonl", "--tokenizer", "tok.json", "--out", "rows", cwd=work)
    assert "rows.jsonl line 4 is not valid JSON" in error_line(done, "prepare")
    assert not (work / "rows").exists() and not list(work.glob(".rows.partial-*"))
    done = forja("prepare", "--source", "jsonl:rows.jsonl", "--tokenizer", "tok.json", "--out", "rows",
                 "--skip-bad-lines", cwd=work)
    assert done.returncode == 0 and "5 documents" in done.stdout and "1 bad lines skipped" in done.stdout


def test_invalid_utf8_is_replaced_not_fatal(work: Path) -> None:
    (work / "latin").mkdir()
    (work / "latin" / "x.txt").write_bytes("déjà vu".encode("latin-1"))
    (work / "latin" / "y.bin").write_bytes(b"\x00\xff\x00")
    done = forja("prepare", "--source", "latin", "--tokenizer", "tok.json", "--out", "latin-out", cwd=work)
    assert done.returncode == 0, done.stderr
    assert "1 binary files skipped" in done.stdout and "1 documents with invalid UTF-8 replaced" in done.stdout
    assert ("\nno validation split (a single document, which went to training): train on it with "
            "train.val_interval = 0, or add documents so that one goes to validation\n") in done.stdout
    tok, ds = load_tokenizer(work / "tok.json"), open_prepared(work / "latin-out")
    assert tok.decode(ds.document("train", 0)[:-1]) == "d\ufffdj\ufffd vu"


def test_mixture_and_stdlib_sources(work: Path) -> None:
    done = forja("prepare", "--source", "stdlib:json:0.5,corpus:0.5", "--tokenizer", "tok.json", "--out", "mix",
                 "--val-fraction", "0", cwd=work)
    assert done.returncode == 0, done.stderr
    meta = json.loads((work / "mix" / "mixture.json").read_text())
    assert [c["source"] for c in meta["components"]] == ["stdlib:json", "corpus"]


@pytest.mark.slow
def test_full_stdlib_corpus(work: Path) -> None:
    """The embedded default corpus, whole: every .py file of this interpreter's stdlib."""
    done = forja("prepare", "--source", "stdlib", "--tokenizer", "tok.json", "--out", "stdlib", "--workers", "2",
                 "--val-fraction", "0", "--no-progress", cwd=work)
    assert done.returncode == 0, done.stderr
    ds, tok = open_prepared(work / "stdlib"), load_tokenizer(work / "tok.json")
    source = ds.meta["source"]
    assert source["documents"] + source["skipped_binary"] == len(stdlib_files())
    assert source["documents"] == ds.num_documents("train")
    assert ds.num_tokens("train") > 5_000_000  # ~30 MB of code
    docs = list(parse_source("stdlib").documents(SourceStats()))
    for i in range(0, len(docs), 37):  # in source order, exactly
        assert tok.decode(ds.document("train", i)[:-1]) == docs[i]
