"""bench/peers.py's torchtitan contender: torchtitan's own Trainer (the released package, run from
the side environment bench/peers_env.py makes), built from a Trainer.Config written here for
the spec's Llama shape, and stepped as its Trainer.train() loop steps it.

    .peers-venv/bin/python bench/peers_titan.py SPEC_JSON      (started by bench/peers.py)

Two modes, chosen by spec["recommended"] (default false):
- matched: what every contender runs, switch for switch: compile (its per-block compile of the
  model plus the loss) and activation checkpointing as the spec says; the plain cross-entropy
  loss; CUDA graphs off; metrics logged once (step 1, in warm-up) instead of every 10 steps.
- recommended: its own defaults and recipes where they differ: the chunked loss of every llama3
  recipe (ChunkedLossWrapper: lm_head + loss in 8 sequence chunks), CUDA graphs as it sets them
  (on, on CUDA), metrics every log_freq = 10 steps (a host sync each time); compile and AC still
  from the spec.
In both: with spec["per_document"], its own FlexAttention and block-causal masks, made from
positions that restart at each of the rows' documents (as its loaders give them); without,
causal SDPA in place of the llama3 registry's default FlexAttention (slow on CPU; the rows are
one document each, so the result is the same causal attention); AdamW as its default_adamw
builds it (its "fused" implementation) with the spec's values and a constant lr; gradient
clipping at grad_clip; no checkpoint, no validation; one process (world size 1, which
torchtitan initialises itself from the env:// variables set here: gloo on CPU, nccl on CUDA).
The step returns the loss its forward_backward_step returned (the token-mean loss of the
batch), kept by a wrapper, since its train_step returns nothing.
"""

from __future__ import annotations

import atexit
import os
import shutil
import socket
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import peers_shims  # noqa: E402
from peers_worker import Contender, attended_pairs, cycle_positions, serve  # noqa: E402


def _single_process_env() -> None:
    """The variables torchrun would set for one process, on a free port."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))


def llama_config(shape: dict, attention: str):
    """A Llama3Model.Config of the spec's shape, built by torchtitan's llama3 layer factory
    (fused QKV, its inits), with no RoPE scaling and the spec's norm eps."""
    from torchtitan.models import llama3
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
    from torchtitan.models.common.attention import FlexAttention, ScaledDotProductAttention

    dim, vocab, heads = shape["dim"], shape["vocab_size"], shape["n_heads"]
    rope = ComplexRoPE.Config(dim=dim // heads, max_seq_len=shape["max_seq_len"], theta=shape["rope_theta"],
                              scaling="none")
    layers = llama3._build_llama3_layers(n_layers=shape["n_layers"], dim=dim, n_heads=heads,
                                         n_kv_heads=shape["n_kv_heads"], hidden_dim=shape["ffn_dim"], rope=rope,
                                         fuse_qkv=True, attn_backend="flex")
    tied = shape["tie_embeddings"]
    config = llama3.Llama3Model.Config(
        dim=dim, vocab_size=vocab, enable_weight_tying=tied, layers=layers,
        tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=dim,
                                        param_init=llama3._EMBEDDING_SKIP_INIT if tied else llama3._EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=dim, param_init=llama3._NORM_INIT),
        lm_head=Linear.Config(in_features=dim, out_features=vocab, param_init=llama3._output_linear_init(dim)))
    for _, norm, _, _ in config.traverse(RMSNorm.Config):
        norm.eps = shape["norm_eps"]
    if attention == "sdpa":  # its factory refuses "sdpa" for language models: swap the inner attention in
        for _, _, parent, field in list(config.traverse(FlexAttention.Config)):
            setattr(parent, field, ScaledDotProductAttention.Config())
    return config


def attention(spec: dict) -> str:
    """Its FlexAttention where the rows hold several documents each; SDPA for one a row."""
    return "flex" if spec.get("per_document") else spec.get("attention", "sdpa")


def attention_settings(trainer, spec: dict) -> dict:
    """What its attention computes on the first batch, from the masks its model builds for it
    (Decoder.get_attention_masks, as its Trainer calls it; none for SDPA's is_causal)."""
    device = torch.device(spec["device"])
    masks = None
    if attention(spec) == "flex":
        places = next(cycle_positions(spec))  # [B, T]: the first batch's, as its loader gives them
        masks = trainer.model_parts[0].get_attention_masks(positions=places.to(device))
    kind = "block-causal (positions restart at each document)" if spec.get("per_document") else "causal"
    return {"attention": f"{attention(spec)}, {kind}",
            **attended_pairs(masks, spec["batch"], spec["seq_len"], device)}


# The learning-rate schedule of torchtitan's own llama3 recipe (config_registry.llama3_debugmodel),
# which the loss race trains with (spec["race"]); the throughput rounds keep the lr constant.
RECIPE_SCHEDULE = dict(warmup_steps=2, decay_ratio=0.8, decay_type="linear", min_lr_factor=0.0)


