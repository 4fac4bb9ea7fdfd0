"""Rule 1 of docs/architecture.md: model code is single-device code."""

import ast
from pathlib import Path

import forja

FORBIDDEN = ("forja.parallel", "forja.train", "forja.checkpoint")


def _imports(path: Path) -> list[str]:
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.append(node.module)
    return names


def test_model_files_import_no_parallel_train_or_checkpoint_code():
    root = Path(forja.__file__).parent / "models"
    model_files = sorted(root.glob("**/model.py")) + sorted((root / "common").glob("*.py"))
    assert len(model_files) >= 3
    offenders = [(p.relative_to(root), m) for p in model_files for m in _imports(p)
                 if m.startswith(FORBIDDEN)]
    assert offenders == []


def test_the_check_sees_a_forbidden_import(tmp_path):
    bad = tmp_path / "model.py"
    bad.write_text("from forja.parallel.fsdp import apply_fsdp\nimport torch\n")
    assert [m for m in _imports(bad) if m.startswith(FORBIDDEN)] == ["forja.parallel.fsdp"]
