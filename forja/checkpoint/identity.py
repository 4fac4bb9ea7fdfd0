"""Which model a checkpoint holds, and the weights a run starts from.

A checkpoint's forja.json records the model's family, flavor and exact arguments; a run
refuses to resume from (or start from) the weights of another model before reading any
tensor. Arguments that choose kernels rather than weights (IMPLEMENTATION_ARGS) never
count: a model trained with fused ops loads into one without.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

from forja.checkpoint import remote
from forja.checkpoint.manager import read_meta
from forja.checkpoint.states import ModelState, with_tied_copies
from forja.errors import ForjaError
from forja.models.common.transformer import TransformerArgs

# Args that choose kernels, not weights: a checkpoint loads whatever they are.
IMPLEMENTATION_ARGS = ("attention", "fused_ops")
# Args that place a rotary model's positions, not its weights: a resume may change them.
POSITION_ARGS = ("max_seq_len", "rope_scaling", "rope_theta")


def model_identity(family: str, flavor: str, args: TransformerArgs) -> dict:
    """What a checkpoint records about its model, to refuse loading it into another."""
    return {"model": {"family": family, "flavor": flavor, "args": plain_args(args)}}


def plain_args(args: TransformerArgs) -> dict:
    """The args as JSON values, kernel choices left out."""
    plain = _json_safe(dataclasses.asdict(args))
    if plain.get("mup_width_mult") == 1.0:  # muP off: the identity of checkpoints from before muP
        del plain["mup_width_mult"]
    # Multi-token prediction: its loss weight shapes no weight (DeepSeek-V3 lowers it mid-run), and
    # without modules the identity is that of checkpoints from before MTP.
    plain.pop("mtp_loss_weight", None)
    if plain.get("mtp_depth") == 0:
        del plain["mtp_depth"]
    return {k: v for k, v in plain.items() if k not in IMPLEMENTATION_ARGS}


def _json_safe(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


def position_args(family: str) -> tuple[str, ...]:
    """The args a run may change when it resumes or starts from these weights: how a rotary
    model places positions (context extension), which no weight's shape depends on. A family
    with a learned position table (GPT-2) has none: its max_seq_len is the table's rows."""
    from forja.models.registry import FAMILIES  # the registry imports every family: only when asked

    spec = FAMILIES.get(family)
    return () if spec is None or spec.args_cls.learned_positions else POSITION_ARGS


def check_model_identity(saved: dict, current: dict, *, loose: bool = False) -> None:
    """Refuse weights of another model. `loose` compares the arguments only (an HF model has
    no flavor). Kernel choices (IMPLEMENTATION_ARGS) never count, nor the positions of a
    rotary model (POSITION_ARGS: a run resumed at a longer context with new RoPE scaling)."""
    old, new = saved.get("model", {}), current["model"]
    free = IMPLEMENTATION_ARGS + position_args(new["family"])
    old_args = old.get("args", {})
    diffs = [f"{k}: {old_args.get(k)!r} vs {v!r}" for k, v in new["args"].items()
             if old_args.get(k) != v and k not in free]
    diffs += [f"{k}: {v!r} vs absent" for k, v in old_args.items() if k not in new["args"] and k not in free]
    same = loose or (old.get("family"), old.get("flavor")) == (new["family"], new["flavor"])
    if not diffs and same:
        return
    if "max_seq_len" in (d.split(":")[0] for d in diffs):
        raise ForjaError(f"the checkpoint's {new['family']} model has max_seq_len {old_args.get('max_seq_len')}, "
                         f"this run {new['args'].get('max_seq_len')}: its learned position table has one row per "
                         "position and cannot be extended; keep model max_seq_len, or use another run.dir")
    raise ForjaError(f"the checkpoint holds a {old.get('family')} {old.get('flavor')!r} model, this run builds a "
                     f"{new['family']} {new['flavor']!r} model ({'; '.join(diffs[:3]) or 'different'}); "
                     "use the same model.* settings, another run.dir, or --start-over")


def initial_weights(source: str | None, identity: dict) -> Callable[[nn.Module], None] | None:
    """A loader of `source` (model.init_from: a forja run or checkpoint, or a Hugging Face
    directory) into a model or pipeline stage, possibly sharded; None for random weights."""
    if source is None:
        return None
    from forja.checkpoint.export import is_forja_source, resolve_checkpoint
    from forja.models import load_hf_checkpoint

    if is_forja_source(source):
        _, ckpt = resolve_checkpoint(source)
        check_model_identity(read_meta(ckpt), identity)
        return lambda part: dcp.load({"model": ModelState(part)}, **remote.dcp_target(ckpt, write=False))
    hf_state: dict = {}  # read on first use, then shared by this rank's pipeline stages

    def load_hf(part: nn.Module) -> None:
        if not hf_state:
            hf = load_hf_checkpoint(source, dtype=torch.float32)
            family = identity["model"]["family"]
            check_model_identity({"model": {"family": family, "flavor": f"from {source}",
                                            "args": plain_args(hf.args)}}, identity, loose=True)
            hf_state.update(hf.state_dict())
        # A pipeline stage takes its own tensors out of the whole model's (strict=False).
        state = with_tied_copies(part, hf_state)
        set_model_state_dict(part, state, options=StateDictOptions(full_state_dict=True, strict=False))

    return load_hf