def trainer_config(spec: dict, recommended: bool, folder: str, data, tokenizer):
    """The Trainer.Config for the spec, in matched or recommended mode (the module's docstring)."""
    from torchtitan.components.checkpoint import CheckpointManager
    from torchtitan.components.loss import ChunkedLossWrapper, CrossEntropyLoss
    from torchtitan.components.metrics import MetricsProcessor
    from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw
    from torchtitan.components.validate import Validator
    from torchtitan.config import CompileConfig, DebugConfig, TrainingConfig
    from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC
    from torchtitan.models.llama3 import model_registry
    from torchtitan.trainer import Trainer

    shape, o, race = spec["shape"], spec["optim"], bool(spec.get("race"))
    model_spec = replace(model_registry("debugmodel"), flavor="forja-peers", model=llama_config(shape, attention(spec)))
    ce = CrossEntropyLoss.Config(global_vocab_size=shape["vocab_size"])
    bf16 = spec["precision"] == "bf16"  # fp32 master weights, bf16 compute (FSDP2's mixed precision)
    return Trainer.Config(
        model_spec=model_spec, hf_assets_path=folder, dump_folder=folder,
        tokenizer=tokenizer(vocab_size=shape["vocab_size"]),
        dataloader=data(dataset_path=spec["tokens"],
                        documents_path=spec["documents"] if spec.get("per_document") else ""),
        loss=ChunkedLossWrapper.Config(loss_fn=ce) if recommended else ce,
        optimizer=default_adamw(lr=o["lr"], betas=tuple(o["betas"]), eps=o["eps"], weight_decay=o["weight_decay"]),
        lr_scheduler=LRSchedulersContainer.Config(**(RECIPE_SCHEDULE if race else dict(warmup_steps=0,
                                                                                           decay_ratio=0.0))),
        training=TrainingConfig(local_batch_size=spec["batch"], seq_len=spec["seq_len"], max_norm=o["grad_clip"],
                                steps=spec["steps"] if race else 10**9, dtype="float32",
                                mixed_precision_param="bfloat16" if bf16 else "float32",
                                disable_cuda_graphs=not recommended),
        metrics=MetricsProcessor.Config(log_freq=10 if recommended else 10**9),
        checkpoint=CheckpointManager.Config(enable=False),
        validator=Validator.Config(enable=False),
        activation_checkpoint={"none": None, "selective": SelectiveAC.Config(), "full": FullAC.Config()}[spec["ac"]],
        compile=CompileConfig(enable=spec["compile"], components=["model", "loss"]),
        debug=DebugConfig(seed=spec["seed"]))


def build(spec: dict) -> Contender:
    shims = [peers_shims.cpu_device()] if spec["device"] == "cpu" else []  # before any other torchtitan import
    data_line, data = peers_shims.token_rows()
    tokenizer_line, tokenizer = peers_shims.vocab_only()
    shims += [data_line, tokenizer_line]

    import torchtitan
    from torchtitan.observability import structured_logger as sl
    from torchtitan.tools.logging import init_logger

    recommended = bool(spec.get("recommended", False))
    folder = tempfile.mkdtemp(prefix="peers-titan-")  # its dump folder: the structured logs
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    _single_process_env()
    init_logger()
    sl.init_structured_logger(source="training", output_dir=folder)  # as its train.py does (default: on)
    config = trainer_config(spec, recommended, folder, data, tokenizer)
    trainer = config.build()
    trainer.checkpointer.load(step=config.checkpoint.load_step)  # what train() does first (nothing here)

    last = {}
    inner = trainer.forward_backward_step

    def keep_loss(**kwargs) -> torch.Tensor:
        loss = inner(**kwargs)
        last["loss"] = loss.detach().clone()  # a CUDA graph's output is overwritten by its next replay
        return loss

    trainer.forward_backward_step = keep_loss
    data_iterator = trainer.batch_generator(trainer.dataloader)

    def step() -> torch.Tensor:
        # The body of Trainer.train()'s loop (less its profiler, validator and first-step timeout).
        trainer.step += 1
        sl.set_step(trainer.step, relative_step=trainer.step)
        trainer.gc_handler.run(trainer.step)
        trainer.train_step(data_iterator)
        trainer.checkpointer.save(trainer.step, last_step=False)
        return last["loss"]

    params = sum(p.numel() for m in trainer.model_parts for p in m.parameters())
    # Its parallelism as applied, read from the parameters it built (not from its config).
    from torch.distributed.tensor import DTensor

    sharded = [p for m in trainer.model_parts for p in m.parameters() if isinstance(p, DTensor)]
    applied = (f"DTensor parameters ({type(sharded[0].placements[0]).__name__}) over a mesh of "
               f"{sharded[0].device_mesh.size()} rank(s)" if sharded else "plain parameters: no FSDP applied")
    settings = {"torchtitan": torchtitan.__version__, "mode": "recommended" if recommended else "matched",
                "trainer": "torchtitan.trainer.Trainer, Trainer.train()'s loop body",
                "model": "llama3 (its _build_llama3_layers: fused QKV, ComplexRoPE without scaling)",
                **attention_settings(trainer, spec),
                "loss": "ChunkedLossWrapper(CrossEntropyLoss, 8 chunks)" if recommended else "CrossEntropyLoss",
                "compile": (f"per TransformerBlock + loss ({config.compile.backend})" if spec["compile"] else "off"),
                "ac": spec["ac"], "dtype": config.training.dtype,
                "mixed_precision_param": config.training.mixed_precision_param,
                "optimizer": f"AdamW ({config.optimizer.implementation})", "lr_schedule": "constant",
                "cuda_graphs": not config.training.disable_cuda_graphs,
                "log_freq": config.metrics.log_freq, "gc_freq": config.training.gc_freq,
                "spmd_backend": config.parallelism.spmd_backend, "parallelism_applied": applied,
                "structured_logging": config.debug.enable_structured_logging}
    if spec.get("race"):
        settings["lr_schedule"] = f"its llama3 recipe's over {config.training.steps} steps: {RECIPE_SCHEDULE}"

    def logits(tokens: torch.Tensor) -> torch.Tensor:
        model = trainer.model_parts[0]
        skip, model._skip_lm_head = model._skip_lm_head, False  # its chunked loss applies lm_head itself
        model.eval()
        try:
            return model(tokens)  # [B, T, V]: the model with its lm_head
        finally:
            model.train()
            model._skip_lm_head = skip

    return Contender(step=step, params=params, settings=settings, shims=shims, logits=logits)


if __name__ == "__main__":
    serve(build)
