"""forja's Triton kernels against their PyTorch references, run by Triton's interpreter.

Run as a program (`python -m tests.unit.ops.interpret_checks`) in a fresh process with
TRITON_INTERPRET=1 and FORJA_OPS=triton in its environment: Triton reads TRITON_INTERPRET
when it is imported, so the interpreter cannot be switched on inside a pytest process that
may already have imported triton (torch.compile does). test_kernels.py starts it once and
checks what it prints: for every case and every output or gradient, the largest error
relative to the largest reference value, and the fraction of elements equal to the bit.

Fidelity patch: the interpreter (triton 3.9) converts float32 to bfloat16 by truncation
(a GPU rounds to nearest even), which would hide whether the kernels round where eager
PyTorch rounds. `exact_bf16_rounding()` replaces that one conversion with torch's; where a
Triton version lacks the patched function, bf16 cases are compared with tolerances only.
"""

from __future__ import annotations

import json
import sys

import torch

F32, BF16 = "float32", "bfloat16"

# Case id -> (op, dtype, shape parameters). Small shapes: the interpreter runs in numpy.
CASES: dict[str, tuple[str, str, dict]] = {}
for _dt in (F32, BF16):
    for _d in (64, 96, 256):
        CASES[f"rms_norm-{_dt}-D{_d}"] = ("rms_norm", _dt, dict(lead=(3, 5), dim=_d))
    for _hd, _h, _hkv in ((64, 4, 2), (96, 4, 2), (64, 3, 1), (128, 40, 8)):
        CASES[f"rope-{_dt}-hd{_hd}-H{_h}-Hkv{_hkv}"] = ("rope", _dt, dict(B=2, T=5, H=_h, Hkv=_hkv, hd=_hd))
    for _shape in ((4, 5, 96), (3, 1000)):
        CASES[f"swiglu-{_dt}-{'x'.join(map(str, _shape))}"] = ("swiglu", _dt, dict(shape=_shape))
CASES["rms_norm-x_bfloat16-w_float32-D96"] = ("rms_norm", BF16, dict(lead=(4,), dim=96, weight_dtype=F32))
CASES["rms_norm-float32-strided_rows-D64"] = ("rms_norm", F32, dict(lead=(3, 5), dim=64, strided=True))
CASES["rms_norm-float32-D16384"] = ("rms_norm", F32, dict(lead=(3,), dim=16384))
CASES["rope-bfloat16-transposed_q-hd64"] = ("rope", BF16, dict(B=2, T=5, H=4, Hkv=2, hd=64, transposed=True))
CASES["rope-float32-one_program_many_tokens"] = ("rope", F32, dict(B=1, T=33, H=2, Hkv=2, hd=32))


def exact_bf16_rounding() -> bool:
    """Make the interpreter round float32 -> bfloat16 to nearest even, as GPUs do."""
    from triton.runtime import interpreter

    original = getattr(interpreter, "_convert_float", None)
    if original is None:
        return False
    import numpy as np
    import triton.language as tl

    def convert(data, src, dst, rounding_mode):
        if src == tl.float32 and dst == tl.bfloat16:
            as_torch = torch.from_numpy(np.ascontiguousarray(data).view(np.float32))
            return as_torch.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
        return original(data, src, dst, rounding_mode)

    interpreter._convert_float = convert
    return True


def _path(out: torch.Tensor) -> str:
    """Which implementation made `out`: the fused op's autograd Function, or eager ops."""
    return type(out.grad_fn).__name__


def _compare(got: torch.Tensor, want: torch.Tensor) -> dict:
    got, want = got.detach().float(), want.detach().float()
    assert got.shape == want.shape, (got.shape, want.shape)
    scale = want.abs().max().clamp_min(1e-30)
    return {"rel_err": float((got - want).abs().max() / scale),
            "bit_equal": float((got == want).float().mean())}


