"""Small helpers shared by tests."""

from __future__ import annotations

import torch


@torch.no_grad()
def max_logit_diff(hf_model, forja_model, tokens: torch.Tensor) -> float:
    """max |logits of transformers - logits of forja| over a batch, in float32."""
    ref = hf_model(tokens).logits.float()
    ours = forja_model(tokens).float()
    return (ref - ours).abs().max().item()


@torch.no_grad()
def hf_greedy(hf_model, prompt: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """transformers' greedy `generate` for every one of `new_tokens` steps (no stop token,
    as forja's generate runs without one)."""
    hf_model.generation_config.eos_token_id = None
    return hf_model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new_tokens,
                             do_sample=False, pad_token_id=0)


def child_stdout(code: str, *args: str, timeout: float = 300) -> str:
    """Run `code` in a fresh Python process (for limits such as RLIMIT_FSIZE that must not
    reach the test process) and return what it printed; it must exit 0."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout
