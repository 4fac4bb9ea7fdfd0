"""Fixtures shared by the unit tests."""

import pytest

from forja.parallel import ParallelDims
from forja.parallel.config import ParallelConfig
from forja.parallel.process_group import init_distributed, shutdown_distributed


@pytest.fixture
def dims():
    """The mesh of one CPU process, as the engine tests (train, optim) build their engine on."""
    init_distributed("cpu")
    dims = ParallelDims.from_config(ParallelConfig(), 1)
    dims.build_mesh("cpu")
    yield dims
    shutdown_distributed()
