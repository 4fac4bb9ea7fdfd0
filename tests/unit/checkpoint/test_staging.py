"""How async saves stage the state: pinned, non-blocking copies from CUDA; plain ones on CPU.
(The copy from CUDA itself is tests/gpu/test_checkpoint_cuda.py.)"""

import dataclasses

import pytest
import torch
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

from forja.checkpoint.config import CheckpointConfig
from forja.checkpoint.manager import CheckpointManager, staging_options


def test_the_staging_options_torch_has_are_the_ones_set():
    # A torch that renamed or dropped one would make every option after it silently default.
    assert {f.name for f in dataclasses.fields(StagingOptions)} >= {
        "use_pinned_memory", "use_shared_memory", "use_async_staging", "use_non_blocking_copy"}


@pytest.mark.parametrize("device", ["cuda", "cuda:1"])
def test_state_on_cuda_is_staged_into_pinned_memory_without_blocking_copies(device):
    assert staging_options(torch.device(device)) == StagingOptions(
        use_pinned_memory=True, use_shared_memory=False, use_async_staging=False, use_non_blocking_copy=True)


def test_state_on_cpu_is_staged_with_plain_copies():
    assert staging_options(torch.device("cpu")) == StagingOptions(
        use_pinned_memory=False, use_shared_memory=False, use_async_staging=False, use_non_blocking_copy=False)


def test_the_cpu_stager_copies_the_state_here():
    state = {"w": torch.arange(6.0), "nested": {"b": torch.ones(3)}}
    stager = DefaultStager(staging_options(torch.device("cpu")))
    try:
        staged = stager.stage(state)  # synchronous: the copy itself, not a future
        state["w"].add_(1.0)  # training goes on in place
        assert torch.equal(staged["w"], torch.arange(6.0)) and torch.equal(staged["nested"]["b"], torch.ones(3))
    finally:
        stager.close()


def test_the_manager_stages_for_the_device_it_is_given(tmp_path):
    assert CheckpointManager(CheckpointConfig(), tmp_path).device == torch.device("cpu")
    assert CheckpointManager(CheckpointConfig(), tmp_path, device="cuda:0").device == torch.device("cuda:0")
