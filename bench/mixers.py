"""forja's new sequence mixers against their transformers 5.25 layers, one layer each, on this CPU:
training speed (forward + backward, tokens/s) and the memory each keeps for backward.

    python bench/mixers.py                                   # 2,048 and 8,192 tokens, every mixer
    python bench/mixers.py --tokens 2048 --mixers kda --repeats 3 --out /tmp/mixers.json
    python bench/mixers.py --tiny --tokens 64 --repeats 1    # seconds: the smoke test's sizes

Mixers (forja's module <- transformers' layer):
- kda: Kimi Delta Attention (forja/models/common/kimi_delta_attention.py) <- KimiLinearDeltaAttention
  (Kimi Team 2025, arXiv 2510.26692);
- mamba2: Mamba-2 (forja/models/common/mamba2.py) <- NemotronHMamba2Mixer (Dao & Gu 2024,
  arXiv 2405.21060);
- dsa: DeepSeek Sparse Attention, SparseMLA (forja/models/common/sparse_attention.py) <-
  DeepseekV32Attention (arXiv 2512.02556), index_topk 2,048 as published, so 8k tokens select;
- llama4-chunk8192 / llama4-chunk1024: forja's Attention under Llama 4's chunked mask <-
  Llama4TextAttention under its chunked mask: the published 8,192-token chunk (one chunk at 8k:
  plain causal) and a 1,024-token one (8k cut into 8 chunks).

How each pair is built: transformers' one-layer model of the family (the mixer's block alone,
a dense MLP after it, a 256-token vocabulary) on its own random init, saved with
save_pretrained and read by forja's loader (forja.models.load_hf_checkpoint): the same weights,
through forja's own conversion. Each model runs once on T tokens with a hook that captures
what its block hands the mixer (rotary tables, masks) and stops there; the mixers are then
called alone on the same input x (B=1, T, dim) ~ N(0, 1), float32, with the same output
gradient, the same thread count (torch.set_num_threads), in train mode.

Equal work: before timing, both mixers' outputs and input gradients must agree (max |diff| over
the largest |value| below --tol, 1e-4); the table prints both differences. A timing is one
forward + backward (parameter gradients set to None before each); the contenders alternate
round by round after that checked warm-up, and the table has the median of --repeats.

Memory: "saved" is what autograd keeps for backward, the bytes of the distinct storages that
torch.autograd.graph.saved_tensors_hooks sees packed (de-duplicated by storage; the module's
parameters excluded: both hold those anyway), counted in the checked warm-up. "peak" is the
most bytes torch's CPU allocator held during one forward + backward above what it held before
(torch.profiler's allocation and free events, summed in time order), in a separate, untimed
pass: it counts every allocation torch makes (outputs, gradients, kernels' scratch), but not
memory a library allocates itself outside torch's allocator (oneDNN/MKL workspaces), so it is
a floor on the process's true peak; CPU torch has no allocator statistics of its own to read.

forja's SparseMLA, like transformers' layer, runs dense attention under a (T, T) mask of the
selected keys: on CPU SDPA's math path holds fp32 scores per head, and the indexer its scores
8 heads at a time, so its memory grows as T^2. Where the estimate (printed) exceeds --max-gib,
forja's side is skipped and the row says so; transformers' layer is still timed. The dsa shape
has one attention head to keep the T^2 terms small.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import platform
import statistics
import sys
import tempfile
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from forja.models import load_hf_checkpoint  # noqa: E402

MIXERS = ("kda", "mamba2", "dsa", "llama4-chunk8192", "llama4-chunk1024")
VOCAB = 256


@dataclass
class Spec:
    """One mixer pair: transformers' class and one-layer config, where its block keeps the mixer."""

    hf_class: str
    config: dict
    hf_mixer: str  # the mixer's attribute on transformers' decoder layer (forja's: `attention`)
    shape: str  # the shapes, printed


