"""The registry of model families: a family's name -> what forja knows about it.

A `ModelSpec` holds the family's model class, its typed args, its sizes (flavors), its
Hugging Face adapter and its tensor-parallel plan, as objects and callables: importing
the registry imports every family, so a typo fails at import, not mid-run.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch

from forja.errors import ForjaError
from forja.models.common.hf_rules import HFAdapter
from forja.models.common.tp_plan import TPPlan
from forja.models.common.transformer import Transformer, TransformerArgs
from forja.models.deepseek_v3 import hf as deepseek_v3_hf
from forja.models.deepseek_v3.flavors import FLAVORS as DEEPSEEK_V3_FLAVORS
from forja.models.deepseek_v3.model import DeepSeekV3, DeepSeekV3Args
from forja.models.deepseek_v3.parallelize import deepseek_v3_tp_plan
from forja.models.gpt2 import hf as gpt2_hf
from forja.models.gpt2.flavors import FLAVORS as GPT2_FLAVORS
from forja.models.gpt2.model import GPT2, GPT2Args
from forja.models.gpt2.parallelize import gpt2_tp_plan
from forja.models.gpt_oss import hf as gpt_oss_hf
from forja.models.gpt_oss.flavors import FLAVORS as GPT_OSS_FLAVORS
from forja.models.gpt_oss.model import GptOss, GptOssArgs
from forja.models.gpt_oss.parallelize import gpt_oss_tp_plan
from forja.models.llama import hf as llama_hf
from forja.models.llama.flavors import FLAVORS as LLAMA_FLAVORS
from forja.models.llama.model import Llama, LlamaArgs
from forja.models.llama.parallelize import llama_tp_plan
from forja.models.mixtral import hf as mixtral_hf
from forja.models.mixtral.flavors import FLAVORS as MIXTRAL_FLAVORS
from forja.models.mixtral.model import Mixtral, MixtralArgs
from forja.models.gemma3 import hf as gemma3_hf
from forja.models.gemma3.flavors import FLAVORS as GEMMA3_FLAVORS
from forja.models.gemma3.model import Gemma3, Gemma3Args
from forja.models.gemma3.parallelize import gemma3_tp_plan
from forja.models.mixtral.parallelize import mixtral_tp_plan
from forja.models.olmo3 import hf as olmo3_hf
from forja.models.olmo3.flavors import FLAVORS as OLMO3_FLAVORS
from forja.models.olmo3.model import Olmo3, Olmo3Args
from forja.models.olmo3.parallelize import olmo3_tp_plan
from forja.models.olmo_hybrid import hf as olmo_hybrid_hf
from forja.models.olmo_hybrid.flavors import FLAVORS as OLMO_HYBRID_FLAVORS
from forja.models.olmo_hybrid.model import OlmoHybrid, OlmoHybridArgs
from forja.models.olmo_hybrid.parallelize import olmo_hybrid_tp_plan
from forja.models.qwen3 import hf as qwen3_hf
from forja.models.qwen3.flavors import FLAVORS as QWEN3_FLAVORS
from forja.models.qwen3.model import Qwen3, Qwen3Args
from forja.models.qwen3.parallelize import qwen3_tp_plan
from forja.models.qwen3_5 import hf as qwen3_5_hf
from forja.models.qwen3_5.flavors import FLAVORS as QWEN3_5_FLAVORS
from forja.models.qwen3_5.model import Qwen3_5, Qwen3_5Args
from forja.models.qwen3_5.parallelize import qwen3_5_tp_plan
from forja.models.qwen3_next import hf as qwen3_next_hf
from forja.models.qwen3_next.flavors import FLAVORS as QWEN3_NEXT_FLAVORS
from forja.models.qwen3_next.model import Qwen3Next, Qwen3NextArgs
from forja.models.qwen3_next.parallelize import qwen3_next_tp_plan


@dataclass(frozen=True)
class ModelSpec:
    """What forja knows about one family."""

    name: str
    model_cls: type[Transformer]
    args_cls: type[TransformerArgs]
    flavors: dict[str, dict]
    """Published and test sizes: flavor name -> args fields."""
    hf: HFAdapter
    """Conversion to and from Hugging Face checkpoints."""
    tp_plan: Callable[[TransformerArgs, bool], TPPlan]
    """(args, sequence_parallel) -> the family's tensor-parallel plan."""


