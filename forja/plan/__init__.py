"""`forja plan`: predicted memory and speed of every parallel layout (docs/planner.md).

    from forja.plan import evaluate, get_hardware, job_from_config, plan
    job = job_from_config(cfg, gpu=True)                 # the model, batch, precision, optimizer
    ranked = plan(job, get_hardware("h100"), world=64)   # every layout; fitting ones first, fastest first
    ranked[0].layout.overrides()                         # the --set keys that select it

hardware (the device table) -> shape (the model's parameters and FLOPs) -> job -> layout
(what is searched) -> memory and speed (the models) -> planner (the search); cli.py is the command.
"""

from forja.plan.hardware import Hardware, get_hardware, load_hardware
from forja.plan.job import Job, job_from_config
from forja.plan.layout import Layout, SearchSpace
from forja.plan.planner import Candidate, evaluate, plan

__all__ = ["Candidate", "Hardware", "Job", "Layout", "SearchSpace", "evaluate", "get_hardware", "job_from_config",
           "load_hardware", "plan"]
