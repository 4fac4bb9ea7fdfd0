"""The best model per second: forja's default recipe against its speedrun recipe (and each of the
speedrun's switches on its own), trained in one process on the same data and hardware, each
model scored by one evaluator as it trains.

    python bench/loss_race.py [--steps 200] [--eval-every 20] [--windows 16]
                              [--only NAMES] [--ablate] [--out runs/bench-loss-race]

The evaluator: the mean next-token loss over fixed held-out windows (the validation split of
the recipe's corpus, which training never reads: forja's ValidationLoader, `--windows`
micro-batches of the default recipe's shape), computed from the model's logits with plain
causal attention, the same function for every contender. Training time is the wall time of the
training steps alone (the evaluations and the build excluded). Reported per contender: the
held-out loss at each evaluation, the final one, tokens, training seconds; then the race:
the first evaluated step at which the speedrun reaches the default recipe's final held-out loss,
its steps and training time as fractions of the default's. `--ablate` adds a row per switch of
the speedrun recipe applied alone to the default recipe. Every row also gives its held-out loss
at the default's training time (interpolated between evaluations; its final one where it
finished sooner).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from forja.config import load_config  # noqa: E402
from forja.train.launch.data import data  # noqa: E402
from forja.train.trainer import Trainer  # noqa: E402

DEFAULT, SPEEDRUN = "forja default", "forja speedrun"
# Each switch of configs/speedrun.toml, as the overrides that apply it alone to the default
# recipe; and Muon's variants (optim.muon), each on top of the Muon switch.
MUON = ['optim.name="muon"', "optim.lr=0.01", "optim.muon.adamw_lr=0.003"]
SWITCHES = {
    "muon": MUON,
    "muon + polar express (4 steps)": MUON + ['optim.muon.orthogonalizer="polar_express"', "optim.muon.ns_steps=4"],
    "muon + cautious weight decay": MUON + ["optim.muon.cautious_weight_decay=true"],
    "qk-norm": ["model.overrides={qk_norm = true}"],
    "wsd schedule": ['schedule.name="wsd"', "schedule.decay_fraction=0.4", "schedule.min_lr_ratio=0.0",
                     "schedule.warmup_steps=10"],
    "bos-aligned packing": ['data.packing="bos"'],
}


@dataclass
class Contender:
    name: str
    recipe: str
    sets: list[str] = field(default_factory=list)
    evals: list[dict] = field(default_factory=list)  # {"step", "train_s", "tokens", "loss"}


def held_out(recipe: str, sets: list[str], windows: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(inputs, labels) of `windows` validation micro-batches of the recipe's shape: the held-out
    windows every contender is scored on."""
    from forja.data import ValidationLoader

    cfg = load_config(recipe, sets)
    _, dataset = data(cfg, rank=0)
    loader = ValidationLoader(dataset, seq_len=cfg.train.seq_len, micro_batch_size=cfg.train.micro_batch_size,
                              num_batches=windows, dp_rank=0, dp_world_size=1)
    return [(b.input_ids.clone(), b.labels.clone()) for b in loader]


@torch.no_grad()
def evaluate(model: torch.nn.Module, windows: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    """Mean next-token loss over the windows' labelled tokens, causal attention, fp32."""
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    for inputs, labels in windows:
        logits = model(inputs)  # (B, T, V)
        mask = labels >= 0
        total += F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=-100,
                                 reduction="sum").item()
        count += int(mask.sum())
    model.train(was_training)
    return total / count


def race(c: Contender, steps: int, every: int, windows, out: Path) -> None:
    """Train `c` for `steps` steps, scoring it on the held-out windows every `every` steps."""
    run = Path(tempfile.mkdtemp(prefix="race-", dir=out))
    sets = [*c.sets, f"train.steps={steps}", "train.val_interval=0", "checkpoint.interval=0",
            "train.sample_tokens=0", f'run.dir="{run}"']
    trainer = Trainer(load_config(c.recipe, sets))
    try:
        trainer.setup()
        trainer.begin()
        model = trainer.parts[0]
        tokens_per_step = trainer.cfg.train.global_batch_size * trainer.cfg.train.seq_len
        train_s = 0.0
        c.evals.append({"step": 0, "train_s": 0.0, "tokens": 0, "loss": evaluate(model, windows)})
        for step in range(1, steps + 1):
            began = time.perf_counter()
            trainer.train_one_step()
            train_s += time.perf_counter() - began
            if step % every == 0 or step == steps:
                c.evals.append({"step": step, "train_s": train_s, "tokens": step * tokens_per_step,
                                "loss": evaluate(model, windows)})
                print(f"  {c.name}: step {step}, {train_s:.1f} s, held-out loss {c.evals[-1]['loss']:.4f}",
                      flush=True)
    finally:
        trainer.close()  # its watchdog too: the next contender's steps are not this one's


