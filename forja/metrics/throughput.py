"""Speed and memory of training: tokens/s, achieved FLOP/s, MFU and memory in use.

    tp = Throughput(flops_per_token=model.flops_per_token(seq_len), num_devices=world_size,
                    peak_flops=peak_flops(device, torch.bfloat16))
    tp.update(tokens=global_batch_tokens, step_time=dt, data_wait=wait)   # every optimizer step
    metrics = tp.compute() | memory_stats(device)                        # every log interval

MFU (model FLOPs utilization, PaLM appendix B) is the FLOPs the model needs per token times
tokens/s, over the hardware's peak. FLOPs recomputed by activation checkpointing are not
counted (that would be HFU). The peak comes from the vendors' datasheets for *dense* math
(never the 2:4 sparsity figures the datasheets print first); a device the table does not know
has no peak and its MFU is None, because a guessed peak gives a wrong MFU that looks right.
"""

from __future__ import annotations

import os
import re
import sys
from dataclasses import dataclass

import torch

from forja import metric_names as names

_TERA = 1e12
_GB = 1e9  # the mem_*_gb keys are decimal gigabytes, as their names say


@dataclass(frozen=True)
class Peak:
    """Dense peak TFLOP/s of one device (one GPU, or one GCD of a two-die AMD MI250/MI250X)."""

    bf16: float | None
    """bfloat16 tensor cores, fp32 accumulate."""
    fp16: float | None
    """float16 tensor cores, fp32 accumulate."""
    tf32: float | None
    """float32 matmuls run on tensor cores as TF32 (torch.set_float32_matmul_precision('high'))."""
    fp32: float | None
    """float32 matmuls in full precision (the default 'highest'): no tensor cores on NVIDIA."""
    fp8: float | None
    """float8 tensor cores, fp32 accumulate."""
    source: str
    """The datasheet or whitepaper the figures come from."""


def _p(bf16, fp16, tf32, fp32, fp8, source) -> Peak:
    return Peak(bf16=bf16, fp16=fp16, tf32=tf32, fp32=fp32, fp8=fp8, source=source)


_HOPPER_SXM = _p(989.4, 989.4, 494.7, 66.9, 1978.9, "NVIDIA H100 whitepaper / datasheet (SXM5)")
_HOPPER_PCIE = _p(756.0, 756.0, 378.0, 51.2, 1513.0, "NVIDIA H100 whitepaper / datasheet (PCIe)")
_HOPPER_NVL = _p(835.5, 835.5, 417.5, 60.0, 1670.5, "NVIDIA H100 NVL / H200 NVL datasheet")
_AMPERE_A100 = _p(312.0, 312.0, 156.0, 19.5, None, "NVIDIA A100 datasheet")

