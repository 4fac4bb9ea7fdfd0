"""Test suite root. tests/ is a package, so test modules may share helpers
(`from tests.helpers import ...`) and equal basenames in different folders don't clash."""
