"""The run directory: what a run leaves behind, and the guard against mixing runs.

    <run.dir>/config.toml       the resolved config (rerun it with `forja train <run.dir>/config.toml`)
    <run.dir>/run.json          code revision, library versions, hardware, command and fallbacks of each launch
    <run.dir>/tokenizer.json    the tokenizer, so the run can be exported or sampled alone
    <run.dir>/checkpoints/      see forja/checkpoint/manager.py
    <run.dir>/metrics.jsonl     one line per logged step
    <run.dir>/ft/group<g>/      under [ft], each replica group's own files (its run.json, goodput, summary)

A run.dir in an object store (`s3://bucket/runs/x`, any fsspec URL) is worked on through a
local mirror, its checkpoints written to the store directly (run_store.py).

Rerunning on a run directory resumes it, if its config is the same apart from keys that
may change between launches (steps, intervals, logging, parallel layout, a longer
sequence length with the RoPE settings that go with it). Anything else
(another model, data, optimizer...) is refused unless `run.start_over` is set.
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import shutil
import socket
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path

import torch
import torch.distributed as dist

import forja
from forja import fallbacks, storage
from forja.config import Config, config_from_dict, dump_toml

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

from forja.errors import ForjaError
from forja.files import check_writable, write_atomic
from forja.parallel.process_group import barrier
from forja.train.config import DebugConfig
from forja.train.launch.run_store import SYNC_S, RunStore, mirror_of

# Keys that may differ between launches of one run ("section." means the whole section).
RESUMABLE = ("run.", "checkpoint.", "metrics.", "parallel.", "ft.", "train.steps", "train.val_interval",
             "train.val_batches", "train.micro_batch_size", "train.sample_tokens", "train.sample_prompt",
             "train.on_nonfinite", "train.spike", "train.rollback", "debug.", "train.gc_interval", "train.profile_at",
             "train.host_malloc", "train.device",
             "data.workers", "data.prefetch",
             # Data stages not yet begun may be edited or appended, and the packing changed (the loader
             # refuses a change to a begun stage, naming it: forja/data/load/stages.py).
             "data.stages", "data.packing", "data.max_doc_tokens", "data.pack_buffer",
             "model.attention", "model.fused_ops", "model.fused_ops_overrides",
             "train.float8",
             # Context extension: a longer length, its schedule and how a rotary model places positions
             # (whether the model allows it is the checkpoint identity's call: forja/checkpoint/identity.py).
             "train.seq_len", "model.rope_scaling", "model.overrides.max_seq_len", "model.overrides.rope_scaling",
             "model.overrides.rope_theta")


def _flat(cfg: Config) -> dict[str, object]:
    flat = {f"{s}.{k}": v for s, values in cfg.to_dict().items() for k, v in values.items()}
    overrides = flat.pop("model.overrides", {}) or {}  # key by key: a position override alone may change
    return {**flat, **{f"model.overrides.{k}": v for k, v in overrides.items()}}


def config_differences(old: Config, new: Config) -> list[str]:
    """Keys whose change makes `new` another run than `old`, as 'key: old -> new'."""
    a, b = _flat(old), _flat(new)
    return [f"{k}: {a.get(k)!r} -> {b.get(k)!r}" for k in sorted(set(a) | set(b))
            if a.get(k) != b.get(k) and not k.startswith(RESUMABLE) and k not in RESUMABLE]


class RunDir:
    def __init__(self, cfg: Config, *, rank: int = 0):
        self.cfg = cfg
        self.rank = rank
        self.store: RunStore | None = None
        if storage.is_url(cfg.run.dir):
            self.store = RunStore(cfg.run.dir, mirror_of(cfg.run.dir), rank=rank)
            self.path = self.store.mirror  # where the run's files are written; the store gets them
        else:
            self.path = Path(cfg.run.dir).expanduser()

    @property
    def checkpoints(self) -> Path | str:
        """The checkpoint folder: a URL in the store for a store's run."""
        return self.store.url_of("checkpoints") if self.store else self.path / "checkpoints"

    def sync(self, *, every_s: float = 0.0) -> None:
        """Upload the run's changed files to its store (rank 0; nothing for a local run.dir)."""
        if self.store is not None:
            self.store.sync(every_s=every_s)

    def sync_often(self) -> None:
        """`sync`, at most every run_store.SYNC_S seconds (as metrics are logged)."""
        self.sync(every_s=SYNC_S)

    def final_sync(self) -> None:
        if self.store is not None:
            self.store.final_sync()

    def saved_config(self) -> tuple[str, str] | None:
        """(where, text) of the config.toml the run directory holds, if any."""
        if self.store is not None:
            text = self.store.read("config.toml")
            return (self.store.url_of("config.toml"), text) if text is not None else None
        saved = self.path / "config.toml"
        return (str(saved), saved.read_text()) if saved.is_file() else None

    def check(self, *, reach: bool = True) -> None:
        """The preflight's part (writes nothing): the directory can be made and written, and
        holds no other run (unless run.start_over). A store's run.dir must answer, with
        credentials allowed to write there (rank 0 writes and deletes one probe object);
        `reach=False` skips asking that again (`prepare`, after the preflight has)."""
        if self.store is not None and reach:
            storage.check_reachable(self.store.url, write=self.rank == 0, what="run.dir")
        existing = self.path
        while not existing.exists() and existing != existing.parent:
            existing = existing.parent
        if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
            if self.store is not None:
                raise ForjaError(f"the local copy {self.path} of run.dir {self.store.url} cannot be written "
                                 f"({existing} is not a writable directory); set FORJA_CACHE to a writable directory")
            raise ForjaError(f"run.dir {self.path} cannot be written ({existing} is not a writable directory); "
                             "choose a writable directory")
        saved = self.saved_config()
        if saved is not None and not self.cfg.run.start_over:
            old = config_from_dict(tomllib.loads(saved[1]), f"in {saved[0]}")
            changed = config_differences(old, self.cfg)
            if changed:
                more = f" (and {len(changed) - 1} more)" if len(changed) > 1 else ""
                raise ForjaError(f"run.dir {self.cfg.run.dir if self.store else self.path} holds another run: "
                                 f"{changed[0]}{more}. Choose another "
                                 "run.dir, or pass --start-over to delete that run and begin afresh")

    def prepare(self, *, group: int | None = None, launch: dict | None = None) -> Path:
        """Record this launch (rank 0), after the preflight's `check` passed; returns the
        directory. With run.start_over, what the directory held is deleted first.

        A replica group's worker (`group`, under [ft]) writes neither config.toml nor run.json:
        its launcher prepared the directory once for all groups, and the group records its own
        launches (torchrun's restarts of it) in ft/group<g>/run.json, a file it alone writes.
        `launch`: what the launcher adds to its launch's record (the groups it started)."""
        self.check(reach=False)
        check_writable(self.path, what="run.dir", fix="choose a writable directory", rank=self.rank)
        if group is not None:
            if self.rank == 0:
                own = self.path / "ft" / f"group{group}"
                own.mkdir(parents=True, exist_ok=True)
                _record_launch(own / "run.json")
            barrier()
            return self.path
        saved = self.path / "config.toml"
        if self.store is not None:
            if self.cfg.run.start_over and self.rank == 0 and self.store.has_run():
                self.store.wipe()
            if self.rank == 0:
                self.store.pull()  # the store is the truth: the mirror gets its files
        elif saved.is_file() and self.cfg.run.start_over:
            self._wipe()
        barrier()
        if self.rank == 0:
            self.path.mkdir(parents=True, exist_ok=True)
            # start_over and drills apply to this launch only: the next one must resume, not wipe
            # again or fail on purpose again.
            kept = dataclasses.replace(self.cfg, run=dataclasses.replace(self.cfg.run, start_over=False),
                                       debug=DebugConfig())
            write_atomic(saved, dump_toml(kept))
            _record_launch(self.path / "run.json", launch)
            self.sync()  # the launch is recorded in the store before any training
        barrier()
        return self.path

    def _wipe(self) -> None:
        barrier()
        if self.rank == 0:
            for child in self.path.iterdir():
                shutil.rmtree(child) if child.is_dir() else child.unlink()


