"""DeepSeek-V3.2 (DeepSeek-AI 2025, arXiv 2512.02556), single-device: DeepSeek-V3
(forja/models/deepseek_v3) whose latent attention is sparse: DeepSeek Sparse Attention
(forja/models/common/sparse_attention.py), a lightning indexer per block choosing the
`index_topk` keys each query attends to. GLM-5 (forja/models/glm5) is the same model with its
indexer's rotary pairs interleaved.

Parameter names: DeepSeek-V3's, plus attention.indexer.{wq_b, wk, k_norm, weights_proj} in
every block. The KV cache keeps each block's expanded keys and values, as DeepSeek-V3's, and
the indexer's keys in its per-layer mixer state.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from forja.errors import ForjaError
from forja.models.common.sparse_attention import SparseMLA, check_dsa_fields
from forja.models.deepseek_v3.model import DeepSeekV3, DeepSeekV3Args


@dataclass(kw_only=True)
class DeepSeekV32Args(DeepSeekV3Args):
    """A DeepSeek-V3.2 model's shape: DeepSeek-V3's and its indexer's (q_lora_rank must be above 0:
    the indexer reads the query latent)."""

    index_n_heads: int = 64
    """The lightning indexer's heads H_I (Hugging Face `index_n_heads`)."""
    index_head_dim: int = 128
    """Width d_I of each indexer head and of its one key (`index_head_dim`); its first
    qk_rope_head_dim dimensions rotate."""
    index_topk: int = 2048
    """Keys each query attends to (`index_topk`); all of them where fewer exist."""
    index_rope_interleaved: bool = False
    """The indexer rotates interleaved pairs (GLM-5) rather than halves (DeepSeek-V3.2)."""
    dsa_stage: Literal["dense_warmup", "sparse"] | None = None
    """How the indexer trains: None, not at all (transformers' forward); "dense_warmup", dense
    attention and the indexer fitted to it; "sparse", top-k attention and the indexer fitted to
    it over the selected keys (forja/models/common/sparse_attention.py)."""
    indexer_loss_weight: float = 1.0
    """Weight of the indexer's KL loss (summed over blocks, each a mean over tokens) in the step's loss."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.q_lora_rank < 1:
            raise ForjaError(f"model.q_lora_rank={self.q_lora_rank}: DeepSeek Sparse Attention's indexer reads the "
                             "query latent; set q_lora_rank >= 1")
        if self.attention != "sdpa":
            raise ForjaError(f"model.attention={self.attention!r}: sparse attention reads dense masks and masks "
                             "SDPA with its selected keys; set model.attention = \"sdpa\"")
        check_dsa_fields(self.index_n_heads, self.index_head_dim, self.index_topk, self.qk_rope_head_dim,
                         self.dsa_stage, self.indexer_loss_weight)

    def layout_limits(self) -> dict[str, str]:
        # The indexer's target sums the attention of every head, of which a TP rank holds a share
        # (context parallelism gathers it: forja/parallel/cp).
        return {"tp": "the indexer's training stages (model.dsa_stage)"} if self.dsa_stage is not None else {}


class DeepSeekV32(DeepSeekV3):
    args: DeepSeekV32Args

    def build_attention(self, layer: int) -> SparseMLA:
        a = self.args
        return SparseMLA(a.dim, a.n_heads, q_lora_rank=a.q_lora_rank, kv_lora_rank=a.kv_lora_rank,
                         qk_nope_head_dim=a.qk_nope_head_dim, qk_rope_head_dim=a.qk_rope_head_dim,
                         v_head_dim=a.v_head_dim, softmax_scale=a.softmax_scale(),
                         fused_norm="rms_norm" in a.fused_ops, index_n_heads=a.index_n_heads,
                         index_head_dim=a.index_head_dim, index_topk=a.index_topk,
                         index_interleaved=a.index_rope_interleaved, stage=a.dsa_stage,
                         loss_weight=a.indexer_loss_weight)

    def mixer_flops(self, kind: str, seq_len: int) -> int:
        """Training FLOPs per token of one block beyond 6 x its parameters: latent attention over
        all T keys, as computed (the selected keys are a mask over dense SDPA, which computes the
        masked scores too: forja/models/common/sparse_attention.py), and the indexer's scores over
        all T keys (q_I . k_I over d_I, then the per-head weights: 2 H_I (d_I + 1) T forward).
        Trained (dsa_stage set) the indexer's backward doubles its forward, and its target, the
        attention's probabilities, takes q k^T once more without gradients (2 H dk T); untrained it
        runs forward only, so its projections cost 2, not 6, FLOPs a parameter: the difference is
        taken off here."""
        a = self.args
        attention = 6 * a.n_heads * (a.head_dim + a.v_head_dim) * seq_len
        scores = 2 * a.index_n_heads * (a.index_head_dim + 1) * seq_len
        if a.dsa_stage is not None:
            return attention + 3 * scores + 2 * a.n_heads * a.head_dim * seq_len
        projections = a.q_lora_rank * a.index_n_heads * a.index_head_dim + a.dim * (a.index_head_dim + a.index_n_heads)
        return attention + scores - 4 * projections
