"""Test suite root. tests/ is a package, so test modules may share helpers
(`from tests.helpers import ...`) and equal basenames in different folders don't clash."""

import os

# Nothing may download at run time: transformers 5.25 looks kernels up on the Hugging Face Hub
# when it loads a model unless told it is offline (and a test's subprocesses inherit this).
os.environ.setdefault("HF_HUB_OFFLINE", "1")

# The local S3-compatible server's fixtures (moto_endpoint, s3_bucket, flaky_s3), for any test that names them;
# the verification cards' `card` fixture and `--cards PATH` (tests/cards.py).
pytest_plugins = ["tests.storage_server", "tests.cards"]
