"""The [parallel] section of a config: how the model and data are spread over ranks."""

from __future__ import annotations

from dataclasses import dataclass

from forja.errors import ForjaError


@dataclass(kw_only=True)
class ParallelConfig:
    """Degrees of each kind of parallelism; their product is the world size."""

    dp_replicate: int = 1
    """Data-parallel replicas (DDP-like, or the outer dimension of HSDP)."""
    dp_shard: int = -1
    """FSDP sharding degree; -1 takes whatever the other degrees leave of the world size."""
    tp: int = 1
    """Tensor-parallel degree."""
    pp: int = 1
    """Pipeline-parallel degree."""
    cp: int = 1
    """Context-parallel degree (CUDA only)."""
    timeout_s: float = 600.0
    """Collective timeout: a hung rank fails the run after this many seconds."""

    def __post_init__(self) -> None:
        for key in ("dp_replicate", "tp", "pp", "cp"):
            if getattr(self, key) < 1:
                raise ForjaError(f"parallel.{key} = {getattr(self, key)} must be at least 1")
        if self.dp_shard < 1 and self.dp_shard != -1:
            raise ForjaError(f"parallel.dp_shard = {self.dp_shard} must be at least 1, or -1 for the rest")
