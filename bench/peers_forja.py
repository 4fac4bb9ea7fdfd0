"""bench/peers.py's forja contender: forja's own Trainer, step by step as `forja train` runs it
(the loader, the step engine, recovery's checks, metrics and the callbacks), on the recipe and
`--set` overrides in the spec. With spec["bare"] it is forja's model alone in a plain loop
instead (forward, backward, clip, AdamW on the harness's token rows, causal as every contender
attends, under the same process settings that the Trainer applies: forja/host.py): the step
time the framework's overhead is measured against.

    python bench/peers_forja.py SPEC_JSON      (started by bench/peers.py)
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from peers_worker import Contender, attended_pairs, cycle_rows, serve  # noqa: E402

from forja import host  # noqa: E402
from forja.config import load_config  # noqa: E402
from forja.train.callbacks import Callback  # noqa: E402
from forja.train.trainer import Trainer  # noqa: E402


def forja_sets(spec: dict) -> list[str]:
    """The overrides that make forja train what every contender trains (bench/peers.py's spec)."""
    o = spec["optim"]
    sets = [*spec["forja_sets"],
            f"train.micro_batch_size={spec['batch']}", f"train.global_batch_size={spec['batch']}",
            f"train.seq_len={spec['seq_len']}", "train.steps=1000000", "train.val_interval=0",
            "train.sample_tokens=0", "checkpoint.interval=0", f"train.grad_clip={o['grad_clip']}",
            "optim.name=\"adamw\"", f"optim.lr={o['lr']}", f"optim.weight_decay={o['weight_decay']}",
            f"optim.betas={list(o['betas'])}", f"optim.eps={o['eps']}",
            "schedule.name=\"constant\"", "schedule.warmup_steps=0",
            f"train.precision=\"{spec['precision']}\"", f"train.device=\"{spec['device']}\"",
            f"parallel.compile={str(spec['compile']).lower()}", f"parallel.ac=\"{spec['ac']}\"",
            # The harness's process settings (bench/peers_worker.py), and the attention every
            # contender computes: causal, or causal within the loader's documents.
            f"train.host_malloc=\"{spec.get('host', 'system')}\"",
            f"model.document_mask={str(spec.get('per_document', False)).lower()}"]
    return sets


def attention_settings(model, cfg, spec: dict, device: torch.device) -> dict:
    """What forja's attention computes on the first batch, from the mask its model builds for
    it (Transformer.mask_for, as in its forward): the backend, the mask kind, the pairs."""
    first = next(cycle_rows(spec, device, key="documents")).to(device)  # [B, T]: the first batch's document ids
    documents = first if cfg.model.document_mask else None
    mask = model.mask_for("full_attention", documents, spec["seq_len"], 0, device)
    built = None if mask.is_causal else (mask.dense if mask.dense is not None else mask.block_mask)
    kind = "causal" if documents is None else "causal within documents"
    return {"attention": f"{cfg.model.attention}, {kind}",
            **attended_pairs(built, spec["batch"], spec["seq_len"], device)}


class _LastLoss(Callback):
    """Keeps the last step's loss (the trainer reports it as a float)."""
    loss = float("nan")

    def on_step_end(self, trainer, record) -> None:
        self.loss = record.loss


def _trainer(spec: dict) -> Contender:
    run = Path(tempfile.mkdtemp(prefix="peers-forja-"))
    sets = forja_sets(spec) + [f"run.dir=\"{run}\""]
    last = _LastLoss()
    trainer = Trainer(load_config(spec["recipe"], sets), callbacks=[last])
    trainer.setup()
    trainer.begin()

    def step() -> torch.Tensor:
        trainer.train_one_step()
        return torch.tensor(last.loss)

    params = sum(p.numel() for part in trainer.parts for p in part.parameters())
    cfg = trainer.cfg
    settings = {"forja": "Trainer.train_one_step", "sets": sets,
                **attention_settings(trainer.parts[0], cfg, spec, torch.device(spec["device"])),
                "optimizer": f"{cfg.optim.name} (optim.implementation = {cfg.optim.implementation!r})"}
    return Contender(step=step, params=params, settings=settings)


def _bare(spec: dict) -> Contender:
    """forja's model built by its build order (compile, AC, fused ops as configured), trained in a
    plain loop with no trainer around it."""
    from forja.models.config import run_model_args
    from forja.parallel import ParallelDims
    from forja.train.build import build_model_parts

    cfg = load_config(spec["recipe"], forja_sets(spec))
    host.prepare_training_process(cfg.train.host_malloc)  # as forja's Trainer does at setup
    device = torch.device(spec["device"])
    args = run_model_args(cfg.model, spec["shape"]["vocab_size"])
    dims = ParallelDims.from_config(cfg.parallel, 1)
    model = build_model_parts(args, dims, cfg.parallel, device=device, seed=spec["seed"], load_weights=None,
                              seq_len=spec["seq_len"]).parts[0]
    o = spec["optim"]
    opt = torch.optim.AdamW(model.parameters(), lr=o["lr"], betas=tuple(o["betas"]), eps=o["eps"],
                            weight_decay=o["weight_decay"], fused=True)  # what optim.implementation = "auto" picks
    rows = cycle_rows(spec, device)
    # The Trainer's document mask: the loader's document ids of the same rows (bench/peers.py).
    documents = cycle_rows(spec, device, key="documents") if cfg.model.document_mask else None
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=spec["precision"] == "bf16")

    def step() -> torch.Tensor:
        batch = next(rows).to(device, non_blocking=True)  # [B, T + 1]
        doc_ids = next(documents).to(device, non_blocking=True) if documents is not None else None  # [B, T]
        with autocast:
            loss = model(batch[:, :-1], doc_ids, labels=batch[:, 1:])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), o["grad_clip"], foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    return Contender(step=step, params=sum(p.numel() for p in model.parameters()),
                     settings={"forja": "model alone, plain loop", "optimizer": "torch.optim.AdamW(fused=True)",
                               **attention_settings(model, cfg, spec, device)})


def build(spec: dict) -> Contender:
    return _bare(spec) if spec.get("bare") else _trainer(spec)


if __name__ == "__main__":
    serve(build)
