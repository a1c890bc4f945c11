"""Script normalization (``service.normalize``): properties, each repair, refusals and hints; then via /execute."""

from __future__ import annotations

import httpx

from service.normalize import compiles
from tests.conftest import execute
from tests.unit.test_normalize import LITERALS, escaped, fenced


def test_a_repaired_script_runs_and_the_view_reports_it(api: httpx.Client) -> None:
    clean = execute(api, LITERALS)
    damaged = fenced(escaped(LITERALS))
    view = execute(api, damaged)
    assert view["status"] == "succeeded", view
    assert view["stdout"] == clean["stdout"] and clean["normalization"] == []
    assert [r["kind"] for r in view["normalization"]] == ["fence", "literal_escapes"]
    assert view["original_script"] == damaged
    assert view["normalized_script"] is not None and compiles(view["normalized_script"])
    assert clean["original_script"] is None and clean["normalized_script"] is None
    stored = api.get(f"/jobs/{view['job_id']}").json()
    assert stored["normalization"] == view["normalization"] and stored["original_script"] == damaged


def test_normalize_false_runs_the_script_as_sent(api: httpx.Client) -> None:
    view = execute(api, "```python\nprint(1)\n```\n", normalize=False)
    assert view["status"] == "failed" and view["normalization"] == []
    assert view["error"]["type"] == "SyntaxError" and view["error"]["hint"] is None


def test_two_fenced_blocks_fail_with_line_column_text_and_hint(api: httpx.Client) -> None:
    view = execute(api, "Try this:\n```python\nprint(1)\n```\nor this:\n```python\nprint(2)\n```\n")
    assert view["status"] == "failed" and view["normalization"] == []
    error = view["error"]
    assert (error["type"], error["line"], error["text"]) == ("SyntaxError", 1, "Try this:")
    assert error["column"] is not None
    assert "2 Markdown fenced code blocks" in error["hint"]


def test_a_wrong_argument_names_parameter_type_value_and_signature(api: httpx.Client) -> None:
    tool = {
        "name": "geo.area",
        "description": "Area.",
        "parameters": {
            "type": "object",
            "properties": {"base": {"type": "integer"}, "unit": {"type": "string", "enum": ["cm", "m"]}},
            "required": ["base"],
        },
        "endpoint": {"kind": "echo"},
    }
    view = execute(api, "import tools\ntools.geo.area(base='3')\n", [tool])
    assert view["status"] == "failed"
    report = view["error"]["script_report"]
    message = report["message"]
    assert report["type"] == "ToolError" and report["line"] == 2
    assert "argument 'base': '3' is not of type 'integer' (got string)" in message
    assert "the stub is tools.geo.area(base: int, unit: Literal['cm', 'm'] | None = None)" in message
    assert (
        view["calls"][0]["error"]["message"] == "geo.area: argument 'base': '3' is not of type 'integer' (got string)"
    )
