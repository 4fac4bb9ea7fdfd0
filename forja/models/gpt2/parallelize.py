"""How a GPT-2 model is spread over ranks.

Its module names match Llama's, so Llama's plan applies with two changes: the MLP has no
gate (w3), and learned positions are added to the embedding's output, so with sequence
parallelism the embedding returns the whole sequence and the first block splits it.
"""

from __future__ import annotations

from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import PrepareModuleInput, RowwiseParallel

from forja.models.common.transformer import Transformer
from forja.models.llama.parallelize import apply_layout, tp_plans
from forja.parallel.config import ParallelConfig
from forja.parallel.dims import ParallelDims


def parallelize_gpt2(model: Transformer, dims: ParallelDims, mesh: DeviceMesh, cfg: ParallelConfig) -> None:
    sp = cfg.sequence_parallel and dims.tp > 1
    root, block = tp_plans(sp)
    del block["feed_forward.w3"]
    if sp:
        root["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
        root["layers.0"] = PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),),
                                              use_local_output=True)
    apply_layout(model, dims, mesh, cfg, (root, block))
