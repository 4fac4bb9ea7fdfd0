"""Model families: a registry from family name to its model, sizes and adapters.

    from forja.models import build_model, load_hf_checkpoint, save_hf_checkpoint
    model = build_model("llama", "debug")           # random weights from a seed
    model = load_hf_checkpoint("path/to/hf_dir")     # a Hugging Face checkpoint
    save_hf_checkpoint(model, "out_dir")            # transformers can load it

Single-device code only: nothing here imports forja.parallel, forja.train or
forja.checkpoint. A family's tensor-parallel plan is data (models/<family>/parallelize.py, or the dense default)
that forja.parallel applies.
"""

from forja.models.hf import load_hf_checkpoint, save_hf_checkpoint
from forja.models.registry import (
    FAMILIES,
    ModelSpec,
    build_from_args,
    build_model,
    family_of,
    get_family,
    model_args,
    spec_of,
)

__all__ = ["FAMILIES", "ModelSpec", "build_from_args", "build_model", "family_of", "get_family",
           "load_hf_checkpoint", "model_args", "save_hf_checkpoint", "spec_of"]
