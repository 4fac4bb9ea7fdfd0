"""Writing files and directories so that a crash never leaves half of one under its name.

A run killed mid-write (preemption, out of memory, a full disk, a power cut) must leave
either the old content or the new one under the final name, never a truncated mix that a
later run would read as valid. So everything is written under a temporary name in the same
directory (a rename is only atomic within one file system), flushed to disk, and renamed
into place; the directory is then flushed too, so the rename itself survives a power cut.

    write_atomic(run_dir / "run.json", text)           one file (a full disk: DiskFull, the old file kept)
    check_writable(run_dir, what="run directory", fix="choose another run.dir")
    replace_dir(tmp_dir, out)                           a whole directory built beside `out`
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
from pathlib import Path

from forja.errors import ForjaError

# A write refused for want of room: the disk is full, the user's quota is spent, or the
# process's file-size limit (ulimit -f, RLIMIT_FSIZE) is reached. One sentence for all three.
_NO_ROOM = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})


class DiskFull(ForjaError, OSError):
    """No room was left to write `what`; nothing is half-written, and `kept` says what remains.

    Also an OSError with the underlying errno, so that a caller which handles failed writes
    (the checkpoint manager, which removes its partial directory) still sees one."""

    def __init__(self, what: str | os.PathLike[str], error: OSError, *, kept: str,
                 fix: str = "free some space on that disk and run again"):
        detail = "" if error.errno == errno.ENOSPC else f" ({error.strerror or error})"
        super().__init__(f"no space left on device writing {what}{detail}: nothing is half-written ({kept}); {fix}")
        self.error, self.errno, self.strerror = error, error.errno, error.strerror

    def __str__(self) -> str:  # the sentence, not OSError's "[Errno 28] ..."
        return str(self.args[0])


def no_room(exc: BaseException) -> OSError | None:
    """The OSError behind `exc` when it is a write refused for want of room (see DiskFull)."""
    if isinstance(exc, DiskFull):
        return exc.error
    return exc if isinstance(exc, OSError) and exc.errno in _NO_ROOM else None


def write_atomic(path: str | os.PathLike[str], data: str | bytes) -> None:
    """Write `data` (text as UTF-8) to `path` whole or not at all; nothing else is left behind.
    A full disk raises DiskFull, naming `path` and saying that its previous content is kept."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    raw = data.encode("utf-8") if isinstance(data, str) else data
    try:
        with open(tmp, "wb") as f:
            f.write(raw)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as exc:  # KeyboardInterrupt too: no stray temporary file
        tmp.unlink(missing_ok=True)
        error = no_room(exc)
        if error is not None:
            kept = f"the previous {path.name} is kept whole" if path.exists() else "nothing was left behind"
            raise DiskFull(path, error, kept=kept) from exc
        raise
    fsync_dir(path.parent)


def check_writable(folder: str | os.PathLike[str], *, what: str, fix: str, rank: int = 0) -> None:
    """Create `folder` and prove a file can be written there, before any long work starts.

    Raises ForjaError("{what} {folder} cannot be written (reason); {fix}"). Each process writes
    its own probe file (its rank and pid: replica groups share a checkpoint folder and each has
    a rank 0), so one process's cleanup cannot remove another's probe mid-check.
    """
    folder = Path(folder)
    probe = folder / f".write-test-{rank}-{os.getpid()}"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise ForjaError(f"{what} {folder} cannot be written ({exc.strerror or exc}); {fix}") from None


def replace_dir(new: str | os.PathLike[str], out: str | os.PathLike[str], *,
                keep_existing: bool = False) -> None:
    """Move the completed directory `new` to `out`, its files flushed to disk first.

    An existing `out` is removed only once `new` is in its place, so `out` always names a
    whole directory (the old one or the new one), apart from the instant between two renames.
    With `keep_existing`, an `out` that appeared meanwhile wins (another process finished the
    same work first) and `new` is deleted instead.
    """
    new, out = Path(new), Path(out)
    _fsync_tree(new)
    if keep_existing or not os.path.lexists(out):
        try:
            os.rename(new, out)  # also replaces an empty directory, on POSIX
        except OSError:
            if not (keep_existing and os.path.lexists(out)):
                raise
            shutil.rmtree(new, ignore_errors=True)
            return
        fsync_dir(out.parent)
        return
    old = out.parent / f".{out.name}.old-{os.getpid()}"
    _remove(old)  # left by a killed process that had our pid
    os.replace(out, old)
    try:
        os.replace(new, out)
    except BaseException:
        with contextlib.suppress(OSError):
            os.replace(old, out)  # put the old one back rather than leave nothing
        raise
    fsync_dir(out.parent)
    _remove(old)


def fsync_dir(folder: str | os.PathLike[str]) -> None:
    """Flush a directory's entries (a rename or a new file) to disk.

    Best effort: some systems (Windows, some network file systems) refuse a directory
    descriptor or its fsync; the data files themselves are already flushed then.
    """
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _fsync_tree(root: Path) -> None:
    """Flush every file and directory under `root`, the deepest first."""
    for dirpath, _, filenames in os.walk(root, topdown=False):
        for name in filenames:
            file = os.path.join(dirpath, name)
            if os.path.islink(file):
                continue
            fd = os.open(file, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(dirpath)


def _remove(path: Path) -> None:
    """Delete a file or a directory tree, if there; what cannot be deleted stays (harmless)."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(OSError):
            path.unlink(missing_ok=True)


def read_records(path: str | os.PathLike[str], *, strict: bool = False) -> list[dict]:
    """The JSON objects of a JSONL file such as a run's metrics.jsonl, in order: the one reader
    of metrics.jsonl. A line that does not parse (torn by a kill, anywhere in a run that was
    resumed) is skipped, and a missing file has none. `strict`: only a torn last line is skipped;
    any other line that does not parse is a ForjaError naming its number (blank lines not counted)."""
    path = Path(path)
    if not path.is_file():
        return []
    lines = [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    records = []
    for number, line in enumerate(lines, 1):
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            if strict and number < len(lines):
                raise ForjaError(f"{path} line {number} is not JSON ({exc}); fix or remove that line") from exc
            continue
        if isinstance(record, dict):
            records.append(record)
    return records
