"""DeepSeek-V3.2: `model.py` the model, `hf.py` its checkpoints, `parallelize.py` its TP plan.

DeepSeek-V3 with DeepSeek Sparse Attention (forja/models/common/sparse_attention.py). The
published size is DeepSeek-V3.2's (and V3.2-Exp's) config.json: DeepSeek-V3's 671B shapes
plus the lightning indexer (index_n_heads 64, index_head_dim 128, index_topk 2048). Its
multi-token prediction layer is off in the flavor (`671b` counts the main model, as
transformers builds it).
"""

from forja.models.deepseek_v3 import FLAVORS as V3_FLAVORS
from forja.models.deepseek_v32.hf import ADAPTER
from forja.models.deepseek_v32.model import DeepSeekV32, DeepSeekV32Args
from forja.models.deepseek_v32.parallelize import deepseek_v32_tp_plan
from forja.models.spec import ModelSpec

FLAVORS: dict[str, dict] = {
    # ~2M parameters: DeepSeek-V3's debug model (a query latent, YaRN, grouped sigmoid routing,
    # a shared expert, a dense first block) with a 4-head indexer choosing 8 keys, so that the
    # tests' sequences (tens of tokens) are sparse.
    "debug": dict(V3_FLAVORS["debug"], index_n_heads=4, index_head_dim=32, index_topk=8),
    # DeepSeek-V3.2: 671B total, 37B active, plus 0.8B of indexers.
    "671b": dict(V3_FLAVORS["671b"], index_n_heads=64, index_head_dim=128, index_topk=2048),
}

SPEC = ModelSpec("deepseek_v32", DeepSeekV32, DeepSeekV32Args, FLAVORS, ADAPTER, tp_plan=deepseek_v32_tp_plan)
