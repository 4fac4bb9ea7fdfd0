"""fused_linear_cross_entropy: the plain loss's value and gradients, without the logits."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from forja.errors import ForjaError
from forja.ops import cross_entropy as ce
from forja.ops.cross_entropy import chunk_rows, fused_linear_cross_entropy
from forja.testing import run_distributed

ROOT = Path(__file__).resolve().parents[3]


def _inputs(n=37, d=16, v=101, dtype=torch.float32, seed=0, ignored=5):
    """hidden (n, d), weight (v, d), targets (n,) with every `ignored`-th row ignored."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, d, generator=g).to(dtype)
    weight = (torch.randn(v, d, generator=g) * 0.5).to(dtype)
    targets = torch.randint(0, v, (n,), generator=g)
    targets[::ignored] = -100
    return hidden, weight, targets


def _run(loss_fn, hidden, weight, targets, scale=1.0):
    """(loss, d hidden, d weight) of loss_fn on fresh leaves."""
    h = hidden.detach().clone().requires_grad_()
    w = weight.detach().clone().requires_grad_()
    loss = loss_fn(h, w, targets)
    (loss * scale).backward()
    return loss.detach(), h.grad, w.grad


def _plain(h, w, t, ignore_index=-100):
    return F.cross_entropy((h @ w.T).float(), t, ignore_index=ignore_index)


def _assert_close(got, want, tol):
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=tol, atol=tol)


@pytest.mark.parametrize("chunk", [1, 3, 7, 16, 37, 64])
def test_matches_cross_entropy_fp32(chunk):
    """Chunks of 1 row, uneven last chunks (37 rows; vocab 101), one chunk, more than N."""
    args = _inputs()
    want = _run(_plain, *args)
    got = _run(lambda h, w, t: fused_linear_cross_entropy(h, w, t, chunk_size=chunk), *args)
    _assert_close(got, want, 1e-5)
    assert got[0].dtype == torch.float32 and got[0].ndim == 0


def test_default_chunking_policy():
    assert chunk_rows(8192, 128256) == 512  # 512 x 128,256 fp32 logits: 263 MB
    assert chunk_rows(8192, 32000) == 2048
    assert chunk_rows(10, 128256) == 10
    assert chunk_rows(100, 10**9) == 1
    assert chunk_rows(100, 1000, budget_bytes=4 * 1000 * 24) == 16


def test_default_chunks_match(monkeypatch):
    monkeypatch.setattr(ce, "LOGITS_BUDGET_BYTES", 4 * 101 * 5)  # 4-row chunks
    args = _inputs()
    _assert_close(_run(fused_linear_cross_entropy, *args), _run(_plain, *args), 1e-5)


@pytest.mark.parametrize("chunk", [1, 5, 64])
def test_bf16_is_as_accurate_as_the_plain_loss(chunk):
    """bf16 inputs: logits in bf16, softmax in fp32. Against the fp32 truth of the same
    (bf16-valued) inputs, relative norm errors measured here: loss 2.2e-4 and d hidden
    4.2e-3, the plain bf16 loss's to the bit; d weight 4.9e-3 vs the plain loss's 4.7e-3,
    as each chunk's product is rounded to bf16 before the fp32 sum. Stated tolerances: the
    loss and d hidden equal the plain loss's (1e-6); every error below 1e-2 and at most
    1.1x the plain loss's."""
    hidden, weight, targets = _inputs(n=64, d=32, v=500, dtype=torch.bfloat16, ignored=7)
    truth = _run(lambda h, w, t: F.cross_entropy(h @ w.T, t), hidden.float(), weight.float(), targets)
    plain = _run(_plain, hidden, weight, targets)
    fused = _run(lambda h, w, t: fused_linear_cross_entropy(h, w, t, chunk_size=chunk), hidden, weight, targets)
    assert fused[0].dtype == torch.float32
    assert fused[1].dtype == fused[2].dtype == torch.bfloat16
    _assert_close(fused[:2], plain[:2], 1e-6)
    rel = [((f.float() - t).norm() / t.norm()).item() for f, t in zip(fused, truth)]
    rel_plain = [((p.float() - t).norm() / t.norm()).item() for p, t in zip(plain, truth)]
    for r, rp in zip(rel, rel_plain):
        assert r < 1e-2 and r <= 1.1 * rp


