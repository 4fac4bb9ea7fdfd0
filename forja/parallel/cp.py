"""Context parallelism: the sequence of every sample split over `parallel.cp` ranks.

Each rank holds 2 * cp chunks' worth of tokens in a load-balanced order (chunk i and its
mirror 2cp-1-i, so causal attention costs every rank the same), and attention passes
keys and values around the ring (PyTorch's `context_parallel`, which replaces SDPA with
ring attention on CUDA kernels only). Tokens, labels and their positions are split the
same way, so RoPE rotates each token by its true position.

FSDP shards parameters over the data-parallel and context-parallel ranks together, and
the loss is averaged over both: a cp group sees one batch, in pieces (both groups are
made by ParallelDims).
"""

from __future__ import annotations

import contextlib

import torch
from torch.distributed.device_mesh import DeviceMesh


def cp_context(cp_mesh: DeviceMesh | None, tokens: torch.Tensor, labels: torch.Tensor,
               positions: torch.Tensor) -> contextlib.AbstractContextManager:
    """Within it, `tokens`, `labels` (B, T) and `positions` (T,) hold this rank's part."""
    if cp_mesh is None:
        return contextlib.nullcontext()
    from torch.distributed.tensor.experimental import context_parallel

    return context_parallel(cp_mesh, buffers=[tokens, labels, positions], buffer_seq_dims=[1, 1, 0],
                            no_restore_buffers={tokens, labels, positions})
