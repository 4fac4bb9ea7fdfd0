"""The progress line of `forja prepare`: documents, tokens and tokens/s, on stderr."""

from __future__ import annotations

import time

from rich.console import Console
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn


class PrepareProgress:
    """A live line while preparing; silent when disabled. Also counts for the summary."""

    def __init__(self, label: str, *, enabled: bool):
        self.label = label
        self.documents = self.tokens = 0
        self._start = time.perf_counter()
        self._progress: Progress | None = None
        if enabled:
            # No markup: a source such as "stdlib:email" would otherwise print as an emoji.
            self._progress = Progress(SpinnerColumn(), TextColumn("{task.description}", markup=False),
                                      TimeElapsedColumn(), console=Console(stderr=True), transient=False)
            self._task = self._progress.add_task(self._text())

    @property
    def seconds(self) -> float:
        return time.perf_counter() - self._start

    def _text(self) -> str:
        rate = self.tokens / max(self.seconds, 1e-9)
        return f"{self.label}: {self.documents:,} documents, {self.tokens:,} tokens, {rate:,.0f} tokens/s"

    def advance(self, documents: int, tokens: int) -> None:
        self.documents += documents
        self.tokens += tokens
        if self._progress is not None:
            self._progress.update(self._task, description=self._text())

    def __enter__(self) -> PrepareProgress:
        if self._progress is not None:
            self._progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._progress is not None:
            self._progress.update(self._task, description=self._text())
            self._progress.stop()