def test_bf16_weight_gradient_in_vocabulary_slices(monkeypatch):
    """The bf16 d(weight) is formed in vocabulary slices (here 7 rows: 101 = 14 x 7 + 3)."""
    args = _inputs(dtype=torch.bfloat16)
    whole = _run(lambda h, w, t: fused_linear_cross_entropy(h, w, t, chunk_size=8), *args)
    monkeypatch.setattr(ce, "DW_SLICE_BYTES", 7 * 16 * 2)
    sliced = _run(lambda h, w, t: fused_linear_cross_entropy(h, w, t, chunk_size=8), *args)
    _assert_close(sliced, whole, 0)


def test_autocast_computes_logits_in_its_dtype():
    """Under autocast (as the model's forward runs) fp32 inputs give bf16 logits, like
    the plain `output(h)`; the gradients keep the parameters' fp32."""
    args = _inputs(n=32, d=32, v=300)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        plain = _run(lambda h, w, t: F.cross_entropy(F.linear(h, w).float(), t), *args)
        fused = _run(lambda h, w, t: fused_linear_cross_entropy(h, w, t, chunk_size=8), *args)
    assert fused[1].dtype == fused[2].dtype == torch.float32
    torch.testing.assert_close(fused[0], plain[0], rtol=1e-5, atol=1e-5)  # same bf16 logits
    for f, p in zip(fused[1:], plain[1:]):
        assert ((f - p).norm() / p.norm()).item() < 1e-2


def test_ignore_index_inside_the_vocabulary():
    hidden, weight, targets = _inputs()
    targets = targets.clamp(min=0)
    targets[::3] = 0  # ignore_index=0 is a real token id
    want = _run(lambda h, w, t: _plain(h, w, t, ignore_index=0), hidden, weight, targets)
    got = _run(lambda h, w, t: fused_linear_cross_entropy(h, w, t, ignore_index=0, chunk_size=4),
               hidden, weight, targets)
    _assert_close(got, want, 1e-5)


def test_all_targets_ignored_gives_zero_not_nan():
    hidden, weight, targets = _inputs()
    targets[:] = -100
    assert _plain(hidden, weight, targets).isnan()  # what we deliberately do not match
    loss, dh, dw = _run(lambda h, w, t: fused_linear_cross_entropy(h, w, t, chunk_size=4), hidden, weight, targets)
    assert loss.item() == 0.0 and not dh.any() and not dw.any()


def test_frozen_weight_and_no_grad():
    hidden, weight, targets = _inputs()
    want = _run(_plain, hidden, weight, targets)
    h = hidden.clone().requires_grad_()
    fused_linear_cross_entropy(h, weight, targets, chunk_size=5).backward()
    torch.testing.assert_close(h.grad, want[1], rtol=1e-5, atol=1e-5)
    assert weight.grad is None
    with torch.no_grad():
        loss = fused_linear_cross_entropy(hidden, weight.requires_grad_(), targets, chunk_size=5)
    torch.testing.assert_close(loss, want[0], rtol=1e-5, atol=1e-5)


def test_leading_dimensions_are_flattened():
    hidden, weight, targets = _inputs(n=24)
    want = _run(_plain, hidden, weight, targets)
    got = _run(lambda h, w, t: fused_linear_cross_entropy(h.view(4, 6, -1), w, t.view(4, 6), chunk_size=5),
               hidden, weight, targets)
    _assert_close(got, want, 1e-5)


def test_backward_scales_by_the_incoming_gradient():
    args = _inputs()
    want = _run(_plain, *args, scale=0.25)
    got = _run(lambda h, w, t: fused_linear_cross_entropy(h, w, t, chunk_size=6), *args, scale=0.25)
    _assert_close(got, want, 1e-5)


