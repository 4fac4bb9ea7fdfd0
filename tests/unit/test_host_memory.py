"""train.host_malloc (forja/host_memory.py): "retain" keeps a step's freed buffers mapped, so
the next step faults in no new pages; "system" leaves glibc returning them to the kernel.

Page faults are counted, not timed: the count is the same on a busy machine. Each policy runs
in a process of its own, since mallopt is process-wide."""

from __future__ import annotations

import json
import platform
import subprocess
import sys

import pytest

from forja import fallbacks, host_memory

# A step that allocates and frees buffers as a CPU training step does: logits of 2,048 tokens
# over 8,192 entries in fp32 (64 MiB), their softmax and gradients, then everything freed.
STEP_FAULTS = r"""
import json, resource, sys
import torch
import torch.nn.functional as F
from forja import host_memory
taken = host_memory.apply(sys.argv[1])
torch.manual_seed(0)
w = torch.randn(8192, 256, requires_grad=True)
h, y = torch.randn(2048, 256), torch.randint(0, 8192, (2048,))
faults = []
for _ in range(8):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    F.cross_entropy(h @ w.t(), y).backward()  # logits (2048, 8192): 64 MiB, and their gradient
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(json.dumps({"taken": taken, "faults": faults}))
"""

glibc = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's (CI runs on glibc)")


def _faults(policy: str) -> dict:
    out = subprocess.run([sys.executable, "-c", STEP_FAULTS, policy], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@glibc
def test_retain_stops_the_page_faults_that_system_pays_every_step():
    system, retain = _faults("system"), _faults("retain")
    assert system["taken"] and retain["taken"]
    page = 4096
    # system: each step's 64 MiB buffers are mapped afresh (16,384 pages each; measured 65,540 a step)
    assert min(system["faults"][-3:]) > 2 * (64 << 20) // page
    # retain: once the heap holds a step's buffers, later steps reuse them (measured 0)
    assert max(retain["faults"][-2:]) < 1000, retain["faults"]


def test_a_c_library_without_mallopt_is_named_in_the_fallback_record(monkeypatch):
    monkeypatch.setattr(host_memory, "_mallopt", lambda: None)
    monkeypatch.setattr(host_memory, "_applied", None)
    fallbacks.clear()
    assert host_memory.apply("retain") is False
    [entry] = [f for f in fallbacks.recorded() if f.key == "host.malloc"]
    assert entry.asked == 'train.host_malloc = "retain"' and "mallopt is glibc's" in entry.why
    assert host_memory.applied() == "system"
    fallbacks.clear()


def test_an_unknown_policy_is_refused():
    with pytest.raises(ValueError, match="choose from retain, system"):
        host_memory.apply("jemalloc")
