"""Loss parity of parallel layouts against one process: the harness.

Every layout trains the debug Llama for PARITY_STEPS steps in fp32 on the same data, seed
and global batch; its losses must match the single-process run's within PARITY_TOL. The
measured differences are printed (pytest -s) and recorded in docs/parallelism.md.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from forja.cli import main
from tests.integration.conftest import forja_process, losses, read_metrics, train_args

PARITY_STEPS = 4
# The resharding tests stop a run halfway (its last checkpoint dropped) and train the rest
# under another layout, so the steps on both sides of the move are compared.
RESUME_STEP = PARITY_STEPS // 2
SAVE_HALFWAY = {"checkpoint.interval": str(RESUME_STEP), "checkpoint.keep": "0"}
# Bounds on max |loss difference| from one process over PARITY_STEPS steps in fp32, about 3x
# what was measured over 10 steps (docs/parallelism.md, 2026-12-01): the data/tensor-parallel
# layouts differ by 4.8e-7 or 9.5e-7, one or two units in the last place of a loss near 7,
# because they sum gradients in another order; torch.compile, which also fuses ops, by 9.5e-7
# to 1.4e-6. Over 4 steps (2026-12-03) they differ by 0 or 4.8e-7.
PARITY_TOL = 3e-6
COMPILE_TOL = 4e-6
# Pipelines run the same ops as one process: measured 0 alone (tied or not), 4.8e-7 with TP
# or FSDP, 9.5e-7 with the fused loss.
PP_TOL = 2e-6
# Mixtures of experts (qwen3 debug-moe): the bound; what is measured is in docs/parallelism.md.
MOE_TOL = 1e-5
# Experts under context parallelism, after the first update: CP's attention rounds apart from one
# pass (dense gemma4 over ring CP: 2.4e-6 over 4 steps), and once the weights have moved a
# router's near tie can fall the other way on it, a token then taking another expert: gemma4
# debug-moe over ring CP read 0, 1.9e-6, 1.3e-5 then 3.0e-4 on an AMD EPYC (4.3e-6 at most on
# an Intel CPU). The first step, before any update, is still held to MOE_TOL: a wrong mask or
# a wrong merge shows there.
ROUTED_CP_TOL = 1e-3
# Big enough for every layout's divisibility (dp 4 x micro 1, tp 2, 2 stages x 2 per rank).
COMMON = {"train.steps": str(PARITY_STEPS), "train.global_batch_size": "8", "train.micro_batch_size": "2",
          "train.val_interval": "0", "train.sample_tokens": "0", "checkpoint.interval": "0",
          "parallel.timeout_s": "180", "train.seq_len": "64"}

# The mixture of experts of the MoE layouts (qwen3 debug-moe, with its auxiliary losses), and
# its experts sharded by EP 2 within FSDP 2.
MOE = {"model.family": '"qwen3"', "model.flavor": '"debug-moe"',
       "model.overrides": "{aux_loss_weight=0.01, z_loss_weight=0.001}"}
EP2 = {**MOE, "parallel.ep": "2", "parallel.dp_shard": "2"}

# Pipeline layouts and their reference also validate (forward-only through the stages) and
# keep the halfway checkpoint to resume from under another layout. The debug model ties its
# output projection to the embedding, so the pipeline's two copies are tested throughout.
PP_COMMON = {"train.val_interval": str(RESUME_STEP), **SAVE_HALFWAY}
UNTIED = {"model.overrides": "{tie_embeddings=false}"}


def single_process_losses(run: Path, data: Path, **changes: str) -> dict[int, float]:
    assert main(train_args(run, data, **{**COMMON, **changes})) == 0
    return losses(run)


def layout_losses(run: Path, data: Path, nproc: int, **changes: str) -> dict[int, float]:
    """Train under torchrun with `nproc` processes and `changes` (e.g. parallel.tp="2")."""
    proc = forja_process(train_args(run, data, **{**COMMON, **changes}) + ["--nproc", str(nproc)])
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out[-5000:]
    return losses(run)


def last_checkpoint(run: Path) -> Path:
    return run / "checkpoints" / f"step-{PARITY_STEPS:08d}"


def stop_halfway(run: Path) -> None:
    """Drop the run's last checkpoint, as if it had stopped at RESUME_STEP (saved with SAVE_HALFWAY)."""
    shutil.rmtree(last_checkpoint(run))


