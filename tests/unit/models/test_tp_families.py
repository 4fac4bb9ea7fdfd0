"""Tensor parallelism of every model family over 2 ranks, with and without sequence
parallelism: the loss and the gradients equal one device's. Spawning the 2 ranks costs
10-20 s (far more on a loaded machine), so one spawn (the module fixture `tp_ranks`) runs
every family's case, and one test per family compares that family's results."""

from __future__ import annotations

import traceback
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch

from forja.models import build_model, get_family, model_args

SP_OFF_AND_ON = ((False, {}), (True, {}))  # (sequence_parallel, build_model overrides) per run


@dataclass(frozen=True, kw_only=True)
class TPCase:
    """One family's tensor-parallel check."""

    id: str
    """The test id, the family's name (a flavor after it where a family has two cases)."""
    family: str
    """The registry name build_model takes."""
    flavor: str = "debug"
    """The flavor built, seed 0."""
    grads: tuple[str, ...] | None
    """The parameters whose gradients are compared; None: every trained parameter (frozen ones
    such as DeepSeek-V4's indexers have none)."""
    runs: tuple[tuple[bool, dict], ...] = SP_OFF_AND_ON
    """(sequence_parallel, build_model overrides) of each run, one device's reference built
    with the same overrides."""
    documents: bool = False
    """Run on a packed batch (two documents in the first row)."""
    prepare: Callable[[torch.nn.Module], None] | None = None
    """Changes the built model's weights in place (before TP and for the reference)."""
    after_tp: Callable[[torch.nn.Module, object], None] | None = None
    """Applied after the plan, given the model and the mesh (e.g. expert parallelism)."""
    check_shards: Callable[[torch.nn.Module], None] | None = None
    """Asserts on a rank's shards, after the plan."""
    sum_experts: bool = False
    """Each rank routes its share of the tokens through whole experts (apply_tp alone spreads
    no experts), so an expert's gradient is the sum of the ranks' shares."""
    grad_atol: float
    """Bound on |TP gradient - one device's| (with rtol 1e-5)."""
    loss_tol: float = 1e-6
    """Bound on |TP loss - one device's|."""

    def build(self, overrides: dict) -> torch.nn.Module:
        model = build_model(self.family, self.flavor, seed=0, **overrides)
        if self.prepare is not None:
            self.prepare(model)
        return model


def _gpt_oss_sinks_by_head(model) -> None:
    with torch.no_grad():  # sinks that differ by head, so a misplaced shard would show
        for i, block in enumerate(model.layers.values()):
            block.attention.sinks.copy_(torch.linspace(-1.0, 1.0, 4) * (i + 1))


def _gpt_oss_shards(model) -> None:
    assert model.layers["0"].attention.sinks.to_local().shape == (2,)  # half the heads' sinks


def _qwen3_5_offsets_by_head(model) -> None:
    with torch.no_grad():  # per-head values that differ by head, and norms away from their init
        for block in model.layers.values():
            for p in block.parameters():
                if p.dim() == 1:
                    p.add_(torch.linspace(-0.5, 0.5, p.numel()))


def _gemma4_scales(model) -> None:
    gen = torch.Generator().manual_seed(0)  # the same on every rank and for the reference
    with torch.no_grad():  # the router's per-expert scales away from one, so that their gradients tell
        for block in model.layers.values():
            block.feed_forward.router.per_expert_scale.uniform_(0.5, 1.5, generator=gen)


def _gemma4_shards(model) -> None:
    block = model.layers["0"]
    assert block.mlp.w1.weight.to_local().shape == (128, 128)  # half the dense MLP beside the experts
    assert block.feed_forward.router.per_expert_scale.placements[0].is_replicate()


def _qwen3_5_shards(model) -> None:
    assert model.layers["0"].attention.A_log.to_local().shape == (2,)  # half the value heads
    assert model.layers["0"].attention.conv_q.weight.to_local().shape == (32, 1, 4)  # one key head's channels


