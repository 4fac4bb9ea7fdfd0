"""forja plan's context parallelism: both kinds searched, each kind's communication and memory
as the kind moves and holds them, worked out here by hand from the model's shapes and the
hardware's figures (docs/planner.md, "CP")."""

from __future__ import annotations

import dataclasses
import io

import pytest
from rich.console import Console

from forja.config import load_config
from forja.errors import ForjaError
from forja.models import model_args
from forja.plan.activations import block_activations
from forja.plan.cli import print_plan, set_items
from forja.plan.context_parallel import a2a_elements, cp_buffers
from forja.plan.hardware import get_hardware
from forja.plan.job import Job
from forja.plan.layout import Layout, SearchSpace, enumerate_layouts, parse_fixed
from forja.plan.memory import end_ranks, rank_moments
from forja.plan.planner import default_space, evaluate, plan
from forja.plan.shape import model_shape
from forja.plan.speed import ATTENTION_EFFICIENCY, HBM_EFFICIENCY, cp_block_time, gemm_efficiency, predict_time

H100 = get_hardware("h100")


def job(family: str = "llama", flavor: str = "3.1-8b", seq: int = 32768, batch: int = 8, args=None) -> Job:
    args = args or model_args(family, flavor)
    return Job(shape=model_shape(args, seq), seq_len=seq, global_batch_size=batch, gpu=True, bf16=True)


def kinds_by_cp(layouts) -> dict[int, set[str]]:
    out: dict[int, set[str]] = {}
    for lay in layouts:
        out.setdefault(lay.cp, set()).add(lay.cp_kind)
    return out


