"""Text generation: greedy and sampled decoding with a KV cache.

    tokens = generate(model, prompt_ids, SamplingConfig(max_new_tokens=32))           # greedy
    tokens = generate(model, prompt_ids, SamplingConfig(temperature=0.8, top_p=0.95, seed=1))

The prompt is run once through the model (prefill), filling the cache; each new token
then costs one single-position forward. `use_cache=False` recomputes the whole sequence
every step: slower, and the reference the cached path is tested against.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import torch

from forja.errors import ForjaError
from forja.models.quantize import DTYPES, QUANTIZE_CHOICES, cast, quantize


@dataclass(kw_only=True)
class SamplingConfig:
    """How to pick each next token."""

    max_new_tokens: int = 64
    """Tokens to generate after the prompt (fewer if every row hits a stop token)."""
    temperature: float = 0.0
    """0 picks the most likely token (greedy); above 0 samples from softmax(logits / temperature)."""
    top_k: int | None = None
    """Sample only among the k most likely tokens."""
    top_p: float | None = None
    """Sample only among the most likely tokens whose probabilities sum to p (nucleus)."""
    seed: int | None = None
    """Seed of the sampling generator, for repeatable samples."""
    stop_token: int | None = None
    """A row that produces this token is finished (later positions repeat it)."""

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ForjaError(f"temperature={self.temperature} must be >= 0 (0 means greedy)")
        if self.top_k is not None and self.top_k < 1:
            raise ForjaError(f"top_k={self.top_k} must be at least 1")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise ForjaError(f"top_p={self.top_p} must be in (0, 1]")


def _filter_logits(logits: torch.Tensor, top_k: int | None, top_p: float | None) -> torch.Tensor:
    """Set logits outside the top-k / top-p set to -inf. logits (B, V) float32."""
    if top_k is not None and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]  # (B, 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = sorted_logits.softmax(-1)
        # Drop a token when the ones before it already reach p; the first always stays.
        drop_sorted = (probs.cumsum(-1) - probs) >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def next_token(logits: torch.Tensor, cfg: SamplingConfig, gen: torch.Generator | None) -> torch.Tensor:
    """Pick one token per row from last-position logits (B, V) -> (B,)."""
    logits = logits.float()
    if cfg.temperature == 0:
        return logits.argmax(-1)
    probs = _filter_logits(logits / cfg.temperature, cfg.top_k, cfg.top_p).softmax(-1)
    return torch.multinomial(probs, 1, generator=gen).squeeze(-1)


@torch.no_grad()
def generate(model: torch.nn.Module, prompt: torch.Tensor, cfg: SamplingConfig, *,
             use_cache: bool = True) -> torch.Tensor:
    """prompt (B, T) int64 -> (B, T + n) with n <= cfg.max_new_tokens new tokens."""
    total = prompt.shape[1] + cfg.max_new_tokens
    if total > model.args.max_seq_len:
        raise ForjaError(f"prompt ({prompt.shape[1]} tokens) + max_new_tokens ({cfg.max_new_tokens}) exceeds the "
                         f"model's max_seq_len of {model.args.max_seq_len}; ask for fewer tokens")
    was_training = model.training
    model.eval()
    gen = None
    if cfg.seed is not None:
        gen = torch.Generator(device=prompt.device)
        gen.manual_seed(cfg.seed)
    tokens = prompt
    finished = torch.zeros(prompt.shape[0], dtype=torch.bool, device=prompt.device)
    cache = model.new_kv_cache(prompt.shape[0], total) if use_cache else None
    step_input = prompt
    for _ in range(cfg.max_new_tokens):
        logits = model(step_input if use_cache else tokens, cache=cache)  # (B, t, V)
        new = next_token(logits[:, -1], cfg, gen)  # (B,)
        if cfg.stop_token is not None:
            new = torch.where(finished, cfg.stop_token, new)
            finished |= new == cfg.stop_token
        tokens = torch.cat([tokens, new[:, None]], dim=1)
        step_input = new[:, None]
        if cfg.stop_token is not None and bool(finished.all()):
            break
    model.train(was_training)
    return tokens


# -- command line --------------------------------------------------------------------------

def add_cli(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate text from a model",
                       description="Continue a prompt with a model: a forja run, one of its checkpoints, "
                                   "or a Hugging Face directory (docs/generation.md).")
    p.add_argument("source", help="a Hugging Face model directory (config.json, *.safetensors, tokenizer.json), "
                                  "a forja run directory, or one of its checkpoints")
    p.add_argument("--prompt", required=True, help="text to continue")
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate at most (default 64)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=None, help="sample among the K likeliest tokens only (default: all)")
    p.add_argument("--top-p", type=float, default=None,
                   help="sample among the likeliest tokens whose probabilities sum to P (nucleus; default: all)")
    p.add_argument("--seed", type=int, default=None, help="seed of the sampling, for a repeatable sample")
    add_model_options(p)
    p.set_defaults(func=_run_cli)


def add_model_options(p: argparse.ArgumentParser) -> None:
    """--device, --dtype and --quantize: where and how a loaded model runs (forja generate, forja eval)."""
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   help="where the model runs, e.g. cpu, cuda, cuda:1 (default: cuda when there is one, else cpu)")
    p.add_argument("--dtype", choices=tuple(DTYPES), default=None,
                   help="cast the model to this dtype first (default: as saved)")
    p.add_argument("--quantize", choices=QUANTIZE_CHOICES, default="none",
                   help="int8: weight-only int8 Linear layers (torchao); with --dtype bfloat16, about half "
                        "the bytes of bf16")


def _run_cli(args: argparse.Namespace) -> int:
    from forja.checkpoint.export import document_start, load_model_and_tokenizer
    model, tok = load_model_and_tokenizer(args.source, device=args.device)
    model = quantize(cast(model, args.dtype), args.quantize)
    start = document_start(args.source, tok)
    ids = ([start] if start is not None else []) + tok.encode(args.prompt)
    cfg = SamplingConfig(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                         top_p=args.top_p, seed=args.seed, stop_token=tok.eos_id)
    prompt = torch.tensor([ids], device=args.device)
    out = generate(model, prompt, cfg)[0, prompt.shape[1]:].tolist()
    if tok.eos_id in out:
        out = out[: out.index(tok.eos_id)]
    print(args.prompt + tok.decode(out))
    return 0
