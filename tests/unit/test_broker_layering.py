"""The broker package's shape, read from its source: small modules, and no import of the layers above it (the job
service, the HTTP layer, the stores, metrics and logs): they hand it what it needs (hooks, a lease check)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "service" / "broker"
HIGHER = (
    "service.api",
    "service.jobs",
    "service.sessions.manager",
    "service.store",
    "service.replicas.registration",
    "service.observability.metrics",
    "service.observability.logs",
)
MODULES = sorted(path.stem for path in PACKAGE.glob("*.py"))


def imported(module: str) -> set[str]:
    tree = ast.parse((PACKAGE / f"{module}.py").read_text())
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module is not None:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)  # ``from service import jobs``
    return names


@pytest.mark.parametrize("module", MODULES)
def test_the_broker_imports_no_higher_layer(module: str) -> None:
    assert not {name for name in imported(module) if name.startswith(HIGHER)}


def test_every_module_of_the_broker_is_small() -> None:
    sizes = {path.name: len(path.read_text().splitlines()) for path in PACKAGE.glob("*.py")}
    assert len(sizes) >= 5 and max(sizes.values()) <= 400, sizes
