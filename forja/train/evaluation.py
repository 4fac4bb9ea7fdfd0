"""Downstream evaluation in the training loop: `[eval] tasks` scored every `eval.interval`
steps and at the end, on the model as it is sharded, with no gathering to one rank and no
conversion (forja/eval/ does the scoring; `forja eval` the same on a checkpoint).

The requests of a task are dealt round-robin over the ranks, each rank scores its share
with the model it holds (under FSDP every forward gathers the parameters it needs, so every
rank must run the same number of forward passes: shares are padded to equal length), and
the log-likelihoods come back to every rank in one gather. Data-parallel layouts (DDP,
FSDP, HSDP, expert parallelism) are supported; tensor, pipeline and context parallelism
are refused before training starts, pointing to `forja eval` on a checkpoint.
"""

from __future__ import annotations

import sys

from forja.config import Config
from forja.errors import ForjaError
from forja.eval import Task, evaluate, load_task, loglikelihoods
from forja.train.callbacks import Callback, StepRecord, TrainerView


def sharded_scorer(trainer: TrainerView):
    """A `forja.eval` scorer that splits requests over the ranks and gathers the results."""
    rank, world = trainer.rank, trainer.world_size

    def score(model, requests, *, batch_size: int) -> list[float]:
        n = len(requests)
        share = -(-n // world)  # requests per rank, the last ones padded with a repeat
        mine = list(range(rank, n, world))
        mine += [mine[0] if mine else 0] * (share - len(mine))
        values = loglikelihoods(model, [requests[i] for i in mine], batch_size=batch_size)
        out = [0.0] * n
        for r, theirs in enumerate(trainer.gather_floats(values)):
            for j, i in enumerate(range(r, n, world)):
                out[i] = theirs[j]
        return out

    return score


def check_layout(cfg: Config) -> None:
    p = cfg.parallel
    if cfg.eval.tasks and (p.tp > 1 or p.pp > 1 or p.cp > 1):
        raise ForjaError(f"eval.tasks in the loop runs on data-parallel layouts (FSDP, HSDP, DDP, EP), not with "
                         f"tp = {p.tp}, pp = {p.pp}, cp = {p.cp}; run `forja eval RUN_DIR --task FILE` on the "
                         "run's checkpoint instead")


class EvalCallback(Callback):
    """Scores the [eval] tasks at their interval and at the end, and logs eval/<task>/<metric>."""

    def __init__(self, cfg: Config):
        check_layout(cfg)
        self.cfg = cfg.eval
        self.total = cfg.train.steps
        self.tasks: list[Task] = [load_task(path, limit=self.cfg.limit or None) for path in self.cfg.tasks]

    def on_step_end(self, trainer: TrainerView, record: StepRecord) -> None:
        due = self.cfg.interval and record.step % self.cfg.interval == 0
        if due and not record.replay and record.step != self.total:  # the last step: on_train_end
            self.run(trainer, record.step)

    def on_train_end(self, trainer: TrainerView) -> None:
        self.run(trainer, trainer.counters.step)

    def run(self, trainer: TrainerView, step: int) -> dict[str, float]:
        model, tok = trainer.model, trainer.tokenizer
        metrics: dict[str, float] = {}
        for task in self.tasks:
            trainer.beat("eval", step)
            with trainer.autocast():
                result = evaluate(model, tok, task, prefix_id=tok.eos_id, batch_size=self.cfg.batch_size,
                                  score=sharded_scorer(trainer))
            metrics |= {f"eval/{task.name}/{k}": v for k, v in result.items() if k not in ("task", "kind")}
        trainer.log(step, metrics)
        if trainer.rank == 0:
            shown = ", ".join(f"{k.removeprefix('eval/')} {v:.4g}" for k, v in metrics.items()
                              if k.endswith(("/acc", "/acc_norm", "/bits_per_byte")))
            print(f"forja: eval at step {step}: {shown}", file=sys.stderr, flush=True)
        return metrics
