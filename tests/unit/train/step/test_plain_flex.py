"""FlexAttention asked for rows with nothing to mask runs SDPA's causal kernel: in the fallback record."""

from __future__ import annotations

import pytest

from forja import fallbacks
from forja.models import model_args
from forja.train.step.engine import _note_plain_flex


@pytest.mark.parametrize("family, changes, document_mask, said", [
    ("llama", {"attention": "flex"}, False, True),
    ("llama", {"attention": "flex"}, True, False),  # document masks: FlexAttention's
    ("llama", {"attention": "sdpa"}, False, False),  # not asked
    ("gemma3", {"attention": "flex"}, False, False),  # sliding windows: FlexAttention's
])
def test_flex_without_masks_is_said(family, changes, document_mask, said):
    fallbacks.clear()
    _note_plain_flex(model_args(family, "debug", **changes), document_mask)
    assert [f.key for f in fallbacks.recorded()] == (["attention.flex.causal"] if said else [])
    fallbacks.clear()