def resume_halfway(run: Path, data: Path, nproc: int, **changes: str) -> None:
    """Drop the run's last checkpoint and train the second half again with `nproc` processes
    and `changes`; the first half's records must stay and the second half's be written anew
    (a record's time tells one from the other)."""
    stop_halfway(run)
    before = {r["step"]: r["time"] for r in read_metrics(run) if "loss" in r}
    if nproc == 1:
        single_process_losses(run, data, **changes)
    else:
        layout_losses(run, data, nproc, **changes)
    after = {r["step"]: r["time"] for r in read_metrics(run) if "loss" in r}
    assert after[RESUME_STEP] == before[RESUME_STEP] and after[RESUME_STEP + 1] != before[RESUME_STEP + 1]


def max_difference(reference: dict[int, float], other: dict[int, float]) -> float:
    assert sorted(other) == sorted(reference) == list(range(1, PARITY_STEPS + 1))
    return max(abs(reference[s] - other[s]) for s in reference)


def _train_one_after_another(rank: int, world: int, runs: list[tuple[str, list[str]]]) -> dict[str, str | None]:
    """Every rank trains the runs in order in the host's process group. One thread a rank,
    as torchrun gives several workers (OMP_NUM_THREADS=1). A run that raises ends the
    sequence (the group may be out of step): its traceback is returned, later runs not tried."""
    import traceback

    import torch

    from forja import fallbacks
    from forja.config import load_config
    from forja.train.trainer import Trainer

    torch.set_num_threads(1)
    outcome: dict[str, str | None] = {}
    for run, overrides in runs:
        # As in a process of its own: each compiled layout compiles its own model, and each
        # run's run.json lists only the fallbacks it took (tests read them).
        torch._dynamo.reset()
        fallbacks.clear()
        try:
            Trainer(load_config("debug", overrides)).run()
        except Exception:
            outcome[run] = traceback.format_exc()
            break
        outcome[run] = None
    return outcome


def shared_layout_runs(root: Path, data: Path, nproc: int, layouts: dict[str, dict[str, str]]) -> dict[str, Path]:
    """Train each layout (name -> changes, as for `layout_losses`) for PARITY_STEPS steps,
    one after another in one group of `nproc` Gloo processes, to save a torchrun start-up
    (most of a layout's time on CPU) per layout. Returns name -> run directory for the
    layouts that trained; a layout missing from it failed or was not reached, and its test
    trains it alone with `layout_losses` (and so fails on its own, with its own output)."""
    from forja.testing import run_distributed
    from tests.integration.conftest import base_overrides

    runs = {name: root / f"layout-{i}" for i, name in enumerate(layouts)}
    jobs = [(str(runs[name]), base_overrides(runs[name], data, **{**COMMON, **changes}))
            for name, changes in layouts.items()]
    try:
        # The group's collective timeout is the runs' own (COMMON's parallel.timeout_s); the wait for
        # the processes is 4 times that.
        outcomes = run_distributed(_train_one_after_another, nproc, jobs, timeout_s=float(COMMON["parallel.timeout_s"]))
    except RuntimeError as e:  # a rank died or hung: every layout is trained alone
        print(f"shared process group of {nproc} failed, layouts train alone:\n{e}")
        return {}
    trained = {}
    for name, run in runs.items():
        errors = [f"rank {r}: {o[str(run)]}" for r, o in enumerate(outcomes) if o.get(str(run)) is not None]
        if errors:
            print(f"layout {name} failed in the shared process group, trains alone:\n" + "\n".join(errors))
        elif all(str(run) in o for o in outcomes):
            trained[name] = run
    return trained


class SharedLayouts:
    """Layouts (name -> (nproc, changes)) trained in shared process groups, one group per
    rank count, each when one of its layouts is first asked for: one start-up a group rather
    than one torchrun a layout. Compiled layouts train after the eager ones of their group.
    Tests only read the runs they get (a test that changes one copies it first)."""

    def __init__(self, tmp_path_factory, data: Path, layouts: dict[str, tuple[int, dict[str, str]]]):
        self.factory, self.data, self.layouts = tmp_path_factory, data, layouts
        self.groups: dict[int, dict[str, Path]] = {}

    def run(self, name: str, alone: Path) -> Path:
        """The layout's run directory from its shared group, or, where it failed there,
        `alone` after training it there alone under torchrun."""
        nproc, changes = self.layouts[name]
        if nproc not in self.groups:
            members = [n for n in self.layouts if self.layouts[n][0] == nproc]
            members.sort(key=lambda n: self.layouts[n][1].get("parallel.compile") == "true")  # stable: eager first
            root = self.factory.mktemp(f"layouts-{nproc}")
            self.groups[nproc] = shared_layout_runs(root, self.data, nproc, {n: self.layouts[n][1] for n in members})
        if name in self.groups[nproc]:
            return self.groups[nproc][name]
        layout_losses(alone, self.data, nproc, **changes)
        return alone
