"""OLMo 2 (OLMo et al. 2024, "2 OLMo 2 Furious", arXiv 2501.00656), single-device.

OLMo 3's blocks without its local attention (forja/models/olmo3/model.py): post-norm blocks,
h = x + post_attention_norm(attn(x)), out = h + post_ffn_norm(mlp(h)); QK-norm over the whole
query and key projections before RoPE; SwiGLU; untied embeddings; every block attends to the
whole causal context with one rotary table (base 500,000 in the released models).
"""

from __future__ import annotations

from dataclasses import dataclass

from forja.errors import ForjaError
from forja.models.olmo3.model import Olmo3, Olmo3Args


@dataclass(kw_only=True)
class Olmo2Args(Olmo3Args):
    """An OLMo 2 model's shape; the package's FLAVORS hold the published sizes. Every block is
    full attention: `layer_types` and a sliding window are OLMo 3's."""

    def __post_init__(self) -> None:
        if self.sliding_window is not None or any(t != "full_attention" for t in self.layer_types or ()):
            raise ForjaError("model.sliding_window / model.layer_types: OLMo 2 attends to the whole context in "
                             "every block; for local attention use model.family = \"olmo3\"")
        self.local_rope_theta = self.rope_theta
        super().__post_init__()


class Olmo2(Olmo3):
    """OLMo 3's decoder with every block full attention (its local blocks never built)."""

    args: Olmo2Args
