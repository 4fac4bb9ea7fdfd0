"""Checks of a parallel layout against the model and the batch, before anything starts.

Each failure names the keys involved and a fix, so a bad layout costs seconds, not a
cluster allocation.
"""

from __future__ import annotations

import torch

from forja.errors import ForjaError
from forja.models.common.transformer import TransformerArgs
from forja.parallel.config import ParallelConfig
from forja.parallel.dims import ParallelDims
from forja.parallel.pp import check_pipeline


def _divides(a: int, b: int, what: str, fix: str) -> None:
    if b % a:
        raise ForjaError(f"{what} is not divisible by {a}; {fix}")


def _check_ep(args: TransformerArgs, dims: ParallelDims) -> None:
    n_experts = getattr(args, "n_experts", 0)
    if n_experts == 0:
        raise ForjaError(f"parallel.ep = {dims.ep} needs a mixture-of-experts model, but this model has no "
                         "experts; set parallel.ep = 1 or choose an MoE flavor (e.g. qwen3 debug-moe)")
    _divides(dims.ep, n_experts, f"model n_experts = {n_experts} (parallel.ep = {dims.ep})",
             "choose a parallel.ep that divides the number of experts")


def check_layout(args: TransformerArgs, dims: ParallelDims, cfg: ParallelConfig, *, seq_len: int,
                 global_batch_size: int, micro_batch_size: int, device: torch.device,
                 document_mask: bool = False, float8: str = "none") -> None:
    tp = dims.tp
    if tp > 1:
        fix = "choose a parallel.tp that divides it, or change the model (model.overrides)"
        _divides(tp, args.n_heads, f"model n_heads = {args.n_heads} (parallel.tp = {tp})", fix)
        _divides(tp, args.n_kv_heads, f"model n_kv_heads = {args.n_kv_heads} (parallel.tp = {tp})", fix)
        _divides(tp, args.ffn_dim, f"model ffn_dim = {args.ffn_dim} (parallel.tp = {tp})", fix)
        _divides(tp, args.vocab_size, f"vocab_size = {args.vocab_size} (parallel.tp = {tp})",
                 "pad it with model.overrides.vocab_size (a multiple of 64 or 128 is also faster)")
        if cfg.sequence_parallel:
            _divides(tp, seq_len, f"train.seq_len = {seq_len} (parallel.tp = {tp} with sequence parallelism)",
                     "change train.seq_len or set parallel.sequence_parallel = false")
        if cfg.async_tp and device.type != "cuda":
            raise ForjaError("parallel.async_tp needs CUDA (symmetric memory); set it to false on CPU")
        if cfg.async_tp and not cfg.compile:
            raise ForjaError("parallel.async_tp works through torch.compile's micro-pipelining; "
                             "set parallel.compile = true as well")
        if float8 != "none":
            raise ForjaError("train.float8 with parallel.tp > 1 is not supported yet (float8 needs its own "
                             "tensor-parallel styles); use FSDP for data parallelism, or train.float8 = 'none'")
    if dims.ep > 1:
        _check_ep(args, dims)
    if dims.cp > 1:
        if device.type != "cuda":
            raise ForjaError("parallel.cp > 1 needs CUDA: PyTorch's context parallelism runs only on CUDA "
                             "attention kernels; set parallel.cp = 1 on CPU")
        _divides(2 * dims.cp, seq_len, f"train.seq_len = {seq_len} (2 x parallel.cp = {2 * dims.cp}, for load "
                 "balancing)", "change train.seq_len or parallel.cp")
        if document_mask:
            raise ForjaError("parallel.cp > 1 runs causal ring attention, without document masks; set "
                             "model.document_mask = false")
    local = global_batch_size // max(1, dims.dp)
    if global_batch_size % dims.dp:
        raise ForjaError(f"train.global_batch_size = {global_batch_size} is not divisible by the data-parallel "
                         f"degree {dims.dp} (dp_replicate x dp_shard); change one of them")
    if local % micro_batch_size:
        raise ForjaError(f"train.global_batch_size / data-parallel degree = {local} is not divisible by "
                         f"train.micro_batch_size = {micro_batch_size}; change one of them")
    check_pipeline(args, dims, cfg, device=device, global_batch_size=global_batch_size,
                   micro_batch_size=micro_batch_size)
