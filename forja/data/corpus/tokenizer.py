"""Tokenizers: train a lossless byte-level BPE, or load any Hugging Face `tokenizer.json`.

`Tokenizer` wraps `tokenizers.Tokenizer` with what forja needs: the ids of the
beginning/end-of-document and padding tokens, a fingerprint that prepared data records (so
data and tokenizer cannot be mixed up), and encoding that never turns text into a special
token: a document that contains the characters "<|eos|>" does not end there.

References: Sennrich et al. 2016 (BPE); Radford et al. 2019 (byte-level BPE, GPT-2).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

from forja.data.config import MIN_VOCAB_SIZE
from forja.errors import ForjaError
from forja.files import write_atomic
from forja.storage import is_url

BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"
# Names other tokenizers use for the same roles, tried when no config says which is which.
_KNOWN = {
    "bos": (BOS, "<s>", "<|begin_of_text|>", "<bos>", "<|startoftext|>"),
    "eos": (EOS, "<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>"),
    "pad": (PAD, "<pad>", "<|pad|>", "[PAD]", "<|finetune_right_pad_id|>"),
}


class Tokenizer:
    """A `tokenizers.Tokenizer` with special-token ids and a fingerprint."""

    def __init__(self, backend: tokenizers.Tokenizer, *, roles: dict[str, str] | None = None):
        # The fingerprint hashes the canonical serialization, so a pretty-printed copy of the
        # same tokenizer.json has the same fingerprint as the compact one.
        self.fingerprint: str = hashlib.sha256(backend.to_str().encode()).hexdigest()
        self.backend = backend
        backend.encode_special_tokens = True  # text never becomes a special token
        ids = {role: _find_id(backend, role, (roles or {}).get(role)) for role in _KNOWN}
        self.bos_id: int | None = ids["bos"]
        self.eos_id: int | None = ids["eos"]
        self.pad_id: int | None = ids["pad"]

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Tokenizer:
        """Load a `tokenizer.json`, or a directory holding one (a Hugging Face model dir), local or
        on an object store (s3://...: copied into the cache first, see remote.fetch_tokenizer)."""
        if is_url(path):
            from forja.data.corpus.remote import fetch_tokenizer

            try:
                path = fetch_tokenizer(str(path))
            except FileNotFoundError:
                raise ForjaError(f"tokenizer {path} does not exist (nor a tokenizer.json below it); train one "
                                 "with `forja tokenizer train` or give a tokenizer.json") from None
        given = Path(path).expanduser()
        file = tokenizer_file(given)
        if not file.is_file():
            where = f"{given} has no tokenizer.json" if given.is_dir() else f"tokenizer {given} does not exist"
            raise ForjaError(f"{where}; train one with `forja tokenizer train` or give a tokenizer.json")
        try:
            backend = tokenizers.Tokenizer.from_file(str(file))
        except Exception as exc:  # the Rust side raises plain Exception for a bad file
            raise ForjaError(f"{file} is not a valid tokenizer.json ({exc})") from exc
        return cls(backend, roles=_roles_from_config(file.parent))

    @classmethod
    def from_str(cls, text: str, roles: dict[str, str] | None = None) -> Tokenizer:
        return cls(tokenizers.Tokenizer.from_str(text), roles=roles)

    @property
    def vocab_size(self) -> int:
        """Number of token ids, special tokens included."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    @property
    def roles(self) -> dict[str, str]:
        """Special-token role -> token text, enough to rebuild this Tokenizer from its JSON."""
        ids = {"bos": self.bos_id, "eos": self.eos_id, "pad": self.pad_id}
        return {role: self.backend.id_to_token(i) for role, i in ids.items() if i is not None}

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, no special tokens added."""
        return self.backend.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        # The "fast" batch path skips character offsets, which forja never uses: ~2x faster.
        return [e.ids for e in self.backend.encode_batch_fast(list(texts), add_special_tokens=False)]

    def decode(self, ids: Iterable[int]) -> str:
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=False)

    def to_str(self) -> str:
        return self.backend.to_str()

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write tokenizer.json atomically; a directory gets a tokenizer.json inside."""
        target = tokenizer_file(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(target, self.backend.to_str(pretty=True))
        return target

    def __repr__(self) -> str:
        return (f"Tokenizer(vocab_size={self.vocab_size}, bos_id={self.bos_id}, eos_id={self.eos_id}, "
                f"pad_id={self.pad_id}, fingerprint={self.fingerprint[:12]})")


def tokenizer_file(path: str | os.PathLike[str]) -> Path:
    """The tokenizer.json that `path` names: itself, or the one inside it when it is a directory."""
    given = Path(path).expanduser()
    return given / "tokenizer.json" if given.is_dir() else given


def load_tokenizer(path: str | os.PathLike[str] | Tokenizer) -> Tokenizer:
    """A Tokenizer from a tokenizer.json or a directory holding one (a Tokenizer passes through)."""
    return path if isinstance(path, Tokenizer) else Tokenizer.load(path)


def _roles_from_config(directory: Path) -> dict[str, str]:
    """bos/eos/pad token texts from a Hugging Face tokenizer_config.json or special_tokens_map.json."""
    roles: dict[str, str] = {}
    for name in ("special_tokens_map.json", "tokenizer_config.json"):  # the later one wins
        file = directory / name
        if not file.is_file():
            continue
        try:
            config = json.loads(file.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise ForjaError(f"{file} is not valid JSON ({exc}); fix or remove it") from exc
        for role in _KNOWN:
            token = config.get(f"{role}_token")
            token = token.get("content") if isinstance(token, dict) else token
            if isinstance(token, str):
                roles[role] = token
    return roles


def _find_id(backend: tokenizers.Tokenizer, role: str, configured: str | None) -> int | None:
    if configured is not None and backend.token_to_id(configured) is not None:
        return backend.token_to_id(configured)
    special = {t.content for t in backend.get_added_tokens_decoder().values() if t.special}
    for name in _KNOWN[role]:
        if name in special or name == _KNOWN[role][0]:
            token_id = backend.token_to_id(name)
            if token_id is not None:
                return token_id
    return None


def new_bpe() -> tokenizers.Tokenizer:
    """An untrained byte-level BPE: lossless on any text, no normalization, no prefix space."""
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return tok


def train_tokenizer(
    source: Any,
    *,
    vocab_size: int,
    out: str | os.PathLike[str] | None = None,
    min_frequency: int = 2,
    skip_bad_lines: bool = False,
) -> Tokenizer:
    """Train a byte-level BPE on a source spec (or an iterable of texts); save it to `out` if given.

    Every component of a mixture spec is read once: weights do not apply to tokenizer training.
    """
    from forja.data.corpus.sources import SourceStats, parse_mixture, parse_source

    if vocab_size < MIN_VOCAB_SIZE:
        raise ForjaError(f"--vocab-size {vocab_size} is too small; it must be at least {MIN_VOCAB_SIZE} "
                         f"(256 byte tokens and 3 special tokens)")
    stats = SourceStats()
    if isinstance(source, str):
        parsed = [parse_source(s, skip_bad_lines=skip_bad_lines) for s, _ in parse_mixture(source)]
        texts: Iterable[str] = (d for src in parsed for d in src.documents(stats))
    else:
        texts = (stats.count(t) for t in source)
    backend = new_bpe()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=min_frequency, show_progress=False,
        special_tokens=[BOS, EOS, PAD], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    backend.train_from_iterator(texts, trainer)
    if stats.characters == 0:
        raise ForjaError(f"source {source!r} holds no text to train a tokenizer on; check the source")
    tok = Tokenizer(backend)
    if out is not None:
        tok.save(out)
    return tok
