"""The devices `forja plan` knows: memory, peak FLOP/s and link bandwidths, in SI units.

    hw = get_hardware("h100")                      # packaged table (hardware.toml)
    hw = get_hardware("h100", memory_gib=93.6)     # same chip, another memory size
    table = load_hardware("my_cluster.toml")       # packaged table + your rows

Your own rows live in a TOML file named by `path` or by the FORJA_HARDWARE environment
variable, in the same shape and units as forja/plan/hardware.toml. A table whose name is a
known kind overrides just the fields it sets (e.g. `[h100]` with `inter_node_gbps = 25` for a
cluster with half the network); a new kind must set every field except `source`.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, replace
from pathlib import Path

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib

from forja.errors import ForjaError

PACKAGED = Path(__file__).with_name("hardware.toml")
ENV_VAR = "FORJA_HARDWARE"
_GIGA, _TERA, _GIB = 1e9, 1e12, 2.0 ** 30
# TOML field -> (Hardware field, scale to SI). The TOML keeps the datasheets' units so each
# figure can be checked against its source by eye.
_FIELDS = {
    "name": ("name", None),
    "memory_gib": ("memory_bytes", _GIB),
    "bf16_tflops": ("bf16_flops", _TERA),
    "fp8_tflops": ("fp8_flops", _TERA),
    "fp32_tflops": ("fp32_flops", _TERA),
    "hbm_gbps": ("hbm_bytes_per_s", _GIGA),
    "intra_node_gbps": ("intra_node_bytes_per_s", _GIGA),
    "inter_node_gbps": ("inter_node_bytes_per_s", _GIGA),
    "gpus_per_node": ("gpus_per_node", None),
    "source": ("source", None),
}
_OPTIONAL = {"source"}  # a user's own device needs no citation


@dataclass(frozen=True, kw_only=True)
class Hardware:
    """One device kind, in SI units (bytes, FLOP/s, bytes/s)."""

    kind: str
    """The table key, e.g. "h100"."""
    name: str
    """Readable name, e.g. "NVIDIA H100 SXM5 80GB"."""
    memory_bytes: float
    """Device memory in bytes, as the device reports it (torch's total_memory)."""
    bf16_flops: float
    """Dense bfloat16 tensor-core peak, FLOP/s."""
    fp8_flops: float
    """Dense float8 tensor-core peak, FLOP/s; 0 where the device has none."""
    fp32_flops: float
    """Plain float32 peak (no TF32), FLOP/s."""
    hbm_bytes_per_s: float
    """Device memory bandwidth (datasheet), bytes/s: the rate of memory-bound kernels."""
    intra_node_bytes_per_s: float
    """Per-GPU NVLink/xGMI/PCIe bandwidth inside a node, one direction, bytes/s."""
    inter_node_bytes_per_s: float
    """Per-GPU network bandwidth between nodes, one direction, bytes/s."""
    gpus_per_node: int
    """GPUs sharing the intra-node fabric."""
    source: str
    """Where the figures come from."""

    @property
    def peak_known(self) -> bool:
        """False for a device the table does not know (`unknown_device`): no speed, no MFU."""
        return self.bf16_flops > 0 or self.fp32_flops > 0


def _read(path: Path) -> dict[str, dict]:
    try:
        raw = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ForjaError(f"hardware file {path} does not exist; fix the path or unset ${ENV_VAR}.") from None
    except tomllib.TOMLDecodeError as exc:
        raise ForjaError(f"hardware file {path} is not valid TOML ({exc}); fix the syntax.") from None
    for kind, row in raw.items():
        if not isinstance(row, dict):
            raise ForjaError(f"hardware file {path}: `{kind}` must be a table like [{kind}], not a value.")
    return raw


def _check(kind: str, row: dict, path: Path, *, new: bool) -> None:
    """Unknown fields always fail; a new kind must also set every required field."""
    where = f"hardware file {path}, device [{kind}]"
    for field in row:
        if field == "memory_gb":
            raise ForjaError(f"{where} sets `memory_gb`, which is now `memory_gib`: the GiB the device reports "
                             "(nvidia-smi's total MiB / 1024; an H100 80GB reports 79.2).")
        if field not in _FIELDS:
            raise ForjaError(f"{where} has unknown field `{field}`; remove it or use one of {sorted(_FIELDS)}.")
    missing = sorted(set(_FIELDS) - _OPTIONAL - set(row)) if new else []
    if missing:
        raise ForjaError(f"{where} is a new device and lacks field `{missing[0]}`; add it "
                         f"(a new device needs {sorted(set(_FIELDS) - _OPTIONAL)}).")
    for field, value in row.items():
        if field in ("name", "source"):
            ok = isinstance(value, str)
        elif field == "gpus_per_node":
            ok = isinstance(value, int) and not isinstance(value, bool) and value >= 1
        else:  # a peak of 0 means "none" (fp8); negatives or NaN are typos
            ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) \
                and value >= 0
        if not ok:
            raise ForjaError(f"{where} has a bad value {value!r} for `{field}`; "
                             f"give {'a string' if field in ('name', 'source') else 'a non-negative number'}.")


