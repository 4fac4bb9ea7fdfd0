"""The best model per second: forja's default recipe against its speedrun recipe (and each of the
speedrun's switches on its own), and the peers' recipes, on the same tokens and hardware, each
model scored by one evaluator as it trains.

    python bench/loss_race.py [--steps N] [--eval-every 20] [--windows 16]
                              [--only NAMES] [--ablate] [--peers] [--out runs/bench-loss-race]

`--peers` adds two contenders, each in its own process (bench/peers_worker.py's protocol) and
given forja's host settings (glibc's malloc thresholds, confined intra-op threads) as forja's
Trainer gives itself: nanoGPT's Shakespeare recipe as a plain loop over transformers' GPT-2
(bench/race_nanogpt.py) and torchtitan's own llama3 recipe run by its Trainer (bench/peers_titan.py,
from the side environment bench/peers_env.py makes; `--no-titan` leaves it out).
Both train on the rows forja's default recipe trains on, in its order, at its model size
(layers, width, heads, vocabulary), batch and steps, and are scored on the same windows by
bench/race_eval.py.

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

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

sys.path.insert(0, str(REPO / "bench"))
import peers  # noqa: E402
from race_eval import held_out_loss, save_windows  # noqa: E402

from forja.config import load_config  # noqa: E402
from forja.train.launch.data import data  # noqa: E402
from forja.train.trainer import Trainer  # noqa: E402

DEFAULT, SPEEDRUN = "forja default", "forja speedrun"
# Each switch of configs/speedrun.toml, as the overrides that apply it alone to the default
# recipe; Muon's variants (optim.muon), each on top of the Muon switch; and the switches tried
# and left out of the recipe (a schedule, Llama's speedrun switches: forja/models/llama/model.py).
MUON = ['optim.name="muon"', "optim.lr=0.01", "optim.muon.adamw_lr=0.006"]
SWITCHES = {
    "muon": MUON,
    "muon + polar express (4 steps)": MUON + ['optim.muon.orthogonalizer="polar_express"', "optim.muon.ns_steps=4"],
    "muon + cautious weight decay": MUON + ["optim.muon.cautious_weight_decay=true"],
    "qk-norm": ["model.overrides={qk_norm = true}"],
    "wsd schedule": ['schedule.name="wsd"', "schedule.decay_fraction=0.4", "schedule.min_lr_ratio=0.0",
                     "schedule.warmup_steps=10"],
    "bos-aligned packing": ['data.packing="bos"'],
    "warm-up 10 and cosine to 0.2": ["schedule.warmup_steps=10", "schedule.min_lr_ratio=0.2"],
    "bf16 autocast": ['train.precision="bf16"'],
    "muon + bf16 orthogonalization": MUON + ['optim.muon.ns_dtype="bf16"'],
    # At ffn_dim x 1.5 (1,152) the squared-ReLU MLP holds SwiGLU's parameters.
    "relu2 mlp": ['model.overrides={ffn_activation = "relu2", ffn_dim = 1152}'],
    "zero-init projections": ["model.overrides={zero_init_projections = true}"],
    "u-net skips": ["model.overrides={unet_skips = true}"],
    "logit soft cap 15": ["model.overrides={logit_softcap = 15.0}"],
    "value embeddings (2 tables)": ["model.overrides={value_embeddings = 2}"],
    "multi-token prediction (depth 1)": ["model.mtp.depth=1"],
}


NANOGPT, TITAN = "nanoGPT recipe (HF GPT-2 loop)", "torchtitan llama3 recipe"
# Each peer: its worker script, and the optimizer values its recipe gives (torchtitan's
# default_adamw and TrainingConfig's max_norm; nanoGPT's live in bench/race_nanogpt.py).
PEERS = {NANOGPT: ("race_nanogpt.py", {}),
         TITAN: ("peers_titan.py", {"lr": 8e-4, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1,
                                    "grad_clip": 1.0})}


@dataclass
class Contender:
    name: str
    recipe: str
    sets: list[str] = field(default_factory=list)
    evals: list[dict] = field(default_factory=list)  # {"step", "train_s", "tokens", "loss"}
    peer: str = ""  # a peer's worker script in bench/; "": a forja recipe trained here
    settings: dict = field(default_factory=dict)


def held_out(recipe: str, sets: list[str], windows: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(inputs, labels) of `windows` validation micro-batches of the recipe's shape: the held-out
    windows every contender is scored on."""
    from forja.data import ValidationLoader

    cfg = load_config(recipe, sets)
    _, dataset = data(cfg, rank=0)
    loader = ValidationLoader(dataset, seq_len=cfg.train.seq_len, micro_batch_size=cfg.train.micro_batch_size,
                              num_batches=windows, dp_rank=0, dp_world_size=1)
    return [(b.input_ids.clone(), b.labels.clone()) for b in loader]


