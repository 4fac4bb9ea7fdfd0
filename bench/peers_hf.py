"""bench/peers.py's plain Hugging Face contender: what a user writes with the HF stack, a loop
over `transformers`' LlamaForCausalLM of the same shape (SDPA attention, causal), torch's fused
AdamW (`TrainingArguments`' default optimizer, "adamw_torch_fused", on torch >= 2.8), gradient
clipping, and `torch.compile(model)` when the spec asks for it.

    python bench/peers_hf.py SPEC_JSON      (started by bench/peers.py)
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from peers_worker import Contender, cycle_rows, serve  # noqa: E402


def build(spec: dict) -> Contender:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(spec["seed"])
    device = torch.device(spec["device"])
    # forja's own exporter's config for the shape (forja/models/llama/hf.py, via bench/peers.py).
    model = LlamaForCausalLM(LlamaConfig(**spec["hf_config"], attn_implementation="sdpa")).to(device)
    model.train()
    o = spec["optim"]
    opt = torch.optim.AdamW(model.parameters(), lr=o["lr"], betas=tuple(o["betas"]), eps=o["eps"],
                            weight_decay=o["weight_decay"], fused=True)  # as TrainingArguments' default
    forward = torch.compile(model) if spec["compile"] else model
    if spec["ac"] != "none":
        model.gradient_checkpointing_enable()  # HF's one switch: every decoder layer recomputed
    rows = cycle_rows(spec, device)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=spec["precision"] == "bf16")

    def step() -> torch.Tensor:
        batch = next(rows).to(device, non_blocking=True)  # [B, T + 1]
        with autocast:
            logits = forward(input_ids=batch[:, :-1]).logits  # [B, T, V]
            loss = F.cross_entropy(logits.flatten(0, 1).float(), batch[:, 1:].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), o["grad_clip"])
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    import transformers

    settings = {"transformers": transformers.__version__, "attention": "sdpa, causal (no document mask)",
                "compile": spec["compile"], "ac": "gradient_checkpointing" if spec["ac"] != "none" else "none",
                "optimizer": "torch.optim.AdamW(fused=True), TrainingArguments' default"}
    return Contender(step=step, params=sum(p.numel() for p in model.parameters()), settings=settings)


if __name__ == "__main__":
    serve(build)
