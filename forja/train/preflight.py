"""Before anything is allocated: choose the layout (`parallel.auto`) and check the layout's
predicted peak memory per rank against the device's (`parallel.memory_check`), with forja
plan's model (forja/plan). A run that would not fit stops here, in seconds, with the
predicted breakdown and the layouts that would fit, instead of out of memory after the
queue and the build."""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from pathlib import Path

import torch

from forja.config import Config
from forja.errors import ForjaError
from forja.files import write_atomic
from forja.models.common.transformer import TransformerArgs
from forja.parallel.checks import check_layout
from forja.parallel.dims import ParallelDims
from forja.plan.hardware import Hardware, get_hardware, hardware_for_device
from forja.plan.job import Job, job_from_config
from forja.plan.layout import PARALLEL_KEYS, Layout, from_config
from forja.plan.planner import Candidate, evaluate, plan, usable_memory

GB = 1e9


def device_hardware(device: torch.device) -> Hardware:
    """This machine's device as the planner sees it, with its real memory: a GPU's own, or on
    a CPU the host's RAM shared by the ranks on this host."""
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return hardware_for_device(props.name, props.total_memory)  # an unknown GPU: its memory, "unknown peak"
    ranks_here = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return get_hardware("cpu", memory_gb=ram / ranks_here / GB)


def _runs(cfg: Config, args: TransformerArgs, lay: Layout, world: int, device: torch.device) -> bool:
    """Whether forja's own checks accept `lay` (the planner does not know every one of them)."""
    c = with_layout(cfg, lay)
    try:
        dims = ParallelDims.from_config(c.parallel, world)
        check_layout(args, dims, c.parallel, seq_len=c.train.seq_len, device=device,
                     global_batch_size=c.train.global_batch_size, micro_batch_size=c.train.micro_batch_size,
                     document_mask=c.model.document_mask, float8=c.train.float8)
    except ForjaError:
        return False
    return True


def with_layout(cfg: Config, lay: Layout) -> Config:
    """`cfg` with the layout's parallel keys and micro-batch size."""
    parallel = dataclasses.replace(cfg.parallel, **{k: getattr(lay, k) for k in PARALLEL_KEYS})
    train = dataclasses.replace(cfg.train, micro_batch_size=lay.micro_batch_size)
    return dataclasses.replace(cfg, parallel=parallel, train=train)


class Preflight:
    """This run as forja plan sees it, made once for both uses: the device (with its real
    memory) and the job. The job reads no key a layout sets (degrees, ZeRO stage, AC,
    micro-batch), so the layout `auto_layout` chooses is checked against the same job."""

    def __init__(self, cfg: Config, args: TransformerArgs, device: torch.device, world: int):
        self.cfg, self.args, self.device, self.world = cfg, args, device, world

    @functools.cached_property
    def hw(self) -> Hardware:
        return device_hardware(self.device)

    @functools.cached_property
    def job(self) -> Job:
        return job_from_config(self.cfg, gpu=self.hw.kind != "cpu", args=self.args)

    def auto_layout(self, run_dir: Path, rank: int) -> Config:
        """The config with the fastest layout predicted to fit (parallel.auto); its choice and
        prediction are written to <run.dir>/plan.json. The search is deterministic, so every
        rank reaches the same choice."""
        hw, world = self.hw, self.world
        ranked = plan(self.job, hw, world)
        chosen = next((c for c in ranked if c.fits and _runs(self.cfg, self.args, c.layout, world, self.device)),
                      None)
        if chosen is None:
            closest = ranked[0].why_not if ranked else "no layout divides the job"
            raise ForjaError(f"parallel.auto found no layout of {world} ranks that fits {hw.name} "
                             f"({closest}); add devices, shorten train.seq_len or shrink the model")
        if rank == 0:
            write_atomic(run_dir / "plan.json", json.dumps({"hardware": hw.kind, "world_size": world,
                                                            "chosen": chosen.as_json()}, indent=1).encode())
            print(f"forja: parallel.auto chose {chosen.layout.describe()} (predicted peak "
                  f"{chosen.memory.total / GB:.2f} GB of {hw.memory_bytes / GB:.1f} GB; plan.json)", flush=True)
        return with_layout(self.cfg, chosen.layout)

    def check_memory(self, cfg: Config, rank: int) -> Candidate | None:
        """Stop (or warn) when `cfg`'s layout's predicted peak per rank exceeds the device's memory."""
        if cfg.parallel.memory_check == "off":
            return None
        own = evaluate(self.job, from_config(cfg.parallel, cfg.train.micro_batch_size, self.world), self.hw)
        if own.memory.total <= usable_memory(self.hw):
            return own
        message = over_memory_message(own, self.job, self.hw, self.world)
        if cfg.parallel.memory_check == "stop":
            raise ForjaError(message)
        if rank == 0:
            print(f"forja: warning: {message}", flush=True)
        return own


def over_memory_message(own: Candidate, job: Job, hw: Hardware, world: int) -> str:
    parts = ", ".join(f"{k.replace('_', ' ')} {v / GB:.2f}" for k, v in own.memory.as_dict().items() if v)
    fitting = [c for c in plan(job, hw, world) if c.fits][:3]
    options = "; ".join(f"{c.layout.describe()} ({c.memory.total / GB:.1f} GB)" for c in fitting)
    return (f"this layout ({own.layout.describe()}) is predicted to need {own.memory.total / GB:.2f} GB per rank "
            f"at its peak ({own.memory.phase}: {parts} GB) but {hw.name} leaves "
            f"{usable_memory(hw) / GB:.1f} GB; "
            + (f"layouts that fit: {options} (or set parallel.auto = true)" if fitting else
               "no layout of this many ranks fits: add devices or shrink the job")
            + "; parallel.memory_check = 'warn' goes on anyway")
