"""The preflight: every check that can fail a launch, run before anything is written or
computed, and with `--nproc`/`--nnodes` in the launcher before torchrun starts.

    pre = Preflight(cfg, world_size=8, device_type="cuda").run()   # raises ForjaError
    cfg = pre.cfg                                                    # parallel.auto's layout applied

It checks, in this order: the run directory (writable, not another run's), the tracker
packages the metric sinks need, the eval task
files and the data source and tokenizer exist, the data stages name data that exists (and,
resumed, that the stages begun are as they were trained), the layout (the one validator, forja/parallel/checks.py;
`parallel.auto` chooses among the layouts it accepts), the layout's predicted peak memory
per rank against the device's (forja plan's model), and prepared data (it matches its
tokenizer and both splits hold a sample).
A launch that fails any of them costs seconds and leaves nothing behind: no run directory,
no restart counted, no tokenizer trained.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import time
from pathlib import Path

from forja.config import Config
from forja.errors import ForjaError
from forja.eval.tasks import check_tasks
from forja.files import write_atomic
from forja.metrics.config import check_sink_packages
from forja.models import build_from_args
from forja.models.common.transformer import TransformerArgs
from forja.models.config import run_model_args
from forja.ops.float8 import check_float8
from forja.parallel.checks import LayoutRequest, check_layout
from forja.plan.hardware import Hardware, get_hardware, hardware_for_device
from forja.plan.job import Job, job_from_config
from forja.plan.layout import Layout, with_layout
from forja.plan.planner import Candidate, evaluate, layout_request, plan, usable_memory
from forja.train.ft.checks import check_ft
from forja.train.launch.data import check_data, check_splits, check_stages
from forja.train.launch.run_dir import RunDir
from forja.train.launch.stage_history import check_stage_history
from forja.train.rehearse.rehearsal import rehearse_apart

GB = 1e9
# Set once a launch's rehearsal has run (parallel.memory_check = "rehearse"), for the workers.
REHEARSED = "FORJA_REHEARSED"


def check_positions(args: TransformerArgs, seq_len: int) -> None:
    """A model with a learned position table (GPT-2) has a row per position up to max_seq_len and
    cannot be extended past it; rotary models compute their positions and can."""
    if args.learned_positions and seq_len > args.max_seq_len:
        raise ForjaError(f"train.seq_len = {seq_len} is longer than the model's learned position table "
                         f"(max_seq_len = {args.max_seq_len} rows), which a resume cannot extend; lower "
                         "train.seq_len, or train a rotary family (llama, qwen3, ...) to extend context")


def _nvidia_smi_device() -> tuple[str, float] | None:
    """(name, memory in bytes) of GPU 0, asked of nvidia-smi: the launcher must not create a
    CUDA context of its own on a GPU its workers need."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        out = subprocess.run([exe, "--query-gpu=name,memory.total", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=20, check=True).stdout
        name, mib = out.splitlines()[0].rsplit(",", 1)
        return name.strip(), float(mib) * 2**20
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None


def device_hardware(device_type: str, *, ranks_here: int | None = None, in_worker: bool = True) -> Hardware | None:
    """This machine's device as the planner sees it, with its real memory: a GPU's own, or on
    a CPU the host's RAM shared by the ranks on this host; None when it cannot be told
    (the memory check is then left to the workers)."""
    if device_type == "cuda":
        if in_worker:
            import torch

            props = torch.cuda.get_device_properties(torch.cuda.current_device())
            name, memory = props.name, props.total_memory
        else:
            found = _nvidia_smi_device()
            if found is None:
                return None
            name, memory = found
        return hardware_for_device(name, memory)  # an unknown GPU: its memory, "unknown peak"
    ranks = ranks_here or int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return get_hardware("cpu", memory_gib=ram / ranks / 2 ** 30)


