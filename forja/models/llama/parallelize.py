"""How a Llama model is spread over ranks (the only Llama file that knows parallelism).

Applies, in the order of forja/parallel/__init__.py: tensor parallel, activation
checkpointing, compile, FSDP. Layouts beyond data parallelism (tp, pp, cp > 1) arrive
with the parallelism issue and are refused clearly until then.
"""

from __future__ import annotations

from torch.distributed.device_mesh import DeviceMesh

from forja.errors import ForjaError
from forja.models.common.transformer import Transformer
from forja.parallel.config import ParallelConfig
from forja.parallel.dims import ParallelDims
from forja.parallel.fsdp import apply_fsdp


def parallelize_llama(model: Transformer, dims: ParallelDims, mesh: DeviceMesh, cfg: ParallelConfig) -> None:
    for key in ("tp", "pp", "cp"):
        if getattr(dims, key) > 1:
            raise ForjaError(f"parallel.{key} = {getattr(dims, key)}: this layout is not available yet; "
                             "use data parallelism (parallel.dp_shard / parallel.dp_replicate)")
    if dims.dp > 1:
        apply_fsdp(model, mesh, dims)
