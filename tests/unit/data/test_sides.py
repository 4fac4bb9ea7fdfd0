"""forja/data's two sides: preparation (forja.data.corpus) never pays for torch, which only
the loader (forja.data.load) needs: `forja prepare`'s worker processes import the corpus side."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import forja.data

CORPUS = Path(forja.data.__file__).parent / "corpus"


def test_importing_the_preparation_side_does_not_import_torch() -> None:
    modules = sorted(f"forja.data.corpus.{p.stem}" for p in CORPUS.glob("*.py") if p.stem != "__init__")
    assert "forja.data.corpus.prepare" in modules and "forja.data.corpus.cli" in modules
    code = f"import forja.data, forja.data.config, {', '.join(modules)}; import sys; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_the_loader_side_is_the_one_that_imports_torch() -> None:
    """The check above would pass vacuously if nothing imported torch: the loader does."""
    code = "import forja.data.load.loader; import sys; assert 'torch' in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
