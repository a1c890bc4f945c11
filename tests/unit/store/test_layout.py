"""The store package's shape, read from its source: small modules, and a lower layer that imports nothing of the
service above it (HTTP, the job service, sessions, sandboxes)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[3] / "service" / "store"
MODULES = sorted(path for path in PACKAGE.glob("*.py"))
ALLOWED = ("service.store", "service.errors", "service.settings")
"""What of the service a store module may import: itself, the error hierarchy, and settings (``job_store``)."""


def test_every_module_of_the_package_is_small() -> None:
    sizes = {path.name: len(path.read_text().splitlines()) for path in MODULES}
    assert max(sizes.values()) <= 400, sizes


@pytest.mark.parametrize("path", MODULES, ids=lambda path: path.name)
def test_the_store_imports_nothing_above_it(path: Path) -> None:
    imported: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            imported.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module is not None:
            imported.add(node.module)
    assert not {name for name in imported if name.startswith("service") and not name.startswith(ALLOWED)}
