"""Parallelism: how a model and its data are spread over ranks.

    degrees.py      the degrees of a layout, one value with named axes (Axis, Degrees)
    dims.py         degrees -> the DeviceMesh and every group derived from it
    parallelize.py  a layout applied to a model or stage: TP -> AC -> compile -> FSDP
    tp, ac, compile, fsdp, cp   one technique each, with torch's own APIs
    pp.py, pp_split.py          pipeline stages: where to cut, who runs what, the schedule
    checks.py       a layout checked against the model and batch before anything starts

This package knows models (it applies a family's plan to them) but nothing of training:
the build order and the step engine that use it live in forja/train.
"""

from forja.parallel.config import ParallelConfig
from forja.parallel.degrees import Axis, Degrees
from forja.parallel.dims import ParallelDims
from forja.parallel.parallelize import parallelize
from forja.parallel.tp import local_value, loss_context

__all__ = ["Axis", "Degrees", "ParallelConfig", "ParallelDims", "local_value", "loss_context", "parallelize"]
