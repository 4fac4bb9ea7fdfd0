"""Downstream evaluation in the training loop: `[eval] tasks` scored every `eval.interval`
steps and at the end, on the model as it is laid out, with no gathering of weights to one
rank and no conversion (forja/eval/ does the scoring; `forja eval` the same on a checkpoint).

The requests of a task are dealt round-robin over the data-parallel copies of the model.
All ranks of one copy score the same requests together: tensor-parallel ranks each hold a
slice of every layer (the logits stay sharded over the vocabulary, scored by
vocabulary-parallel cross-entropy), pipeline ranks pass hidden states stage to stage and
only the last stage's rank has the scores; context-parallel ranks each run the whole short
sequence, as validation does. Under FSDP every forward gathers the parameters it needs, so
every rank must run the same number of forward passes: the copies' shares are padded to
equal length. The log-likelihoods then come back to every rank in one gather.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

import torch

from forja.config import Config
from forja.eval import Request, Task, evaluate, load_task, score_requests
from forja.train.callbacks import Callback, StepRecord, TrainerView


def sharded_scorer(trainer: TrainerView):
    """A `forja.eval` scorer that splits requests over the model's copies and gathers the results."""
    copy, copies = trainer.dims.dp_rank, trainer.dims.dp

    def score(model, requests: Sequence[Request], *, batch_size: int) -> list[float]:
        n = len(requests)
        share = -(-n // copies)  # requests per copy, the last ones padded with a repeat
        mine = list(range(copy, n, copies))
        mine += [mine[0] if mine else 0] * (share - len(mine))
        held: list[bool] = []  # whether this rank's forwards gave logits (a pipeline's last stage does)

        def forward(tokens: torch.Tensor) -> torch.Tensor | None:
            logits = trainer.logits(tokens)
            held.append(logits is not None)
            return logits

        # Sequence parallelism splits T over the tp ranks: padded to a multiple of tp.
        scores = score_requests(forward, [requests[i] for i in mine], batch_size=batch_size, device=trainer.device,
                                max_len=trainer.max_seq_len, pad_to=trainer.dims.tp)
        values = [score.logprob for score in scores]
        out = [0.0] * n
        for theirs in trainer.gather_floats([float(copy), float(all(held)), *values]):
            if theirs[1]:  # a rank holding its copy's scores (every tp rank of it holds the same)
                for j, i in enumerate(range(int(theirs[0]), n, copies)):
                    out[i] = theirs[2 + j]
        return out

    return score


class EvalCallback(Callback):
    """Scores the [eval] tasks at their interval and at the end, and logs eval/<task>/<metric>."""

    def __init__(self, cfg: Config):
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
        tok = trainer.tokenizer
        metrics: dict[str, float] = {}
        for task in self.tasks:
            trainer.beat("eval", step)
            result = evaluate(None, tok, task, prefix_id=tok.eos_id, batch_size=self.cfg.batch_size,
                              score=sharded_scorer(trainer), max_len=trainer.max_seq_len)
            metrics |= {f"eval/{task.name}/{k}": v for k, v in result.items() if k not in ("task", "kind")}
        trainer.log(step, metrics)
        if trainer.rank == 0:
            shown = ", ".join(f"{k.removeprefix('eval/')} {v:.4g}" for k, v in metrics.items()
                              if k.endswith(("/acc", "/acc_norm", "/bits_per_byte")))
            print(f"forja: eval at step {step}: {shown}", file=sys.stderr, flush=True)
        return metrics
