"""Checkpoints with `torch.distributed.checkpoint` (DCP): atomic, kept N at a time.

Layout under `<run.dir>/checkpoints/`:

    step-00000100/          a complete checkpoint: DCP files + forja.json
    step-00000200.partial/  one being written (or left by a crash): never loaded

A checkpoint is written into `<name>.partial/`, and renamed to `<name>/` by rank 0 only
after every rank has finished and `forja.json` (step, model identity) is in place. So
the newest directory without `.partial` is always complete, and a crash, a full disk or
a kill -9 during a save leaves the previous checkpoint as the one to resume from.

DCP writes each rank's shards, so a checkpoint saved under one parallel layout loads
under another. With `async_save`, the write continues in the background and the
checkpoint is finalized (renamed) at the next save or at `wait()`.
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from forja.checkpoint.config import CheckpointConfig
from forja.errors import ForjaError
from forja.files import check_writable, fsync_dir, write_atomic
from forja.parallel.process_group import barrier

_NAME = re.compile(r"step-(\d{8})")
META_FILE = "forja.json"


def checkpoint_name(step: int) -> str:
    return f"step-{step:08d}"


def complete_checkpoints(folder: Path) -> list[tuple[int, Path]]:
    """(step, path) of every complete checkpoint in `folder`, oldest first."""
    if not folder.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in folder.iterdir()
             if (m := _NAME.fullmatch(p.name)) and (p / META_FILE).is_file()]
    return sorted(found)


def read_meta(path: Path) -> dict:
    meta = path / META_FILE
    if not meta.is_file():
        raise ForjaError(f"{path} is not a complete forja checkpoint (it has no {META_FILE})")
    return json.loads(meta.read_text())


def loadable_state(state: dict[str, Any], path: Path) -> dict[str, Any]:
    """`state` without the per-rank RNG entries the checkpoint at `path` lacks (it was saved
    by fewer ranks: a run resumed on more processes)."""
    stored = checkpoint_keys(path)
    return {k: v for k, v in state.items() if not k.startswith("rng.") or k in stored}


def checkpoint_keys(path: Path) -> set[str]:
    """Top-level keys stored in a DCP checkpoint ('model', 'optim', 'rng.rank0', ...)."""
    metadata = dcp.FileSystemReader(str(path)).read_metadata()
    return {key.split(".", 1)[0] if not key.startswith("rng.") else ".".join(key.split(".")[:2])
            for key in metadata.state_dict_metadata}


class CheckpointManager:
    def __init__(self, cfg: CheckpointConfig, folder: Path, *, rank: int = 0,
                 meta: dict[str, Any] | None = None):
        self.cfg = cfg
        self.folder = folder
        self.rank = rank
        self.meta = meta or {}  # identity of the run's model, written into forja.json
        self._pending: tuple[Any, Path, dict] | None = None  # (future, partial dir, meta) of an async save

    # -- finding ----------------------------------------------------------------------------
    def latest(self) -> Path | None:
        found = complete_checkpoints(self.folder)
        return found[-1][1] if found else None

    def clean_partial(self) -> None:
        """Remove checkpoints left half-written by a crash (rank 0, before training)."""
        if self.rank == 0 and self.folder.is_dir():
            for p in self.folder.glob("*.partial"):
                shutil.rmtree(p, ignore_errors=True)

    def check_writable(self) -> None:
        """Fail before training, not at the first save, when the folder cannot be written."""
        check_writable(self.folder, what="checkpoint folder", fix="choose a writable run.dir or free some space",
                       rank=self.rank)

    # -- saving -----------------------------------------------------------------------------
    def save(self, step: int, state: dict[str, Any], extra_meta: dict | None = None) -> Path:
        """Write `state` as the checkpoint of `step`; returns its final path."""
        self.wait()
        final = self.folder / checkpoint_name(step)
        partial = final.with_name(final.name + ".partial")
        meta = {**self.meta, **(extra_meta or {}), "step": step}
        if self.rank == 0:
            shutil.rmtree(partial, ignore_errors=True)
        barrier()
        try:
            if self.cfg.async_save:
                self._pending = (dcp.async_save(state, checkpoint_id=str(partial)), partial, meta)
                return final
            dcp.save(state, checkpoint_id=str(partial))
        except (OSError, CheckpointException) as exc:
            self._abandon(partial, exc)
        self._finalize(partial, meta)
        return final

    def wait(self) -> None:
        """Finish an async save in flight (all ranks call this)."""
        if self._pending is None:
            return
        future, partial, meta = self._pending
        self._pending = None
        try:
            future.result()
        except (OSError, CheckpointException) as exc:
            self._abandon(partial, exc)
        self._finalize(partial, meta)

    def _abandon(self, partial: Path, exc: Exception) -> None:
        if self.rank == 0:
            shutil.rmtree(partial, ignore_errors=True)
        previous = self.latest()
        kept = f"{previous.name} is intact" if previous else "no earlier checkpoint exists"
        raise ForjaError(f"could not write checkpoint {partial.name.removesuffix('.partial')} to {self.folder} "
                         f"({_reason(exc)}); {kept}. Free space or choose another run.dir") from None

    def _finalize(self, partial: Path, meta: dict) -> None:
        barrier()  # every rank's shards are on disk
        if self.rank == 0:
            try:
                write_atomic(partial / META_FILE, json.dumps(meta, indent=2))
                partial.rename(partial.with_name(partial.name.removesuffix(".partial")))
                fsync_dir(self.folder)  # the rename itself survives a power cut
            except OSError as exc:
                self._abandon(partial, exc)
            self._retain()
        barrier()

    def _retain(self) -> None:
        if self.cfg.keep <= 0:
            return
        for _, path in complete_checkpoints(self.folder)[: -self.cfg.keep]:
            shutil.rmtree(path, ignore_errors=True)

    # -- loading ----------------------------------------------------------------------------
    def load(self, path: Path, state: dict[str, Any], check: Callable[[dict], None] | None = None) -> dict:
        """Load `state` in place from the checkpoint at `path`; returns its forja.json.

        `check(meta)` may refuse the checkpoint (another model, say) before any tensor is read.
        """
        meta = read_meta(path)
        if check is not None:
            check(meta)
        dcp.load(state, checkpoint_id=str(path))
        return meta


def _reason(exc: Exception) -> str:
    """The first underlying error of a failed write, in one line."""
    if isinstance(exc, CheckpointException) and exc.failures:
        failure = next(iter(exc.failures.values()))  # a WrappedException: (exception, traceback)
        exc = failure[0] if isinstance(failure, tuple) else failure
    text = getattr(exc, "strerror", None) or str(exc)
    return text.strip().splitlines()[-1] if text.strip() else type(exc).__name__