def test_both_kinds_are_searched_unless_one_is_held():
    a = model_args("llama", "3.1-8b")  # 32 heads, 8 KV heads
    common = dict(n_layers=a.n_layers, n_heads=a.n_heads, n_kv_heads=a.n_kv_heads, n_experts=0,
                  global_batch_size=64, seq_len=8192)
    free = list(enumerate_layouts(64, **common, space=SearchSpace()))
    kinds = kinds_by_cp(free)
    assert kinds[1] == {"ring"} and all(kinds[cp] == {"ring", "all-to-all"} for cp in (2, 4, 8))
    # All-to-all splits a TP rank's heads over cp: 32 / tp 8 = 4 heads cannot go to 8 cp ranks.
    assert {lay.cp_kind for lay in free if lay.tp == 8 and lay.cp == 8} == {"ring"}
    held = list(enumerate_layouts(64, **common,
                                  space=SearchSpace().with_fixed(parse_fixed("parallel.cp_kind=all-to-all"))))
    assert {lay.cp_kind for lay in held if lay.cp > 1} == {"all-to-all"}
    # Held, the kind is tried also where the heads do not split (the validator then says why).
    searched = {lay for lay in free if lay.cp > 1 and lay.cp_kind == "all-to-all"}
    extra = {lay for lay in held if lay.cp > 1} - searched
    assert searched <= set(held) and extra and all((32 // lay.tp) % lay.cp for lay in extra)
    with pytest.raises(ForjaError, match="parallel.cp_kind = 'ulysses' is not valid: it must be one of 'ring', "
                                         "'all-to-all'"):
        parse_fixed("parallel.cp_kind=ulysses")


def _ring_by_hand(j: Job, lay: Layout, bw: float) -> float:
    """forja's ring (forja/parallel/cp/ring.py): fp32 K, V and dK, dV; fp32 matmul blocks."""
    a = j.args
    s = lay.micro_batch_size * j.seq_len / lay.cp  # tokens of a micro-batch on a rank
    kv = dkv = s * 2 * a.n_kv_heads * a.head_dim * 4
    c = j.seq_len / (2 * lay.cp)  # 2 cp chunks: a rank computes its 2, by every chunk at or before them
    scores = lay.micro_batch_size * a.n_heads * c * c * (2 * lay.cp + 1)
    fp32, hbm = H100.fp32_flops * gemm_efficiency(H100), H100.hbm_bytes_per_s * HBM_EFFICIENCY
    forward = scores * 4 * a.head_dim / fp32 + scores * 10 * 4 / hbm  # q k^T, p v; 10 passes over the scores
    backward = scores * 10 * a.head_dim / fp32 + scores * 16 * 4 / hbm
    hops = lay.cp - 1
    block = (hops * max(0.0, kv / bw - forward / lay.cp) + hops * max(0.0, (kv + dkv) / bw - backward / lay.cp)
             + dkv / bw)
    micro = j.global_batch_size // lay.dp // lay.micro_batch_size
    return a.n_layers * micro * block


def test_ring_shows_only_what_a_hop_of_attention_cannot_hide():
    j, lay = job(), Layout.of(dp_shard=2, cp=4, cp_kind="ring")
    fast = predict_time(j, lay, H100).cp_comm
    assert fast == pytest.approx(_ring_by_hand(j, lay, H100.intra_node_bytes_per_s), rel=1e-9)
    # On NVLink every hop hides under the attention: only the last dK, dV hop home shows.
    last_hop = j.args.n_layers * 4 * (8192 * 2 * 8 * 128 * 4) / H100.intra_node_bytes_per_s
    assert fast == pytest.approx(last_hop, rel=1e-9)
    for bw in (1e9, 0.5e9):
        slow = dataclasses.replace(H100, intra_node_bytes_per_s=bw)
        assert predict_time(j, lay, slow).cp_comm == pytest.approx(_ring_by_hand(j, lay, bw), rel=1e-9)
        assert predict_time(j, lay, slow).cp_comm > 1.5 * last_hop * H100.intra_node_bytes_per_s / bw  # hops show
    # A longer sequence adds attention (T^2) faster than K, V (T): the hops hide better.
    short, long_ = (predict_time(job(seq=s), lay, dataclasses.replace(H100, intra_node_bytes_per_s=2e9)).cp_comm
                    for s in (8192, 32768))
    assert long_ < 4 * short


def test_ring_attention_runs_at_the_fp32_rate_of_its_blocks():
    """forja's ring has no fused kernel yet: attention under it costs its fp32 blocks, not flash."""
    j = job()
    one, ring = Layout.of(dp_shard=4), Layout.of(dp_shard=1, cp=4, cp_kind="ring")
    a2a = dataclasses.replace(ring, cp_kind="all-to-all")
    a = j.args
    c = 32768 / 8
    scores = a.n_heads * c * c * 9  # per sequence: 9 of the 64 blocks of 4096 x 4096 on a rank
    per_sequence = scores * 14 * a.head_dim / (H100.fp32_flops * gemm_efficiency(H100)) + \
        scores * 26 * 4 / (H100.hbm_bytes_per_s * HBM_EFFICIENCY)
    flash = 32768 / 4 * 6 * a.n_heads * a.head_dim * 32768 / (H100.bf16_flops * ATTENTION_EFFICIENCY)
    sequences = 8 // 1  # a cp group shares one batch of 8 rows: each rank runs 8 sequences' shards
    extra = a.n_layers * sequences * (per_sequence - flash)
    assert predict_time(j, ring, H100).compute - predict_time(j, a2a, H100).compute == pytest.approx(extra, rel=1e-9)
    assert predict_time(j, a2a, H100).compute == pytest.approx(predict_time(j, one, H100).compute, rel=0.05)


def _all_to_all_by_hand(j: Job, lay: Layout, forwards: int) -> float:
    a = j.args
    s = lay.micro_batch_size * j.seq_len / lay.cp
    kv_heads_per_rank = a.n_kv_heads / lay.tp
    replicated = lay.cp / kv_heads_per_rank if kv_heads_per_rank < lay.cp else 1
    q = out = a.n_heads * a.head_dim / lay.tp
    k = v = a.n_kv_heads * a.head_dim / lay.tp * replicated
    one_pass = (lay.cp - 1) / lay.cp * s * (q + k + v + out) * 2 / H100.intra_node_bytes_per_s  # 4 all-to-alls
    micro = j.global_batch_size // lay.dp // lay.micro_batch_size
    return a.n_layers * micro * (forwards + 1) * one_pass


def test_all_to_all_pays_eight_exchanges_per_block_on_the_critical_path():
    j = job()
    lay = Layout.of(dp_shard=2, cp=4, cp_kind="all-to-all")
    t = predict_time(j, lay, H100).cp_comm
    assert t == pytest.approx(_all_to_all_by_hand(j, lay, forwards=1), rel=1e-9)
    full = dataclasses.replace(lay, ac="full")  # the recomputed forward runs its 4 again
    assert predict_time(j, full, H100).cp_comm == pytest.approx(_all_to_all_by_hand(j, full, forwards=2), rel=1e-9)
    # Per rank the volume is its tokens (T / cp) times (cp - 1) / cp: twice T, twice the time;
    # cp 2 -> 4 at the same tokens per rank, (3/4) / (1/2) = 1.5 times.
    assert predict_time(job(seq=65536), lay, H100).cp_comm == pytest.approx(2 * t, rel=1e-9)
    two = predict_time(job(seq=16384), Layout.of(dp_shard=2, cp=2, cp_kind="all-to-all"), H100).cp_comm
    assert t == pytest.approx(1.5 * two, rel=1e-9)
    # Nothing hides it: unlike ring, it does not shrink when attention grows.
    assert t > predict_time(j, dataclasses.replace(lay, cp_kind="ring"), H100).cp_comm


def test_all_to_all_replicates_kv_heads_fewer_than_cp():
    args = dataclasses.replace(model_args("llama", "3.1-8b"), n_kv_heads=2)
    j, lay = job(args=args), Layout.of(dp_shard=1, cp=8, cp_kind="all-to-all")
    assert predict_time(j, lay, H100).cp_comm == pytest.approx(_all_to_all_by_hand(j, lay, forwards=1), rel=1e-9)
    # SDPA keeps k and v as they arrive: one KV head per rank, 4 times its share of 2 heads.
    block = j.shape.blocks[0]
    extra = block_activations(j, lay, block, 1)[0] - block_activations(j, Layout(), block, 1)[0]
    out = 32 * 128 * 2  # SDPA's full-sequence output besides the copy wo keeps
    assert extra == pytest.approx(2 * 2 * 128 * (8 / 2 - 1) * 2 + out)  # k and v, 2 heads of 128, bf16


def test_gated_deltanet_under_ring_gathers_states_where_all_to_all_moves_every_token():
    j = job("qwen3_5", "9b", seq=65536, batch=8)  # 16 key heads, 32 value heads of 128, 4 taps
    block = next(b for b in j.shape.blocks if b.kind == "linear_attention")
    ring, a2a = Layout.of(dp_shard=2, cp=4, cp_kind="ring"), Layout.of(dp_shard=2, cp=4, cp_kind="all-to-all")
    s, bw = 65536 / 4, H100.intra_node_bytes_per_s
    gather = 3 * 32 * 128 * 256 * 4 / bw  # 3 other ranks' (32, 128, 128 + 128) fp32 transitions
    halo = 3 * (2 * 16 * 128 + 32 * 128) * 2 / bw  # 3 tokens of q, k, v in bf16
    assert cp_block_time(j, ring, H100, block, s) == pytest.approx(2 * (gather + halo), rel=1e-9)
    moved = 3 / 4 * s * (2 * 16 * 128 + 2 * 32 * 128) * 2 / bw  # q, k, v in and the output back
    assert cp_block_time(j, a2a, H100, block, s) == pytest.approx(2 * moved, rel=1e-9)
    assert cp_block_time(j, ring, H100, block, s) < cp_block_time(j, a2a, H100, block, s) / 20


def test_mamba2_and_kda_blocks_move_what_their_mixers_read_and_feed_forward_blocks_nothing():
    j = job("nemotron_h", "8b", seq=65536, batch=8)  # Mamba-2: 128 heads of 64, 8 groups of 128 states, 4 taps
    ring, a2a = Layout.of(dp_shard=2, cp=4, cp_kind="ring"), Layout.of(dp_shard=2, cp=4, cp_kind="all-to-all")
    s, bw = 65536 / 4, H100.intra_node_bytes_per_s
    mamba = next(b for b in j.shape.blocks if b.kind == "mamba2")
    gather = 3 * 128 * (64 * 128 + 1) * 4 / bw  # 3 other ranks' fp32 states and decays
    halo = 3 * (128 * 64 + 2 * 8 * 128) * 2 / bw  # 3 tokens of x, B, C in bf16
    assert cp_block_time(j, ring, H100, mamba, s) == pytest.approx(2 * (gather + halo), rel=1e-9)
    moved = 3 / 4 * s * (2 * 128 * 64 + 128 + 2 * 8 * 128) * 2 / bw  # x, dt, B, C in; y back
    assert cp_block_time(j, a2a, H100, mamba, s) == pytest.approx(2 * moved, rel=1e-9)
    sixteen = Layout.of(dp_shard=1, cp=16, cp_kind="all-to-all")  # 8 groups over 16 ranks: B and C twice over
    assert a2a_elements(j, sixteen, mamba) == 2 * 128 * 64 + 128 + 2 * 2 * 8 * 128
    mlp = next(b for b in j.shape.blocks if b.kind == "mlp")
    assert cp_block_time(j, ring, H100, mlp, s) == 0 == cp_block_time(j, a2a, H100, mlp, s)
    k = job("kimi_linear", "48b-a3b", seq=65536, batch=8)  # KDA: 32 heads of 128, a decay per key channel
    kda = next(b for b in k.shape.blocks if b.kind == "linear_attention")
    moved = 3 / 4 * s * (4 * 32 * 128 + 32 * 128) * 2 / bw  # q, k, v and the decay in; the output back
    assert cp_block_time(k, a2a, H100, kda, s) == pytest.approx(2 * moved, rel=1e-9)


def block_backward(j, lay: Layout):
    """The moment a block computes its backward (CP's transients live only then)."""
    (rm,) = end_ranks(j, lay)
    return next(m for m in rank_moments(j, lay, rm) if m.phase == "first block backward")


@pytest.mark.parametrize("kind", ["ring", "all-to-all"])
def test_activations_per_rank_fall_with_cp_and_each_kind_adds_its_buffers(kind):
    j = job()
    base = block_backward(j, Layout.of(dp_shard=4))  # the same FSDP degree (dp_shard x cp) as below
    # Eager autocast keeps each block's bf16 weights for its backward, whatever the tokens.
    casts = sum(2 * (b.tp_split + b.replicated) for b in j.shape.blocks)
    for cp in (2, 4):
        split = block_backward(j, Layout.of(dp_shard=4 // cp, cp=cp, cp_kind=kind))
        s = 32768 / cp
        # Beside the output wo keeps: ring's own fp32 one, all-to-all's full-sequence one (bf16).
        out = 32 * s * 4096 * (4 if kind == "ring" else 2)
        assert split.activations - casts == pytest.approx((base.activations - casts) / cp + out, rel=1e-9)
        if kind == "ring":  # fp32 q, k, v, dO copies, dQ, 3 x (K, V)-sized: own dK dV, incoming, next K V
            c = 32768 / (2 * cp)
            transient = s * (10240 + 4096 + 3 * 2048) * 4 + 3 * 32 * c * c * 4  # and p, dO V^T, ds of a block
        else:  # q, k, v and the output in their other layout
            transient = s * (4096 + 1024 + 1024 + 4096) * 2
        assert split.buffers - base.buffers == pytest.approx(transient, rel=1e-9)


def test_gated_deltanet_activations_follow_the_shard_under_ring():
    j = job("qwen3_5", "9b", seq=65536, batch=8)
    block = next(b for b in j.shape.blocks if b.kind == "linear_attention")
    one = block_activations(j, Layout(), block, 0)[0]
    for cp in (2, 4, 8):  # per token of the shard: the same but for its halo and chunk states
        for kind in ("ring", "all-to-all"):
            assert block_activations(j, Layout.of(cp=cp, cp_kind=kind), block, 0)[0] == pytest.approx(one, rel=0.01)
    # A shard shorter than a chunk (256 / 8 = 32 < 64): under ring each keeps a whole chunk's state
    # and its halo for 32 tokens, more per token than narrower C-wide tensors save; all-to-all scans
    # the whole sequence (for its heads), as one rank would.
    short = job("qwen3_5", "9b", seq=256, batch=8)
    ring, a2a = (block_activations(short, Layout.of(cp=8, cp_kind=k), block, 0)[0] for k in ("ring", "all-to-all"))
    assert a2a == pytest.approx(block_activations(short, Layout(), block, 0)[0]) and ring > 1.05 * a2a


def test_mamba2_activations_follow_the_shard_under_ring():
    long = job("nemotron_h", "8b", seq=65536, batch=8)
    block = next(b for b in long.shape.blocks if b.kind == "mamba2")
    one = block_activations(long, Layout(), block, 0)[0]
    for kind in ("ring", "all-to-all"):  # per token of the shard: the same but for its halo and chunk states
        assert block_activations(long, Layout.of(cp=8, cp_kind=kind), block, 0)[0] == pytest.approx(one, rel=0.01)
    # A ring shard of 256 / 8 = 32 tokens pads its scan to a chunk of 128; all-to-all scans whole rows.
    short = job("nemotron_h", "8b", seq=256, batch=8)
    ring, a2a = (block_activations(short, Layout.of(cp=8, cp_kind=k), block, 0)[0] for k in ("ring", "all-to-all"))
    assert a2a == pytest.approx(block_activations(short, Layout(), block, 0)[0]) and ring > 1.5 * a2a


def test_the_table_and_the_set_line_name_the_kind(capsys):
    j = job(seq=65536)
    space = default_space(H100).with_fixed(parse_fixed("parallel.cp=4"))
    ranked = plan(j, H100, 8, space=space)
    assert {c.layout.cp_kind for c in ranked} == {"ring", "all-to-all"}
    held = plan(j, H100, 8,
                space=default_space(H100).with_fixed(parse_fixed("parallel.cp=4,parallel.cp_kind=all-to-all")))
    assert held and {c.layout.cp_kind for c in held} == {"all-to-all"}
    console = Console(file=io.StringIO(), width=300)
    print_plan([evaluate(j, Layout.of(dp_shard=2, cp=4, cp_kind=k), H100) for k in ("all-to-all", "ring")], H100, 8, 5,
               j, console=console, wide=True)
    table = console.file.getvalue()
    assert "dp_shard 2 x cp 4 all-to-all |" in table and "dp_shard 2 x cp 4 ring |" in table
    assert "--set parallel.cp_kind=" in capsys.readouterr().out
    cfg = load_config("llama3-8b", set_items(Layout.of(dp_shard=2, cp=4, cp_kind="all-to-all")))
    assert (cfg.parallel.cp, cfg.parallel.cp_kind) == (4, "all-to-all")


@pytest.mark.parametrize("stage", [None, "sparse"])
def test_sparse_attention_adds_its_indexer_traffic_and_selection(stage):
    """DeepSeek Sparse Attention under CP: latent attention's exchanges plus its indexer's (the
    whole rows' keys gathered, all-to-all's selection, a trained target's exchange), and the
    selection kept: all-to-all's bias over whole rows, ring's booleans of its own queries."""
    T = 8192
    args = dataclasses.replace(model_args("deepseek_v32", "debug"), dsa_stage=stage)  # 4 heads of 48; d_I 32
    j = job(args=args, seq=T, batch=4)
    dsa = j.shape.blocks[-1]
    plain = dataclasses.replace(dsa, indexer=())  # the same block, latent attention alone
    ring, a2a = Layout.of(dp_shard=1, cp=4, cp_kind="ring"), Layout.of(dp_shard=1, cp=4, cp_kind="all-to-all")
    s, bw = T / 4, H100.intra_node_bytes_per_s
    keys = 4 * s * 32 * 2  # the whole rows' indexer keys, bf16
    summed = 2 * 3 / 4 * keys / bw if stage else 0.0  # their gradient all-reduced
    target = 4 * s * T * 4 if stage else 0.0  # the whole rows' head sums, fp32
    by_hand = {"all-to-all": 3 / 4 * (keys + 4 * s * T + target) / bw + summed,  # the selection, a byte a key
               "ring": 3 / 4 * keys / bw + (3 * s * 4 * 48 * 4 if stage else 0.0) / bw + summed}  # K round again
    for lay in (ring, a2a):
        extra = cp_block_time(j, lay, H100, dsa, s) - cp_block_time(j, lay, H100, plain, s)
        assert extra == pytest.approx(by_hand[lay.cp_kind], rel=1e-9)
    buffers = {"all-to-all": keys + 4 * s * T * (1 + (12 if stage else 0)), "ring": keys + (s * T * 4 if stage else 0)}
    for lay in (ring, a2a):
        assert cp_buffers(j, lay, dsa, s) - cp_buffers(j, lay, plain, s) == pytest.approx(buffers[lay.cp_kind])

    def kept(lay: Layout) -> float:  # bytes per token the indexer adds to the block
        return block_activations(j, lay, dsa, 0)[0] - block_activations(j, lay, plain, 0)[0]

    one = kept(Layout.of(dp_shard=4))
    assert kept(a2a) - one == pytest.approx(3 * T * 2)  # bf16 bias over cp times the rows
    assert kept(ring) - one == pytest.approx(T * 1 - T * 2)  # a byte a key instead of the bias
