"""What a fault-tolerant run refuses before any step (the preflight calls `check_ft`)."""

from __future__ import annotations

from datetime import timedelta

from forja.errors import ForjaError


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
    ft, t, ck = cfg.ft, cfg.train, cfg.checkpoint
    period = ft.inner_steps // ft.fragments
    every = f"every ft.inner_steps / ft.fragments = {period} steps" if ft.fragments > 1 else \
        f"every ft.inner_steps = {period} steps"
    if t.steps % period:
        raise ForjaError(f"train.steps = {t.steps} with ft.mode = {ft.mode!r}: a sync lands {every}; make "
                         f"train.steps a multiple of {period} so the run ends on one")
    if ck.enabled and ck.interval and ck.interval % period:
        raise ForjaError(f"checkpoint.interval = {ck.interval} with ft.mode = {ft.mode!r}: a sync lands {every}; "
                         f"make checkpoint.interval a multiple of {period} so no checkpoint holds a sync in flight")