def loss_at(evals: list[dict], seconds: float) -> float:
    """The held-out loss at `seconds` of training, linear between evaluations (the last past them)."""
    for a, b in zip(evals, evals[1:]):
        if b["train_s"] >= seconds:
            share = (seconds - a["train_s"]) / max(b["train_s"] - a["train_s"], 1e-9)
            return a["loss"] + share * (b["loss"] - a["loss"])
    return evals[-1]["loss"]


def reached(evals: list[dict], target: float) -> dict | None:
    """The first evaluation at or below `target`."""
    return next((e for e in evals if e["loss"] <= target), None)


def summarize(contenders: list[Contender]) -> dict:
    rows = {c.name: {"final_loss": c.evals[-1]["loss"], "train_s": c.evals[-1]["train_s"],
                     "tokens": c.evals[-1]["tokens"], "steps": c.evals[-1]["step"], "evals": c.evals,
                     "sets": c.sets} for c in contenders}
    out: dict = {"contenders": rows}
    base = rows.get(DEFAULT)
    if base is None:
        return out
    for c in contenders:
        rows[c.name]["loss_at_default_time"] = loss_at(c.evals, base["train_s"])
    fast = rows.get(SPEEDRUN)
    if fast is not None:
        hit = reached(fast["evals"], base["final_loss"])
        out["race"] = {"target": base["final_loss"], "reached_at_step": hit and hit["step"],
                       "steps_fraction": hit and hit["step"] / base["steps"],
                       "time_fraction": hit and hit["train_s"] / base["train_s"],
                       "cost_per_step": (fast["train_s"] / fast["steps"]) / (base["train_s"] / base["steps"])}
    return out


def markdown(result: dict, header: str) -> str:
    lines = [header, ""]
    race_ = result.get("race")
    if race_:
        if race_["reached_at_step"]:
            lines.append(f"The speedrun reaches the default's final held-out loss ({race_['target']:.4f}) at step "
                         f"{race_['reached_at_step']}: {race_['steps_fraction']:.2f}x the default's steps, "
                         f"{race_['time_fraction']:.2f}x its training time; a step costs "
                         f"{race_['cost_per_step']:.2f}x the default's.")
        else:
            lines.append(f"The speedrun does not reach the default's final held-out loss ({race_['target']:.4f}).")
        lines.append("")
    lines += ["| contender | final held-out loss | at the default's time | steps | tokens | training s |",
              "|---|---:|---:|---:|---:|---:|"]
    for name, r in result["contenders"].items():
        at = r.get("loss_at_default_time")
        lines.append(f"| {name} | {r['final_loss']:.4f} | {'-' if at is None else f'{at:.4f}'} | {r['steps']} | "
                     f"{r['tokens']:,} | {r['train_s']:.1f} |")
    return "\n".join(lines)


def contenders(ablate: bool, only: set[str] | None) -> list[Contender]:
    out = [Contender(DEFAULT, "default"), Contender(SPEEDRUN, "speedrun")]
    if ablate:
        out += [Contender(f"default + {name}", "default", sets) for name, sets in SWITCHES.items()]
    return [c for c in out if only is None or c.name in only]


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=200, help="steps for every contender (the default recipe's)")
    p.add_argument("--eval-every", type=int, default=20)
    p.add_argument("--windows", type=int, default=16, help="held-out micro-batches of the default recipe's shape")
    p.add_argument("--only", default="", help="contender names, comma-separated")
    p.add_argument("--ablate", action="store_true", help="add each speedrun switch alone on the default recipe")
    p.add_argument("--set", dest="sets", action="append", default=[], help="an override for every contender")
    p.add_argument("--out", default="runs/bench-loss-race")
    args = p.parse_args(argv)
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    only = {n.strip() for n in args.only.split(",") if n.strip()} or None
    entries = contenders(args.ablate, only)
    for c in entries:
        c.sets = [*c.sets, *args.sets]
    windows = held_out("default", args.sets, args.windows)
    for c in entries:
        race(c, args.steps, args.eval_every, windows, out)
    result = summarize(entries)
    command = " ".join(["python bench/loss_race.py", *(argv if argv is not None else sys.argv[1:])])
    result["meta"] = {"date": datetime.date.today().isoformat(), "machine": platform.platform(),
                      "cpu_count": os.cpu_count(), "torch": torch.__version__, "command": command,
                      "held_out_tokens": sum(int((lab >= 0).sum()) for _, lab in windows)}
    text = markdown(result, f"{result['meta']['date']}, {os.cpu_count()} cores, torch {torch.__version__}, "
                            f"`{command}`, {result['meta']['held_out_tokens']:,} held-out tokens")
    (out / "loss_race.json").write_text(json.dumps(result, indent=1))
    (out / "loss_race.md").write_text(text + "\n")
    print(text)
    return result


if __name__ == "__main__":
    main()
