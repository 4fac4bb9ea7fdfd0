"""Checkpoints with `torch.distributed.checkpoint` (DCP): atomic, kept N at a time.

Layout under `<run.dir>/checkpoints/`:

    step-00000100/          a complete checkpoint: DCP files + forja.json
    step-00000200.partial/  one being written (or left by a crash): never loaded

A checkpoint is written into `<name>.partial/`, and renamed to `<name>/` by rank 0 only
after every rank has finished and `forja.json` (step, model identity) is in place. So
the newest directory without `.partial` is always complete, and a crash, a full disk or
a kill -9 during a save leaves the previous checkpoint as the one to resume from.

DCP writes each rank's shards, so a checkpoint saved under one parallel layout loads
under another.

In an object store (run.dir = "s3://..."), which has no rename, a checkpoint is written under
its own name and complete once its forja.json is written last (remote.py).

With `async_save`, `save()` copies the state into fresh CPU memory (torch's DefaultStager,
pinned when the state is on CUDA, synchronously, so training may update parameters and
optimizer state in place as soon as it returns) and the write continues in a background
thread. The trainer calls `poll()` after every step: once every rank's write is done, the
checkpoint is finalized there (forja.json, rename), or at `wait()` / the next `save()` at the
latest. DCP's background collectives (planning, metadata gather, write results) run on a Gloo
group of their own, and `poll()` agrees on another: a collective of a background thread must
never share a group with the main thread's, whose sequence of collectives it would interleave
differently on each rank.

forja.json also lists every file of the checkpoint with its size and CRC-32 (verify.py): each
rank hashes the files it wrote as soon as its own write is done (for an async save, in the
writing thread), and rank 0 gathers them at the finalization. `resume_point()` then loads the
newest checkpoint whose files still match; newer, damaged ones are named and set aside.
"""

from __future__ import annotations

import concurrent.futures
import json
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

from forja import storage
from forja.checkpoint import remote
from forja.checkpoint.config import CheckpointConfig
from forja.checkpoint.trust import refusal_in
from forja.checkpoint.verify import (
    MANIFEST_KEY,
    META_FILE,
    complete_checkpoints,
    digests,
    newest_intact,
    own_files,
    set_aside,
)
from forja.errors import ForjaError
from forja.files import check_writable, fsync_dir, no_room, write_atomic
from forja.parallel.process_group import barrier, new_group

# A rank's state of an async save, agreed across ranks as the minimum: all written only
# when every rank has written, failed when one has failed and none is still writing.
_WRITING, _FAILED, _WRITTEN = 0, 1, 2


def checkpoint_name(step: int) -> str:
    return f"step-{step:08d}"


__all__ = ["CheckpointManager", "checkpoint_name", "complete_checkpoints", "read_meta", "META_FILE"]


def read_meta(path: Path | str) -> dict:
    if remote.is_remote(path):
        try:
            text = remote.read_text(f"{str(path).rstrip('/')}/{META_FILE}")
        except FileNotFoundError:
            raise ForjaError(f"{path} is not a complete forja checkpoint (it has no {META_FILE})") from None
    else:
        meta = path / META_FILE
        if not meta.is_file():
            raise ForjaError(f"{path} is not a complete forja checkpoint (it has no {META_FILE})")
        text = meta.read_text()
    try:
        return json.loads(text)
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise ForjaError(f"{path} is damaged (its {META_FILE} is not valid JSON: cut short or overwritten); "
                         "give another checkpoint, or its run directory to use the newest intact one") from None


def loadable_state(state: dict[str, Any], path: Path, optional: tuple[str, ...] = (),
                   partial: tuple[str, ...] = ()) -> dict[str, Any]:
    """`state` without the entries the checkpoint at `path` lacks and may lack: per-rank RNG
    states (it was saved by fewer ranks: a run resumed on more processes) and the `optional`
    keys (state newer than the checkpoint, or of a setting it was saved without). A `partial`
    entry loads the fields the checkpoint has (fields newer than it keep the object's own way
    of filling them: the data loader's tokens, derived from its position in older checkpoints)."""
    stored = checkpoint_keys(path)
    out = {k: v for k, v in state.items() if k in stored or not (k.startswith("rng.") or k in optional)}
    if partial:
        names = remote.reader(path).read_metadata().state_dict_metadata
        for key in (k for k in partial if k in out):
            out[key] = _StoredFields(out[key], {n.split(".", 1)[1] for n in names if n.startswith(key + ".")})
    return out


class _StoredFields:
    """A Stateful seen through the fields a checkpoint holds (DCP refuses to load a field it lacks)."""

    def __init__(self, inner: Any, fields: set[str]):
        self.inner, self.fields = inner, fields

    def state_dict(self) -> dict[str, Any]:
        return {k: v for k, v in self.inner.state_dict().items() if k in self.fields}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.inner.load_state_dict(state)


