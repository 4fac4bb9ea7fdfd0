"""A mixture: several prepared datasets with weights, sampled by the loader in proportion.

Weights act at sampling time, not when preparing, so changing them never re-tokenizes.
`forja prepare` given a mixture spec writes each part into its own subdirectory and a
`mixture.json` naming them (paths relative to the mixture directory):

    {"format": "forja-mixture", "components": [{"path": "0", "source": "stdlib", "weight": 0.7}, ...]}
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from forja.data.corpus.shards import PreparedDataset, open_prepared, write_json
from forja.errors import ForjaError
from forja.storage import exists, is_url, join, read_bytes

MIXTURE = "mixture.json"
_FORMAT = "forja-mixture"


@dataclass(frozen=True)
class Mixture:
    """Prepared datasets and their sampling weights."""

    datasets: tuple[PreparedDataset, ...]
    weights: tuple[float, ...]

    def __post_init__(self) -> None:
        if not self.datasets or len(self.datasets) != len(self.weights):
            raise ForjaError("a mixture needs one weight per dataset and at least one dataset")
        vocab = {d.vocab_size for d in self.datasets}
        tokenizers = {d.meta["tokenizer"]["fingerprint"] for d in self.datasets}
        if len(vocab) > 1 or len(tokenizers) > 1:
            names = ", ".join(d.name for d in self.datasets)
            raise ForjaError(f"the datasets of a mixture must share one tokenizer, but {names} do not; "
                             f"prepare them all with the same tokenizer")

    @classmethod
    def of(cls, data: PreparedDataset | Mixture | Sequence[tuple[PreparedDataset, float]]) -> Mixture:
        """A Mixture from a dataset (weight 1), a Mixture, or (dataset, weight) pairs."""
        if isinstance(data, Mixture):
            return data
        if isinstance(data, PreparedDataset):
            return cls((data,), (1.0,))
        pairs = list(data)
        return cls(tuple(d for d, _ in pairs), tuple(float(w) for _, w in pairs))

    @property
    def fingerprint(self) -> str:
        key = json.dumps([[d.fingerprint, w] for d, w in zip(self.datasets, self.weights, strict=True)])
        return hashlib.sha256(key.encode()).hexdigest()

    @property
    def eos_id(self) -> int:
        return self.datasets[0].eos_id

    def check_tokenizer(self, tokenizer: Any) -> None:
        for dataset in self.datasets:
            dataset.check_tokenizer(tokenizer)


def is_mixture_dir(path: str | os.PathLike[str]) -> bool:
    if is_url(path):
        return exists(join(str(path), MIXTURE))
    return (Path(path).expanduser() / MIXTURE).is_file()


def write_mixture(directory: Path, components: Sequence[tuple[str, str, float]]) -> None:
    """Write mixture.json for (subdirectory, source spec, weight) components."""
    write_json(directory / MIXTURE, {
        "format": _FORMAT,
        "components": [{"path": p, "source": s, "weight": w} for p, s, w in components],
    })


def open_mixture(path: str | os.PathLike[str], tokenizer: Any = None) -> Mixture:
    """Open a mixture directory written by `forja prepare`."""
    remote = is_url(path)  # an object store: the components are URLs below it
    root: Any = str(path).rstrip("/") if remote else Path(path).expanduser()
    file = join(root, MIXTURE) if remote else root / MIXTURE
    try:
        spec = json.loads(read_bytes(file).decode("utf-8") if remote else file.read_text(encoding="utf-8"))
        components = [(join(root, c["path"]) if remote else root / c["path"], float(c["weight"]))
                      for c in spec["components"]]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ForjaError(f"{file} is not a valid mixture file ({exc}); prepare the data again") from exc
    if spec.get("format") != _FORMAT:
        raise ForjaError(f"{file} is not a forja mixture file; prepare the data again")
    return Mixture.of([(open_prepared(p, tokenizer), w) for p, w in components])
