"""Memory figures and the peak look-up on a real CUDA device (skipped without one)."""

import torch

from forja.metrics.throughput import lookup_peak, memory_stats, peak_flops


def test_cuda_memory_stats_see_an_allocation():
    device = torch.device("cuda")
    before = memory_stats(device, reset_peak=True)
    x = torch.empty(256 * 1024 * 1024, dtype=torch.uint8, device=device)  # 0.27 GB
    after = memory_stats(device)
    assert set(after) == {"mem_alloc_gb", "mem_reserved_gb", "mem_peak_gb", "mem_alloc_retries"}
    assert after["mem_alloc_gb"] - before["mem_alloc_gb"] >= 0.26
    assert after["mem_peak_gb"] >= after["mem_alloc_gb"] and after["mem_reserved_gb"] >= after["mem_alloc_gb"]
    del x


def test_peak_of_this_device_matches_the_table():
    name = torch.cuda.get_device_name()
    peak = peak_flops(torch.device("cuda"), torch.bfloat16)
    if lookup_peak(name) is None:
        assert peak is None, name
    else:
        assert peak is None or 1e13 < peak < 1e16, (name, peak)
