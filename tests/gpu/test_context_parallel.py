"""forja's context parallelism on CUDA over NCCL: every mixer case of
tests/distributed/test_cp_mixing.py on the GPUs, and a training run's losses against one GPU.

At cp 1 (one GPU) the ring still splits each row into a chunk and its mirror and merges their
blocks by log-sum-exp, with the CUDA block path (fp32 matmuls, not CPU's fused kernels); the
collectives run over a group of one. Tests that need more GPUs skip with "needs N CUDA GPUs",
which bench/gpu_check.py reports apart from other skips."""

import pytest
import torch

from forja.testing import run_distributed
from tests.distributed.parity import layout_losses, max_difference, single_process_losses
from tests.distributed.test_cp_mixing import ATTENTION, RECURRENT, TOL, _all_cases
from tests.integration.conftest import train_data  # noqa: F401  (the shared prepared corpus)


def _gpus(n: int):
    found = torch.cuda.device_count()
    return pytest.mark.skipif(found < n, reason=f"needs {n} CUDA GPUs (found {found})")


def _on_gpus(rank: int, world: int):
    return _all_cases(rank, world, f"cuda:{rank}")


@pytest.mark.parametrize("world", [1, pytest.param(2, marks=_gpus(2))],
                         ids=["cp1", "cp2"])
def test_every_mixer_matches_whole_rows_on_cuda(world):
    by_rank = run_distributed(_on_gpus, world, backend="nccl", timeout_s=300)
    worst = {case: max(max(r[case].values()) for r in by_rank) for case in by_rank[0]}
    assert len(worst) == 2 * (len(ATTENTION) + 2 * len(RECURRENT))
    assert all(err < 100 * TOL for err in worst.values()), worst  # TF32-free fp32, other kernels


@_gpus(2)
@pytest.mark.parametrize("kind", ["ring", "all-to-all"])
def test_cp2_matches_one_gpu(tmp_path, train_data, kind):  # noqa: F811
    cuda = {"train.device": '"cuda"', "train.precision": '"fp32"'}
    reference = single_process_losses(tmp_path / "ref", train_data, **cuda)
    cp2 = layout_losses(tmp_path / "cp2", train_data, 2, **cuda,
                        **{"parallel.cp": "2", "parallel.dp_shard": "1", "parallel.cp_kind": f'"{kind}"'})
    # CUDA attention kernels in fp32 differ from the single-GPU run in summation order only.
    assert max_difference(reference, cp2) < 1e-4
