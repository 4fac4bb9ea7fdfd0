"""GLM-5 (Zhipu AI / Z.ai 2026; transformers' GlmMoeDsaForCausalLM), single-device: DeepSeek-V3.2's
architecture (forja/models/deepseek_v32: MLA with DeepSeek Sparse Attention, DeepSeekMoE with
sigmoid routing and a shared expert, dense first blocks) at GLM-5's shapes, its lightning
indexer rotating interleaved pairs (`index_rope_interleaved`, set here).

transformers' GLM-5 can also let a block reuse the previous block's top-k selection
(`indexer_types` "shared", arXiv 2603.12201); forja builds an indexer in every block and
refuses configs with shared ones (forja/models/glm5/hf.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from forja.errors import ForjaError
from forja.models.deepseek_v32.model import DeepSeekV32, DeepSeekV32Args


@dataclass(kw_only=True)
class GLM5Args(DeepSeekV32Args):
    """A GLM-5 model's shape: DeepSeek-V3.2's fields, its indexer's pairs interleaved."""

    index_rope_interleaved: bool = True
    """GLM-5's indexer rotates interleaved pairs; False is DeepSeek-V3.2's indexer (family deepseek_v32)."""

    def __post_init__(self) -> None:
        if not self.index_rope_interleaved:
            raise ForjaError("model.index_rope_interleaved=False is DeepSeek-V3.2's indexer, not GLM-5's; use "
                             "model.family = \"deepseek_v32\"")
        super().__post_init__()


class GLM5(DeepSeekV32):
    args: GLM5Args
