"""The trainer's data: tokenizer and dataset from `[data]`, prepared once, then loaders.

`data.path` is either a directory written by `forja prepare` (or a mixture of them), or
a source string. A source string is prepared on first use and cached; without
`data.tokenizer`, a tokenizer is first trained on the source (also cached, keyed by the
source's files and the vocabulary size). Only rank 0 trains and prepares; the other
ranks wait at a barrier and then open what it wrote. The run directory keeps a copy of
the tokenizer, so export and generation need nothing else.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from forja import fallbacks
from forja.config import Config
from forja.data import load_tokenizer, open_dataset, train_tokenizer
from forja.data.corpus.mixture import is_mixture_dir
from forja.data.corpus.prepare import cache_root
from forja.data.corpus.shards import META
from forja.data.corpus.sources import parse_mixture, parse_source
from forja.data.corpus.tokenizer import Tokenizer
from forja.errors import ForjaError
from forja.parallel.process_group import barrier
from forja.storage import check_reachable, is_url


def _is_prepared(path: Path | str) -> bool:
    if is_url(path):  # prepared data on an object store (forja/data/corpus/store.py)
        from forja.data.corpus.store import is_prepared

        return is_prepared(path)
    return (path / META).is_file() or is_mixture_dir(path)


def _where(path: str) -> Path | str:
    """data.path as a local Path, or as the URL it is (Path would fold its "//")."""
    return path if is_url(path) else Path(path).expanduser()


def _cached_tokenizer(source: str, vocab_size: int) -> Path:
    """Where the tokenizer trained on `source` with `vocab_size` lives in the cache."""
    parts = [(spec, parse_source(spec).stat_fingerprint()) for spec, _ in parse_mixture(source)]
    key = hashlib.sha256(json.dumps([parts, vocab_size]).encode()).hexdigest()[:24]
    return cache_root() / "tokenizers" / key / "tokenizer.json"


def _tokenizer_path(cfg: Config, path: Path | str) -> Path:
    d = cfg.data
    if d.tokenizer is not None and is_url(d.tokenizer):
        return _fetched(d.tokenizer, "data.tokenizer")
    if d.tokenizer is not None:
        return Path(d.tokenizer).expanduser()
    if is_url(path):
        return _fetched(path, "data.path")
    if _is_prepared(path):
        if (path / "tokenizer.json").is_file():
            return path / "tokenizer.json"
        raise ForjaError(f"data.path {path} is prepared data without a tokenizer.json beside it; "
                         "set data.tokenizer to the tokenizer it was prepared with")
    return _cached_tokenizer(d.path, d.vocab_size)


def _fetched(url: str, key: str) -> Path:
    """A local copy (in the cache) of the tokenizer at `url`, for the tokenizers library."""
    from forja.data.corpus.remote import fetch_tokenizer

    try:
        return fetch_tokenizer(url)
    except FileNotFoundError:
        raise ForjaError(f"{key} {url} has no tokenizer.json; set data.tokenizer to the tokenizer the data "
                         "was prepared with") from None


def _train_and_prepare(cfg: Config, tok_path: Path) -> tuple[Tokenizer, Any]:
    """Rank 0's first-use work for a source string: the tokenizer (trained unless cached or
    given), then the prepared data (cached)."""
    d = cfg.data
    if d.tokenizer is None and not tok_path.is_file():
        print(f"forja: training a {d.vocab_size}-token tokenizer on {d.path} (cached in {tok_path.parent})",
              flush=True)
        tokenizer = train_tokenizer(d.path, vocab_size=d.vocab_size, out=tok_path)
    else:
        tokenizer = load_tokenizer(tok_path)
    return tokenizer, open_dataset(d.path, tokenizer, val_fraction=d.val_fraction, workers=d.workers or None,
                                   progress=True)


def _check_sources(spec: str, key: str = "data.path") -> None:
    """Every rank checks a source string (data.path's, or a stage's: `key` names it) before rank 0
    starts any work on it: its parts and weights, and that each part's source exists."""
    try:
        parts = parse_mixture(spec)
    except ForjaError as exc:
        raise ForjaError(f"{key}: {exc}") from None
    for part, _ in parts:
        try:
            parse_source(part)
        except ForjaError as exc:
            raise ForjaError(f"{key}: {exc}; or give a directory written by `forja prepare`") from None


