"""The [eval] section: downstream tasks scored while training (forja/train/evaluation.py).

Values only: whether each task exists is the preflight's question (forja/eval/tasks.py's
check_tasks), as a file's existence is no property of the config."""

from __future__ import annotations

from dataclasses import dataclass, field

from forja.errors import ForjaError


@dataclass(kw_only=True)
class EvalConfig:
    """Downstream tasks (docs/evaluation.md) scored on the model as it trains, as it is laid out."""

    tasks: list[str] = field(default_factory=list)
    """JSONL task files or task names (forja/eval/tasks.py) scored every `interval` steps and at the end of
    training; empty: none."""
    interval: int = 0
    """Steps between evaluations (there is always one at the end); 0: only at the end."""
    limit: int = 0
    """Score only each task's first N examples; 0: all of them."""
    batch_size: int = 16
    """Sequences per forward pass on each rank."""

    def __post_init__(self) -> None:
        if self.interval < 0 or self.limit < 0 or self.batch_size < 1:
            raise ForjaError("eval.interval and eval.limit must be >= 0 and eval.batch_size >= 1")