# (pattern on torch.cuda.get_device_name(), dense peak). The first match wins; \b keeps
# "H20" from matching "H200", "A10" from "A100", "L40" from "L40S" and "B200" from "GB200".
# AMD's TF32 is left out on purpose: whether PyTorch's fp32 matmuls use it on ROCm depends
# on the chip and the library version, so an fp32 MFU there would be a guess.
PEAKS: list[tuple[str, Peak]] = [
    # Blackwell: NVIDIA HGX B200 (1000 W) and GB200 NVL72 per-GPU specifications.
    (r"\bGB200\b", _p(2500.0, 2500.0, 1250.0, 80.0, 5000.0, "NVIDIA GB200 NVL72 datasheet, per GPU")),
    (r"\bB200\b", _p(2250.0, 2250.0, 1100.0, 75.0, 4500.0, "NVIDIA HGX B200 datasheet, per GPU")),
    # Hopper. H200 is the H100 chip with more memory; GH200's GPU is an H100 SXM.
    (r"\bGH200\b", _HOPPER_SXM),
    (r"\bH200 NVL\b", _HOPPER_NVL),
    (r"\bH200\b", _HOPPER_SXM),
    (r"\bH100 NVL\b", _HOPPER_NVL),
    (r"\bH100 PCIe\b", _HOPPER_PCIE),
    (r"\bH100\b", _HOPPER_SXM),  # "NVIDIA H100 80GB HBM3" is the SXM part
    (r"\bH800 PCIe\b", _HOPPER_PCIE),
    (r"\bH800\b", _HOPPER_SXM),
    (r"\bH20\b", _p(148.0, 148.0, 74.0, 44.0, 296.0, "NVIDIA H20 specifications")),
    # Ampere.
    (r"\bA100\b|\bA800\b", _AMPERE_A100),
    (r"\bA10G\b", _p(70.0, 70.0, 35.0, 31.2, None, "NVIDIA A10G for AWS datasheet")),
    (r"\bA10\b", _p(125.0, 125.0, 62.5, 31.2, None, "NVIDIA A10 datasheet")),
    (r"\bA40\b", _p(149.7, 149.7, 74.8, 37.4, None, "NVIDIA A40 datasheet")),
    (r"\bRTX A6000\b", _p(154.8, 154.8, 77.4, 38.7, None, "NVIDIA RTX A6000 datasheet")),
    (r"\bRTX 3090\b(?! Ti)", _p(71.0, 71.0, 35.6, 35.6, None, "NVIDIA GA102 whitepaper (RTX 3090)")),
    # Ada Lovelace.
    (r"\bL40S\b", _p(362.05, 362.05, 183.0, 91.6, 733.0, "NVIDIA L40S datasheet")),
    (r"\bL40\b", _p(181.05, 181.05, 90.5, 90.5, 362.05, "NVIDIA L40 datasheet")),
    (r"\bL4\b", _p(121.0, 121.0, 60.0, 30.3, 242.5, "NVIDIA L4 datasheet")),
    (r"\bRTX 4090\b(?! D)", _p(165.2, 165.2, 82.6, 82.6, 330.3, "NVIDIA Ada whitepaper (RTX 4090)")),
    # Volta and Turing have no bfloat16 tensor cores: bf16 there is emulated, no peak.
    (r"\bV100S\b", _p(None, 130.0, None, 16.4, None, "NVIDIA V100S datasheet")),
    (r"\bV100\b.*\bPCIE\b", _p(None, 112.0, None, 14.0, None, "NVIDIA V100 datasheet (PCIe)")),
    (r"\bV100\b", _p(None, 125.0, None, 15.7, None, "NVIDIA V100 datasheet (SXM2)")),
    (r"\bT4\b", _p(None, 65.0, None, 8.1, None, "NVIDIA T4 datasheet")),
    # AMD Instinct. MI300X and MI325X share the compute die.
    (r"\bMI300X\b|\bMI325X\b", _p(1307.4, 1307.4, None, 163.4, 2614.9, "AMD Instinct MI300X / MI325X datasheet")),
    # MI250X and MI250 are two dies (GCDs) that PyTorch sees as two devices: half of the card each.
    (r"\bMI250X\b", _p(191.5, 191.5, None, 47.85, None, "AMD Instinct MI250X datasheet, per GCD")),
    (r"\bMI250\b", _p(181.05, 181.05, None, 45.25, None, "AMD Instinct MI250 datasheet, per GCD")),
]


def lookup_peak(device_name: str) -> Peak | None:
    """The table row for a device name, or None for a device the table does not know."""
    for pattern, peak in PEAKS:
        if re.search(pattern, device_name, flags=re.IGNORECASE):
            return peak
    return None


def _fp32_uses_tf32() -> bool:
    """Whether PyTorch runs float32 matmuls on CUDA as TF32 right now."""
    precision = getattr(torch.backends.cuda.matmul, "fp32_precision", "none")
    if precision in ("tf32", "ieee"):
        return precision == "tf32"
    return torch.get_float32_matmul_precision() != "highest"


def peak_for_dtype(peak: Peak, dtype: torch.dtype) -> float | None:
    """Dense peak FLOP/s of a table row for matmuls in `dtype`; None when the row has none.

    float32 follows PyTorch's current matmul precision: the TF32 tensor-core peak when TF32
    is allowed (`set_float32_matmul_precision('high')`), the full-precision peak otherwise,
    so the MFU is measured against what the hardware could do with the math that actually runs.
    """
    if dtype == torch.bfloat16:
        tflops = peak.bf16
    elif dtype == torch.float16:
        tflops = peak.fp16
    elif dtype == torch.float32:
        tflops = peak.tf32 if _fp32_uses_tf32() else peak.fp32
    elif dtype.is_floating_point and dtype.itemsize == 1:
        tflops = peak.fp8
    else:
        tflops = None
    return None if tflops is None else tflops * _TERA


def peak_flops(device: torch.device | str, dtype: torch.dtype) -> float | None:
    """Dense peak FLOP/s of one `device` for matmuls in `dtype`, from the vendor's datasheet.

    None on a CPU and on any accelerator the table (`PEAKS`) does not know: an MFU is only
    worth reporting against a peak that is known. Set `metrics.peak_tflops` in the config
    for hardware missing from the table.
    """
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    peak = lookup_peak(torch.cuda.get_device_name(device))
    return None if peak is None else peak_for_dtype(peak, dtype)


