"""The pieces the trainer is built from, one function each, so trainer.py stays the loop."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.device_mesh import DeviceMesh

from forja.checkpoint.manager import checkpoint_keys, read_meta
from forja.checkpoint.states import ModelState
from forja.config import Config
from forja.errors import ForjaError
from forja.metrics.sinks import build_sinks
from forja.models.common.transformer import TransformerArgs
from forja.parallel.process_group import new_group, set_group_timeout
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


# Args that choose kernels, not weights: a checkpoint loads whatever they are.
IMPLEMENTATION_ARGS = ("attention", "fused_ops")


def model_identity(cfg: Config, args: TransformerArgs) -> dict:
    """What a checkpoint records about its model, to refuse loading it into another."""
    return {"model": {"family": cfg.model.family, "flavor": cfg.model.flavor, "args": _plain(args)}}


def _plain(args: TransformerArgs) -> dict:
    plain = json_safe(dataclasses.asdict(args))
    return {k: v for k, v in plain.items() if k not in IMPLEMENTATION_ARGS}


def json_safe(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


def check_model_identity(saved: dict, current: dict, *, loose: bool = False) -> None:
    """Refuse weights of another model. `loose` compares the arguments only (an HF model has
    no flavor). Kernel choices (IMPLEMENTATION_ARGS) never count."""
    old, new = saved.get("model", {}), current["model"]
    ignore = set(IMPLEMENTATION_ARGS)
    diffs = [f"{k}: {old.get('args', {}).get(k)!r} vs {v!r}" for k, v in new["args"].items()
             if old.get("args", {}).get(k) != v and k not in ignore]
    if not diffs and (loose or old == new):
        return
    raise ForjaError(f"the checkpoint holds a {old.get('family')} {old.get('flavor')!r} model, this run builds a "
                     f"{new['family']} {new['flavor']!r} model ({'; '.join(diffs[:3]) or 'different'}); "
                     "use the same model.* settings, another run.dir, or --start-over")


def initial_weights(cfg: Config, identity: dict) -> Callable[[nn.Module], None] | None:
    """A loader of `model.init_from` into a (possibly sharded) model, or None for random weights."""
    source = cfg.model.init_from
    if source is None:
        return None
    from forja.checkpoint.export import is_forja_source, resolve_checkpoint
    from forja.models import load_hf_checkpoint

    def load(model: nn.Module) -> None:
        if is_forja_source(source):
            _, ckpt = resolve_checkpoint(source)
            check_model_identity(read_meta(ckpt), identity)
            dcp.load({"model": ModelState(model)}, checkpoint_id=str(ckpt))
            return
        hf = load_hf_checkpoint(source, dtype=torch.float32)
        check_model_identity({"model": {"family": cfg.model.family, "flavor": f"from {source}",
                                        "args": _plain(hf.args)}}, identity, loose=True)
        set_model_state_dict(model, hf.state_dict(), options=StateDictOptions(full_state_dict=True))

    return load


def loadable_state(state: dict[str, Any], path: Path) -> dict[str, Any]:
    """`state` without the RNG entries the checkpoint lacks (it was saved by fewer ranks)."""
    stored = checkpoint_keys(path)
    return {k: v for k, v in state.items() if not k.startswith("rng.") or k in stored}


def dp_group(mesh: DeviceMesh) -> dist.ProcessGroup:
    """The ranks that see different data (or, with cp, different parts of it)."""
    names = [n for n in ("dp_replicate", "dp_shard", "cp") if mesh[n].size() > 1]
    if len(names) <= 1:
        return mesh[names[0] if names else "dp_shard"].get_group()
    group = mesh[tuple(names)]._flatten("dp_cp").get_group()
    set_group_timeout(group)  # a new group: torch's default timeout, not parallel.timeout_s
    return group


@functools.cache
def cpu_group() -> dist.ProcessGroup:
    """A Gloo group over all ranks, for small CPU-side agreements (stop flags)."""
    return new_group(backend="gloo")


def default_callbacks(trainer: Trainer) -> list[Callback]:
    c = trainer.cfg
    sinks = build_sinks(c.metrics, run_dir=trainer.run_dir, run_name=c.run.name or trainer.run_dir.name,
                        config=c.to_dict(), rank=trainer.rank)
    metrics = MetricsCallback(sinks, flops_per_token=trainer.flops_per_token,
                              num_devices=trainer.dims.world_size, device=trainer.device,
                              compute_dtype=trainer.compute_dtype or torch.float32, interval=c.metrics.interval,
                              peak_tflops=c.metrics.peak_tflops)
    callbacks: list[Callback] = [metrics, SampleCallback(), GCCallback(c.train.gc_interval), PreemptionCallback()]
    if c.train.profile_at > 0:
        callbacks.append(ProfilerCallback(c.train.profile_at))
    return callbacks
