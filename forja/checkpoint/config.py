"""The [checkpoint] section of a config."""

from __future__ import annotations

from dataclasses import dataclass

from forja.errors import ForjaError


@dataclass(kw_only=True)
class CheckpointConfig:
    """When and how checkpoints are written (under <run.dir>/checkpoints)."""

    interval: int = 500
    """Steps between checkpoints; one is always written at the end. 0: only at the end."""
    keep: int = 3
    """Complete checkpoints kept; older ones are deleted. 0 keeps all."""
    async_save: bool = False
    """Write checkpoints in the background while training continues."""
    enabled: bool = True
    """Write checkpoints at all."""

    def __post_init__(self) -> None:
        if self.interval < 0 or self.keep < 0:
            raise ForjaError("checkpoint.interval and checkpoint.keep must be >= 0")
