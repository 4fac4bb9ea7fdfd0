"""Shared data fixtures: a small corpus of prose, non-ASCII text and code, a tokenizer trained
on it, and the corpus prepared once per session (tests must not write into these)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from forja.data import prepare, train_tokenizer
from forja.data.corpus.sources import SourceStats, parse_source

SPECIAL_TEXTS = [
    "Ünïcödé façade — naïve café, Straße, ÆØÅ, ½ ≠ ∞\n",
    "日本語のテキストと中文文本，한국어 텍스트。\n",
    "Ελληνικά και Русский текст; עברית ועربي\n",
    "emoji 🎉🚀👩‍👩‍👧 and combining e\u0301 and a zero\u200bwidth space\n",
    "def f(x):\r\n\treturn x  # CRLF and a tab, trailing spaces   \r\n",
    "a document that mentions <|eos|>, <|endoftext|> and <|pad|> as plain text",
    "   \n\n\t  ",
    "",
]
_WORDS = ("the of data token shard loader résumé naïve 数据 модель λ def return class import "
          "yield for while 0 1 42 3.14 == != -> {} [] () ' \" \\ \t").split(" ")


def _synthetic(rng: random.Random, n: int) -> list[str]:
    docs = []
    for _ in range(n):
        lines = [" ".join(rng.choice(_WORDS) for _ in range(rng.randint(1, 12))) for _ in range(rng.randint(1, 6))]
        docs.append("\n".join(lines) + ("\n" if rng.random() < 0.5 else ""))
    return docs


@pytest.fixture(scope="session")
def special_texts() -> list[str]:
    """Texts that break careless pipelines: non-ASCII, CRLF, specials spelled out, blank."""
    return list(SPECIAL_TEXTS)


@pytest.fixture(scope="session")
def corpus_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One file per document: special texts, 240 synthetic documents, and stdlib json code."""
    root = tmp_path_factory.mktemp("corpus")
    docs = SPECIAL_TEXTS + _synthetic(random.Random(0), 240)
    for path in sorted(parse_source("stdlib:json").files):
        docs.append(path.read_text(encoding="utf-8"))
    for i, text in enumerate(docs):
        (root / f"doc{i:04d}.txt").write_bytes(text.encode("utf-8"))
    return root


@pytest.fixture(scope="session")
def corpus_docs(corpus_dir: Path) -> list[str]:
    """The corpus documents in source order."""
    return list(parse_source(str(corpus_dir)).documents(SourceStats()))


@pytest.fixture(scope="session")
def tokenizer_path(corpus_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    train_tokenizer(str(corpus_dir), vocab_size=512, out=out)
    return out


@pytest.fixture(scope="session")
def tokenizer(tokenizer_path: Path):
    from forja.data import load_tokenizer

    return load_tokenizer(tokenizer_path)


@pytest.fixture(scope="session")
def prepared_dir(corpus_dir: Path, tokenizer, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The corpus prepared in one shard, 20% validation."""
    out = tmp_path_factory.mktemp("prepared") / "data"
    prepare(str(corpus_dir), tokenizer, out, val_fraction=0.2, workers=1)
    return out


@pytest.fixture(scope="session")
def prepared_sharded_dir(corpus_dir: Path, tokenizer, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same corpus in shards of about 997 tokens: the same token stream, many files."""
    out = tmp_path_factory.mktemp("prepared") / "sharded"
    prepare(str(corpus_dir), tokenizer, out, val_fraction=0.2, workers=1, shard_tokens=997)
    return out


@pytest.fixture(scope="session")
def other_dir(corpus_dir: Path, tokenizer, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The corpus split another way (40% validation): other data, with the same tokenizer."""
    out = tmp_path_factory.mktemp("prepared") / "other"
    prepare(str(corpus_dir), tokenizer, out, val_fraction=0.4, workers=1)
    return out
