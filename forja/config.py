"""Typed configuration: dataclass sections, TOML recipes, `--set` overrides.

A config is one `Config` whose fields are sections (`run`, `model`, `data`, ...); each
section is a `@dataclass(kw_only=True)` that lives next to the code it configures.
Values are checked against the field annotations when loaded: an unknown section or
key, or a value of the wrong type or outside a `Literal`'s choices, stops at once with
the key's name and what would be valid, before any work is done.

    cfg = load_config("debug", ["train.steps=20", "model.flavor=tiny"])
    text = dump_toml(cfg)   # the resolved config, as saved in the run directory
"""

from __future__ import annotations

import dataclasses
import sys
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Union

from forja.checkpoint.config import CheckpointConfig
from forja.data.config import DataConfig
from forja.errors import ForjaError, unknown_key
from forja.eval.config import EvalConfig
from forja.metrics.config import MetricsConfig
from forja.models.config import ModelConfig
from forja.optim.config import DEFAULT_LR, OptimConfig, ScheduleConfig
from forja.parallel.config import ParallelConfig
from forja.train.config import DebugConfig, RunConfig, TrainConfig
from forja.train.ft.config import FTConfig

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"


@dataclass(kw_only=True)
class Config:
    """A whole training run."""

    run: RunConfig = field(default_factory=RunConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    ft: FTConfig = field(default_factory=FTConfig)
    debug: DebugConfig = field(default_factory=DebugConfig)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return dataclasses.asdict(self)

    def run_seq_lens(self) -> tuple[int, ...]:
        """Every sequence length the run trains at, ascending: train.seq_len_schedule's and the
        data stages' (each must pass the layout's checks, not train.seq_len alone)."""
        lengths = set(self.train.seq_lens())
        lengths |= {s.seq_len for s in self.data.stages if s.seq_len is not None and s.start_step <= self.train.steps}
        return tuple(sorted(lengths))


# -- checking values against annotations ----------------------------------------------------

def _describe(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin in (Union, types.UnionType):
        return " or ".join(_describe(a) for a in typing.get_args(tp))
    if tp is type(None):
        return "none"
    if origin in (list, tuple):
        inner = typing.get_args(tp)[0]
        plural = {int: "integers", float: "numbers", bool: "true/false values", str: "strings"}.get(inner)
        return f"a list of {plural or _describe(inner)}"
    if dataclasses.is_dataclass(tp):
        return f"a table of {', '.join(f.name for f in dataclasses.fields(tp))}"
    return {int: "an integer", float: "a number", bool: "true or false", str: "a string",
            dict: "a table"}.get(origin or tp, str(tp))


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """`value` as type `tp`, or a ForjaError naming `key` and what it accepts."""
    origin = typing.get_origin(tp)
    if origin is Literal:
        if value in typing.get_args(tp):
            return value
    elif origin in (Union, types.UnionType):
        options = typing.get_args(tp)
        if value is None and type(None) in options:
            return None
        for option in (o for o in options if o is not type(None)):
            try:
                return _coerce(value, option, key)
            except ForjaError:
                continue
    elif origin in (list, tuple):
        inner = typing.get_args(tp)[0]
        if isinstance(value, str) and inner is str:
            # `--set 'debug.inject="nan@15"'` means a list of one; any other single value (a
            # number for a list of numbers) falls through to the error below.
            value = [value]
        if isinstance(value, (list, tuple)):
            items = [_coerce(v, inner, key) for v in value]
            return tuple(items) if origin is tuple else items
    elif origin is dict or tp is dict:
        if isinstance(value, dict):
            return dict(value)
    elif tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    elif tp is str:
        if isinstance(value, str):
            return value
    elif dataclasses.is_dataclass(tp):  # a sub-section, e.g. [optim.muon]
        if isinstance(value, dict):
            return _build_section(tp, value, key, f"in [{key}]")
    else:
        raise TypeError(f"config field {key} has an unsupported annotation {tp!r}")
    raise ForjaError(f"{key} = {value!r} is not valid: it must be {_describe(tp)}")


def _build_section(cls: type, values: dict[str, Any], section: str, where: str) -> Any:
    hints = typing.get_type_hints(cls)
    valid = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in values.items():
        if key not in hints:
            raise unknown_key(f"{section}.{key}", valid, where)
        kwargs[key] = _coerce(value, hints[key], f"{section}.{key}")
    try:
        return cls(**kwargs)
    except TypeError as exc:
        raise ForjaError(f"[{section}] {where}: {exc}") from None


def config_from_dict(raw: dict[str, Any], where: str = "") -> Config:
    sections = {f.name: f.type for f in dataclasses.fields(Config)}
    hints = typing.get_type_hints(Config)
    built = {}
    for name, values in raw.items():
        if name not in sections:
            raise unknown_key(name, list(sections), where)
        if not isinstance(values, dict):
            raise ForjaError(f"{name} {where} must be a [{name}] table of keys, not {values!r}")
        built[name] = _build_section(hints[name], values, name, where)
    return Config(**built)


# -- loading --------------------------------------------------------------------------------

def resolve_config_path(name_or_path: str) -> Path:
    """A recipe by path, or by name from ./configs or forja's own configs/."""
    candidates = [Path(name_or_path).expanduser()]
    if not name_or_path.endswith(".toml"):
        candidates += [Path("configs") / f"{name_or_path}.toml", CONFIG_DIR / f"{name_or_path}.toml"]
    for path in candidates:
        if path.is_file():
            return path
    known = sorted(p.stem for p in CONFIG_DIR.glob("*.toml"))
    raise ForjaError(f"config {name_or_path!r} not found: give a .toml path or one of: {', '.join(known)}")


def parse_value(raw: str) -> Any:
    """A value given on the command line (`--set`, `forja plan --layout`), read as TOML
    (numbers, true/false, "strings", [lists]); anything else is taken as a bare string."""
    raw = raw.strip()
    try:
        return tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        return raw


def coerce_key(key: str, value: Any) -> Any:
    """`value` as the config key `key` ('section.name') takes it, by its field's annotation (a
    Literal's choices, int, bool, ...); otherwise a ForjaError naming the key and what it accepts."""
    section, _, name = key.partition(".")
    sections = typing.get_type_hints(Config)
    if section not in sections:
        raise unknown_key(section, list(sections))
    hints = typing.get_type_hints(sections[section])
    if name not in hints:
        raise unknown_key(key, [f.name for f in dataclasses.fields(sections[section])])
    return _coerce(value, hints[name], key)


def parse_override(text: str) -> tuple[list[str], Any]:
    """'section.key=value' -> (['section', 'key'], value), the value read by `parse_value`."""
    if "=" not in text:
        raise ForjaError(f"--set {text!r} must look like section.key=value, e.g. train.steps=100")
    key, raw = text.split("=", 1)
    return key.strip().split("."), parse_value(raw)


def _apply_override(raw: dict[str, Any], parts: list[str], value: Any, text: str) -> None:
    if len(parts) < 2:
        raise ForjaError(f"--set {text!r}: name a key inside a section, e.g. train.steps=100")
    node = raw
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ForjaError(f"--set {text!r}: {part} is a value, not a section")
    node[parts[-1]] = value


def load_config(name_or_path: str | None, overrides: list[str] = ()) -> Config:
    """The config of a recipe (None: the defaults) with `section.key=value` overrides."""
    raw: dict[str, Any] = {}
    where = "in the defaults"
    if name_or_path is not None:
        path = resolve_config_path(name_or_path)
        where = f"in {path}"
        try:
            raw = tomllib.loads(path.read_text())
        except tomllib.TOMLDecodeError as exc:
            raise ForjaError(f"{path} is not valid TOML: {exc}") from None
    cfg = config_from_dict(raw, where)  # the file alone first, so its errors name the file
    if cfg.debug.inject:
        raise ForjaError(f"debug.inject is set {where}: drills come only from the command line "
                         "(--set 'debug.inject=[\"kill@10\"]'), so that no run fails on purpose by accident")
    parsed = [parse_override(text) for text in overrides]
    for (parts, value), text in zip(parsed, overrides):
        _apply_override(raw, parts, value, text)
    if not overrides:
        return cfg
    return _optimizer_lr(cfg, config_from_dict(raw, "from --set"), parsed)


def _optimizer_lr(recipe: Config, cfg: Config, parsed: list[tuple[list[str], Any]]) -> Config:
    """`cfg` with the learning rate of its optimizer when --set switched the optimizer
    and gave no optim.lr: a recipe's lr is tuned for the recipe's optimizer only, so it
    is carried over by the ratio of the two optimizers' measured defaults (DEFAULT_LR,
    forja/optim/config.py): lr = recipe lr x DEFAULT_LR[new] / DEFAULT_LR[recipe's]. On a
    recipe whose lr is its optimizer's default (debug, default) that is the new default;
    on a recipe tuned lower for a larger model, the new lr is as much lower."""
    old, new = recipe.optim.name, cfg.optim.name
    lr_given = any(parts[:2] == ["optim", "lr"] for parts, _ in parsed)
    if new == old or lr_given or old not in DEFAULT_LR or new not in DEFAULT_LR:
        return cfg  # an unknown name is refused later, by build_optimizer, with the known ones
    lr = float(f"{recipe.optim.lr * DEFAULT_LR[new] / DEFAULT_LR[old]:.3g}")
    return dataclasses.replace(cfg, optim=dataclasses.replace(cfg.optim, lr=lr))


# -- saving ---------------------------------------------------------------------------------

def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k} = {_toml_value(v)}" for k, v in value.items() if v is not None) + "}"
    raise TypeError(f"cannot write {value!r} as TOML")


def dump_toml(cfg: Config) -> str:
    """The config as TOML; a key whose value is None is left out (TOML has no null), which
    reloads as None because only fields defaulting to None may hold it."""
    lines = []
    for section, values in cfg.to_dict().items():
        lines.append(f"[{section}]")
        lines += [f"{k} = {_toml_value(v)}" for k, v in values.items() if v is not None]
        lines.append("")
    return "\n".join(lines)
