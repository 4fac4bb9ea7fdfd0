"""Rule 1 of docs/architecture.md for ops: the models use the ops, never the other way."""

import ast
from pathlib import Path

import forja

FORBIDDEN = ("forja.models", "forja.parallel", "forja.train", "forja.checkpoint", "forja.data")


def _imports(path: Path) -> list[str]:
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.append(node.module)
    return names


def test_op_files_import_nothing_of_models_parallel_train_checkpoint_or_data():
    root = Path(forja.__file__).parent / "ops"
    files = sorted(root.glob("*.py"))
    assert len(files) >= 5
    offenders = [(p.name, m) for p in files for m in _imports(p) if m.startswith(FORBIDDEN)]
    assert offenders == []


def test_the_models_rope_is_the_ops_reference():
    from forja.models.common.rope import apply_rope
    from forja.ops.rope import apply_rope as reference

    assert apply_rope is reference
