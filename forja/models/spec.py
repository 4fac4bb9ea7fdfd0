"""What forja knows about one model family: its `ModelSpec`.

Each family package (forja/models/<family>/) exposes one `SPEC` in its __init__.py; the
registry (forja/models/registry.py) lists the packages and reads their specs, so a family
lands without a line of its own anywhere else.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from forja.models.common.hf_rules import HFAdapter
from forja.models.common.tp_plan import TPPlan, default_tp_plan
from forja.models.common.transformer import Transformer, TransformerArgs


@dataclass(frozen=True)
class ModelSpec:
    """What forja knows about one family."""

    name: str
    """The family's name (model.family), its package's."""
    model_cls: type[Transformer]
    args_cls: type[TransformerArgs]
    flavors: dict[str, dict]
    """Published and test sizes: flavor name -> args fields."""
    hf: HFAdapter
    """Conversion to and from Hugging Face checkpoints."""
    tp_plan: Callable[[TransformerArgs, bool], TPPlan] = default_tp_plan
    """(args, sequence_parallel) -> the family's tensor-parallel plan; by default the dense
    decoder's (forja/models/common/tp_plan.py), which needs no parallelize.py of the family's own."""
