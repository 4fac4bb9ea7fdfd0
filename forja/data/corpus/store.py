"""Prepared data on an object store: `forja prepare --out s3://bucket/dir`, and opening it.

An object store has no rename, so a prepared directory cannot appear there whole at once.
Instead it is prepared as usual into a local staging directory (under $FORJA_CACHE/staging),
then every file is uploaded with retries, the commit markers last: each prepared directory's
meta.json after its shards, and a mixture's mixture.json after everything. Readers trust a
directory only once its marker is there, so an interrupted upload is never read as data.
Reachability, credentials and an existing --out are checked before any work.

    @to_store                       on prepare(): an object-store `out` goes through here
    open_stored(url, tokenizer)     a prepared or mixture directory at a URL
    is_prepared(path)               a local path or URL holding prepared data or a mixture
"""

from __future__ import annotations

import functools
import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable

from forja.data.corpus.mixture import MIXTURE, is_mixture_dir, open_mixture
from forja.data.corpus.shards import META, open_prepared
from forja.data.corpus.tokenizer import load_tokenizer
from forja.errors import ForjaError
from forja.storage import check_reachable, exists, is_url, join, remove_tree, upload_dir
from forja.storage.blocks import cache_root


def to_store(prepare: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap prepare(source, tokenizer, out, **options) so that an object-store `out` is staged
    locally, uploaded with its markers last, and opened from the store."""

    @functools.wraps(prepare)
    def wrapper(source: Any, tokenizer: Any, out: Any, **options: Any) -> Any:
        if not is_url(out):
            return prepare(source, tokenizer, out, **options)
        out = str(out).rstrip("/")
        if options.get("part") is not None or options.get("merge"):
            raise ForjaError(f"--part and --merge need a local or shared-disk --out, not {out}; prepare "
                             f"without them to write to an object store")
        check_reachable(out, write=True, what="--out")
        overwrite = bool(options.pop("overwrite", False))
        if exists(out) and not overwrite:
            raise ForjaError(f"{out} already exists; choose another --out or pass --overwrite to replace it")
        root = cache_root() / "staging"
        root.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix="prepare-", dir=root))
        try:
            local = staging / "out"
            prepare(source, tokenizer, local, **options)
            upload(local, out, replace=overwrite)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        return open_stored(out, tokenizer)

    return wrapper


def upload(local: Path, out: str, *, replace: bool) -> None:
    """Copy the prepared directory `local` to `out`, its markers last; with `replace`, whatever
    was at `out` goes first, its markers before the rest (so it stops being trusted at once)."""
    markers = sorted(p.relative_to(local).as_posix() for p in local.rglob(META))
    markers += [MIXTURE] if (local / MIXTURE).is_file() else []
    if replace:
        for name in (MIXTURE, META):
            remove_tree(join(out, name))
        remove_tree(out)
    upload_dir(local, out, last=markers)


def open_stored(url: str, tokenizer: Any = None) -> Any:
    """The prepared data (a PreparedDataset or a Mixture) at object-store URL `url`."""
    tok = load_tokenizer(tokenizer) if tokenizer is not None else None
    if is_mixture_dir(url):
        return open_mixture(url, tok)
    return open_prepared(url, tok)  # its error says so when meta.json is missing


def is_prepared(path: str | Any) -> bool:
    """Whether `path` (a local path or a URL) holds prepared data or a mixture of it."""
    if is_url(path):
        return exists(join(str(path), META)) or is_mixture_dir(str(path))
    local = Path(path).expanduser()
    return (local / META).is_file() or is_mixture_dir(local)