def test_second_backward_is_refused():
    hidden, weight, targets = _inputs()
    h = hidden.requires_grad_()
    loss = fused_linear_cross_entropy(h, weight, targets)
    loss.backward(retain_graph=True)
    with pytest.raises(ForjaError, match="second time"):
        loss.backward()


def test_bad_inputs_are_named():
    hidden, weight, targets = _inputs()
    with pytest.raises(ForjaError, match="weight"):
        fused_linear_cross_entropy(hidden, weight[:, :8], targets)
    with pytest.raises(ForjaError, match="one target per hidden row"):
        fused_linear_cross_entropy(hidden, weight, targets[:5])
    with pytest.raises(ForjaError, match="integer targets"):
        fused_linear_cross_entropy(hidden, weight, targets.float())
    too_large = targets.clone()
    too_large[1] = 101
    with pytest.raises(ForjaError, match="target id 101 outside the vocabulary of 101"):
        fused_linear_cross_entropy(hidden, weight, too_large)
    with pytest.raises(ForjaError, match="chunk_size"):
        fused_linear_cross_entropy(hidden, weight, targets, chunk_size=0)


class _LargestOutput(TorchDispatchMode):
    """Records the most elements of any tensor an operator returns."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def _largest_tensor(loss_fn, hidden, weight, targets) -> int:
    with _LargestOutput() as probe:
        _run(loss_fn, hidden, weight, targets)
    return probe.largest


def test_never_allocates_the_full_logits():
    """Forward and backward: no op returns N*V elements. (D < N and chunk*V < N*V, so the
    inputs and their gradients are all smaller than the logits.) The same probe on the
    plain loss sees them."""
    n, d, v, chunk = 256, 16, 1000, 32
    args = _inputs(n=n, d=d, v=v)
    assert _largest_tensor(_plain, *args) >= n * v  # the probe can see logits
    fused = _largest_tensor(lambda h, w, t: fused_linear_cross_entropy(h, w, t, chunk_size=chunk), *args)
    assert fused == chunk * v  # one chunk's logits, the largest thing there is


_INTERPRETED = r"""
import json, os, torch
from forja.ops import cross_entropy as ce
ce.BLOCK = 128  # several column blocks per row, the last one partial (vocab 300)
results = {}
for name in ("float32", "bfloat16"):
    dtype = getattr(torch, name)
    g = torch.Generator().manual_seed(1)
    h = torch.randn(13, 8, generator=g).to(dtype)
    w = (torch.randn(300, 8, generator=g) * 2).to(dtype)
    t = torch.randint(0, 300, (13,), generator=g)
    t[3] = -100
    out = {}
    for backend in ("torch", "triton", None):  # None: chosen by forja.ops.dispatch
        os.environ["FORJA_OPS"] = "triton" if backend is None else "auto"
        hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
        loss = ce.fused_linear_cross_entropy(hh, ww, t, chunk_size=4, backend=backend)
        loss.backward()
        out[backend] = [loss.detach().float(), hh.grad.float(), ww.grad.float()]
    assert all(torch.equal(a, b) for a, b in zip(out[None], out["triton"]))
    results[name] = [((a - b).norm() / b.norm()).item() for a, b in zip(out["triton"], out["torch"])]