def _deepseek_v4_offsets(model) -> None:
    with torch.no_grad():  # sinks, norms, compressor position biases and hyper-connection biases and
        for name, p in model.named_parameters():  # gains by head or channel, away from their 0 and 1 inits
            if p.dim() == 1 or name.endswith("position_bias"):
                p.add_(torch.linspace(-0.5, 0.5, p.numel()).view_as(p))


def _deepseek_v4_shards(model) -> None:
    attention = model.layers["1"].attention
    assert attention.sinks.to_local().shape == (2,)  # half the heads' sinks, and their rows of wq_b
    assert attention.wq_b.weight.to_local().shape == (2 * 64, 64)
    assert attention.wo.wo_a.to_local().shape == (64, 128)  # one of the 2 output groups (rank 64)
    assert attention.wo.wo_b.weight.to_local().shape == (128, 64)


def _deepseek_v3_experts_over_tp_ranks(model, mesh) -> None:
    from forja.parallel.ep import apply_ep

    # As forja/parallel/parallelize.py does: the TP ranks split an MoE layer's tokens, so its
    # routed experts are spread over them (each expert's gradient whole on its rank).
    apply_ep(model, mesh)


CASES = (
    # Each rank routes half the tokens through whole experts; the router's and attention's
    # gradients are complete on every rank.
    TPCase(id="mixtral", family="mixtral",
           grads=("layers.0.attention.wq.weight", "layers.1.feed_forward.router.gate.weight",
                  "layers.2.feed_forward.experts.w1", "layers.3.feed_forward.experts.w2"),
           sum_experts=True, grad_atol=1e-7),
    # Sinks sharded with the heads, q/k/v biases with their columns, on a packed batch; experts
    # as Mixtral's. The loss: measured 1.9e-6 apart (a loss of 8.19: two float32 ulps).
    TPCase(id="gpt_oss", family="gpt_oss",
           grads=("layers.0.attention.sinks", "layers.0.attention.wq.bias", "layers.1.attention.wo.bias",
                  "layers.1.feed_forward.router.gate.bias", "layers.2.feed_forward.experts.b1",
                  "layers.3.feed_forward.experts.w2"),
           documents=True, prepare=_gpt_oss_sinks_by_head, check_shards=_gpt_oss_shards, sum_experts=True,
           grad_atol=1e-7, loss_tol=1e-5),
    # Llama 4: heads split over 2 ranks (the weightless QK-norm and the NoPE blocks' temperature
    # per head and position), chunked and full masks on a packed batch, dense and MoE blocks
    # (each rank routes half the tokens; the shared expert replicated). Measured: gradients
    # 1.9e-9 apart at most (wo), the loss equal, with and without sequence parallelism.
    TPCase(id="llama4", family="llama4",
           grads=("layers.0.attention.wq.weight", "layers.1.attention.wk.weight", "layers.0.feed_forward.w2.weight",
                  "layers.1.feed_forward.router.gate.weight", "layers.2.feed_forward.experts.w1",
                  "layers.2.feed_forward.shared_experts.w2.weight", "layers.3.attention.wo.weight"),
           documents=True, sum_experts=True, grad_atol=1e-7),
    # The QK-norms' RMS spans all heads: the plan gathers q and k before them (to the rounding
    # of the ranks' partial sums: measured max |diff| 6.6e-7, on w2's gradient).
    TPCase(id="olmo3", family="olmo3",
           grads=("layers.0.attention.q_norm.weight", "layers.3.attention.k_norm.weight",
                  "layers.1.attention.wk.weight", "layers.2.post_attention_norm.weight",
                  "layers.0.feed_forward.w2.weight"),
           grad_atol=2e-6),
    # OLMo 3's plan, every block full attention.
    TPCase(id="olmo2", family="olmo2",
           grads=("layers.0.attention.q_norm.weight", "layers.1.attention.wk.weight",
                  "layers.3.post_ffn_norm.weight"),
           grad_atol=2e-6),
    # Heads split over 2 ranks, the per-head QK-norms' and the sandwich norms' gradients
    # summed where needed (to the rounding of the ranks' partial sums).
    TPCase(id="gemma3", family="gemma3",
           grads=("layers.0.attention.q_norm.weight", "layers.5.attention.k_norm.weight",
                  "layers.1.attention.wk.weight", "layers.2.post_attention_norm.weight",
                  "layers.3.post_ffn_norm.weight", "layers.0.feed_forward.w2.weight", "tok_embeddings.weight"),
           grad_atol=2e-6),
    # Gemma 3's plan over Gemma 4's blocks, on a packed batch: shared key/value blocks reading
    # their producers' heads, global blocks' values = keys, the per-layer embedding table split
    # by vocabulary and the per-layer modules (replicated, their gradients summed under SP).
    TPCase(id="gemma4", family="gemma4",
           grads=("layers.0.attention.q_norm.weight", "layers.2.attention.k_norm.weight",
                  "layers.3.attention.wk.weight", "layers.2.attention.wk.weight", "layers.5.attention.wq.weight",
                  "layers.4.post_attention_norm.weight", "layers.1.ple_gate.weight", "layers.5.ple_proj.weight",
                  "layers.3.ple_norm.weight", "ple_embeddings.weight", "ple_projection.weight",
                  "ple_projection_norm.weight", "layers.5.feed_forward.w2.weight", "tok_embeddings.weight"),
           # Sums of the ranks' partial sums, rounded otherwise: the per-layer projection's gradient (up to
           # ~0.3: its input is the sqrt(dim)-scaled embedding) measured 7.4e-6 apart, the gates' 2.1e-6.
           documents=True, grad_atol=2e-5, loss_tol=1e-5),
    # Gemma 4 with experts beside every dense MLP: the dense MLPs split as above, each rank routing
    # half the tokens through whole experts; the router's own scales (LocalParameters) and the
    # experts' input norm (SplitTokens) whole on each rank, their gradients summed, as the norms on
    # the dense and expert outputs' under SP.
    TPCase(id="gemma4-debug-moe", family="gemma4", flavor="debug-moe",
           grads=("layers.0.feed_forward.router.gate.weight", "layers.1.feed_forward.router.norm.weight",
                  "layers.2.feed_forward.router.per_expert_scale", "layers.3.feed_forward.expert_norm.weight",
                  "layers.4.feed_forward.experts.w1", "layers.5.feed_forward.experts.w2",
                  "layers.1.post_mlp_norm.weight", "layers.2.post_moe_norm.weight", "layers.5.mlp.w2.weight",
                  "layers.0.mlp.w1.weight", "layers.3.ple_gate.weight"),
           # Measured: gradients 1.8e-7 apart at most (ple_gate), the loss equal, with and without SP.
           documents=True, prepare=_gemma4_scales, check_shards=_gemma4_shards, sum_experts=True, grad_atol=1e-6,
           loss_tol=1e-5),
    # Gated DeltaNet split by head (one key head and two value heads a rank), on a packed
    # batch. Every kind of its parameters (projections, convolutions, decay, the shared norm)
    # and the gated attention's gate: a misplaced shard shows in one of them.
    TPCase(id="qwen3_5", family="qwen3_5",
           grads=("layers.0.attention.wq.weight", "layers.0.attention.conv_k.weight",
                  "layers.1.attention.conv_v.weight", "layers.0.attention.A_log", "layers.2.attention.dt_bias",
                  "layers.1.attention.norm.weight", "layers.2.attention.wb.weight", "layers.1.attention.wa.weight",
                  "layers.2.attention.wo.weight", "layers.3.attention.wg.weight", "layers.3.attention.q_norm.weight",
                  "layers.0.feed_forward.w2.weight"),
           documents=True, prepare=_qwen3_5_offsets_by_head, check_shards=_qwen3_5_shards,
           grad_atol=1e-6, loss_tol=1e-5),
    # Qwen3.5's plan under Qwen3-Next's mixture of experts (each rank routes its share of the
    # tokens): the Gated DeltaNet and gated-attention parameters, on a packed batch, and the
    # shared expert's gate (whole on every rank, its gradient summed over the ranks' tokens:
    # left a plain tensor it measured 1.5e-4 off).
    TPCase(id="qwen3_next", family="qwen3_next",
           grads=("layers.0.attention.wq.weight", "layers.0.attention.conv_k.weight", "layers.2.attention.A_log",
                  "layers.1.attention.norm.weight", "layers.3.attention.wg.weight", "layers.3.attention.q_norm.weight",
                  "layers.1.feed_forward.w2.weight", "layers.0.feed_forward.shared_gate.weight"),
           documents=True, prepare=_qwen3_5_offsets_by_head, grad_atol=1e-6, loss_tol=1e-5),
    # GPT-2's plan: learned positions, biases with their columns, LayerNorms; every gradient.
    TPCase(id="gpt2", family="gpt2", grads=None, grad_atol=1e-6, loss_tol=1e-5),
    # Mamba-2 split by group (one group and its 4 heads a rank: projections, convolutions with
    # biases, A_log, D, dt_bias, the grouped norm's weight), attention, MLP and MoE blocks (each
    # rank routes half the tokens through whole squared-ReLU experts), packed.
    TPCase(id="nemotron_h", family="nemotron_h",
           grads=("layers.0.attention.wx.weight", "layers.0.attention.wB.weight", "layers.2.attention.conv_C.bias",
                  "layers.0.attention.conv_x.weight", "layers.2.attention.A_log", "layers.0.attention.D",
                  "layers.2.attention.dt_bias", "layers.0.attention.norm.weight", "layers.0.attention.wo.weight",
                  "layers.3.attention.wq.weight", "layers.1.feed_forward.w2.weight", "layers.1.ffn_norm.weight",
                  "layers.6.feed_forward.router.gate.weight", "layers.6.feed_forward.experts.w1",
                  "layers.6.feed_forward.experts.w2", "layers.6.feed_forward.shared_experts.w1.weight",
                  "layers.6.ffn_norm.weight"),
           documents=True, sum_experts=True, grad_atol=1e-6, loss_tol=1e-5),
    # Nemotron 3 Super's latent experts (biased projections, as with mlp_bias): the projections
    # to and from the latent whole on every rank, their gradients summed over the ranks' tokens;
    # the routed experts spread over the ranks, computing on latent-width rows (expert parallelism).
    TPCase(id="nemotron_h-latent", family="nemotron_h",
           grads=("layers.6.feed_forward.to_latent.weight", "layers.6.feed_forward.to_latent.bias",
                  "layers.6.feed_forward.from_latent.weight", "layers.6.feed_forward.from_latent.bias",
                  "layers.6.feed_forward.experts.w1", "layers.6.feed_forward.experts.w2",
                  "layers.6.feed_forward.router.gate.weight", "layers.6.feed_forward.shared_experts.w2.bias",
                  "layers.6.ffn_norm.weight", "layers.1.feed_forward.w1.bias"),
           runs=((True, dict(moe_latent_dim=48, mlp_bias=True)),), documents=True,
           after_tp=_deepseek_v3_experts_over_tp_ranks, grad_atol=1e-6, loss_tol=1e-5),
    # Attention blocks under OLMo 3's plan, Gated DeltaNet blocks split by head with their pre-norms.
    TPCase(id="olmo_hybrid", family="olmo_hybrid",
           grads=("layers.0.attention.wq.weight", "layers.0.attention.conv_k.weight", "layers.1.attention.A_log",
                  "layers.2.attention.norm.weight", "layers.2.attention_norm.weight", "layers.1.ffn_norm.weight",
                  "layers.3.attention.q_norm.weight", "layers.3.post_attention_norm.weight",
                  "layers.3.feed_forward.w2.weight"),
           runs=((False, dict(rope_theta=10_000.0)), (True, dict(rope_theta=10_000.0))), grad_atol=2e-6),
    # q_norm/k_norm see only a rank's heads; their weight gradients must still be the whole
    # model's (left as plain replicated tensors they would differ by ~2e-3 here). The loss: measured
    # 1.4e-6 apart with the venv built 2026-12-02 (a loss of 7.69: three float32 ulps).
    *(TPCase(id=f"qwen3-{flavor}", family="qwen3", flavor=flavor,
             grads=("layers.0.attention.q_norm.weight", "layers.3.attention.k_norm.weight",
                    "layers.1.attention.wk.weight"), grad_atol=1e-7, loss_tol=1e-5)
      for flavor in ("debug", "debug-moe")),
    # MLA split by heads, queries through the latent then directly: every gradient, the
    # replicated latent projections included (the shared rotated key's gradient is summed
    # over the ranks: without it wkv_a's differs).
    # DeepSeek-V3.2: DeepSeek-V3's plan, the indexer replicated (every rank selects the same top 8
    # of 32 keys for its heads), on a packed batch; its parameters get no gradient (untrained).
    TPCase(id="deepseek_v32", family="deepseek_v32",
           grads=("layers.0.attention.wq_a.weight", "layers.0.attention.wq_b.weight", "layers.1.attention.wkv_a.weight",
                  "layers.2.attention.wkv_b.weight", "layers.3.attention.wo.weight", "layers.0.feed_forward.w2.weight",
                  "tok_embeddings.weight"),
           documents=True, after_tp=_deepseek_v3_experts_over_tp_ranks, grad_atol=1e-6, loss_tol=1e-5),
    # GLM-5: DeepSeek-V3.2's plan, its indexer rotating interleaved pairs.
    TPCase(id="glm5", family="glm5",
           grads=("layers.0.attention.wq_b.weight", "layers.1.attention.wkv_a.weight", "layers.3.attention.wo.weight"),
           documents=True, after_tp=_deepseek_v3_experts_over_tp_ranks, grad_atol=1e-6, loss_tol=1e-5),
    TPCase(id="deepseek_v3", family="deepseek_v3",
           grads=None, runs=((False, dict(q_lora_rank=64)), (True, dict(q_lora_rank=0))),
           after_tp=_deepseek_v3_experts_over_tp_ranks, grad_atol=1e-7),
    # DeepSeek-V4: query heads split (2 a rank) with their sinks and output groups, the query latent,
    # the shared key/value head, the compressors and the indexers (frozen: no gradient) whole on every
    # rank, the key/value rows' gradient summed over the ranks; hash- and top-k-routed experts spread
    # over the ranks (each routing its tokens by their own ids); the hyper-connections whole, under SP
    # on the rank's slice of the streams. Every trained gradient, on a packed batch (each document's
    # windows compressed alone).
    TPCase(id="deepseek_v4", family="deepseek_v4", grads=None, prepare=_deepseek_v4_offsets,
           check_shards=_deepseek_v4_shards, after_tp=_deepseek_v3_experts_over_tp_ranks, grad_atol=1e-6,
           loss_tol=1e-5, documents=True),
    # KDA split by head (one of two a rank), its rank-d projections whole, on a packed batch;
    # NoPE latent attention and the experts as DeepSeek-V3's: every gradient.
    TPCase(id="kimi_linear", family="kimi_linear", grads=None, documents=True,
           after_tp=_deepseek_v3_experts_over_tp_ranks, grad_atol=1e-6, loss_tol=1e-5),
)


