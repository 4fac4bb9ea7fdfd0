"""One layout truth: every layout `forja plan` ranks is one `forja train` accepts, and every
one it marks refused is one train refuses, over a grid of jobs (dense, mixture of experts,
tied embeddings, float8, compile, document masks, fp16, every pipeline schedule).

Train's side is reached the way a user reaches it: the recipe loaded again with the
candidate's `--set` line, then the preflight's request to the validator. Before the one
validator, the README's own `forja plan llama3-8b --gpus 64` ranked first a cp 2 layout that
train refused (document masks)."""

from __future__ import annotations

import dataclasses

import pytest

from forja.config import load_config
from forja.models.config import run_model_args
from forja.parallel.checks import layout_errors
from forja.parallel.config import PP_SCHEDULES
from forja.plan import get_hardware, job_from_config
from forja.plan.cli import set_items  # the --set line forja plan prints
from forja.plan.layout import with_layout
from forja.plan.planner import default_space, plan
from forja.train.launch.preflight import Preflight

PRINTED = 10  # rows of forja plan's table (its default --top)

JOBS = {
    "llama3-8b": ("llama3-8b", []),
    "llama3-8b, compile, no document mask": ("llama3-8b", ["parallel.compile=true", "model.document_mask=false"]),
    "llama3-8b, float8": ("llama3-8b", ['train.float8="tensorwise"', "parallel.compile=true"]),
    "llama3-8b, fp16, bf16 params": ("llama3-8b", ['train.precision="fp16"', 'parallel.mixed_precision="bf16"']),
    "llama 3.2-1b (tied)": ("llama3-1b", []),
    "qwen3-30b-a3b (MoE)": ("llama3-8b", ['model.family="qwen3"', 'model.flavor="30b-a3b"']),
    "deepseek-v3 16b (MoE, latent attention)": ("llama3-8b", ['model.family="deepseek_v3"', 'model.flavor="16b"']),
}
WORLDS = {"h100": (16,), "cpu": (4,)}


def _train_errors(recipe: str, overrides: list[str], layout, world: int, device_type: str) -> list[str]:
    cfg = load_config(recipe, overrides + set_items(layout))
    args = run_model_args(cfg.model, cfg.data.vocab_size)
    return layout_errors(Preflight(cfg, world_size=world, device_type=device_type, args=args).request())


@pytest.mark.parametrize("name", JOBS)
def test_what_the_planner_ranks_is_what_train_accepts(name):
    recipe, overrides = JOBS[name]
    base = load_config(recipe, overrides)
    args = run_model_args(base.model, base.data.vocab_size)
    checked = 0
    for kind, worlds in WORLDS.items():
        hw = get_hardware(kind, memory_gib=80 if kind == "h100" else 64)
        device_type = "cpu" if kind == "cpu" else "cuda"
        job = job_from_config(base, gpu=kind != "cpu", args=args)
        space = dataclasses.replace(default_space(hw), pp_schedules=PP_SCHEDULES)  # every schedule
        for world in worlds:
            ranked = plan(job, hw, world, space=space)
            printed = [c for c in ranked if c.fits][:PRINTED]
            for c in printed:  # the rows a user copies, through the recipe and their --set line
                assert _train_errors(recipe, overrides, c.layout, world, device_type) == [], c.layout.describe()
            for c in ranked:  # every candidate: ranked as running exactly when train accepts it
                errors = layout_errors(Preflight(with_layout(base, c.layout), world_size=world, device_type=device_type,
                                                 args=args).request())
                assert (errors == []) == c.runs, (c.layout.describe(), errors, c.why_not)
                assert c.fits <= c.runs
            checked += len(ranked)
    assert checked > 100