class Throughput:
    """Tokens/s, achieved TFLOP/s and MFU, averaged over the steps since the last `compute()`.

    Feed it every optimizer step; read it every log interval. Averages are over time, not
    over steps (tokens/s is all tokens over all seconds), so a slow step weighs as much as
    the time it took.
    """

    def __init__(self, *, flops_per_token: float, num_devices: int, peak_flops: float | None = None):
        if num_devices < 1:
            raise ValueError(f"num_devices must be at least 1, not {num_devices}")
        self.flops_per_token = float(flops_per_token)
        self.num_devices = num_devices
        self.peak_flops = peak_flops
        self._reset()

    def _reset(self) -> None:
        self.steps = 0
        self._tokens = 0
        self._seconds = 0.0
        self._wait = 0.0

    def update(self, *, tokens: int, step_time: float, data_wait: float = 0.0) -> None:
        """One optimizer step: `tokens` over all ranks, its wall time in seconds (data wait
        included) and the part of it spent waiting for the next batch."""
        if step_time <= 0 or data_wait < 0:
            raise ValueError(f"step_time must be > 0 and data_wait >= 0, got {step_time}, {data_wait}")
        self.steps += 1
        self._tokens += tokens
        self._seconds += step_time
        self._wait += data_wait

    def compute(self) -> dict[str, float | None]:
        """Averages over the window since the last call, then start a new window.

        Keys: tokens_per_sec (all devices), tokens_per_sec_per_device, tflops (achieved, per
        device), mfu (None without a peak), step_time and data_wait (mean seconds per step),
        data_wait_frac (share of the time spent waiting for data). Empty when no step was fed.
        """
        if self.steps == 0:
            return {}
        tokens_per_sec = self._tokens / self._seconds
        per_device = tokens_per_sec / self.num_devices
        achieved = per_device * self.flops_per_token  # FLOP/s of one device
        out = {
            names.TOKENS_PER_SEC: tokens_per_sec,
            names.TOKENS_PER_SEC_PER_DEVICE: per_device,
            names.TFLOPS: achieved / _TERA,
            names.MFU: achieved / self.peak_flops if self.peak_flops else None,
            names.STEP_TIME: self._seconds / self.steps,
            names.DATA_WAIT: self._wait / self.steps,
            names.DATA_WAIT_FRAC: self._wait / self._seconds,
        }
        self._reset()
        return out


def memory_stats(device: torch.device | str, *, reset_peak: bool = False) -> dict[str, float]:
    """Memory in use, in decimal GB.

    On a CUDA device: mem_alloc_gb (tensors), mem_reserved_gb (the caching allocator's
    pool), mem_peak_gb (most allocated since the last reset) and mem_alloc_retries (times the
    allocator had to free its cache to satisfy a request: a sign of fragmentation). Elsewhere:
    the process's mem_rss_gb now and mem_peak_gb, its largest RSS so far.
    `reset_peak=True` starts a new peak window on CUDA (the process RSS peak cannot be reset).
    """
    device = torch.device(device)
    if device.type == "cuda" and torch.cuda.is_available():
        stats = {
            "mem_alloc_gb": torch.cuda.memory_allocated(device) / _GB,
            "mem_reserved_gb": torch.cuda.memory_reserved(device) / _GB,
            names.MEM_PEAK_GB: torch.cuda.max_memory_allocated(device) / _GB,
            "mem_alloc_retries": float(torch.cuda.memory_stats(device).get("num_alloc_retries", 0)),
        }
        if reset_peak:
            torch.cuda.reset_peak_memory_stats(device)
        return stats
    stats = {}
    rss = _current_rss_bytes()
    if rss is not None:
        stats["mem_rss_gb"] = rss / _GB
    peak = _peak_rss_bytes()
    if peak is not None:
        stats[names.MEM_PEAK_GB] = peak / _GB
    return stats


def _current_rss_bytes() -> int | None:
    try:  # Linux: the second field of statm is resident pages
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        pass
    try:  # macOS and Windows, when psutil happens to be installed (it is no dependency)
        import psutil

        return psutil.Process().memory_info().rss
    except ImportError:
        return None


def _peak_rss_bytes() -> int | None:
    try:
        import resource
    except ImportError:  # Windows
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # bytes on macOS, KiB on Linux
