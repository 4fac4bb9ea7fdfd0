"""Prepared data on an object store (`data.path = "s3://bucket/prepared"`), read by ranges.

meta.json and each shard's offsets are small and read whole (the offsets kept on local disk and
memory-mapped, as they are for a local directory); the token shards are not:
`RemoteTokens` slices like the memory map of a local shard (`tokens[lo:hi]`) and reads only
those bytes, through the machine's bounded block cache (forja/storage/blocks.py), with retries.
Opening lists each split's directory once, so every shard's size is checked against its
offsets before any training, as for a local directory.

meta.json is the prepared directory's commit marker: `forja prepare --out s3://...` uploads it
last, so a directory without it is incomplete and is refused. A tokenizer on a store is
copied into the cache (`fetch_tokenizer`), since the tokenizers library reads local files.
"""

from __future__ import annotations

import hashlib
import io
from pathlib import Path
from typing import Any

import numpy as np

from forja.errors import ForjaError
from forja.files import write_atomic
from forja.storage import filesystem, join, read_bytes, retrying
from forja.storage.blocks import BlockCache, cache_root, default_cache, object_key


class RemoteTokens:
    """A shard's token ids in object `url`, sliced as a read-only array: `[lo:hi]` reads those bytes."""

    def __init__(self, url: str, info: dict[str, Any], dtype: np.dtype, cache: BlockCache | None = None):
        self.url, self.dtype = url, np.dtype(dtype)
        self.nbytes = int(info["size"])
        self.key = object_key(url, info)
        self.cache = cache or default_cache()

    def __len__(self) -> int:
        return self.nbytes // self.dtype.itemsize

    def __getitem__(self, item: slice) -> np.ndarray:
        if not isinstance(item, slice):
            raise TypeError("a remote shard is read by slices, tokens[lo:hi]")
        start, stop, step = item.indices(len(self))
        if step != 1:
            raise TypeError("a remote shard is read by contiguous slices (step 1)")
        if stop <= start:
            return np.zeros(0, self.dtype)
        size = self.dtype.itemsize
        data = self.cache.read(self.url, self.key, self.nbytes, start * size, stop * size)
        return np.frombuffer(data, dtype=self.dtype)


def read_meta(root: str) -> bytes | None:
    """meta.json of the prepared directory `root`, or None when there is none (not committed)."""
    try:
        return read_bytes(join(root, "meta.json"))
    except FileNotFoundError:
        return None


def has_object(root: str, name: str) -> bool:
    """Whether object `name` exists under `root` (mixture.json, tokenizer.json ...)."""
    fs, path = filesystem(join(root, name))
    return bool(retrying(lambda: fs.exists(path), what=f"looking up {join(root, name)}", url=root))


def listing(root: str, shards: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """fsspec info of every object in the directories holding `shards`, by relative name:
    one listing per directory rather than one request per shard."""
    found: dict[str, dict[str, Any]] = {}
    for folder in sorted({s["tokens"].rsplit("/", 1)[0] for s in shards if "/" in s["tokens"]}):
        fs, path = filesystem(join(root, folder))
        try:
            entries = retrying(lambda: fs.ls(path, detail=True, refresh=True), what=f"listing {join(root, folder)}",
                               url=root)
        except FileNotFoundError:
            continue
        for info in entries:
            found[f"{folder}/{info['name'].rstrip('/').rsplit('/', 1)[-1]}"] = info
    return found


def _offsets(url: str, info: dict[str, Any] | None) -> np.ndarray:
    """A shard's offsets, memory-mapped from a local copy in $FORJA_CACHE/remote/offsets/ (keyed by
    the object's identity): held in RAM by every rank, the offsets of a large corpus would take
    gigabytes, as they do not on local disk where they are memory-mapped too."""
    if info is None:
        raise FileNotFoundError(f"{url} is missing")
    local = cache_root() / "remote" / "offsets" / f"{object_key(url, info)}.npy"
    if not local.is_file():
        data = read_bytes(url)
        np.load(io.BytesIO(data), allow_pickle=False)  # damaged: said before it is kept
        local.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(local, data)
    return np.load(local, mmap_mode="r")


def open_shard(root: str, entry: dict[str, Any], dtype: np.dtype, redo: str,
               infos: dict[str, dict[str, Any]]) -> tuple[Any, np.ndarray]:
    """(tokens, offsets) of one remote shard, its size checked against its offsets."""
    tokens_url, offsets_url = join(root, entry["tokens"]), join(root, entry["offsets"])
    try:
        offsets = _offsets(offsets_url, infos.get(entry["offsets"]))
    except (OSError, ValueError) as exc:
        raise ForjaError(f"offsets file {offsets_url} is missing or damaged ({exc}); {redo}") from exc
    if offsets.ndim != 1 or len(offsets) != int(entry["documents"]) + 1 or offsets[0] != 0:
        raise ForjaError(f"offsets file {offsets_url} does not match {join(root, 'meta.json')}; {redo}")
    expected = int(offsets[-1]) * dtype.itemsize
    info = infos.get(entry["tokens"])
    actual = int(info["size"]) if info is not None else -1
    if actual != expected:
        state = "is missing" if actual < 0 else f"has {actual} bytes"
        raise ForjaError(f"shard {tokens_url} {state} but its offsets need {expected} bytes "
                         f"(truncated or damaged); {redo}")
    tokens = RemoteTokens(tokens_url, info, dtype) if expected else np.zeros(0, dtype)
    return tokens, offsets


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def fetch_tokenizer(url: str) -> Path:
    """A local copy of the tokenizer at `url` (a tokenizer.json, or a directory holding one, and
    the Hugging Face config files beside it when there), kept in $FORJA_CACHE/remote/ under a key
    of its URL and version, so the tokenizers library can read it. FileNotFoundError: none there."""
    url = str(url).rstrip("/")
    folder = url.rsplit("/", 1)[0] if url.endswith(".json") else url
    main = url if url.endswith(".json") else join(folder, "tokenizer.json")
    fs, path = filesystem(main)
    info = retrying(lambda: fs.info(path), what=f"looking up {main}", url=main)
    version = info.get("ETag") or info.get("mtime") or info.get("LastModified") or info.get("size")
    key = hashlib.sha256(f"{main}\0{version}".encode()).hexdigest()[:24]
    local = cache_root() / "remote" / key
    if not (local / "tokenizer.json").is_file():
        local.mkdir(parents=True, exist_ok=True)
        for name in _TOKENIZER_FILES[1:]:
            try:
                write_atomic(local / name, read_bytes(join(folder, name)))
            except FileNotFoundError:
                pass
        write_atomic(local / "tokenizer.json", read_bytes(main))  # last: its presence means complete
    return local / "tokenizer.json"