def _specs(tiny: bool) -> dict[str, Spec]:
    """Per-layer widths that fit a 24 GiB, 2-core CPU at 8k tokens (`tiny`: the smoke test's):
    hidden 1024, the families' published head widths, fewer heads than published."""
    d = 64 if tiny else 1024
    common = dict(hidden_size=d, num_hidden_layers=1, vocab_size=VOCAB, max_position_embeddings=16_384,
                  intermediate_size=64 if tiny else 256, tie_word_embeddings=False, pad_token_id=None,
                  bos_token_id=None, eos_token_id=None)
    kda_h, kda_d = (2, 16) if tiny else (8, 128)  # published: 32 heads of 128 at hidden 2304
    kda = dict(common, layer_types=["linear_attention"], mlp_layer_types=["dense"], linear_num_heads=kda_h,
               linear_head_dim=kda_d, linear_conv_kernel_dim=4, num_attention_heads=kda_h, kv_lora_rank=32,
               q_lora_rank=None, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16, num_experts=4,
               num_experts_per_token=1, moe_intermediate_size=32, rms_norm_eps=1e-5)
    m_h, m_d, m_n, m_g, m_c = (4, 16, 16, 2, 16) if tiny else (32, 64, 128, 8, 128)  # published: 128 x 64, N 128
    mamba = dict(common, layers_block_type=["linear_attention"], mamba_num_heads=m_h, mamba_head_dim=m_d,
                 ssm_state_size=m_n, n_groups=m_g, chunk_size=m_c, conv_kernel=4, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16)
    if tiny:
        mla = dict(num_attention_heads=2, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8,
                   v_head_dim=16, index_n_heads=2, index_head_dim=16, index_topk=16)
    else:  # DeepSeek-V3.2's head widths (128 + 64, 128), latents 512; 64 indexer heads published
        mla = dict(num_attention_heads=1, q_lora_rank=512, kv_lora_rank=512, qk_nope_head_dim=128,
                   qk_rope_head_dim=64, v_head_dim=128, index_n_heads=4, index_head_dim=128, index_topk=2048)
    dsa = dict(common, **mla, num_key_value_heads=mla["num_attention_heads"], first_k_dense_replace=1,
               n_routed_experts=4, num_experts_per_tok=1, n_group=1, topk_group=1, moe_intermediate_size=32,
               rope_parameters={"rope_type": "default", "rope_theta": 10_000.0})
    l_h, l_kv, l_d = (4, 2, 16) if tiny else (8, 2, 128)  # Scout: 40 heads, 8 KV heads, of 128
    llama4 = dict(common, num_attention_heads=l_h, num_key_value_heads=l_kv, head_dim=l_d, intermediate_size_mlp=
                  common["intermediate_size"], num_local_experts=1, moe_layers=[], layer_types=["chunked_attention"],
                  no_rope_layers=[1], use_qk_norm=True, rope_parameters={
                      "rope_type": "llama3", "factor": 16.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 8192, "rope_theta": 500_000.0})
    small_chunk = 16 if tiny else 1024
    return {
        "kda": Spec("KimiLinearForCausalLM", kda, "self_attn",
                    f"dim {d}, {kda_h} heads of {kda_d}, conv 4, chunk: forja's 16, transformers' 64"),
        "mamba2": Spec("NemotronHForCausalLM", mamba, "mixer",
                       f"dim {d}, {m_h} heads of {m_d} (expand {m_h * m_d / d:g}), state {m_n}, {m_g} groups, "
                       f"conv 4, chunk {m_c}"),
        "dsa": Spec("DeepseekV32ForCausalLM", dsa, "self_attn",
                    f"dim {d}, {mla['num_attention_heads']} head(s) of {mla['qk_nope_head_dim']}+"
                    f"{mla['qk_rope_head_dim']} / {mla['v_head_dim']}, latents q {mla['q_lora_rank']} kv "
                    f"{mla['kv_lora_rank']}, indexer {mla['index_n_heads']} heads of {mla['index_head_dim']}, "
                    f"top-k {mla['index_topk']}"),
        "llama4-chunk8192": Spec("Llama4ForCausalLM", dict(llama4, attention_chunk_size=8192), "self_attn",
                                 f"dim {d}, {l_h} heads ({l_kv} KV) of {l_d}, QK-norm, RoPE, chunk 8192"),
        "llama4-chunk1024": Spec("Llama4ForCausalLM", dict(llama4, attention_chunk_size=small_chunk), "self_attn",
                                 f"dim {d}, {l_h} heads ({l_kv} KV) of {l_d}, QK-norm, RoPE, chunk {small_chunk}"),
    }


def build_pair(spec: Spec, seed: int = 0) -> tuple[torch.nn.Module, torch.nn.Module]:
    """transformers' one-layer model and forja's, read from its save_pretrained (same weights)."""
    import transformers

    cls = getattr(transformers, spec.hf_class)
    torch.manual_seed(seed)
    hf = cls(cls.config_class(**spec.config, attn_implementation="sdpa"))
    with tempfile.TemporaryDirectory() as tmp:
        hf.save_pretrained(tmp)
        ours = load_hf_checkpoint(tmp, dtype=torch.float32)
    return hf.float().train(), ours.train()


class _Captured(Exception):
    pass


def captured_call(model: torch.nn.Module, mixer: torch.nn.Module, T: int, **model_kwargs) -> tuple[tuple, dict]:
    """What `model`'s block hands `mixer` on T tokens (args, kwargs), the model stopped there."""
    seen: list = []

    def hook(module, args, kwargs):
        seen.append((args, kwargs))
        raise _Captured

    handle = mixer.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        with torch.no_grad():
            model(torch.zeros(1, T, dtype=torch.long), **model_kwargs)
    except _Captured:
        pass
    finally:
        handle.remove()
    return seen[0]