def _rms_norm_case(dtype: torch.dtype, p: dict):
    from forja.ops import rms_norm
    from forja.ops.rms_norm import rms_norm_reference

    D = p["dim"]
    if p.get("strided"):  # every other row of a bigger tensor: rows with stride 2 * D
        x = torch.randn(*p["lead"][:-1], 2 * p["lead"][-1], D, dtype=dtype)[..., ::2, :]
    else:
        x = torch.randn(*p["lead"], D, dtype=dtype)
    x.requires_grad_()
    w = (1 + 0.1 * torch.randn(D)).to(getattr(torch, p.get("weight_dtype", str(dtype)[6:]))).requires_grad_()
    y = rms_norm(x, w, 1e-5)
    dy = torch.randn_like(y)
    dx, dw = torch.autograd.grad(y, (x, w), dy)
    y_ref = rms_norm_reference(x, w, 1e-5)
    dx_ref, dw_ref = torch.autograd.grad(y_ref, (x, w), dy)
    return _path(y), {"y": (y, y_ref), "dx": (dx, dx_ref), "dweight": (dw, dw_ref)}


def _rope_case(dtype: torch.dtype, p: dict):
    from forja.ops import rope
    from forja.ops.rope import rope_reference

    B, T, H, Hkv, hd = p["B"], p["T"], p["H"], p["Hkv"], p["hd"]
    if p.get("transposed"):  # (B, H, T, hd) storage seen as (B, T, H, hd): strided heads and tokens
        q = torch.randn(B, H, T, hd, dtype=dtype).transpose(1, 2)
    else:
        q = torch.randn(B, T, H, hd, dtype=dtype)
    k = torch.randn(B, T, Hkv, hd, dtype=dtype)
    q.requires_grad_(), k.requires_grad_()
    angles = torch.arange(T, dtype=torch.float32)[:, None] * torch.rand(hd // 2)[None, :] * 3
    angles = torch.cat((angles, angles), dim=-1)  # (T, hd), as rope_cos_sin builds them
    cos, sin = angles.cos(), angles.sin()
    qo, ko = rope(q, k, cos, sin)
    dqo, dko = torch.randn_like(qo), torch.randn_like(ko)
    dq, dk = torch.autograd.grad((qo, ko), (q, k), (dqo, dko))
    qr, kr = rope_reference(q, k, cos, sin)
    dq_ref, dk_ref = torch.autograd.grad((qr, kr), (q, k), (dqo, dko))
    return _path(qo), {"q": (qo, qr), "k": (ko, kr), "dq": (dq, dq_ref), "dk": (dk, dk_ref)}


def _swiglu_case(dtype: torch.dtype, p: dict):
    from forja.ops import swiglu
    from forja.ops.swiglu import swiglu_reference

    # Wide gate values: silu's tails (exp overflowing to inf for gate << 0) are exercised.
    gate = (torch.randn(p["shape"]) * 6).to(dtype).requires_grad_()
    up = torch.randn(p["shape"], dtype=dtype, requires_grad=True)
    y = swiglu(gate, up)
    dy = torch.randn_like(y)
    dg, du = torch.autograd.grad(y, (gate, up), dy)
    y_ref = swiglu_reference(gate, up)
    dg_ref, du_ref = torch.autograd.grad(y_ref, (gate, up), dy)
    return _path(y), {"y": (y, y_ref), "dgate": (dg, dg_ref), "dup": (du, du_ref)}


RUNNERS = {"rms_norm": _rms_norm_case, "rope": _rope_case, "swiglu": _swiglu_case}


def run_all() -> dict:
    from forja.ops import use_triton

    exact = exact_bf16_rounding()
    results: dict = {"exact_bf16_rounding": exact, "use_triton_cpu": use_triton(torch.ones(1)),
                     "paths": {}, "cases": {}}
    for i, (case, (op, dtype, params)) in enumerate(CASES.items()):
        torch.manual_seed(i)
        results["paths"][case], pairs = RUNNERS[op](getattr(torch, dtype), params)
        results["cases"][case] = {name: _compare(*pair) for name, pair in pairs.items()}
    return results


if __name__ == "__main__":
    from forja.ops.dispatch import interpreting, ops_mode

    if not interpreting() or ops_mode() != "triton":
        sys.exit("run with TRITON_INTERPRET=1 FORJA_OPS=triton in the environment")
    print(json.dumps(run_all()))
