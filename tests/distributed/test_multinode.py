"""Two machines, simulated on one: two separate launchers (`forja train --nnodes 2
--rdzv-endpoint ...`, each starting torchrun with one process, as each node of a real job
would) meet at a c10d rendezvous and train together; their losses match one process."""

from __future__ import annotations

from forja.testing import free_port
from tests.distributed.parity import COMMON, PARITY_TOL, max_difference
from tests.integration.conftest import forja_process, losses, train_args


def test_two_nodes_match_one_process(tmp_path, train_data, reference_losses):
    run = tmp_path / "two-nodes"
    endpoint = f"127.0.0.1:{free_port()}"
    node = train_args(run, train_data, **COMMON) + ["--nproc", "1", "--nnodes", "2", "--rdzv-endpoint", endpoint]
    nodes = [forja_process(node) for _ in range(2)]
    outs = [p.communicate(timeout=300)[0] for p in nodes]
    for i, (p, out) in enumerate(zip(nodes, outs)):
        assert p.returncode == 0, f"node {i}:\n{out[-5000:]}"
    diff = max_difference(reference_losses, losses(run))
    print(f"2 nodes x 1 process (c10d rendezvous) vs 1 process: max |loss diff| = {diff:.2e}")
    assert diff < PARITY_TOL