@dataclass
class Contender:
    """A mixer and the call that runs it on an input x: mixer(x, *args, **kwargs)[0 if a tuple]."""

    name: str
    mixer: torch.nn.Module
    args: tuple
    kwargs: dict
    skip: str | None = None  # why it is not run (memory), or None
    stats: dict = field(default_factory=dict)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if "hidden_states" in self.kwargs:
            out = self.mixer(**{**self.kwargs, "hidden_states": x})
        else:
            out = self.mixer(x, *self.args[1:], **self.kwargs)
        return out[0] if isinstance(out, tuple) else out

    def step(self, x: torch.Tensor, grad: torch.Tensor, *, count_saved: bool = False) -> tuple:
        """One forward + backward -> (output, input gradient), detached; with `count_saved`, also
        the bytes of the distinct storages autograd saves for backward (parameters excluded)."""
        for p in self.mixer.parameters():
            p.grad = None
        params = {p.untyped_storage().data_ptr() for p in self.mixer.parameters()}
        storages: dict[int, int] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            if t.layout == torch.strided and t.untyped_storage().data_ptr() not in params:
                storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        x = x.detach().requires_grad_(True)
        hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t) if count_saved else nullcontext()
        with hooks:
            out = self(x)
        out.backward(grad)
        return (out.detach(), x.grad, sum(storages.values())) if count_saved else (out.detach(), x.grad)


def contenders(name: str, spec: Spec, T: int, max_gib: float) -> tuple[Contender, Contender]:
    hf, ours = build_pair(spec)
    hf_mixer, our_mixer = getattr(hf.model.layers[0], spec.hf_mixer), ours.layers["0"].attention
    hf_args, hf_kwargs = captured_call(hf, hf_mixer, T, use_cache=False)
    our_args, our_kwargs = captured_call(ours, our_mixer, T)
    skip = None
    if name == "dsa":
        need = sparse_mla_bytes(spec.config, T) / 2**30
        if need > max_gib:
            skip = f"forja's masked sparse attention needs ~{need:.0f} GiB > --max-gib {max_gib:g}"
    return (Contender("forja", our_mixer, our_args, our_kwargs, skip),
            Contender("transformers", hf_mixer, hf_args, hf_kwargs))


def sparse_mla_bytes(cfg: dict, T: int) -> int:
    """Estimate of forja's SparseMLA memory for one forward + backward at T tokens (B=1, fp32):
    SDPA's math path under a mask keeps the scores, the probabilities and their gradient per
    head (3 H T^2 floats), the indexer at most 8 heads' scores at a time, and the (T, T) mask."""
    H, H_I = cfg["num_attention_heads"], min(cfg["index_n_heads"], 8)
    return 4 * T * T * (3 * H + H_I) + T * T