def check_data(cfg: Config) -> Tokenizer | None:
    """The preflight's data checks, before any work on the data: the source exists, a given
    tokenizer exists. Returns the run's tokenizer when it exists already (None: it is trained
    on first use, to data.vocab_size tokens). A URL is checked to be reachable first, with
    credentials, and to hold prepared data (forja prepares sources only into a local cache)."""
    path = _where(cfg.data.path)
    for url in (cfg.data.path, cfg.data.tokenizer):
        if url is not None and is_url(url):
            check_reachable(url, write=False, what="data.path" if url == cfg.data.path else "data.tokenizer")
    prepared = _is_prepared(path)
    if is_url(path) and not prepared:
        raise ForjaError(f"data.path {path} holds no prepared data (no meta.json or mixture.json there); "
                         f"write it with `forja prepare --out {path}`, or give a local source")
    if not prepared:
        _check_sources(cfg.data.path)
    tok_path = _tokenizer_path(cfg, path)
    if cfg.data.tokenizer is not None and not tok_path.is_file():
        raise ForjaError(f"data.tokenizer {tok_path} does not exist; give the tokenizer.json the data was "
                         "prepared with, or leave data.tokenizer unset to train one")
    return load_tokenizer(tok_path) if tok_path.is_file() else None


def check_splits(cfg: Config, tokenizer: Tokenizer | None) -> None:
    """Prepared data opens with its tokenizer (the fingerprints agree), and each split the run
    reads holds at least one sample of train.seq_len + 1 tokens. (A source is checked as soon as
    it is prepared, by `data`, still before the run directory is written.)"""
    if tokenizer is None or not _is_prepared(_where(cfg.data.path)):
        return  # prepared data always has its tokenizer (check_data stops otherwise)
    _check_samples(cfg, open_dataset(cfg.data.path, tokenizer), f"data.path {cfg.data.path}: ")


def _check_samples(cfg: Config, dataset: Any, prefix: str = "") -> None:
    """Each split the run reads holds at least one sample of train.seq_len + 1 tokens."""
    from forja.data.load.batch import as_mixture
    from forja.data.load.windows import Samples

    t = cfg.train
    splits = ["train"] + (["val"] if t.val_interval > 0 and t.val_batches > 0 else [])
    for split in splits:
        try:
            Samples(as_mixture(dataset, None), split, t.seq_len)
        except ForjaError as exc:
            raise ForjaError(f"{prefix}{exc}") from None


def data(cfg: Config, *, rank: int) -> tuple[Tokenizer, Any]:
    """(tokenizer, dataset) of the run. Sources are prepared on first use by rank 0 (into the
    cache: the run directory is not written yet), and their splits checked as prepared data's
    are in the preflight, so that a corpus too small for the run stops before run.dir exists."""
    path = _where(cfg.data.path)
    prepared = _is_prepared(path)
    if not prepared:
        _check_sources(cfg.data.path)
    tok_path = _tokenizer_path(cfg, path)
    if rank == 0 and not prepared:
        tokenizer, dataset = _train_and_prepare(cfg, tok_path)
    barrier()
    if rank != 0 or prepared:  # open what rank 0 wrote (or what `forja prepare` did)
        tokenizer = load_tokenizer(tok_path)
        dataset = open_dataset(cfg.data.path, tokenizer, val_fraction=cfg.data.val_fraction,
                               workers=cfg.data.workers or None)
    if not prepared:
        _check_samples(cfg, dataset)
    return tokenizer, dataset


def keep_tokenizer(tokenizer: Tokenizer, run_dir: Path, rank: int) -> None:
    """The run's tokenizer, saved into its directory (a resumed run's must be the same one)."""
    saved = run_dir / "tokenizer.json"
    if saved.is_file() and load_tokenizer(saved).fingerprint != tokenizer.fingerprint:
        raise ForjaError(f"{saved} differs from the tokenizer of data.path; this run.dir was trained with "
                         "another tokenizer: use another run.dir or --start-over")
    if rank == 0 and not saved.is_file():
        tokenizer.save(saved)


