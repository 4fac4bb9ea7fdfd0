"""transformers' float32 casts, kept at float64 for the float64 comparisons: some of its
functions compute a piece in float32 whatever the model's dtype (a router's softmax, a norm's
`.float()`, the delta rule's `.to(torch.float32)`), where forja computes "at least float32"
(forja/models/common/precision.py), so float64 in a float64 model. A family's CASE names those
functions (`FamilyCase.float64_kept`); in the float64 comparisons only, each runs under
`KeepFloat64`, which turns the float32 casts of float64 tensors written in its own body into
no-ops, not those of the functions it calls (each of those is named if it must be). Nothing is
lifted globally: forja and transformers cast in the same places elsewhere, and lifting one
side's casts alone would make them differ.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import os
import sys
import types

import torch
from torch.overrides import TorchFunctionMode

_CASTS = (torch.Tensor.to, torch.Tensor.type)
_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep


def _is64(x) -> bool:
    return isinstance(x, torch.Tensor) and x.dtype == torch.float64


def _codes(code: types.CodeType) -> set[types.CodeType]:
    """`code` and the code of the comprehensions and lambdas inside it."""
    inner = (c for c in code.co_consts if isinstance(c, types.CodeType))
    return {code}.union(*(_codes(c) for c in inner))


class KeepFloat64(TorchFunctionMode):
    """Within the code `codes` (a function's body): float64 tensors stay float64 where it casts
    them to float32: `.float()`, `.to(torch.float32)`, `.type(torch.float32)`, `.to(a float32
    tensor)` and a `dtype=float32` argument (softmax's). Every other call runs as written."""

    def __init__(self, codes: set[types.CodeType]):
        super().__init__()
        self.codes = codes

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if args and _is64(args[0]) and self._called_from_body():
            if func is torch.Tensor.float:
                return args[0]
            if func in _CASTS:
                args = tuple(torch.float64 if a is torch.float32 or (isinstance(a, torch.Tensor) and
                                                                     a.dtype == torch.float32) else a for a in args)
            if kwargs.get("dtype") is torch.float32:
                kwargs["dtype"] = torch.float64
        return func(*args, **kwargs)

    def _called_from_body(self) -> bool:
        """Whether the call comes from the body itself: the first frame outside torch's own
        code (F.softmax's Python wrapper, the dispatch) is one of `codes`."""
        frame = sys._getframe(2)
        while frame is not None and frame.f_code.co_filename.startswith(_TORCH_DIR):
            frame = frame.f_back
        return frame is not None and frame.f_code in self.codes


def _resolve(path: str) -> tuple[object, str]:
    """"mixtral.MixtralTopKRouter.forward" (in transformers.models.mixtral.modeling_mixtral), or
    "qwen3_next.torch_chunk_gated_delta_rule" -> (the class or module holding it, its name)."""
    model, *inner, name = path.split(".")
    owner = importlib.import_module(f"transformers.models.{model}.modeling_{model}")
    for part in inner:
        owner = getattr(owner, part)
    if not hasattr(owner, name):
        raise AttributeError(f"{path} is not in transformers' modeling_{model}: fix the CASE's float64_kept entry")
    return owner, name


def keep_float64(monkeypatch, paths: tuple[str, ...]) -> None:
    """Each of transformers' functions at `paths` (`_resolve`'s) runs under KeepFloat64 until
    `monkeypatch` undoes it (the test's end)."""
    for path in paths:
        owner, name = _resolve(path)
        original = owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)
        monkeypatch.setattr(owner, name, _kept(original))


def _body(fn):
    """The Python function whose code runs when `fn` is called: under transformers' decorators,
    or inside the module its hub-kernel decorator wraps a function in (the module's forward
    calls it from its closure)."""
    if isinstance(fn, torch.nn.Module):
        cells = type(fn).forward.__closure__ or ()
        fn = next(c.cell_contents for c in cells if inspect.isfunction(c.cell_contents))
    return inspect.unwrap(fn)


def _kept(fn):
    if isinstance(fn, staticmethod):
        return staticmethod(_kept(fn.__func__))
    codes = _codes(_body(fn).__code__)

    @functools.wraps(fn)
    def run(*args, **kwargs):
        with KeepFloat64(codes):
            return fn(*args, **kwargs)
    return run


def exact_embed_scales(hf64: torch.nn.Module, monkeypatch) -> None:
    """Gemma's scaled embeddings hold sqrt(hidden_size) in a float32 buffer, which `.double()`
    widens without the digits float32 dropped; forja multiplies by the float64 number. Set it
    to the number (`scalar_embed_scale`), in the float64 copy only."""
    for module in hf64.modules():
        if hasattr(module, "scalar_embed_scale"):
            module.embed_scale.fill_(module.scalar_embed_scale)


class _PolarAsCosSin(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.polar:
            magnitude, angle = args
            return torch.complex(magnitude * angle.cos(), magnitude * angle.sin())
        return func(*args, **(kwargs or {}))


def polar_as_cos_sin(path: str):
    """A float64_fix: the function at `path` (as `keep_float64`'s) builds its rotary table with
    `torch.polar` of float32 angles, which rounds otherwise than the cos and sin of forja's
    float32 tables (by an ulp); it builds them from cos and sin instead, still in float32."""
    def fix(hf64: torch.nn.Module, monkeypatch) -> None:
        owner, name = _resolve(path)
        original = owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)

        @functools.wraps(original)
        def run(*args, **kwargs):
            with _PolarAsCosSin():
                return original(*args, **kwargs)
        monkeypatch.setattr(owner, name, run)
    return fix