FAMILIES: dict[str, ModelSpec] = {
    "llama": ModelSpec("llama", Llama, LlamaArgs, LLAMA_FLAVORS, llama_hf.ADAPTER, llama_tp_plan),
    "gpt2": ModelSpec("gpt2", GPT2, GPT2Args, GPT2_FLAVORS, gpt2_hf.ADAPTER, gpt2_tp_plan),
    "deepseek_v3": ModelSpec("deepseek_v3", DeepSeekV3, DeepSeekV3Args, DEEPSEEK_V3_FLAVORS, deepseek_v3_hf.ADAPTER,
                             deepseek_v3_tp_plan),
    "qwen3": ModelSpec("qwen3", Qwen3, Qwen3Args, QWEN3_FLAVORS, qwen3_hf.ADAPTER, qwen3_tp_plan),
    "qwen3_5": ModelSpec("qwen3_5", Qwen3_5, Qwen3_5Args, QWEN3_5_FLAVORS, qwen3_5_hf.ADAPTER, qwen3_5_tp_plan),
    "qwen3_next": ModelSpec("qwen3_next", Qwen3Next, Qwen3NextArgs, QWEN3_NEXT_FLAVORS, qwen3_next_hf.ADAPTER,
                            qwen3_next_tp_plan),
    "mixtral": ModelSpec("mixtral", Mixtral, MixtralArgs, MIXTRAL_FLAVORS, mixtral_hf.ADAPTER, mixtral_tp_plan),
    "gpt_oss": ModelSpec("gpt_oss", GptOss, GptOssArgs, GPT_OSS_FLAVORS, gpt_oss_hf.ADAPTER, gpt_oss_tp_plan),
    "olmo3": ModelSpec("olmo3", Olmo3, Olmo3Args, OLMO3_FLAVORS, olmo3_hf.ADAPTER, olmo3_tp_plan),
    "olmo_hybrid": ModelSpec("olmo_hybrid", OlmoHybrid, OlmoHybridArgs, OLMO_HYBRID_FLAVORS, olmo_hybrid_hf.ADAPTER,
                             olmo_hybrid_tp_plan),
    "gemma3": ModelSpec("gemma3", Gemma3, Gemma3Args, GEMMA3_FLAVORS, gemma3_hf.ADAPTER, gemma3_tp_plan),
}


def get_family(family: str) -> ModelSpec:
    if family not in FAMILIES:
        raise ForjaError(f"unknown model family {family!r}; known families: {', '.join(FAMILIES)}")
    return FAMILIES[family]


def spec_of(args: TransformerArgs) -> ModelSpec:
    """The family whose typed args `args` are."""
    for spec in FAMILIES.values():
        if type(args) is spec.args_cls:
            return spec
    raise ForjaError(f"{type(args).__name__} is not the args of a forja model family")


def family_of(model: Transformer) -> ModelSpec:
    return spec_of(model.args)


def model_args(family: str, flavor: str, **overrides) -> TransformerArgs:
    """The typed arguments of `family`/`flavor`, with fields overridden by keyword."""
    spec = get_family(family)
    if flavor not in spec.flavors:
        raise ForjaError(f"unknown {family} flavor {flavor!r}; known flavors: {', '.join(spec.flavors)}")
    fields = {f.name for f in dataclasses.fields(spec.args_cls)}
    unknown = sorted(set(overrides) - fields)
    if unknown:
        raise ForjaError(f"{family} has no model field {unknown[0]!r}; valid fields: {', '.join(sorted(fields))}")
    return spec.args_cls(**{**spec.flavors[flavor], **overrides})


def build_model(family: str, flavor: str, *, device: str | torch.device = "cpu", seed: int = 0,
                dtype: torch.dtype = torch.float32, **overrides) -> Transformer:
    """Build a model with weights initialized from `seed`.

    `device="meta"` returns it uninitialized, for the parallel build order
    (shard, then `to_empty`, then `init_weights(seed)`).
    """
    args = model_args(family, flavor, **overrides)
    return build_from_args(args, device=device, seed=seed, dtype=dtype)


def build_from_args(args: TransformerArgs, *, device: str | torch.device = "cpu", seed: int = 0,
                    dtype: torch.dtype = torch.float32, init: bool = True) -> Transformer:
    """Build from typed arguments; `init=False` leaves weights to be loaded."""
    with torch.device("meta"):
        model = spec_of(args).model_cls(args).to(dtype)  # cast while on meta: costs no memory
    if str(device) == "meta":
        return model
    model = model.to_empty(device=device)
    model.tie_weights()
    if init:
        model.init_weights(seed)
    return model