def peak_bytes(c: Contender, x: torch.Tensor, grad: torch.Tensor) -> int:
    """The most bytes torch's CPU allocator held during one forward + backward above what it held
    before: its allocation and free events from torch.profiler, summed in time order."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        c.step(x, grad)
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"
              and e.device_type() == torch.autograd.DeviceType.CPU]
    live = peak = 0
    for e in sorted(events, key=lambda e: e.start_ns()):
        live += e.nbytes()
        peak = max(peak, live)
    return peak


def rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def measure(name: str, spec: Spec, T: int, args: argparse.Namespace) -> dict:
    """One table row: the equal-output check, the timings, the memory of both sides."""
    gc.collect()  # the previous row's models
    ours, theirs = contenders(name, spec, T, args.max_gib)
    gen = torch.Generator().manual_seed(1)
    dim = spec.config["hidden_size"]
    x, grad = torch.randn(1, T, dim, generator=gen), torch.randn(1, T, dim, generator=gen)
    live = [c for c in (ours, theirs) if c.skip is None]
    results = {c.name: c.step(x, grad, count_saved=True) for c in live}  # the checked warm-up
    row = {"mixer": name, "T": T, "shape": spec.shape, "forja_skipped": ours.skip}
    for c in live:
        row[f"{c.name}_saved_bytes"] = results[c.name][2]
    if ours.skip is None:
        (o_out, o_grad, _), (t_out, t_grad, _) = results["forja"], results["transformers"]
        row.update(out_rel_diff=rel_diff(o_out, t_out), grad_rel_diff=rel_diff(o_grad, t_grad),
                   out_abs_diff=(o_out - t_out).abs().max().item(), out_max=t_out.abs().max().item())
        row["equal_output"] = row["out_rel_diff"] < args.tol and row["grad_rel_diff"] < args.tol
        if not row["equal_output"]:
            raise SystemExit(f"{name} at T={T}: the outputs differ (output {row['out_rel_diff']:.2e}, input "
                             f"gradient {row['grad_rel_diff']:.2e} of the largest value, --tol {args.tol:g}): "
                             "the comparison would not be of equal work")
    times: dict[str, list[float]] = {c.name: [] for c in live}
    for r in range(args.repeats):
        for c in (live if r % 2 == 0 else live[::-1]):  # alternate who goes first
            start = time.perf_counter()
            c.step(x, grad)
            times[c.name].append(time.perf_counter() - start)
    for c in live:
        seconds = statistics.median(times[c.name])
        row[f"{c.name}_s"], row[f"{c.name}_tokens_s"] = seconds, T / seconds
        row[f"{c.name}_peak_bytes"] = peak_bytes(c, x, grad) if args.peak else None
    if ours.skip is None:
        row["ratio"] = row["forja_tokens_s"] / row["transformers_tokens_s"]
    return row


def _mib(row: dict, key: str) -> str:
    value = row.get(key)
    return "-" if value is None else f"{value / 2**20:,.0f}"


def table(rows: list[dict]) -> str:
    lines = ["| mixer | T | forja tokens/s | transformers tokens/s | forja / transformers | saved MiB forja / "
             "transformers | peak MiB forja / transformers | equal output (rel. diff out, grad) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        ours = f"{r['forja_tokens_s']:,.0f}" if "forja_tokens_s" in r else f"skipped: {r['forja_skipped']}"
        ratio = f"**{r['ratio']:.2f}x**" if "ratio" in r else "-"
        check = (f"yes ({r['out_rel_diff']:.1e}, {r['grad_rel_diff']:.1e})" if r.get("equal_output")
                 else "not checked (forja skipped)")
        lines.append(f"| {r['mixer']} | {r['T']:,} | {ours} | {r['transformers_tokens_s']:,.0f} | {ratio} | "
                     f"{_mib(r, 'forja_saved_bytes')} / {_mib(r, 'transformers_saved_bytes')} | "
                     f"{_mib(r, 'forja_peak_bytes')} / {_mib(r, 'transformers_peak_bytes')} | {check} |")
    return "\n".join(lines)


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", default="2048,8192", help="sequence lengths, comma-separated (batch 1)")
    p.add_argument("--mixers", default=",".join(MIXERS), help=f"comma-separated, of {', '.join(MIXERS)}")
    p.add_argument("--repeats", type=int, default=3, help="timed rounds after the checked warm-up; the median")
    p.add_argument("--threads", type=int, default=2, help="torch.set_num_threads, both contenders")
    p.add_argument("--tol", type=float, default=1e-4, help="largest max |diff| / max |value| of outputs and grads")
    p.add_argument("--max-gib", type=float, default=16.0, help="skip forja's DSA where its estimate is above this")
    p.add_argument("--no-peak", dest="peak", action="store_false", help="skip the profiled peak-memory pass")
    p.add_argument("--tiny", action="store_true", help="tiny widths (the smoke test's): seconds, not minutes")
    p.add_argument("--out", type=Path, help="write the rows and the run's facts here as JSON")
    args = p.parse_args(argv)
    args.tokens = [int(t) for t in args.tokens.split(",")]
    args.mixers = args.mixers.split(",")
    unknown = [m for m in args.mixers if m not in MIXERS]
    if unknown:
        p.error(f"--mixers: unknown {', '.join(unknown)}; choose from {', '.join(MIXERS)}")
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse(argv)
    import transformers

    torch.set_num_threads(args.threads)
    specs = _specs(args.tiny)
    meta = {"date": datetime.date.today().isoformat(), "machine": platform.processor() or platform.machine(),
            "torch": torch.__version__, "transformers": transformers.__version__, "threads": args.threads,
            "repeats": args.repeats, "dtype": "float32", "batch": 1, "tol": args.tol,
            "command": "python bench/mixers.py " + " ".join(sys.argv[1:] if argv is None else argv),
            "shapes": {m: specs[m].shape for m in args.mixers}}
    print(f"torch {meta['torch']}, transformers {meta['transformers']}, {args.threads} threads, float32, batch 1, "
          f"median of {args.repeats}")
    for m in args.mixers:
        print(f"  {m}: {specs[m].shape}")
    rows = []
    for m in args.mixers:
        for T in args.tokens:
            rows.append(measure(m, specs[m], T, args))
            print(f"  done {m} T={T}", flush=True)
    text = table(rows)
    print("\n" + text)
    result = {"meta": meta, "rows": rows, "table": text}
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
