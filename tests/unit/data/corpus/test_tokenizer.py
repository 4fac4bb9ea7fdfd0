"""Tokenizer: lossless byte-level BPE, special tokens, fingerprints, loading HF tokenizers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import tokenizers
from tokenizers import models

from forja.data import Tokenizer, load_tokenizer, train_tokenizer
from forja.data.corpus.tokenizer import new_bpe
from forja.errors import ForjaError


def test_round_trip_is_lossless(tokenizer: Tokenizer, corpus_docs: list[str], special_texts: list[str]) -> None:
    for text in special_texts + corpus_docs + ["\ufffd", "\x00\x01 control", " leading space", "x" * 5000]:
        assert tokenizer.decode(tokenizer.encode(text)) == text


def test_special_tokens_and_batch(tokenizer: Tokenizer) -> None:
    assert (tokenizer.bos_id, tokenizer.eos_id, tokenizer.pad_id) == (0, 1, 2)
    assert tokenizer.vocab_size == 512
    texts = ["héllo", "world <|eos|>"]
    assert tokenizer.encode_batch(texts) == [tokenizer.encode(t) for t in texts]
    # Text that spells a special token stays text: documents end only where forja says.
    assert tokenizer.eos_id not in tokenizer.encode("<|eos|>")
    assert tokenizer.decode([tokenizer.eos_id]) == "<|eos|>"


def test_fingerprint_survives_save_and_load(tokenizer: Tokenizer, tmp_path: Path) -> None:
    saved = tokenizer.save(tmp_path / "t.json")
    again = load_tokenizer(saved)
    assert again.fingerprint == tokenizer.fingerprint and len(again.fingerprint) == 64
    tokenizer.save(tmp_path)  # a directory gets tokenizer.json inside
    assert load_tokenizer(tmp_path).fingerprint == tokenizer.fingerprint


def test_different_tokenizers_have_different_fingerprints(tokenizer: Tokenizer, corpus_dir: Path) -> None:
    other = train_tokenizer(str(corpus_dir), vocab_size=300)
    assert other.fingerprint != tokenizer.fingerprint and other.vocab_size == 300


def test_missing_tokenizer_names_the_path(tmp_path: Path) -> None:
    with pytest.raises(ForjaError, match=r"nope\.json does not exist"):
        load_tokenizer(tmp_path / "nope.json")
    with pytest.raises(ForjaError, match="has no tokenizer.json"):
        load_tokenizer(tmp_path)
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ForjaError, match="not a valid tokenizer.json"):
        load_tokenizer(tmp_path / "bad.json")


def _gpt2_like(directory: Path, config: dict | None) -> None:
    """A foreign tokenizer in a Hugging Face model directory, GPT-2 style: <|endoftext|> only."""
    backend = new_bpe()
    backend.model = models.BPE(vocab={chr(c): i for i, c in enumerate(range(33, 127))}, merges=[])
    backend.add_special_tokens([tokenizers.AddedToken("<|endoftext|>", special=True)])
    directory.mkdir()
    backend.save(str(directory / "tokenizer.json"))
    if config is not None:
        (directory / "tokenizer_config.json").write_text(json.dumps(config))


def test_hf_model_directory_with_config(tmp_path: Path) -> None:
    _gpt2_like(tmp_path / "gpt2", {"bos_token": "<|endoftext|>", "eos_token": {"content": "<|endoftext|>"}})
    tok = Tokenizer.load(tmp_path / "gpt2")
    assert tok.eos_id == tok.bos_id == 94 and tok.pad_id is None


def test_hf_tokenizer_without_config_finds_known_names(tmp_path: Path) -> None:
    _gpt2_like(tmp_path / "bare", None)
    tok = load_tokenizer(tmp_path / "bare" / "tokenizer.json")
    assert tok.eos_id == 94 and tok.bos_id is None


def test_vocab_size_too_small_and_empty_source(tmp_path: Path) -> None:
    with pytest.raises(ForjaError, match="at least 259"):
        train_tokenizer("stdlib:json", vocab_size=100)
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(ForjaError, match="holds no text"):
        train_tokenizer(str(tmp_path), vocab_size=300, out=tmp_path / "t.json")
    assert not (tmp_path / "t.json").exists()


def test_training_error_in_source_propagates(tmp_path: Path) -> None:
    (tmp_path / "d.jsonl").write_text('{"text": "a"}\nnot json\n')
    with pytest.raises(ForjaError, match="line 2 is not valid JSON"):
        train_tokenizer(f"jsonl:{tmp_path / 'd.jsonl'}", vocab_size=300, out=tmp_path / "t.json")
    assert not (tmp_path / "t.json").exists()