def _build(kind: str, row: dict) -> Hardware:
    values = {"kind": kind}
    for field, (attr, scale) in _FIELDS.items():
        value = row[field]
        values[attr] = float(value) * scale if scale else value
    return Hardware(**values)


def load_hardware(path: str | Path | None = None) -> dict[str, Hardware]:
    """The packaged table, with the rows of `path` (or $FORJA_HARDWARE) merged over it."""
    rows = _read(PACKAGED)
    for kind, row in rows.items():  # the packaged file obeys the same rules as a user's
        _check(kind, row, PACKAGED, new=True)
    user = path if path is not None else os.environ.get(ENV_VAR) or None
    if user is not None:
        user = Path(user).expanduser()
        for kind, row in _read(user).items():
            kind = kind.lower()  # kinds are looked up case-insensitively
            _check(kind, row, user, new=kind not in rows)
            # An override keeps the packaged citation but says which figures are no longer its.
            cited = rows[kind]["source"] + "; " if kind in rows else ""
            rows[kind] = rows.get(kind, {}) | {"source": f"{cited}{', '.join(row)} from {user}"} | row
    return {kind: _build(kind, row) for kind, row in rows.items()}


# torch.cuda.get_device_name -> the table's kind; the first pattern that matches wins.
_DEVICE_NAMES = [(r"GB200", "gb200"), (r"B200", "b200"), (r"H200", "h200"), (r"H100.*PCIe", "h100-pcie"),
                 (r"H100", "h100"), (r"A100.*40GB", "a100-40gb"), (r"A100", "a100"), (r"MI300X", "mi300x"),
                 (r"L40S", "l40s")]


def kind_of_device(device_name: str) -> str | None:
    """The kind of a CUDA device name such as "NVIDIA H100 80GB HBM3"; None if the table has none."""
    return next((kind for pattern, kind in _DEVICE_NAMES if re.search(pattern, device_name)), None)


def unknown_device(name: str, memory_bytes: float) -> Hardware:
    """A device the table has no row for: its real memory (so what fits can still be told)
    and no peak, no bandwidths: "unknown peak" rather than another device's figures."""
    return Hardware(kind="unknown", name=name, memory_bytes=float(memory_bytes), bf16_flops=0.0, fp8_flops=0.0,
                    fp32_flops=0.0, hbm_bytes_per_s=0.0, intra_node_bytes_per_s=0.0, inter_node_bytes_per_s=0.0,
                    gpus_per_node=8, source=f"not in forja's hardware table (unknown peak): {UNKNOWN_FIX}")


UNKNOWN_FIX = (f"add a [kind] row with its peaks and bandwidths to a TOML file named by ${ENV_VAR} (fields as in "
               "forja/plan/hardware.toml), or plan a known kind with --gpu KIND --gpu-memory GIB")


def hardware_for_device(device_name: str, memory_bytes: float, *, path: str | Path | None = None) -> Hardware:
    """The planner's view of a CUDA device named `device_name` (torch.cuda.get_device_name or
    nvidia-smi) with `memory_bytes` of memory: its table row with that memory, or, for a name
    the table (and $FORJA_HARDWARE) does not know, `unknown_device` -- never another device's
    peaks. A user's row matches when its `name` is the device name, or its kind is a part
    of it ("[rtx6000]" for "NVIDIA RTX6000 Ada"), both case-insensitive."""
    table = load_hardware(path)
    lowered = device_name.strip().lower()
    kind = kind_of_device(device_name) or next((k for k, hw in table.items() if hw.name.lower() == lowered), None) \
        or next((k for k in sorted(table, key=len, reverse=True) if k != "cpu" and k in lowered), None)
    if kind is None:
        return unknown_device(device_name, memory_bytes)
    return replace(table[kind], memory_bytes=float(memory_bytes))


def get_hardware(kind: str, *, memory_gib: float | None = None, path: str | Path | None = None) -> Hardware:
    """The device `kind` (case-insensitive); `memory_gib` replaces its memory (GiB, as the
    device reports it: torch's total_memory / 2**30, nvidia-smi's total MiB / 1024)."""
    table = load_hardware(path)
    hw = table.get(kind.lower())
    if hw is None:
        raise ForjaError(f"unknown hardware kind {kind!r}: unknown peak; use one of {', '.join(sorted(table))}, "
                         f"or {UNKNOWN_FIX}.")
    if memory_gib is not None:
        if not memory_gib > 0:
            raise ForjaError(f"memory_gib must be a positive number of GiB, got {memory_gib!r}.")
        hw = replace(hw, memory_bytes=float(memory_gib) * _GIB)
    return hw