def evaluate(model: torch.nn.Module, windows: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    """The one evaluator's score (bench/race_eval.py) of a forja model: its logits with causal
    attention (no document ids), in eval mode."""
    was_training = model.training
    model.eval()
    try:
        return held_out_loss(model, windows)
    finally:
        model.train(was_training)


def peer_spec(c: Contender, steps: int, rows: str, shape: dict, cfg) -> dict:
    """What a peer's worker builds from: the default recipe's rows, size, batch and steps, its
    own recipe's optimizer values, forja's host settings."""
    optim = PEERS[c.name][1]
    t = cfg.train
    return {"seed": 0, "device": "cpu", "warmup": 0, "host": t.host_malloc, "threads": None, "tokens": rows,
            "seq_len": t.seq_len, "batch": t.global_batch_size, "steps": steps, "shape": shape, "compile": False,
            "ac": "none", "precision": "fp32", "attention": "sdpa", "recommended": True, "race": True,
            "optim": optim, "forja_sets": []}


def race_peer(c: Contender, steps: int, every: int, windows: str, spec: dict, python: str, out: Path) -> None:
    """Train a peer in its own process, `every` steps a round, scoring it between rounds."""
    entry = peers.Entry(c.name, PEERS[c.name][0], {}, python=python)
    tokens_per_step = spec["batch"] * spec["seq_len"]
    try:
        peers.start(entry, spec, out, timeout=600)
        c.settings = entry.ready["settings"]
        train_s, step = 0.0, 0
        c.evals.append({"step": 0, "train_s": 0.0, "tokens": 0,
                        "loss": peers.send(entry, {"eval": windows}, 600)["held_out"]})
        while step < steps:
            k = min(every, steps - step)
            train_s += peers.send(entry, {"steps": k}, 600)["seconds"]
            step += k
            loss = peers.send(entry, {"eval": windows}, 600)["held_out"]
            c.evals.append({"step": step, "train_s": train_s, "tokens": step * tokens_per_step, "loss": loss})
            print(f"  {c.name}: step {step}, {train_s:.1f} s, held-out loss {loss:.4f}", flush=True)
    finally:
        peers.stop([entry])


def recipe_steps(c: Contender, steps: int | None) -> int:
    """The steps `c` trains: --steps for all where given, else its recipe's own (train.steps)."""
    return steps if steps is not None else load_config(c.recipe, c.sets).train.steps


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
                     "sets": c.sets, "settings": c.settings} for c in contenders}
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


def contenders(ablate: bool, with_peers: bool, only: set[str] | None) -> list[Contender]:
    out = [Contender(DEFAULT, "default"), Contender(SPEEDRUN, "speedrun")]
    if ablate:
        out += [Contender(f"default + {name}", "default", sets) for name, sets in SWITCHES.items()]
    if with_peers:
        out += [Contender(name, "default", peer=script) for name, (script, _) in PEERS.items()]
    return [c for c in out if only is None or c.name in only]


def run_peers(entries: list[Contender], args, windows, out: Path) -> list[Contender]:
    """Race the peers among `entries` (torchtitan from its side environment, made if missing,
    unless --no-titan), after writing the rows and windows they read; the contenders that ran."""
    from forja.models.config import run_model_args

    todo = [c for c in entries if c.peer and not (args.no_titan and c.name == TITAN)]
    if not todo:
        return []
    cfg = load_config("default", args.sets)
    steps = args.steps if args.steps is not None else cfg.train.steps  # the default's
    tokenizer, dataset = data(cfg, rank=0)
    rows = str(out / "rows.pt")  # (steps x global batch, seq_len + 1): what the default trains on, in order
    torch.save(peers.loader_rows(cfg, dataset, steps * cfg.train.global_batch_size)[0], rows)
    shape = peers.model_shape(run_model_args(cfg.model, tokenizer.vocab_size), cfg.train.seq_len)
    windows_path = str(out / "windows.pt")
    save_windows(windows, windows_path)
    ran = []
    for c in todo:
        if c.name == TITAN:
            from peers_env import ensure_env  # made, or checked, once: torchtitan's pinned release

            python = str(ensure_env(wheels=args.wheels))
        else:
            python = sys.executable
        spec = peer_spec(c, steps, rows, shape, cfg)
        race_peer(c, steps, args.eval_every, windows_path, spec, python, out)
        ran.append(c)
    return ran


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=None,
                   help="steps for every contender; default: each recipe's own (the peers: the default's)")
    p.add_argument("--eval-every", type=int, default=20)
    p.add_argument("--windows", type=int, default=16, help="held-out micro-batches of the default recipe's shape")
    p.add_argument("--only", default="", help="contender names, comma-separated")
    p.add_argument("--ablate", action="store_true", help="add each speedrun switch alone on the default recipe")
    p.add_argument("--peers", action="store_true", help="add nanoGPT's and torchtitan's recipes")
    p.add_argument("--no-titan", action="store_true", help="leave torchtitan out (no side environment)")
    p.add_argument("--wheels", default=None, help="install torchtitan offline from these wheels")
    p.add_argument("--set", dest="sets", action="append", default=[], help="an override for every contender")
    p.add_argument("--out", default="runs/bench-loss-race")
    args = p.parse_args(argv)
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    only = {n.strip() for n in args.only.split(",") if n.strip()} or None
    entries = contenders(args.ablate, args.peers, only)
    for c in entries:
        c.sets = [*c.sets, *args.sets]
    windows = held_out("default", args.sets, args.windows)
    for c in entries:
        if not c.peer:
            race(c, recipe_steps(c, args.steps), args.eval_every, windows, out)
    ran = {id(c) for c in run_peers(entries, args, windows, out)}
    result = summarize([c for c in entries if not c.peer or id(c) in ran])
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
