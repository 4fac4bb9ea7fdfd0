"""Memory figures, the peak look-up and MFU on a real CUDA device (skipped without one)."""

import torch

from forja.metrics.throughput import Throughput, lookup_peak, memory_stats, peak_flops


def test_cuda_memory_stats_see_an_allocation():
    device = torch.device("cuda")
    before = memory_stats(device, reset_peak=True)
    x = torch.empty(256 * 1024 * 1024, dtype=torch.uint8, device=device)  # 0.27 GB
    after = memory_stats(device)
    assert set(after) == {"mem_alloc_gb", "mem_reserved_gb", "mem_peak_gb", "mem_alloc_retries"}
    assert after["mem_alloc_gb"] - before["mem_alloc_gb"] >= 0.26
    assert after["mem_peak_gb"] >= after["mem_alloc_gb"] and after["mem_reserved_gb"] >= after["mem_alloc_gb"]
    del x


def test_this_device_is_in_the_peak_table():
    # An unknown device would report no MFU at all: fail here rather than pass on a guess.
    name = torch.cuda.get_device_name()
    assert lookup_peak(name) is not None, f"{name!r} matches no row of metrics.throughput.PEAKS: add its peaks"
    peak = peak_flops(torch.device("cuda"), torch.bfloat16)
    assert peak is not None and 1e13 < peak < 1e16, (name, peak)


def test_mfu_of_a_bf16_matmul_is_a_fraction_of_the_peak():
    # A dense bf16 matmul reaches a large share of the datasheet peak and never more: an MFU
    # of 1 or above would mean a peak too low for this device (every run's MFU too high).
    n, repeats = 8192, 20
    a, b = (torch.randn(n, n, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    for _ in range(3):  # warm-up: cuBLAS picks its kernel
        a @ b
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        a @ b
    end.record()
    torch.cuda.synchronize()
    peak = peak_flops(torch.device("cuda"), torch.bfloat16)
    tp = Throughput(flops_per_token=2 * n**3, num_devices=1, peak_flops=peak)
    tp.update(tokens=repeats, step_time=start.elapsed_time(end) / 1e3)  # one "token" a matmul
    mfu = tp.compute()["mfu"]
    print(f"{torch.cuda.get_device_name()}: bf16 matmul {n}^3 at MFU {mfu}")
    assert mfu is not None and 0 < mfu < 1, mfu
