"""Stub generation: typed signatures, names, docstrings, and every BFCL v4 function schema."""

from __future__ import annotations

import sys
import types
from pathlib import Path
from typing import Any

import httpx

from tests.bfcl_data import iter_function_docs
from tests.unit.toolkit.test_stubs import ECHO, lookup

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "sandbox_image"))


def test_every_bfcl_function_doc_renders_through_the_stubs_endpoint(api: httpx.Client) -> None:
    """All ~8,700 BFCL v4 docs (simple_java and simple_javascript included), one POST /stubs per entry."""
    entries: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for stem, entry_id, doc in iter_function_docs():
        entries.setdefault((stem, entry_id), []).append(doc)
    assert {stem for stem, _ in entries} >= {"BFCL_v4_simple_java", "BFCL_v4_simple_javascript"}
    rendered = 0
    for (stem, entry_id), docs in entries.items():
        response = api.post("/stubs", json={"tools": [{**doc, "endpoint": ECHO} for doc in docs]})
        assert response.status_code == 200, (stem, entry_id, response.text)
        module = types.ModuleType("tools")
        exec(compile(response.json()["module"], f"{entry_id}/tools.py", "exec"), module.__dict__)
        for doc in docs:
            assert lookup(module, doc["name"])._binder.tool == doc["name"], (stem, entry_id)
            rendered += 1
    assert rendered > 8_000