x = torch.randn(5, 300) * 4
m, s = ce._stats_triton(x)
m0 = x.amax(dim=1)
s0 = torch.exp(x - m0[:, None]).sum(dim=1)
results["stats"] = [(m - m0).abs().max().item(), ((s - s0) / s0).abs().max().item()]
print(json.dumps(results))
"""


def test_triton_kernels_interpreted_match_the_pytorch_chunk_math():
    """The Triton kernels, run by Triton's CPU interpreter (it must be switched on before
    triton is imported: a fresh interpreter), against the PyTorch per-chunk math."""
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-c", _INTERPRETED], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    results = json.loads(done.stdout.strip().splitlines()[-1])
    assert max(results["float32"]) < 1e-6
    # bf16: both write the same gradient rounded to bf16; exp() differs in the last fp32
    # bits between numpy and torch, which can flip a rounding.
    assert results["bfloat16"][0] < 1e-6 and max(results["bfloat16"][1:]) < 1e-2
    assert results["stats"][0] == 0.0 and results["stats"][1] < 1e-6


# -- tensor parallelism: 2 Gloo ranks against one process ------------------------------------

def _tp_case(rank: int, world_size: int, layout: str, backend: str = "torch"):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world_size,))
    hidden, weight, targets = _inputs(n=24, d=8, v=37)  # 37: uneven shards (19 + 18 rows)
    w = distribute_tensor(weight.clone(), mesh, [Shard(0)]).requires_grad_()
    ce.BLOCK = 8  # for the kernels: several column blocks per rank's 19 or 18
    if layout == "plain":  # the same (N, D) tensor on every rank
        h = hidden.clone().requires_grad_()
        loss = fused_linear_cross_entropy(h, w, targets, chunk_size=5, backend=backend)
    else:  # (B, T, D) split along T, as sequence parallelism leaves it, flattened as
        # Transformer.loss does (DTensor makes that a _StridedShard of the token dimension)
        h = distribute_tensor(hidden.view(2, 12, 8), mesh, [Shard(1)]).requires_grad_()
        loss = fused_linear_cross_entropy(h.flatten(0, 1), w, targets, chunk_size=5, backend=backend)
    with pytest.raises(ForjaError, match="model.fused_ops"):  # a layout the fused loss does not take
        fused_linear_cross_entropy(hidden, distribute_tensor(weight, mesh, [Shard(1)]), targets)
    loss.backward()
    dh = h.grad.full_tensor().reshape(24, 8) if layout == "sequence" else h.grad
    return loss.detach(), dh, w.grad.full_tensor()


LAYOUTS = ["plain", "sequence"]


def _tp_cases(rank: int, world_size: int, layouts: list[str]) -> list:
    return [_tp_case(rank, world_size, layout) for layout in layouts]


@pytest.fixture(scope="module")
def tp_results() -> list[list]:
    """rank -> layout -> (loss, input gradient, weight gradient): both layouts in one spawn."""
    return run_distributed(_tp_cases, 2, LAYOUTS)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_vocabulary_parallel_matches_one_process(layout, tp_results):
    """Also: a weight split another way (on D) is refused with a ForjaError naming
    model.fused_ops."""
    want = _run(_plain, *_inputs(n=24, d=8, v=37))
    for of_rank in tp_results:
        _assert_close(of_rank[LAYOUTS.index(layout)], want, 1e-5)


def test_vocabulary_parallel_with_the_triton_kernels_interpreted(monkeypatch):
    """The kernels' partial maxima and sums, combined over the ranks. The ranks are fresh
    processes: they import triton after TRITON_INTERPRET is set."""
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    want = _run(_plain, *_inputs(n=24, d=8, v=37))
    for got in run_distributed(_tp_case, 2, "plain", "triton", fresh=True):
        _assert_close(got, want, 1e-5)


@pytest.mark.parametrize("capability", [80, 90])
def test_kernels_compile_for_cuda(capability):
    """The interpreter accepts things the compiler refuses: lower both kernels to cubins
    for an A100 (sm_80) and an H100/H200 (sm_90), as launched, without a GPU."""
    triton = pytest.importorskip("triton")
    try:
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
    except ImportError:
        pytest.skip(f"triton {triton.__version__} cannot compile ahead of time")
    for dtype in ("bf16", "fp32"):
        common = {"x_ptr": f"*{dtype}", "stride": "i32", "n_cols": "i32", "BLOCK": "constexpr"}
        signatures = {ce._stats_kernel: {**common, "max_ptr": "*fp32", "sum_ptr": "*fp32"},
                      ce._grad_kernel: {**common, "lse_ptr": "*fp32", "target_ptr": "*i64", "scale_ptr": "*fp32"}}
        for kernel, signature in signatures.items():
            signature = {name: signature[name] for name in kernel.arg_names}
            source = ASTSource(fn=kernel, signature=signature, constexprs={"BLOCK": ce.BLOCK})
            compiled = triton.compile(source, target=GPUTarget("cuda", capability, 32), options={"num_warps": 8})
            assert compiled.asm["cubin"], (kernel.fn.__name__, dtype)
