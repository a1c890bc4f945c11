"""The client's runnable examples (clients/python/examples/) loaded as modules, for the tests that run them with a
framework's scripted model."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType


def load_example(name: str) -> ModuleType:
    """``clients/python/examples/<name>.py`` as a module."""
    path = Path(__file__).resolve().parents[2] / "clients" / "python" / "examples" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