def _record_launch(info_path: Path, extra: dict | None = None) -> None:
    """Append this launch's environment to `info_path` (a run.json; one writer per file)."""
    info = json.loads(info_path.read_text()) if info_path.is_file() else {"launches": []}
    info["launches"].append({**environment(), **(extra or {})})
    write_atomic(info_path, json.dumps(info, indent=2) + "\n")


def _git_revision() -> dict[str, object] | None:
    root = Path(forja.__file__).resolve().parent.parent
    try:
        rev = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=5)
        if rev.returncode != 0:
            return None
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, timeout=5).stdout.strip() != ""
        return {"commit": rev.stdout.strip(), "dirty": dirty}
    except (OSError, subprocess.SubprocessError):
        return None


def _versions() -> dict[str, str]:
    out = {"python": platform.python_version(), "torch": torch.__version__, "forja": forja.__version__}
    for name in ("numpy", "tokenizers", "safetensors", "transformers", "triton"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return out


def _hardware() -> dict[str, object]:
    hw: dict[str, object] = {"host": socket.gethostname(), "platform": platform.platform(),
                             "cpu": platform.processor() or platform.machine(), "cpu_count": os.cpu_count(),
                             "threads": torch.get_num_threads()}  # the training thread's intra-op threads
    if torch.cuda.is_available():
        hw["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        hw["cuda"] = torch.version.cuda
    return hw


def environment() -> dict[str, object]:
    """What it takes to reproduce a figure: code, libraries, hardware, command, world size."""
    return {"time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "command": sys.argv, "git": _git_revision(),
            "versions": _versions(), "hardware": _hardware(),
            "world_size": dist.get_world_size() if dist.is_initialized() else 1}


def report_fallbacks(run_dir: Path, *, rank: int, group: dist.ProcessGroup | None = None) -> list[fallbacks.Fallback]:
    """Every rank's recorded fallbacks (forja/fallbacks.py) brought to rank 0, which prints each
    one not printed yet as one line and keeps them all in this launch's entry of run.json
    ("fallbacks": a list of {key, asked, instead, why, fix}). A collective over `group` when
    several ranks run: every rank calls it at the same point. Returns rank 0's full list."""
    mine = [f.as_json() for f in fallbacks.recorded()]
    fallbacks.shared(f["key"] for f in mine)
    gathered = [mine]
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        # A pipeline's last stage or an expert-parallel rank may take decisions rank 0 never sees.
        gathered = [None] * dist.get_world_size(group)
        dist.all_gather_object(gathered, mine, group=group)
    if rank != 0:
        return []
    for entries in gathered:
        for entry in entries:
            fallbacks.record(**entry)  # another rank's entries join this record (first one kept)
    for fallback in fallbacks.unreported():
        print(fallback.line(), file=sys.stderr, flush=True)
    everything = fallbacks.recorded()
    info_path = run_dir / "run.json"
    info = json.loads(info_path.read_text()) if info_path.is_file() else {"launches": [environment()]}
    listed = [f.as_json() for f in everything]
    if info["launches"][-1].get("fallbacks") != listed:
        info["launches"][-1]["fallbacks"] = listed
        write_atomic(info_path, json.dumps(info, indent=2) + "\n")
    return everything
