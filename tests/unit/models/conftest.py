"""Random-weight Hugging Face models saved to disk: the reference for forja's families."""

from __future__ import annotations

import pytest

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="session")
def hf_store() -> dict:
    """The session's transformers models, their checkpoints and the forja models loaded from
    them, each made once whichever test needs it first (family_checks.FamilyCheckpoints)."""
    return {}
