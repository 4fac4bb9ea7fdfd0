"""The pieces the trainer is built from, one function each, so trainer.py stays the loop."""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from forja.checkpoint.manager import checkpoint_keys
from forja.config import Config
from forja.errors import ForjaError
from forja.metrics.sinks import build_sinks
from forja.models.common.transformer import TransformerArgs
from forja.train.callbacks import Callback, GCCallback, MetricsCallback, PreemptionCallback, ProfilerCallback, \
    SampleCallback
from forja.train.data import data, loaders  # noqa: F401  (re-exported: the trainer's data steps)

if TYPE_CHECKING:
    from forja.train.trainer import Trainer


def compute_dtype(precision: str, device: torch.device) -> torch.dtype | None:
    """The autocast dtype, or None for full fp32."""
    if precision == "bf16" or (precision == "auto" and device.type == "cuda"):
        return torch.bfloat16
    return None


def check_vocab(model_vocab: int, tokenizer: Any) -> None:
    if model_vocab < tokenizer.vocab_size:
        raise ForjaError(f"model.overrides.vocab_size = {model_vocab} is smaller than the tokenizer's "
                         f"{tokenizer.vocab_size} tokens; remove the override or make it larger")


def model_identity(cfg: Config, args: TransformerArgs) -> dict:
    """What a checkpoint records about its model, to refuse loading it into another."""
    return {"model": {"family": cfg.model.family, "flavor": cfg.model.flavor, "args": _plain(args)}}


def _plain(args: TransformerArgs) -> dict:
    return json_safe(dataclasses.asdict(args))


def json_safe(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


def check_model_identity(saved: dict, current: dict) -> None:
    old, new = saved.get("model", {}), current["model"]
    if old == new:
        return
    diffs = [f"{k}: {old.get('args', {}).get(k)!r} vs {v!r}" for k, v in new["args"].items()
             if old.get("args", {}).get(k) != v]
    raise ForjaError(f"the checkpoint holds a {old.get('family')} {old.get('flavor')!r} model, this run builds a "
                     f"{new['family']} {new['flavor']!r} model ({'; '.join(diffs[:3]) or 'different'}); "
                     "use the same model.* settings, another run.dir, or --start-over")


def loadable_state(state: dict[str, Any], path: Path) -> dict[str, Any]:
    """`state` without the RNG entries the checkpoint lacks (it was saved by fewer ranks)."""
    stored = checkpoint_keys(path)
    return {k: v for k, v in state.items() if not k.startswith("rng.") or k in stored}


def dp_group(mesh: DeviceMesh) -> dist.ProcessGroup:
    if mesh["dp_replicate"].size() == 1:
        return mesh["dp_shard"].get_group()
    return mesh["dp_replicate", "dp_shard"]._flatten("dp").get_group()


@functools.cache
def cpu_group() -> dist.ProcessGroup:
    """A Gloo group over all ranks, for small CPU-side agreements (stop flags)."""
    return dist.new_group(backend="gloo")


def default_callbacks(trainer: Trainer) -> list[Callback]:
    c = trainer.cfg
    sinks = build_sinks(c.metrics, run_dir=trainer.run_dir, run_name=c.run.name or trainer.run_dir.name,
                        config=c.to_dict(), rank=trainer.rank)
    metrics = MetricsCallback(sinks, flops_per_token=trainer.model.flops_per_token(c.train.seq_len),
                              num_devices=trainer.dims.world_size, device=trainer.device,
                              compute_dtype=trainer.compute_dtype or torch.float32, interval=c.metrics.interval,
                              peak_tflops=c.metrics.peak_tflops)
    callbacks: list[Callback] = [metrics, SampleCallback(), GCCallback(c.train.gc_interval), PreemptionCallback()]
    if c.train.profile_at > 0:
        callbacks.append(ProfilerCallback(c.train.profile_at))
    return callbacks
