"""The allocation tracker against programs whose bytes are known by hand."""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from forja.train.rehearse.tracker import ROUND, AllocationTracker


def test_the_peak_is_the_largest_sum_of_live_storages_and_priced_by_where_they_were_made():
    fake = FakeTensorMode()
    with fake:
        weight = torch.empty(256, 256)  # 256 KiB
    tracker = AllocationTracker({})
    with fake, tracker:
        tracker.add([weight], "parameters")
        tracker.phase = "forward"
        x = torch.empty(64, 256)  # 64 KiB, kept
        y = x @ weight  # 64 KiB, kept
        tracker.phase = "backward"
        g = torch.ones_like(y) @ weight.t()  # ones_like (freed at once) and the product (kept)
        del x
        tracker.finish()
    kib = 1024
    assert tracker.peak.bytes == 256 * kib + 64 * kib * 4  # weight, x, y, ones_like and g at once
    by = tracker.at_peak()
    assert by["parameters"] == 256 * kib
    assert by["activations"] == 128 * kib
    assert by["temporaries"] == 128 * kib
    assert tracker.peak.phase == "backward"
    assert tracker.total == 256 * kib + 128 * kib  # x and ones_like freed
    assert g.shape == (64, 256)


def test_sizes_round_as_the_cuda_allocator_rounds_them():
    tracker = AllocationTracker({})
    with FakeTensorMode(), tracker:
        tracker.phase = "forward"
        t = torch.empty(3)  # 12 bytes -> one 512-byte block
        tracker.finish()
    assert tracker.peak.bytes == ROUND and t.numel() == 3


def test_a_storage_resized_by_fsdp_counts_as_gathered_weights_and_shrinks_when_freed():
    tracker = AllocationTracker({})
    with FakeTensorMode(), tracker:
        tracker.phase = "forward"
        t = torch.empty(1024)  # 4 KiB
        t.untyped_storage().resize_(0)  # FSDP frees an unsharded weight this way
        assert tracker.total == 0
        t.untyped_storage().resize_(8192)  # and gathers it again
        tracker.finish()
    assert tracker.total == 8192
    assert tracker.at_peak()["gathered_parameters"] == 8192


def test_restart_forgets_the_earlier_peak_and_collectives():
    tracker = AllocationTracker({})
    with FakeTensorMode(), tracker:
        tracker.phase = "forward"
        big = torch.empty(4096)
        del big
        tracker.restart()
        small = torch.empty(128)
        tracker.finish()
    assert tracker.peak.bytes == small.nbytes