def _loss_and_grads(case: TPCase, model, tp: int) -> tuple[float, dict[str, torch.Tensor]]:
    """The loss of one batch (2 rows of 32 tokens, seed 0) and the case's gradients, whole."""
    from forja.parallel.tp import loss_context

    gen = torch.Generator().manual_seed(0)
    tokens, labels = (torch.randint(0, 2048, (2, 32), generator=gen) for _ in range(2))
    docs = torch.tensor([[0] * 20 + [1] * 12, [0] * 32]) if case.documents else None
    with loss_context(tp):
        loss = model(tokens, docs, labels=labels)
        loss.backward()
    full = lambda t: t.full_tensor() if hasattr(t, "full_tensor") else t  # noqa: E731
    params = dict(model.named_parameters())
    trained = [n for n, p in params.items() if p.requires_grad]
    return float(full(loss.detach())), {n: full(params[n].grad) for n in case.grads or trained}


def _run_case(case: TPCase, mesh, world: int) -> list:
    plan = get_family(case.family).tp_plan  # the plan training applies: the family's, or the dense default
    from forja.parallel.tp import apply_tp

    out = []
    for sequence_parallel, overrides in case.runs:
        model = case.build(overrides)
        apply_tp(model, mesh, plan(model.args, sequence_parallel))
        if case.after_tp is not None:
            case.after_tp(model, mesh)
        if case.check_shards is not None:
            case.check_shards(model)
        out.append((*_loss_and_grads(case, model, world), _held_by_blocks(model)))
    return out


