"""Test suite root. tests/ is a package, so test modules may share helpers
(`from tests.helpers import ...`) and equal basenames in different folders don't clash."""

import os

# Nothing may download at run time: transformers 5.25 looks kernels up on the Hugging Face Hub
# when it loads a model unless told it is offline (and a test's subprocesses inherit this).
os.environ.setdefault("HF_HUB_OFFLINE", "1")

# The local S3-compatible server's fixtures (moto_endpoint, s3_bucket, flaky_s3), for any test that names them;
# the verification cards' `card` fixture and `--cards PATH` (tests/cards.py).
pytest_plugins = ["tests.storage_server", "tests.cards"]

# The files that take longest (seconds of one core, make test's first pass, 2026-12-06), started
# first: pytest-xdist hands whole files to its workers in collection order (--dist loadfile), so
# a long file collected last would run alone at the end of the pass. The rest keep their order.
LONGEST_FIRST = ("tests/unit/models/test_conformance.py",  # 239 s
                 "tests/unit/models/test_random_configs.py",  # 97 s at 3 seeds
                 "tests/integration/test_train.py",  # 80 s
                 "tests/unit/train/rehearse/test_rehearsal.py",  # 71 s
                 "tests/unit/plan/test_layout_truth.py",  # 59 s
                 "tests/integration/test_readme.py",  # 55 s
                 "tests/integration/test_recovery.py",  # 52 s
                 "tests/unit/models/test_flops.py",  # 43 s
                 "tests/integration/test_loss_race_smoke.py")  # 38 s with the peers


def pytest_collection_modifyitems(items):
    rank = {path: i for i, path in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(LONGEST_FIRST)))  # stable: order kept within
