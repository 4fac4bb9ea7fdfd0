"""bench/peers.py's plain Hugging Face contender: what a user writes with the HF stack, a loop
over `transformers`' LlamaForCausalLM of the same shape (SDPA attention: causal, or within each
document of a packed row), torch's fused AdamW (`TrainingArguments`' default optimizer,
"adamw_torch_fused", on torch >= 2.8), gradient clipping, and `torch.compile(model)` when the spec
asks for it.

    python bench/peers_hf.py SPEC_JSON      (started by bench/peers.py)
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import peers_worker as w  # noqa: E402


def build(spec: dict) -> w.Contender:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(spec["seed"])
    device = torch.device(spec["device"])
    # forja's own exporter's config for the shape (forja/models/llama/hf.py, via bench/peers.py).
    # No KV cache in training (use_cache=False): with one, transformers also skips its
    # packed-rows detection, and the document masks would silently be causal ones.
    config = LlamaConfig(**spec["hf_config"], attn_implementation="sdpa", use_cache=False)
    model = LlamaForCausalLM(config).to(device)
    model.train()
    o = spec["optim"]
    opt = torch.optim.AdamW(model.parameters(), lr=o["lr"], betas=tuple(o["betas"]), eps=o["eps"],
                            weight_decay=o["weight_decay"], fused=True)  # as TrainingArguments' default
    forward = torch.compile(model) if spec["compile"] else model
    if spec["ac"] != "none":
        model.gradient_checkpointing_enable()  # HF's one switch: every decoder layer recomputed
    rows = w.cycle_rows(spec, device)
    # Packed documents as transformers takes them: positions that restart at each document
    # (DataCollatorWithFlattening's way), from which its masks make block-causal attention.
    places = w.cycle_positions(spec) if spec.get("per_document") else None
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=spec["precision"] == "bf16")
    attention = attention_settings(model, spec, device)

    def step() -> torch.Tensor:
        batch = next(rows).to(device, non_blocking=True)  # [B, T + 1]
        positions = next(places).to(device) if places is not None else None  # [B, T]
        with autocast:
            logits = forward(input_ids=batch[:, :-1], position_ids=positions).logits  # [B, T, V]
            loss = F.cross_entropy(logits.flatten(0, 1).float(), batch[:, 1:].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), o["grad_clip"])
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    import transformers

    settings = {"transformers": transformers.__version__, **attention,
                "compile": spec["compile"], "ac": "gradient_checkpointing" if spec["ac"] != "none" else "none",
                "optimizer": "torch.optim.AdamW(fused=True), TrainingArguments' default"}
    return w.Contender(step=step, params=sum(p.numel() for p in model.parameters()), settings=settings)


def attention_settings(model, spec: dict, device: torch.device) -> dict:
    """What its attention computes on the first batch: the mask its first attention layer is
    handed in a forward (None where SDPA runs with is_causal), and the pairs it lets through."""
    seen = {}

    def keep(module, args, kwargs):
        seen["mask"] = kwargs.get("attention_mask")

    hook = model.model.layers[0].self_attn.register_forward_pre_hook(keep, with_kwargs=True)
    tokens = w.token_batches(spec)[:spec["batch"], :-1].to(device)  # [B, T]
    positions = next(w.cycle_positions(spec)).to(device) if spec.get("per_document") else None  # [B, T]
    try:
        with torch.no_grad():
            model(input_ids=tokens, position_ids=positions, logits_to_keep=1)
    finally:
        hook.remove()
    mask = seen["mask"]
    if mask is not None and mask.is_floating_point():  # an additive mask: 0 where a key is seen
        mask = mask == 0
    kind = "causal within documents (positions restart at each)" if positions is not None else "causal"
    return {"attention": f"{model.config._attn_implementation}, {kind}",
            **w.attended_pairs(mask, spec["batch"], spec["seq_len"], device)}


if __name__ == "__main__":
    w.serve(build)