def _held_by_blocks(model) -> int:
    """The elements of the blocks' parameters this rank holds, the routed experts aside (what
    expert parallelism spreads, which some cases leave whole)."""
    local = lambda p: p.to_local() if hasattr(p, "to_local") else p  # noqa: E731
    return sum(local(p).numel() for n, p in model.layers.named_parameters() if ".experts." not in f".{n}")


def _planned_per_rank(args, tp: int) -> float:
    """What the planner (forja/plan/shape.py) says a TP rank holds of the same parameters."""
    from forja.plan.shape import model_shape

    return sum(b.tp_split / tp + b.replicated for b in model_shape(args, 64).blocks)


def _run_every_case(rank: int, world: int) -> dict:
    """On each rank: case id -> [(loss, gradients) per run], or the traceback of the case's
    failure (so that one family's failure fails its own test, the others still run)."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh, out = init_device_mesh("cpu", (world,)), {}
    for case in CASES:
        try:
            out[case.id] = _run_case(case, mesh, world)
        except Exception:
            out[case.id] = traceback.format_exc()
    return out


@pytest.fixture(scope="module")
def tp_ranks() -> list[dict]:
    """Every case's results on each of 2 ranks, from one spawn."""
    from forja.testing import run_distributed

    # All cases in one run: 120 s per collective, the ranks joined within 4x that.
    return run_distributed(_run_every_case, 2, timeout_s=120.0)


