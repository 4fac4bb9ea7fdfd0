"""The models use the ops' references, never the other way (tests/unit/test_layering.py guards imports)."""


def test_the_models_rope_is_the_ops_reference():
    from forja.models.common.rope import apply_rope
    from forja.ops.rope import apply_rope as reference

    assert apply_rope is reference
