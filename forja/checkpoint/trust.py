"""Checkpoints that load only what they trust.

DCP stores a checkpoint's index (`.metadata`) as a pickle and every value that is not a tensor
(an optimizer's betas, the RNG states, the data loader's position) as a `torch.save` blob that
it reads back with `torch.load(weights_only=False)`. Unpickling runs whatever callable a pickle
names, so a checkpoint from someone else's bucket could run code on `forja export` or on a
resume, and forja.json's checksums would not stop it: the manifest sits beside the data and
proves integrity, not origin.

So every checkpoint forja reads goes through the reader and the planner here:
- `.metadata` is unpickled by `_MetadataUnpickler`, which admits DCP's own metadata records
  (dataclasses and enums of `torch.distributed.checkpoint`), `torch.Size`, dtypes and layouts,
  paths and a few containers; any other name refuses the checkpoint in one sentence naming it;
- a non-tensor value is first read with `torch.load(weights_only=True)` (plain Python values
  and tensors, plus numpy's array reconstruction for numpy's RNG state) before DCP's own load
  of the same bytes.

Not verified: that the tensors hold what their author meant (weights can still be bad), and
who wrote the checkpoint. Tensor bytes are read raw and never unpickled.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import io
import pickle
import re
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from forja.errors import ForjaError

_DCP = "torch.distributed.checkpoint"
_ADMITTED = {
    ("torch", "Size"), ("torch.serialization", "_get_layout"), ("collections", "OrderedDict"),
    ("builtins", "set"), ("builtins", "frozenset"),
    ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"),
    ("pathlib", "WindowsPath"), ("pathlib", "PureWindowsPath"),
}


class UntrustedCheckpoint(ForjaError):
    """A checkpoint holds something that unpickling would have to call or build. (One argument,
    the sentence, as any exception: DCP rebuilds the errors it gathers from the ranks.)"""

    reason = ""  # what is wrong, without the file: a damage check's few words


def _untrusted(where: str, reason: str) -> UntrustedCheckpoint:
    exc = UntrustedCheckpoint(f"{where} {reason}: forja does not load it; take the checkpoint from its source "
                              "again, or train from one you made")
    exc.reason = reason
    return exc


def _refusal(where: str, name: str) -> UntrustedCheckpoint:
    return _untrusted(where, f"names {name}, which a forja checkpoint never holds, and unpickling it could run code")


def _admitted(module: str, name: str, found: Any) -> bool:
    if (module, name) in _ADMITTED:
        return True
    if module == "torch" and isinstance(found, (torch.dtype, torch.layout)):
        return True
    # DCP's own records: plain dataclasses and enums (whose construction only stores fields), in
    # whichever torch.distributed.checkpoint module this torch keeps them.
    return ((module == _DCP or module.startswith(_DCP + ".")) and isinstance(found, type)
            and (dataclasses.is_dataclass(found) or issubclass(found, enum.Enum)))


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, stream, where: str):
        super().__init__(stream)
        self.where = where

    def find_class(self, module: str, name: str) -> Any:
        try:
            found = super().find_class(module, name)
        except (ImportError, AttributeError):
            raise _refusal(self.where, f"{module}.{name}") from None
        if not _admitted(module, name, found):
            raise _refusal(self.where, f"{module}.{name}")
        return found


def read_metadata(data: bytes, where: str) -> Metadata:
    """DCP's Metadata from the bytes of a `.metadata`, admitting only what DCP writes there."""
    metadata = _MetadataUnpickler(io.BytesIO(data), where).load()
    if not isinstance(metadata, Metadata):
        raise _untrusted(where, f"holds a {type(metadata).__name__}, not DCP's Metadata")
    return metadata


class _TrustedReading:
    """read_metadata through `read_metadata` above (mixed into DCP's two readers)."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        rank = kwargs.get("rank")  # DCP's per-rank metadata (no_dist saves of several ranks)
        name = ".metadata" if rank is None else f"__{rank}.metadata"
        path = self.fs.concat_path(self.path, name)
        with self.fs.create_stream(path, "rb") as stream:
            metadata = read_metadata(stream.read(), f"{self.path}/{name}")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = getattr(self, "load_id", None)  # as DCP's own reader does
        return metadata


class TrustedFileSystemReader(_TrustedReading, FileSystemReader):
    """DCP's reader of a checkpoint on disk, with `.metadata` read as above."""


@functools.cache
def _fsspec_reader_class() -> type:
    """DCP's store reader with `.metadata` read as above (fsspec imported only for a store)."""
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader  # torch 2.11 and 2.13

    return type("TrustedFsspecReader", (_TrustedReading, FsspecReader), {})


def fsspec_reader(path: str, **options: Any):
    """DCP's reader of a checkpoint in a store, with `.metadata` read as above."""
    return _fsspec_reader_class()(path, **options)


@functools.cache
def _numpy_globals() -> list:
    """What a numpy array's pickle names (numpy's RNG state holds one): array reconstruction only."""
    import numpy as np

    try:
        from numpy._core.multiarray import _reconstruct  # numpy 2
    except ImportError:  # numpy 1
        from numpy.core.multiarray import _reconstruct
    return [_reconstruct, np.ndarray, np.dtype, *{type(np.dtype(c)) for c in "?bBhHiIlLqQefdgFDG"}]


def _named_global(exc: Exception) -> str:
    """What torch's weights_only refusal says the value names ("it names io.open")."""
    found = re.search(r"GLOBAL (\S+)", str(exc))
    return f"it names {found.group(1)}" if found else str(exc).splitlines()[0][:200]


class TrustedLoadPlanner(DefaultLoadPlanner):
    """DCP's load planner, reading each non-tensor value with `weights_only=True` first."""

    def __init__(self, where: str, **kwargs: Any):
        super().__init__(**kwargs)
        self.where = where  # the checkpoint, for the refusal

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        data = value.read()
        try:
            with torch.serialization.safe_globals(_numpy_globals()):
                torch.load(io.BytesIO(data), weights_only=True)
        except pickle.UnpicklingError as exc:
            raise _untrusted(f"{self.where}: its value {read_item.dest_index.fqn}",
                             f"is not plain data ({_named_global(exc)}), and unpickling it could "
                             "run code") from None
        super().load_bytes(read_item, io.BytesIO(data))


def refusal_in(exc: BaseException) -> UntrustedCheckpoint | None:
    """The refusal above when it is what a DCP load failed on (DCP wraps each rank's error in a
    CheckpointException), so the caller can say it as it is."""
    if isinstance(exc, UntrustedCheckpoint):
        return exc
    for pair in (getattr(exc, "failures", None) or {}).values():
        inner = pair[0] if isinstance(pair, tuple) else pair
        if isinstance(inner, UntrustedCheckpoint):
            return inner
    return None