def checkpoint_keys(path: Path) -> set[str]:
    """Top-level keys stored in a DCP checkpoint ('model', 'optim', 'rng.rank0', ...)."""
    metadata = remote.reader(path).read_metadata()
    return {key.split(".", 1)[0] if not key.startswith("rng.") else ".".join(key.split(".")[:2])
            for key in metadata.state_dict_metadata}


@dataclass
class _PendingSave:
    """An async save whose write may still be running in DCP's background thread."""

    future: concurrent.futures.Future  # the write, then the hashing of this rank's files: their digests
    stager: DefaultStager  # holds the staged copy of the state until the write is done
    partial: Path | str
    meta: dict
    start: float  # time.perf_counter() when this save began its own work


class CheckpointManager:
    """Saves and loads a run's checkpoints. Build it at the same point on every rank, after
    the process group exists: with `async_save` on more than one rank it creates two groups."""

    def __init__(self, cfg: CheckpointConfig, folder: Path | str, *, rank: int = 0,
                 meta: dict[str, Any] | None = None, device: torch.device | str = "cpu"):
        self.cfg = cfg
        self.device = torch.device(device)  # where the state lives: how async saves stage it
        self.folder = folder  # a URL (str) for a run.dir in an object store
        self.remote = remote.is_remote(folder)
        self.rank = rank
        self.meta = meta or {}  # identity of the run's model, written into forja.json
        self._pending: _PendingSave | None = None
        self._save_group, self._poll_group = _async_groups(cfg)
        self.last_blocking_s: float | None = None
        """Seconds the last `save()` blocked its caller (None before the first save)."""
        self.last_total_s: float | None = None
        """Seconds from the start of the last finalized save to its finalization."""
        self.slow_write_s = 0.0
        """A drill's (slowsave): the next save's write takes this much longer, in the writing thread."""

    # -- finding ----------------------------------------------------------------------------
    def latest(self) -> Path | None:
        found = complete_checkpoints(self.folder)
        return found[-1][1] if found else None

    def resume_point(self, *, tidy: bool = True) -> Path | None:
        """The newest intact checkpoint (sizes and checksums checked, the files shared out among
        the ranks; all ranks call it), or None when there is none yet. Newer, damaged ones are
        named on rank 0 in one line and set aside as `<name>.damaged`; when every checkpoint is
        damaged the run stops with one sentence. `tidy=False` (a folder another replica group
        writes, tidied by the launcher): damaged ones are passed over and left where they are."""
        world = dist.get_world_size() if dist.is_initialized() else 1
        pick = newest_intact(self.folder, checksums=True, rank=self.rank, world=world)
        if not pick.damaged:
            return pick.path
        if pick.path is None:
            raise ForjaError(f"{pick.none_intact(self.folder)}; restore them from a copy, or pass --start-over "
                             "to begin the run afresh")
        if not tidy:
            if self.rank == 0:
                print(f"forja: {pick.notice('resuming from')}", file=sys.stderr, flush=True)
            return pick.path
        if self.rank == 0:
            names = ", ".join(f"{remote.name_of(p)}.damaged" for p, _ in pick.damaged)
            what = "one is" if len(pick.damaged) == 1 else "ones are"
            print(f"forja: {pick.notice('resuming from')} (the damaged {what} set aside as {names})",
                  file=sys.stderr, flush=True)
            for path, _ in pick.damaged:
                set_aside(path)
        barrier()  # no rank looks at the folder before the damaged ones are out of the way
        return pick.path

    def clean_partial(self) -> None:
        """Remove checkpoints left half-written by a crash (rank 0, before training)."""
        if self.rank == 0 and self.remote:
            remote.clean_partial(self.folder)
        elif self.rank == 0 and self.folder.is_dir():
            for p in self.folder.glob("*.partial"):
                shutil.rmtree(p, ignore_errors=True)

    def check_writable(self) -> None:
        """Fail before training, not at the first save, when the folder cannot be written."""
        if self.remote:
            storage.check_reachable(self.folder, write=self.rank == 0, what="checkpoint folder")
            return
        check_writable(self.folder, what="checkpoint folder", fix="choose a writable run.dir or free some space",
                       rank=self.rank)

    # -- saving -----------------------------------------------------------------------------
    def save(self, step: int, state: dict[str, Any], extra_meta: dict | None = None) -> Path:
        """Write `state` as the checkpoint of `step`; returns its final path (with
        `async_save`, where it will be once `poll()` or `wait()` has finalized it)."""
        called = time.perf_counter()
        self.wait()  # one save at a time: its stall counts in this one's blocking time
        start = time.perf_counter()
        final, partial = self._names(step)
        meta = {**self.meta, **(extra_meta or {}), "step": step}
        if self.rank == 0:
            self._remove(partial)
        barrier()
        try:
            slow, self.slow_write_s = self.slow_write_s, 0.0
            if self.cfg.async_save:
                self._pending = self._start_async(state, partial, meta, start, slow)
            else:
                dcp.save(state, **remote.dcp_target(partial, write=True))
                time.sleep(slow)
                files = self._files(partial)
        except (OSError, CheckpointException) as exc:
            self._abandon(partial, exc)
        except RuntimeError as exc:  # torch.save's stream writer on a full disk: no errno, "unexpected pos"
            if "unexpected pos" not in str(exc):
                raise
            self._abandon(partial, exc)
        if not self.cfg.async_save:
            self._finalize(partial, meta, files)
            self.last_total_s = time.perf_counter() - start
        self.last_blocking_s = time.perf_counter() - called
        return final

    def _names(self, step: int) -> tuple[Path | str, Path | str]:
        """(final, partial) place of the checkpoint of `step`: the same in a store (no rename)."""
        if self.remote:
            final = storage.join(self.folder, checkpoint_name(step))
            return final, final
        final = self.folder / checkpoint_name(step)
        return final, final.with_name(final.name + ".partial")

    def _remove(self, path: Path | str) -> None:
        if self.remote:
            remote.remove(path)  # a complete one of this step too: its manifest goes first
        else:
            shutil.rmtree(path, ignore_errors=True)

    def _files(self, partial: Path | str) -> dict[str, dict]:
        """This rank's manifest entries of the checkpoint just written at `partial`."""
        if self.remote:
            return remote.sizes(partial, self.rank)
        return digests(partial, own_files(partial, self.rank))

    def _start_async(self, state: dict[str, Any], partial: Path | str, meta: dict, start: float,
                     slow: float = 0.0) -> _PendingSave:
        # torch's default staging, made here so that it can be closed when the write is done
        # (torch 2.11 never closes the one it makes, and its cached copy of the whole state
        # then lives until a full garbage collection).
        stager = DefaultStager(staging_options(self.device))
        try:
            future = dcp.async_save(state, process_group=self._save_group, async_stager=stager,
                                    **remote.dcp_target(partial, write=True))
        except BaseException:
            stager.close()
            raise
        return _PendingSave(self._then_hash(future, partial, slow), stager, partial, meta, start)

    def _then_hash(self, write: concurrent.futures.Future, partial: Path | str,
                   slow: float = 0.0) -> concurrent.futures.Future:
        """A future of this rank's digests, computed by the writing thread once `write` is done
        (the files are then in the page cache, and the main thread keeps training)."""
        hashed: concurrent.futures.Future = concurrent.futures.Future()

        def hash_files(done: concurrent.futures.Future) -> None:
            try:
                time.sleep(slow)  # a slowsave drill: the write is in flight this much longer
                if (error := done.exception()) is not None:
                    hashed.set_exception(error)
                else:
                    hashed.set_result(self._files(partial))
            except BaseException as exc:  # an exception in a done-callback would only be logged
                hashed.set_exception(exc)

        write.add_done_callback(hash_files)
        return hashed

    def poll(self) -> Path | None:
        """Finalize an async save once every rank has written it; returns its path then, else
        None. Call it on every rank at the same steps (it is a collective while a save is
        pending); with none pending it does nothing."""
        if self._pending is None:
            return None
        status = self._agree(self._local_status())
        if status == _WRITING:
            return None
        return self._conclude(status)

    def wait(self) -> Path | None:
        """Finish an async save in flight (all ranks call this); returns its path, if any."""
        if self._pending is None:
            return None
        concurrent.futures.wait([self._pending.future])
        return self._conclude(self._agree(self._local_status()))

    def _local_status(self) -> int:
        future = self._pending.future
        if not future.done():
            return _WRITING
        return _FAILED if future.exception() is not None else _WRITTEN

    def _agree(self, local: int) -> int:
        """The minimum of every rank's `local` status: an all-reduce on the poll group, on the
        main thread, so it never interleaves with the background thread's collectives."""
        if self._poll_group is None:  # alone: nothing to agree on
            return local
        flag = torch.tensor([local], dtype=torch.int32)  # CPU: the group is Gloo
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self._poll_group)
        return int(flag.item())

    def _conclude(self, status: int) -> Path:
        """Finalize or abandon the pending save, whose write every rank has ended."""
        pending, self._pending = self._pending, None
        pending.stager.close()  # the staged copy is no longer needed
        error = pending.future.exception()
        if error is not None and not isinstance(error, (OSError, CheckpointException)):
            raise error  # a bug rather than a disk that failed: its own traceback says more
        if error is not None or status == _FAILED:
            self._abandon(pending.partial, error or RuntimeError("another rank could not write its part"))
        final = self._finalize(pending.partial, pending.meta, pending.future.result())
        self.last_total_s = time.perf_counter() - pending.start
        return final

    def _abandon(self, partial: Path | str, exc: Exception) -> None:
        if self.rank == 0:
            self._remove(partial)
        previous = self.latest()
        kept = f"{remote.name_of(previous)} is intact" if previous else "no earlier checkpoint exists"
        name = remote.name_of(partial).removesuffix(".partial")
        raise ForjaError(f"could not write checkpoint {name} to {self.folder} "
                         f"({_reason(exc)}); {kept}. Free space or choose another run.dir") from None

    def _finalize(self, partial: Path | str, meta: dict, files: dict[str, dict]) -> Path | str:
        files = _gather_files(files)  # and every rank's shards are on disk
        if self.remote:
            return self._commit(partial, {**meta, MANIFEST_KEY: files})
        final = partial.with_name(partial.name.removesuffix(".partial"))
        if self.rank == 0:
            try:
                write_atomic(partial / META_FILE, json.dumps({**meta, MANIFEST_KEY: files}, indent=2))
                partial.rename(final)
                fsync_dir(self.folder)  # the rename itself survives a power cut
            except OSError as exc:
                self._abandon(partial, exc)
            self._retain()
        barrier()
        return final

    def _commit(self, url: str, meta: dict) -> str:
        """A store checkpoint's finalization: its manifest written last (rank 0)."""
        if self.rank == 0:
            try:
                remote.commit(url, meta)
            except (OSError, ForjaError) as exc:  # ForjaError: the store failed every retry
                self._abandon(url, exc)
            self._retain()
        barrier()
        return url

    def _retain(self) -> None:
        if self.cfg.keep <= 0:
            return
        for _, path in complete_checkpoints(self.folder)[: -self.cfg.keep]:
            self._remove(path)

    # -- loading ----------------------------------------------------------------------------
    def load(self, path: Path, state: dict[str, Any], check: Callable[[dict], None] | None = None) -> dict:
        """Load `state` in place from the checkpoint at `path`; returns its forja.json.

        `check(meta)` may refuse the checkpoint (another model, say) before any tensor is read.
        """
        meta = read_meta(path)
        if check is not None:
            check(meta)
        try:
            dcp.load(state, **remote.dcp_target(path, write=False))
        except CheckpointException as exc:
            if (refusal := refusal_in(exc)) is not None:
                raise refusal from None
            raise
        return meta


