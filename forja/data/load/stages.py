"""The data stages of a run (`data.path`, then `[[data.stages]]`), their sources, and the check
that a resumed run's stages agree with what it has trained on.

Each stage is a mixture. The run's sources are the distinct datasets of all stages, numbered by
first appearance (stage 0's parts first, in order), so a source keeps its number -- and with it
its shuffle (`derive_key(seed, number, epoch)`) -- whatever later stages are added or edited;
stage 0's numbers are its mixture's indices, as before stages existed.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from forja.data.corpus.mixture import Mixture
from forja.data.corpus.shards import PreparedDataset
from forja.data.load.order import Interleave
from forja.errors import ForjaError


@dataclass(frozen=True)
class Stage:
    """From step `start_step` (counted from 1) on, samples come from `data`."""

    start_step: int
    data: Any
    """A dataset, mixture, path, source spec or (data, weight) pairs: what DataLoader takes."""
    seq_len: int | None = None
    """This stage's length; None: the loader's seq_len_at."""
    name: str = ""
    """How errors name it (data.path, data.stages[0], ...)."""


def stage_name(index: int) -> str:
    return "data.path (stage 0)" if index == 0 else f"data.stages[{index - 1}] (stage {index})"


def source_label(dataset: PreparedDataset) -> str:
    """A source's name in metrics: the spec it was prepared from ("jsonl:s3://b/web.jsonl" as
    "jsonl:s3:b/web.jsonl": trackers such as MLflow refuse "//" in a metric's name)."""
    label = str(dataset.meta.get("source", {}).get("spec") or dataset.name)
    return re.sub("/{2,}", "/", label).replace(":/", ":")


class StageSet:
    """The opened stages: each one's mixture, its components' source numbers and interleave."""

    def __init__(self, stages: Sequence[Stage], mixtures: Sequence[Mixture]):
        self.stages = list(stages)
        self.mixtures = list(mixtures)
        tokenizers = {d.meta["tokenizer"]["fingerprint"] for m in mixtures for d in m.datasets}
        if len(tokenizers) > 1:
            raise ForjaError("the data stages were prepared with different tokenizers; one tokenizer serves "
                             "every stage: prepare each stage's data with the tokenizer of stage 0")
        self.sources: list[PreparedDataset] = []
        number: dict[str, int] = {}
        self.components: list[list[int]] = []  # per stage: the source number of each component
        for index, mixture in enumerate(self.mixtures):
            _check_distinct(mixture, index)
            for d in mixture.datasets:
                if d.fingerprint not in number:
                    number[d.fingerprint] = len(self.sources)
                    self.sources.append(d)
            self.components.append([number[d.fingerprint] for d in mixture.datasets])
        self.fingerprints = [d.fingerprint for d in self.sources]
        self.interleaves = [Interleave(m.weights) for m in self.mixtures]
        labels = [source_label(d) for d in self.sources]
        self.labels = [lab if labels.count(lab) == 1 else f"{lab}#{i}" for i, lab in enumerate(labels)]

    def at(self, step: int) -> int:
        """The stage of step `step` (counted from 1)."""
        return sum(1 for s in self.stages[1:] if s.start_step <= step)

    def component_fingerprints(self, stage: int) -> list[str]:
        return [self.fingerprints[s] for s in self.components[stage]]

    # -- what a checkpoint records, and the check on resume ------------------------------------
    def record(self, index: int) -> dict[str, Any]:
        stage = self.stages[index]
        return {"start_step": stage.start_step if index else 1, "seq_len": stage.seq_len,
                "data": self.mixtures[index].fingerprint, "path": stage.name}

    def history(self, steps: int) -> str:
        """The stages begun by `steps` completed steps, as JSON."""
        return json.dumps([self.record(i) for i in range(self.at(max(steps, 1)) + 1)])

    def check_history(self, recorded: str, steps: int) -> None:
        """Stop, naming the stage, unless every stage begun by `steps` is as it was trained."""
        now = [self.record(i) for i in range(len(self.stages))]
        check_begun(json.loads(recorded), now, steps,
                    {"start_step": "start_step", "data": "data or weights", "seq_len": "seq_len"})


def check_begun(past: list[dict[str, Any]], now: list[dict[str, Any]], steps: int, keys: dict[str, str | None], *,
                first: int = 0) -> None:
    """The one check of a resumed run's stages: every stage begun by `steps` (`past`, as
    recorded) is in `now` (the config's, as records) with the same `keys`, and no stage of `now`
    starts inside the steps done without having been recorded. `keys` maps a record key to how a
    change of it is named without its values (None: the two values are shown). Stages before
    `first` are left to other checks."""
    for i, then in enumerate(past[first:], start=first):
        if i >= len(now):
            raise ForjaError(f"{stage_name(i)} was trained on from step {then['start_step']} ({then['path']}) "
                             f"but this config has no such stage; a stage already begun cannot be removed: "
                             f"restore it, or change only stages that start after step {steps}")
        for key, label in keys.items():
            if now[i][key] == then[key]:
                continue
            if label is None:
                change = (f"has {key} {now[i][key]!r} but this run trained on it with {then[key]!r} "
                          f"(from step {then['start_step']})")
            else:
                change = (f"differs in its {label} from what this run has trained on (from step "
                          f"{then['start_step']}: {then['path']}, seq_len {then['seq_len']})")
            raise ForjaError(f"{stage_name(i)} {change}; a stage already begun cannot change: restore it, or "
                             f"change only stages that start after step {steps}")
    begun = sum(1 for record in now if record["start_step"] <= max(steps, 1))
    if begun > len(past):
        raise ForjaError(f"{stage_name(len(past))} starts at step {now[len(past)]['start_step']}, but this run is "
                         f"past step {steps} without it; a new stage must start after step {steps}")


def _check_distinct(mixture: Mixture, index: int) -> None:
    """A stage's parts are distinct data: one source listed twice would draw its samples twice."""
    seen: dict[str, str] = {}
    for d in mixture.datasets:
        if d.fingerprint in seen:
            raise ForjaError(f"{stage_name(index)} lists the same data twice ({seen[d.fingerprint]} and {d.name}); "
                             "list it once, with the sum of the two weights")
        seen[d.fingerprint] = d.name