@pytest.mark.slow  # two spawned ranks, shared by every case
@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_tensor_parallel_loss_and_gradients_equal_one_device(tp_ranks, card, case):
    ranks = [r[case.id] for r in tp_ranks]
    for rank, result in enumerate(ranks):
        if isinstance(result, str):
            pytest.fail(f"{case.id} failed on rank {rank}:\n{result}")
    references: dict[str, tuple] = {}  # runs with the same overrides share one device's reference
    loss_diff = 0.0
    for i, (sequence_parallel, overrides) in enumerate(case.runs):
        key = repr(sorted(overrides.items()))
        if key not in references:
            references[key] = _loss_and_grads(case, case.build(overrides), tp=1)
        loss, grads = references[key]
        for name, want in grads.items():
            shares = [r[i][1][name] for r in ranks]
            # Every rank holds the whole gradient, but an expert's under sum_experts.
            whole = [sum(shares)] if case.sum_experts and ".experts." in name else shares
            for got in whole:
                err = (got - want).abs().max().item()
                assert torch.allclose(got, want, atol=case.grad_atol, rtol=1e-5), (sequence_parallel, name, err)
        # the planner's per-rank count of the blocks' split and replicated parameters is what a rank holds
        planned = _planned_per_rank(model_args(case.family, case.flavor, **overrides), len(ranks))
        for r in ranks:
            assert abs(r[i][0] - loss) < case.loss_tol, (sequence_parallel, r[i][0], loss)
            loss_diff = max(loss_diff, abs(r[i][0] - loss))
            assert r[i][2] == planned, (sequence_parallel, r[i][2], planned)
    if any(sequence_parallel for sequence_parallel, _ in case.runs):
        card(case.family, "tp_sp", loss_diff)