@dataclasses.dataclass
class Preflight:
    """One launch's checks. `device_type` is "cuda" or "cpu"; `in_worker` is False in the
    launcher (torchrun has not started), where the GPU is asked of nvidia-smi."""

    cfg: Config
    world_size: int
    device_type: str
    rank: int = 0
    ranks_here: int | None = None
    in_worker: bool = True
    args: TransformerArgs | None = None
    chosen: Candidate | None = None
    """parallel.auto's choice, once run() has made it."""
    hw: Hardware | None = None

    def run(self) -> Preflight:
        """Every check; raises the first failure as one ForjaError. Writes nothing."""
        RunDir(self.cfg, rank=self.rank).check()
        check_ft(self.cfg)  # replica groups: a setting torchft cannot serve (a layout: check_layout below)
        check_sink_packages(self.cfg.metrics.sinks)
        check_tasks(self.cfg.eval.tasks)
        tokenizer = check_data(self.cfg)
        check_stages(self.cfg)
        check_stage_history(self.cfg)
        self.args = run_model_args(self.cfg.model, tokenizer.vocab_size if tokenizer else self.cfg.data.vocab_size)
        hw = self.hw = device_hardware(self.device_type, ranks_here=self.ranks_here, in_worker=self.in_worker)
        if self.cfg.parallel.auto:
            self.cfg = self._auto_layout(hw)
        check_layout(self.request())  # every scheduled length, one replica group's batch
        check_positions(self.args, self.cfg.run_seq_lens()[-1])
        if self.cfg.train.float8 != "none":  # float8 that would convert no layer (a meta model tells)
            check_float8(build_from_args(self.args, device="meta"), self.cfg.train.float8,
                         self.cfg.train.float8_min_features)
        if hw is not None:
            self._check_memory(hw)
        check_splits(self.cfg, tokenizer)
        return self

    def job(self, args: TransformerArgs | None = None) -> Job:
        """The planner's job of this launch (`args`: the model's, when they differ from the
        preflight's, e.g. after a tokenizer was trained with fewer tokens)."""
        return job_from_config(self.cfg, gpu=self.device_type == "cuda", args=args or self.args)

    def request(self, args: TransformerArgs | None = None) -> LayoutRequest:
        """This launch's layout as the layout validator reads it."""
        return layout_request(self.job(args), self.device_type, self.world_size)

    def _auto_layout(self, hw: Hardware | None) -> Config:
        """The config with the fastest layout predicted to fit (parallel.auto). The search is
        deterministic, so every rank reaches the same choice; its candidates passed the validator."""
        if hw is None:
            raise ForjaError("parallel.auto needs to know the device's memory, and nvidia-smi could not tell it "
                             "here; set the layout's parallel keys yourself, or run forja train without --nproc")
        if not hw.peak_known:
            raise ForjaError(f"parallel.auto ranks layouts by predicted speed, but {hw.name} has an unknown peak; "
                             "add the device to a hardware file named by $FORJA_HARDWARE (docs/planner.md), or set "
                             "the layout's parallel keys yourself")
        ranked = plan(self.job(), hw, self.world_size)
        self.chosen = next((c for c in ranked if c.fits), None)
        if self.chosen is None:
            closest = ranked[0].why_not if ranked else "no layout divides the job"
            raise ForjaError(f"parallel.auto found no layout of {self.world_size} ranks that fits {hw.name} "
                             f"({closest}); add devices, shorten train.seq_len or shrink the model")
        return with_layout(self.cfg, self.chosen.layout)

    def write_plan(self, run_dir: Path) -> None:
        """parallel.auto's choice and its prediction, into <run.dir>/plan.json (rank 0)."""
        if self.chosen is None or self.rank != 0:
            return
        c = self.chosen
        write_atomic(run_dir / "plan.json", json.dumps({"hardware": self.hw.kind, "world_size": self.world_size,
                                                        "chosen": c.as_json()}, indent=1).encode())
        print(f"forja: parallel.auto chose {c.layout.describe()} (predicted peak {c.memory.total / GB:.2f} GB of "
              f"{self.hw.memory_bytes / GB:.1f} GB; plan.json)", flush=True)

    def _check_memory(self, hw: Hardware) -> None:
        """Stop (or warn) when the layout's predicted peak per rank exceeds the device's memory."""
        cfg = self.cfg
        if cfg.parallel.memory_check == "off":
            return
        if cfg.parallel.memory_check == "rehearse":
            return self._rehearse(hw)
        job = self.job()
        own = evaluate(job, Layout.from_config(cfg.parallel, cfg.train.micro_batch_size, self.world_size), hw)
        if own.memory.total <= usable_memory(hw):
            return
        message = over_memory_message(own, job, hw, self.world_size)
        if cfg.parallel.memory_check == "stop":
            raise ForjaError(message)
        if self.rank == 0:
            print(f"forja: warning: {message}", flush=True)


    def _rehearse(self, hw: Hardware) -> None:
        """parallel.memory_check = "rehearse": the rehearsed peak against the device's memory. Once
        per launch: the launcher's preflight, or rank 0's where no launcher ran one (the others
        meet rank 0's verdict at their first collective)."""
        if os.environ.get(REHEARSED) or (self.in_worker and self.rank != 0):
            return
        began = time.perf_counter()
        out = rehearse_apart(self.cfg, self.world_size)
        peak = max(r["peak_bytes"] for r in out["ranks"])
        os.environ[REHEARSED] = "1"  # torchrun's workers inherit it: they need not rehearse again
        seconds = time.perf_counter() - began
        if peak > usable_memory(hw):
            raise ForjaError(f"the rehearsal of this layout ({out['layout']}) peaks at {peak / GB:.2f} GB per rank "
                             f"but {hw.name} leaves {usable_memory(hw) / GB:.1f} GB (rehearsed in {seconds:.0f} s; "
                             "forja plan RECIPE --gpus N --rehearse shows where it goes); change the layout, or "
                             "parallel.memory_check = 'warn' goes on anyway")
        print(f"forja: rehearsed the layout in {seconds:.0f} s: peak {peak / GB:.2f} GB per rank of "
              f"{usable_memory(hw) / GB:.1f} GB usable", flush=True)


def over_memory_message(own: Candidate, job: Job, hw: Hardware, world: int) -> str:
    parts = ", ".join(f"{k.replace('_', ' ')} {v / GB:.2f}" for k, v in own.memory.as_dict().items() if v)
    fitting = [c for c in plan(job, hw, world) if c.fits][:3]  # each passed the layout validator
    options = "; ".join(f"{c.layout.describe()} ({c.memory.total / GB:.1f} GB)" for c in fitting)
    return (f"this layout ({own.layout.describe()}) is predicted to need {own.memory.total / GB:.2f} GB per rank "
            f"at its peak ({own.memory.phase}: {parts} GB) but {hw.name} leaves "
            f"{usable_memory(hw) / GB:.1f} GB; "
            + (f"layouts that fit: {options} (or set parallel.auto = true)" if fitting else
               "no layout of this many ranks fits: add devices or shrink the job")
            + "; parallel.memory_check = 'warn' goes on anyway")
