"""Peak table look-ups, the throughput and MFU arithmetic, and memory figures on CPU."""

import pytest
import torch

from forja.metrics.throughput import Throughput, lookup_peak, memory_stats, peak_flops, peak_for_dtype


@pytest.mark.parametrize("name, bf16_tflops", [
    ("NVIDIA H100 80GB HBM3", 989.4),         # SXM
    ("NVIDIA H100 PCIe", 756.0),
    ("NVIDIA H100 NVL", 835.5),
    ("NVIDIA H200", 989.4),
    ("NVIDIA H200 NVL", 835.5),
    ("NVIDIA GH200 480GB", 989.4),
    ("NVIDIA H20", 148.0),                     # not H200
    ("NVIDIA A100-SXM4-80GB", 312.0),
    ("NVIDIA A100 80GB PCIe", 312.0),
    ("NVIDIA A10G", 70.0),                     # not the A10, not the A100
    ("NVIDIA A10", 125.0),
    ("NVIDIA L4", 121.0),                      # not L40 / L40S
    ("NVIDIA L40S", 362.05),
    ("NVIDIA B200", 2250.0),
    ("NVIDIA GB200", 2500.0),                  # not B200
    ("AMD Instinct MI300X", 1307.4),
    ("AMD Instinct MI250X", 191.5),            # one of the card's two GCDs
    ("NVIDIA GeForce RTX 4090", 165.2),
    ("NVIDIA GeForce RTX 3090", 71.0),
])
def test_known_devices_have_their_dense_bf16_peak(name, bf16_tflops):
    assert peak_for_dtype(lookup_peak(name), torch.bfloat16) == pytest.approx(bf16_tflops * 1e12)


@pytest.mark.parametrize("name", ["NVIDIA GeForce GTX 1080", "NVIDIA GeForce RTX 3090 Ti", "Some Accelerator"])
def test_unknown_devices_have_no_peak(name):
    assert lookup_peak(name) is None


def test_volta_has_fp16_peak_but_no_bf16():
    v100 = lookup_peak("Tesla V100-SXM2-16GB")
    assert peak_for_dtype(v100, torch.float16) == pytest.approx(125e12)
    assert peak_for_dtype(v100, torch.bfloat16) is None
    assert peak_for_dtype(lookup_peak("Tesla V100-PCIE-32GB"), torch.float16) == pytest.approx(112e12)


def test_fp32_peak_follows_the_matmul_precision():
    h100 = lookup_peak("NVIDIA H100 80GB HBM3")
    before = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("highest")
        assert peak_for_dtype(h100, torch.float32) == pytest.approx(66.9e12)
        torch.set_float32_matmul_precision("high")
        assert peak_for_dtype(h100, torch.float32) == pytest.approx(494.7e12)  # TF32
    finally:
        torch.set_float32_matmul_precision(before)
    assert peak_for_dtype(h100, torch.float8_e4m3fn) == pytest.approx(1978.9e12)
    assert peak_for_dtype(h100, torch.int8) is None


def test_cpu_has_no_peak():
    assert peak_flops(torch.device("cpu"), torch.bfloat16) is None
    assert peak_flops("cpu", torch.float32) is None


def test_throughput_averages_over_time_in_the_window():
    tp = Throughput(flops_per_token=6e9, num_devices=4, peak_flops=None)
    # 1000 tokens in 1 s, then 1000 in 3 s: 500 tokens/s over the window (not the mean rate 667).
    tp.update(tokens=1000, step_time=1.0, data_wait=0.5)
    tp.update(tokens=1000, step_time=3.0, data_wait=0.5)
    m = tp.compute()
    assert m["tokens_per_sec"] == pytest.approx(500.0)
    assert m["tokens_per_sec_per_device"] == pytest.approx(125.0)
    assert m["tflops"] == pytest.approx(125.0 * 6e9 / 1e12)
    assert m["mfu"] is None
    assert m["step_time"] == pytest.approx(2.0)
    assert m["data_wait"] == pytest.approx(0.5)
    assert m["data_wait_frac"] == pytest.approx(0.25)
    assert tp.compute() == {}  # a new, empty window


def test_mfu_against_a_given_peak():
    # 8 devices, 4M tokens in 2 s: 250k tokens/s per device; 6e9 FLOPs each -> 1.5e15 FLOP/s.
    tp = Throughput(flops_per_token=6e9, num_devices=8, peak_flops=989.4e12)
    tp.update(tokens=4_000_000, step_time=2.0)
    m = tp.compute()
    assert m["tflops"] == pytest.approx(1500.0)
    assert m["mfu"] == pytest.approx(1.5e15 / 989.4e12)


def test_throughput_rejects_nonsense():
    with pytest.raises(ValueError):
        Throughput(flops_per_token=1.0, num_devices=0)
    with pytest.raises(ValueError):
        Throughput(flops_per_token=1.0, num_devices=1).update(tokens=10, step_time=0.0)


def test_cpu_memory_is_the_process_rss():
    big = torch.ones(64 * 1024 * 1024 // 4)  # 64 MiB the process now holds
    stats = memory_stats(torch.device("cpu"))
    assert set(stats) == {"mem_rss_gb", "mem_peak_gb"}
    assert stats["mem_rss_gb"] > 0.064
    assert stats["mem_peak_gb"] >= stats["mem_rss_gb"] * 0.99
    del big