def stages(cfg: Config, tokenizer: Tokenizer, *, rank: int) -> list[Any]:
    """The later data stages (`[[data.stages]]`), opened with the run's one tokenizer; a source
    spec is prepared on first use by rank 0 (cached), the other ranks wait and open it."""
    from forja.data.load.stages import Stage

    d = cfg.data
    options = dict(val_fraction=d.val_fraction, workers=d.workers or None)
    opened = [open_dataset(s.path, tokenizer, progress=True, **options) for s in d.stages] if rank == 0 else []
    barrier()
    if rank != 0:  # open what rank 0 prepared
        opened = [open_dataset(s.path, tokenizer, **options) for s in d.stages]
    return [Stage(s.start_step, data, s.seq_len, s.path) for s, data in zip(d.stages, opened, strict=True)]


def check_stages(cfg: Config) -> None:
    """The preflight's checks of `[[data.stages]]`: each names data that exists (a prepared
    directory, or sources that parse, weights positive), a length the model is built for, and
    an lr phase its schedule has."""
    t = cfg.train
    for i, stage in enumerate(cfg.data.stages):
        name = f"data.stages[{i}] (from step {stage.start_step})"
        if not _is_prepared(_where(stage.path)):
            _check_sources(stage.path, name)
        if stage.seq_len is not None and stage.seq_len > t.seq_len:
            raise ForjaError(f"{name} has seq_len = {stage.seq_len}, longer than train.seq_len = {t.seq_len} (the "
                             f"length the model is built for); raise train.seq_len to {stage.seq_len}")
        if stage.lr_phase == "decay" and cfg.schedule.name != "wsd":
            raise ForjaError(f"{name} has lr_phase = \"decay\", which needs schedule.name = \"wsd\" (a stable "
                             f"phase to decay from) but it is {cfg.schedule.name!r}; set schedule.name = \"wsd\"")
    if sum(s.lr_phase == "decay" for s in cfg.data.stages) > 1:
        raise ForjaError("more than one data stage has lr_phase = \"decay\"; the learning rate decays once: "
                         "keep it on the stage whose steps should anneal")


def decay_window(cfg: Config) -> tuple[int, int] | None:
    """(first, last) completed-step counts of a stage's lr_phase = "decay": from the stage's
    first step to the next stage's start or train.steps; None without one."""
    stages = cfg.data.stages
    for i, stage in enumerate(stages):
        if stage.lr_phase == "decay":
            end = stages[i + 1].start_step - 1 if i + 1 < len(stages) else cfg.train.steps
            return stage.start_step - 1, min(end, cfg.train.steps) - 1
    return None


def loaders(cfg: Config, dataset: Any, *, dp_rank: int, dp_size: int, later: Any = ()) -> tuple[Any, Any]:
    """The training loader (resumable, rank-sharded; stage 0 is `dataset`, `later` the rest) and
    the validation loader (or None), which reads stage 0's validation split."""
    from forja.data import DataLoader, ValidationLoader

    t, d = cfg.train, cfg.data
    if cfg.ft.enabled and d.prefetch > 0:  # a fast path not taken: said at start and in run.json
        fallbacks.record("data.prefetch", asked=f"data.prefetch = {d.prefetch}", instead="no prefetch",
                         why="a replica group ([ft]) learns its share of a step only from that step's quorum")
    # Under [ft] each replica group is a run of its own share of the global batch.
    train = DataLoader(dataset, seq_len=t.seq_len, global_batch_size=cfg.ft.group_batch(t.global_batch_size),
                       micro_batch_size=t.micro_batch_size, dp_rank=dp_rank, dp_world_size=dp_size,
                       seed=t.seed, prefetch=0 if cfg.ft.enabled else d.prefetch,
                       seq_len_at=t.seq_len_at if t.seq_len_schedule else None,
                       stages=later, packing=d.packing, max_doc_tokens=d.max_doc_tokens, pack_buffer=d.pack_buffer)
    val = None
    if t.val_interval > 0 and t.val_batches > 0:
        val = ValidationLoader(dataset, seq_len=t.seq_len, micro_batch_size=t.micro_batch_size,
                               num_batches=t.val_batches, dp_rank=dp_rank, dp_world_size=dp_size)
    return train, val