def staging_options(device: torch.device) -> StagingOptions:
    """How an async save copies the state on `device` into host memory. Always synchronously
    (async staging would make dcp.async_save return another type, and `save()` promises that
    training may update the state in place once it returns). From CUDA, into pinned memory
    with non-blocking copies and one synchronize at the end: a copy into pageable memory goes
    through the driver's bounce buffer, one blocking copy per tensor. On CPU, plain copies
    (pinning needs CUDA; a non-blocking copy, an accelerator)."""
    cuda = device.type == "cuda"
    return StagingOptions(use_pinned_memory=cuda, use_shared_memory=False, use_async_staging=False,
                          use_non_blocking_copy=cuda)


def _async_groups(cfg: CheckpointConfig) -> tuple[dist.ProcessGroup | None, dist.ProcessGroup | None]:
    """Gloo groups for async saves on more than one rank: one for DCP's background thread,
    one for `poll()`'s agreement on the main thread (None, None otherwise). Every rank
    builds its manager at the same point, so all create them in the same order."""
    if not (cfg.enabled and cfg.async_save and dist.is_initialized() and dist.get_world_size() > 1):
        return None, None
    return new_group(backend="gloo"), new_group(backend="gloo")


def _gather_files(files: dict[str, dict]) -> dict[str, dict]:
    """Every rank's digests, merged (on every rank): a barrier too."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return files
    found: list[dict] = [{}] * dist.get_world_size()
    dist.all_gather_object(found, files)
    return {name: d for part in found for name, d in sorted(part.items())}


def _reason(exc: Exception) -> str:
    """The first underlying error of a failed write, in one line."""
    if isinstance(exc, CheckpointException) and exc.failures:
        failure = next(iter(exc.failures.values()))  # a WrappedException: (exception, traceback)
        exc = failure[0] if isinstance(failure, tuple) else failure
    if no_room(exc) is not None:
        return "no space left on device"
    text = getattr(exc, "strerror", None) or str(exc)
    if "unexpected pos" in text:  # PyTorch's stream writer saw a short write, not an errno
        return "a write was cut short: no space left on device, or a file-size limit"
    return text.strip().splitlines()[-1] if text.strip() else type(exc).__name__
