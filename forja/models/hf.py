"""Load and save Hugging Face checkpoints (config.json + safetensors, sharded or not).

Loading streams one tensor at a time from the safetensors files into a model built
on the meta device and materialized in the target dtype, so a checkpoint needs about
its own size in memory, not twice that (a mixture of experts' per-expert tensors go one
by one into the slices of forja's stacked tensor). When a family's checkpoints come in
several layouts (transformers 5 may save experts fused), the loader follows the one whose
names the checkpoint holds. Every problem is reported before any weight is read: an
unknown architecture, a missing, extra or misshapen tensor, each named.
Saving writes to a temporary directory renamed when complete.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from forja.errors import ForjaError
from forja.files import DiskFull, no_room, replace_dir
from forja.models.common.hf_rules import HFAdapter, TensorRule
from forja.models.common.transformer import Transformer
from forja.models.registry import FAMILIES, build_from_args, family_of

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
_STORED_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}  # safetensors' names
_INDEX = "model.safetensors.index.json"


def _adapter_for_architecture(cfg: dict, where: Path) -> HFAdapter:
    archs = cfg.get("architectures") or []
    for spec in FAMILIES.values():
        if any(a in spec.hf.architectures for a in archs):
            return spec.hf
    known = [a for s in FAMILIES.values() for a in s.hf.architectures]
    found = ", ".join(archs) or f"none (model_type={cfg.get('model_type')!r})"
    raise ForjaError(f"{where}: architecture {found} is not supported; forja loads {', '.join(known)}")


def read_config(path: Path) -> dict:
    if not path.is_dir():
        raise ForjaError(f"{path} is not a directory; give the Hugging Face model directory holding config.json")
    cfg_path = path / "config.json"
    if not cfg_path.is_file():
        raise ForjaError(f"{path} has no config.json; is it a Hugging Face model directory?")
    try:
        return json.loads(cfg_path.read_text())
    except json.JSONDecodeError as exc:
        raise ForjaError(f"{cfg_path} is not valid JSON ({exc})") from None


# A stored tensor: the open safetensors file holding it, and its name there.
Stored = tuple[Any, str]


def _open_tensors(path: Path, normalize, stack: contextlib.ExitStack) -> dict[str, Stored]:
    """Every stored tensor by (normalized) name; each safetensors file is opened once,
    memory-mapped, for the whole load."""
    index = path / _INDEX
    if index.is_file():
        files = sorted({path / file for file in json.loads(index.read_text())["weight_map"].values()})
    else:
        files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ForjaError(f"{path} holds no .safetensors files; forja reads safetensors only "
                         "(re-save the model with transformers' save_pretrained)")
    stored: dict[str, Stored] = {}
    for file in files:
        handle = stack.enter_context(safe_open(file, framework="pt"))
        stored.update({normalize(name): (handle, name) for name in handle.keys()})
    return stored


def _check_names_and_shapes(rules: list[TensorRule], stored: dict[str, Stored], adapter: HFAdapter,
                            expected: dict[str, torch.Tensor], arch: str, where: Path) -> None:
    ignored = [re.compile(p) for p in adapter.ignored] + [re.compile(r"lm_head\.weight")]
    wanted = {r.hf for r in rules}
    for rule in rules:
        if rule.hf not in stored:
            raise ForjaError(f"{where}: tensor {rule.hf} is missing; a {arch} with this config.json needs it")
        want = tuple(rule.to_hf(rule.forja_views(expected)).shape)
        have = _stored_shape(stored[rule.hf])
        if have != want:
            raise ForjaError(f"{where}: tensor {rule.hf} has shape {list(have)}; a {arch} with this "
                             f"config.json expects {list(want)}")
    extra = sorted(n for n in stored if n not in wanted and not any(p.fullmatch(n) for p in ignored))
    if extra:
        more = f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""
        raise ForjaError(f"{where}: unexpected tensor {extra[0]}{more}; it has no place in a {arch} "
                         "with this config.json (does config.json match the weights?)")


def _layout_of(stored: dict[str, Stored], adapter: HFAdapter, args: Any,
               expected: dict[str, torch.Tensor]) -> list[TensorRule]:
    """The rules, expanded per layer and slice, of the layout the checkpoint is in: of the
    adapter's layouts, the one naming the most stored tensors, then (layouts with the same
    names but cut elsewhere: OLMo-Hybrid's convolutions) the one whose shapes match the
    most, the saved one on a tie; so a damaged checkpoint is reported against the layout it
    was written in."""
    layouts = [adapter.rules(args), *adapter.other_layouts(args)]
    expanded = [[x for r in rules for x in r.expand(args.n_layers)] for rules in layouts]

    def fit(rules: list[TensorRule]) -> tuple[int, int]:
        held = [r for r in rules if r.hf in stored]
        return len(held), sum(_stored_shape(stored[r.hf]) == tuple(r.to_hf(r.forja_views(expected)).shape)
                              for r in held)

    return max(expanded, key=fit)


def _stored_shape(tensor: Stored) -> tuple[int, ...]:
    handle, name = tensor
    return tuple(handle.get_slice(name).get_shape())  # from the header: no data read


def _checkpoint_dtype(cfg: dict, stored: dict[str, Stored]) -> torch.dtype:
    name = cfg.get("dtype") or cfg.get("torch_dtype")
    if name in _DTYPES:
        return _DTYPES[name]
    handle, first = next(iter(stored.values()))
    return _STORED_DTYPES.get(handle.get_slice(first).get_dtype(), torch.float32)


def load_hf_checkpoint(path: str | os.PathLike, *, dtype: torch.dtype | None = None,
                       device: str | torch.device = "cpu") -> Transformer:
    """A forja model with the weights of a Hugging Face checkpoint directory.

    `dtype` defaults to the checkpoint's own (config.json's `torch_dtype`/`dtype`).
    """
    path = Path(path)
    cfg = read_config(path)
    adapter = _adapter_for_architecture(cfg, path)
    args = adapter.args_from_config(cfg)
    with contextlib.ExitStack() as stack:
        stored = _open_tensors(path, adapter.normalize_name, stack)
        args = adapter.held_args(args, set(stored))
        expected = build_from_args(args, device="meta").state_dict()
        rules = _layout_of(stored, adapter, args, expected)
        _check_names_and_shapes(rules, stored, adapter, expected, cfg["architectures"][0], path)
        model = build_from_args(args, device=device, dtype=dtype or _checkpoint_dtype(cfg, stored), init=False)
        params = model.state_dict()
        with torch.no_grad():
            for rule in rules:  # one stored tensor at a time, into its tensor or slice
                handle, name = stored[rule.hf]
                for target, value in zip(rule.forja_views(params), rule.to_forja(handle.get_tensor(name))):
                    target.copy_(value)
    return model


def _to_hf_tensors(model: Transformer, adapter: HFAdapter, dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    state = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v) for k, v in model.state_dict().items()}
    out = {}
    for rule in (x for r in adapter.rules(model.args) for x in r.expand(model.args.n_layers)):
        t = rule.to_hf(tuple(v.detach() for v in rule.forja_views(state)))
        out[rule.hf] = t.to(device="cpu", dtype=dtype or t.dtype).contiguous().clone()
    return out


def _write_shards(tensors: dict[str, torch.Tensor], out: Path, max_shard_bytes: int) -> None:
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    if len(shards) == 1:
        save_file(shards[0], out / "model.safetensors", metadata={"format": "pt"})
        return
    weight_map = {}
    for k, shard in enumerate(shards, 1):
        file = f"model-{k:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, out / file, metadata={"format": "pt"})
        weight_map.update({name: file for name in shard})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / _INDEX).write_text(json.dumps(index, indent=2))


def save_hf_checkpoint(model: Transformer, out: str | os.PathLike, *, overwrite: bool = False,
                       dtype: torch.dtype | None = None, max_shard_bytes: int = 5 * 2**30,
                       extra_files: dict[str, str] | None = None, config_updates: dict | None = None) -> Path:
    """Write `model` as a Hugging Face checkpoint that `AutoModelForCausalLM` loads.

    Refuses an existing non-empty `out` unless `overwrite`. `extra_files` maps file
    names to text written beside the weights (a tokenizer, for instance);
    `config_updates` adds entries to config.json (special-token ids, for instance).
    """
    adapter = family_of(model).hf
    if getattr(model.args, "mup_width_mult", 1.0) != 1.0:
        raise ForjaError(f"this model was trained with muP (width multiplier {model.args.mup_width_mult:g}): its "
                         "logits are scaled by 1/multiplier, which no transformers architecture does; "
                         "export is refused rather than written wrong")
    cfg = {**adapter.config_from_args(model.args), **(config_updates or {})}  # refuses unexportable models
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not overwrite:
        raise ForjaError(f"{out} already exists and is not empty; choose another directory, or pass --overwrite "
                         "(overwrite=True from Python)")
    tensors = _to_hf_tensors(model, adapter, dtype)
    cfg["torch_dtype"] = str(next(iter(tensors.values())).dtype).removeprefix("torch.")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
        _write_shards(tensors, tmp, max_shard_bytes)
        for name, text in (extra_files or {}).items():
            (tmp / name).write_text(text)
        replace_dir(tmp, out)
    except BaseException as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        full = _out_of_room(exc)
        if full is not None:
            kept = "the existing export is kept whole" if out.exists() else "nothing was left behind"
            raise DiskFull(out, full, kept=kept, fix="free some space, or export to another disk") from None
        raise
    return out


def _out_of_room(exc: BaseException) -> OSError | None:
    """The refused write behind `exc`: an OSError, or safetensors' own error, which carries the
    OS error only in its text ("No space left on device (os error 28)")."""
    found = no_room(exc)
    code = re.search(r"\(os error (\d+)\)", str(exc))
    if found is None and code is not None:
        found = no_room(OSError(int(code.group(1)), os.strerror(int(code.group(1)))))
    return found
