"""eager_only: torch.compiler.disable without importing torch._dynamo until compiling is possible."""

from __future__ import annotations

import subprocess
import sys

import torch

from forja.eager import before_compile, eager_only


def test_marking_and_calling_import_no_dynamo():
    code = ("import sys, torch\nfrom forja.eager import eager_only\n"
            "@eager_only\ndef f(x):\n    return x + 1\n"
            "assert f(torch.ones(1)).item() == 2\nprint('torch._dynamo' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_a_marked_function_is_left_out_of_a_compiled_graph():
    """A graph break around the marked call (a plain function would be traced into the graph)."""

    @eager_only
    def double(x: torch.Tensor) -> torch.Tensor:
        return x * 2

    def plain(x: torch.Tensor) -> torch.Tensor:
        return x * 2

    before_compile()
    breaks = {}
    for name, inner in (("marked", double), ("plain", plain)):
        torch._dynamo.reset()
        explained = torch._dynamo.explain(lambda x, f=inner: f(x + 1) - 1)(torch.ones(2))
        breaks[name] = explained.graph_break_count
    assert breaks == {"marked": 1, "plain": 0}
