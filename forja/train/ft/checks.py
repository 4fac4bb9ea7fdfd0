"""What a fault-tolerant run refuses before any step (the preflight calls `check_ft`)."""

from __future__ import annotations

from datetime import timedelta

from forja import storage
from forja.errors import ForjaError
from forja.train.ft.config import checkpoint_due


def check_ft(cfg) -> None:
    """One sentence for each setting torchft's replica groups cannot serve (a layout they cannot:
    the layout validator, forja/parallel/checks.py)."""
    ft, t = cfg.ft, cfg.train
    if not ft.enabled:
        return
    try:
        import torchft  # noqa: F401
    except ImportError as exc:
        raise ForjaError("ft.enabled needs torchft: pip install -e '.[ft]'") from exc
    if storage.is_url(cfg.run.dir):
        raise ForjaError(f"ft.enabled with run.dir = {cfg.run.dir} in an object store: the replica groups share one "
                         "run directory, and a group restarted alone would pull the store's copy over the files the "
                         "others are writing; give run.dir a local or shared-filesystem path (copy the checkpoints "
                         "to the store when the run is done)")
    if t.global_batch_size % ft.groups:
        raise ForjaError(f"train.global_batch_size = {t.global_batch_size} does not divide into ft.groups = "
                         f"{ft.groups} equal shares: each group trains global_batch_size / groups samples per step")
    if cfg.data.stages or t.seq_len_schedule:
        key = "data.stages" if cfg.data.stages else "train.seq_len_schedule"
        raise ForjaError(f"{key} with ft.enabled: replica groups count the data in shares of one length and "
                         f"stage; train the stages one after another without [ft], or drop {key}")
    if ft.mode != "hsdp":
        _check_diloco(cfg)
    if "rollback" in (t.on_nonfinite, t.spike.action):
        raise ForjaError("train.on_nonfinite / train.spike.action = 'rollback' with ft.enabled: a live group "
                         "heals a restarted one instead of going back; use 'skip' or 'stop'")


def check_lighthouse(address: str, timeout_s: float) -> None:
    """Stop with one sentence when the lighthouse at `address` does not answer."""
    from torchft.coordination import LighthouseClient

    try:
        LighthouseClient(address, connect_timeout=timedelta(seconds=timeout_s))  # connects, or raises
    except Exception as exc:  # torchft raises RuntimeError (or a connection error) from its Rust client
        raise ForjaError(f"the torchft lighthouse at {address} cannot be reached ({str(exc).split(';')[0]}); "
                         "start one (`forja train --ft-groups G` does, or `python -m forja.train.ft.lighthouse`) "
                         "or fix ft.lighthouse / --ft-lighthouse") from exc


def _check_diloco(cfg) -> None:
    """A fragment's sync must have landed wherever the run saves or ends: nothing in flight is
    checkpointed (forja/train/ft/diloco.py)."""
    ft, t = cfg.ft, cfg.train
    period = ft.sync_period
    every = f"every ft.inner_steps / ft.fragments = {period} steps" if ft.fragments > 1 else \
        f"every ft.inner_steps = {period} steps"
    if t.steps % period:
        raise ForjaError(f"train.steps = {t.steps} with ft.mode = {ft.mode!r}: a sync lands {every}; make "
                         f"train.steps a multiple of {period} so the run ends on one")


def checkpoint_rounding(cfg) -> str | None:
    """The one line saying that DiLoCo takes the checkpoints at sync boundaries, when
    checkpoint.interval is not a whole number of sync periods (None otherwise)."""
    ck, period = cfg.checkpoint, cfg.ft.sync_period
    if not (ck.enabled and ck.interval) or ck.interval % period == 0:
        return None
    steps = [s for s in range(period, min(cfg.train.steps, 4 * ck.interval) + 1, period)
             if checkpoint_due(s, ck.interval, period)][:3]
    at = ", ".join(map(str, steps)) + (", ..." if steps else "")
    return (f"checkpoint.interval = {ck.interval} with ft.mode = {cfg.ft.mode!r}: a sync lands every {period} "
            f"steps, so each checkpoint is taken at the first sync at or after its interval (steps {at})")
