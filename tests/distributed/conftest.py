"""Distributed tests: real process groups (Gloo) on CPU, launched through torchrun."""

import pytest

from forja.testing import child_launchers, stop_launchers
from tests.distributed.parity import PP_COMMON, single_process_losses
from tests.integration.conftest import train_data  # noqa: F401  (the shared prepared corpus)


@pytest.fixture(scope="session")
def reference_losses(tmp_path_factory, train_data):  # noqa: F811
    """The single-process fp32 losses every layout is compared with."""
    return single_process_losses(tmp_path_factory.mktemp("ref") / "run", train_data)


@pytest.fixture(scope="session")
def pp_reference_run(tmp_path_factory, train_data):  # noqa: F811
    """The run directory of the single-process reference of pipeline layouts: the (tied)
    debug model, validated and saved halfway and at the end (PP_COMMON)."""
    run = tmp_path_factory.mktemp("ref-pp") / "run"
    single_process_losses(run, train_data, **PP_COMMON)
    return run


# Each test here launches processes; a hung one must fail well before the suite-wide 600 s.
DISTRIBUTED_TIMEOUT_S = 300
# Drills timed by sleeps, deadlines and signals: they run alone (`-m alone`, Makefile), after
# the other process groups have run two at a time.
ALONE = ("test_drills.py", "test_timeouts.py", "test_watchdog.py", "test_preemption.py", "test_torchrun.py")


@pytest.hookimpl(tryfirst=True)  # before `-m` selects by the markers added here
def pytest_collection_modifyitems(config, items):
    # pytest-timeout: a marker outranks --timeout, so keep a lower --timeout in force.
    configured = float(config.getoption("timeout", None) or config.getini("timeout") or 0)
    limit = min(DISTRIBUTED_TIMEOUT_S, configured) if configured else DISTRIBUTED_TIMEOUT_S
    for item in items:
        if "tests/distributed/" not in item.nodeid:
            continue
        item.add_marker(pytest.mark.serial)  # a group of 2-4 ranks takes a core or two (Makefile)
        if item.path.name in ALONE:
            item.add_marker(pytest.mark.alone)
        if item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(limit))


@pytest.fixture(autouse=True)
def _no_leftover_launchers():
    """A test that failed or timed out may leave torchrun running, and its workers (in
    sessions of their own) with it, busy or hung: stop them before the next test."""
    yield
    stop_launchers(child_launchers())
