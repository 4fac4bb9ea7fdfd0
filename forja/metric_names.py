"""The names of the metrics forja logs, in one place.

The step engine's hooks (forja/train/step/), the loop's metrics callback and the throughput
meter make these names; the console, the trackers and `forja report` read them back from
metrics.jsonl. A name changed here changes on both sides at once. A leaf module (it imports
nothing of forja), so that every layer, `forja.metrics` and `forja.report` included, may use it.
"""

from __future__ import annotations

# -- the loop: forja/train/callbacks.py --------------------------------------------------------
LOSS = "loss"
VAL_LOSS = "val_loss"
VAL_PREFIX = "val_"  # every validation figure (val_loss, the activation sizes) starts so
LR = "lr"
GRAD_NORM = "grad_norm"
TOKENS_SEEN = "tokens_seen"
SKIPPED_STEPS = "skipped_steps"
STAGE = "stage"

# -- throughput and memory: forja/metrics/throughput.py ---------------------------------------
TOKENS_PER_SEC = "tokens_per_sec"
TOKENS_PER_SEC_PER_DEVICE = "tokens_per_sec_per_device"
TFLOPS = "tflops"
MFU = "mfu"
STEP_TIME = "step_time"
DATA_WAIT = "data_wait"
DATA_WAIT_FRAC = "data_wait_frac"
MEM_PEAK_GB = "mem_peak_gb"

# -- fp16's loss scale: forja/train/step/scaler.py ---------------------------------------------
LOSS_SCALE = "loss_scale"
OVERFLOW = "overflow"
OVERFLOWS = "overflows"

# -- a mixture of experts: forja/train/step/experts.py -----------------------------------------
MOE = "moe"
MOE_LOAD_MAX_MEAN = "moe/load_max_mean"
MOE_LOAD_CV = "moe/load_cv"
MOE_DROPPED = "moe/dropped"
MOE_AUX_LOSS = "moe/aux_loss"
MOE_Z_LOSS = "moe/z_loss"
MOE_FIGURES = ("load_max_mean", "load_cv", "dropped", "aux_loss", "z_loss")
"""What each MoE layer reports (moe/layer{i}/<figure>), and the model as a whole (moe/<figure>)."""


def moe(figure: str) -> str:
    """A whole-model MoE figure: moe/load_cv."""
    return f"{MOE}/{figure}"


def moe_layer(layer: int, figure: str) -> str:
    """One MoE layer's figure: moe/layer3/load_cv."""
    return f"{MOE}/layer{layer}/{figure}"


def moe_layer_pattern(figure: str) -> str:
    """A regular expression of moe_layer's names for `figure`; its group is the layer."""
    return rf"{MOE}/layer(\d+)/{figure}"

# -- multi-token prediction: forja/train/step/mtp.py -------------------------------------------
MTP = "mtp"


def mtp_loss(depth: int) -> str:
    """Depth k's mean cross-entropy: mtp/loss_1 predicts the token after next."""
    return f"{MTP}/loss_{depth}"


# -- attention logits and QK-clip: forja/train/step/attention_logits.py ------------------------
ATTN = "attn"
ATTN_MAX_LOGIT = "attn/max_logit"
ATTN_CLIPPED_HEADS = "attn/clipped_heads"


def attn_layer_max_logit(layer: int) -> str:
    """One layer's largest attention logit of the step: attn/layer3/max_logit."""
    return f"{ATTN}/layer{layer}/max_logit"


# -- what else is logged under a group of its own -----------------------------------------------
HEALTH = "health"  # forja/train/resilience: anomalies, rollbacks, replays
EVAL = "eval"  # forja/train/evaluation.py: eval/<task>/<figure>
DATA = "data"  # the loader's padding and cut documents
TOKENS = "tokens"  # tokens given by each data source
SAMPLES = "samples"  # generated text (log_text)
GROUPS = (EVAL, MOE, ATTN, HEALTH, SAMPLES, DATA, TOKENS)
"""The metric groups (name prefixes before '/') a tracker draws against forja's step."""
