"""Process-wide settings of the host a training process runs on, applied once at the start of
training (`prepare_training_process`, from Trainer.setup). Any layer may import this module.

**What malloc does with freed memory** (`train.host_malloc`). Every step allocates and frees
the same large host buffers: on a CPU all of its activations, the logits and their gradient
(8 x 256 tokens x 8,192 vocabulary in fp32 is 64 MiB); on a GPU host, CPU-offloaded optimizer
steps and checkpoint staging. glibc serves a block above its mmap threshold (128 KiB, raised on
the fly to at most 32 MiB) with a fresh mmap and unmaps it at free, and trims the top of its
heap once 128 KiB lie free there. So the next step's buffers are new pages: the kernel faults
each 4 KiB page in and zeroes it, 72,100 faults and 0.11 s of system time in a 0.61 s step at
the default recipe on a 2-core CPU (bench/RESULTS.md, "Host malloc"). "retain" sets glibc's
thresholds (mallopt) so that large blocks come from the heap and freed memory stays mapped
there for the next step: the process keeps its peak footprint, which a training step reaches
every step anyway. A C library without mallopt (musl, macOS) keeps its own policy, and the
fallback record says so.

**Whose tensor ops run on several threads** (`confine_intra_op_threads`). torch's CPU ops run
on an OpenMP team, and every other thread that runs a large enough op gets an OpenMP team of
its own: Gloo's work threads copying a collective's tensors (the object collectives of every
checkpoint save and load), the data prefetcher, DCP's writer. Once libgomp manages more
threads than there are cores, it stops letting idle team threads spin and puts them to sleep
at the end of every parallel region, so each of the thousands of ops in a step pays a futex
wake-up: after the first checkpoint of the default recipe on a 2-core CPU, 3,700 voluntary
context switches a step instead of 120, and every later step 20-25% slower. So only the
training thread keeps its intra-op threads; threads started later run their ops on one.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import platform
import threading

from forja import fallbacks

HOST_MALLOC = ("retain", "system")

# mallopt(3) parameters (malloc.h) and glibc's documented defaults.
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_DEFAULT_THRESHOLD = 128 * 1024
# A block at least this large is still mmapped (and unmapped at free): far above any one
# activation, so that only a rare huge buffer (a checkpoint's staging copy) leaves the heap.
RETAIN_MMAP_THRESHOLD = 1 << 30
# Free memory at the top of the heap beyond this is given back (the largest value mallopt's int takes).
RETAIN_TRIM_THRESHOLD = (1 << 31) - 1

_applied: str | None = None


def malloc_applied() -> str:
    """The policy in force in this process ("system" until `apply_malloc` changes it)."""
    return _applied or "system"


def _mallopt():
    """glibc's mallopt, or None where the C library is not glibc."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    mallopt = getattr(libc, "mallopt", None)
    if mallopt is not None:
        mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return mallopt


def apply_malloc(policy: str) -> bool:
    """Set this process's malloc policy (`HOST_MALLOC`); True when glibc took it. "system" in
    a fresh process changes nothing; after "retain" it restores glibc's default thresholds
    (without their on-the-fly raise, which glibc cannot turn back on)."""
    global _applied
    if policy not in HOST_MALLOC:
        raise ValueError(f"host malloc policy {policy!r}: choose from {', '.join(HOST_MALLOC)}")
    if policy == _applied or (policy == "system" and _applied is None):
        return True
    mallopt = _mallopt()
    mmap, trim = ((RETAIN_MMAP_THRESHOLD, RETAIN_TRIM_THRESHOLD) if policy == "retain"
                  else (_DEFAULT_THRESHOLD, _DEFAULT_THRESHOLD))
    if mallopt is None:
        instead, why = ("the C library's own policy for freed memory",
                        f"mallopt is glibc's and this is {platform.system()} "
                        f"with {platform.libc_ver()[0] or 'another C library'}")
    elif not (mallopt(_M_MMAP_THRESHOLD, mmap) and mallopt(_M_TRIM_THRESHOLD, trim)):
        instead, why = "glibc's own thresholds", "glibc refused the thresholds (mallopt returned 0)"
    else:
        _applied = policy
        return True
    fallbacks.record("host.malloc", asked=f'train.host_malloc = "{policy}"', instead=instead, why=why)
    return False


def prepare_training_process(malloc: str) -> None:
    """Both settings, in the order training needs them: before the first step's buffers are
    allocated, and before Gloo's threads and the data prefetcher start."""
    apply_malloc(malloc)
    confine_intra_op_threads()


def confine_intra_op_threads() -> int:
    """Keep torch's intra-op threads for the calling (training) thread alone: threads that run
    tensor ops later (Gloo's, the prefetcher, DCP's writer) run them on one thread. Returns the
    calling thread's count, which is unchanged.

    How: torch.set_num_threads sets the calling thread's OpenMP and MKL thread counts and a
    process-wide count that a thread copies at its first parallel op. Setting it to N here and
    then to 1 from a short-lived thread leaves this thread at N and every later thread at 1
    (tests/unit/test_host.py checks both, so a torch that changes this fails there)."""
    import torch  # here: apply_malloc may run before torch is imported

    n = torch.get_num_threads()
    torch.set_num_threads(n)  # this thread's own counts, made explicit
    if n > 1:
        helper = threading.Thread(target=torch.set_num_threads, args=(1,), name="forja-confine-threads")
        helper.start()
        helper.join()
    return n


def threads_per_process(processes: int) -> dict[str, str]:
    """OMP_NUM_THREADS for `processes` processes sharing this machine's cores (ranks of a
    launch, replica groups, sweep trials), unless the user set it: each would otherwise take
    every core and fight the others for them (torchrun would set 1, leaving a many-core CPU idle)."""
    if "OMP_NUM_THREADS" in os.environ or processes < 2:
        return {}
    return {"OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // processes))}
