"""bench/loss_race.py's nanoGPT contender: a plain training loop over `transformers`' GPT-2 at
nanoGPT's published Shakespeare hyperparameters (karpathy/nanoGPT, config/train_shakespeare_char.py
and train.py's defaults), at the race's model size, batch and steps:

- GPT-2 blocks (learned positions, LayerNorm, GELU MLP, tied embedding and output), dropout 0.2,
  nanoGPT's init (N(0, 0.02), the residual projections 0.02 / sqrt(2 x layers): GPT-2's own);
- AdamW lr 1e-3, betas (0.9, 0.99), weight decay 0.1 on the 2-D weights only (its
  configure_optimizers' two groups), torch's fused kernel (TrainingArguments' default; the same
  arithmetic as nanoGPT's loop);
- linear warm-up then cosine decay to min_lr 1e-4 at lr_decay_iters = max_iters, with the
  published 100 warm-up iterations of 5,000 scaled to the race's steps (100 / 5,000 of them);
- gradient clipping at 1.0; fp32 (nanoGPT's CPU dtype), SDPA causal attention.

    python bench/race_nanogpt.py SPEC_JSON      (started by bench/loss_race.py)
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from peers_worker import Contender, cycle_rows, serve  # noqa: E402

# nanoGPT's config/train_shakespeare_char.py (and train.py's defaults where it sets none).
SHAKESPEARE = dict(learning_rate=1e-3, min_lr=1e-4, beta1=0.9, beta2=0.99, weight_decay=0.1, dropout=0.2,
                   grad_clip=1.0, warmup_iters=100, max_iters=5000)


def nanogpt_lr(it: int, steps: int) -> float:
    """nanoGPT's get_lr(it), its iterations scaled from max_iters to `steps`."""
    h = SHAKESPEARE
    warmup = max(1, round(h["warmup_iters"] * steps / h["max_iters"]))
    if it < warmup:
        return h["learning_rate"] * (it + 1) / (warmup + 1)
    if it > steps:
        return h["min_lr"]
    ratio = (it - warmup) / (steps - warmup)
    coeff = 0.5 * (1.0 + math.cos(math.pi * ratio))
    return h["min_lr"] + coeff * (h["learning_rate"] - h["min_lr"])


def build(spec: dict) -> Contender:
    from transformers import GPT2Config, GPT2LMHeadModel

    s, h = spec["shape"], SHAKESPEARE
    torch.manual_seed(spec["seed"])
    config = GPT2Config(vocab_size=s["vocab_size"], n_positions=spec["seq_len"], n_embd=s["dim"],
                        n_layer=s["n_layers"], n_head=s["n_heads"], resid_pdrop=h["dropout"],
                        embd_pdrop=h["dropout"], attn_pdrop=h["dropout"], attn_implementation="sdpa")
    model = GPT2LMHeadModel(config)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": h["weight_decay"]},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=h["learning_rate"], betas=(h["beta1"], h["beta2"]), fused=True)
    rows, it = cycle_rows(spec, torch.device("cpu")), 0

    def step() -> torch.Tensor:
        nonlocal it
        for group in opt.param_groups:
            group["lr"] = nanogpt_lr(it, spec["steps"])
        batch = next(rows)  # [B, T + 1]
        logits = model(input_ids=batch[:, :-1]).logits  # [B, T, V]
        loss = F.cross_entropy(logits.flatten(0, 1).float(), batch[:, 1:].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), h["grad_clip"])
        opt.step()
        opt.zero_grad(set_to_none=True)
        it += 1
        return loss.detach()

    def logits(tokens: torch.Tensor) -> torch.Tensor:
        model.eval()
        try:
            return model(input_ids=tokens).logits  # [B, T, V], dropout off
        finally:
            model.train()

    import transformers

    settings = {"transformers": transformers.__version__, "model": "GPT2LMHeadModel (sdpa, causal), tied output",
                "recipe": "nanoGPT train_shakespeare_char: " + ", ".join(f"{k} {v}" for k, v in h.items()),
                "warmup_steps": max(1, round(h["warmup_iters"] * spec["steps"] / h["max_iters"])),
                "optimizer": "torch.optim.AdamW(fused=True), decay on 2-D weights"}
    return Contender(step=step, params=sum(p.numel() for p in params), settings=settings, logits=logits)


if __name__ == "__main__":
    serve(build)
