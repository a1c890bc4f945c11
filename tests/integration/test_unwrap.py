"""Wrapped code is unwrapped (``service.normalize``: ``tag_wrapper``, ``json_wrapper``, ``indent``), valid code is not.

The issue's inputs: ``<code>\\nprint('hi')\\n</code>`` (a SyntaxError at line 1 before) and ``{"code": "print('hi')"}``
(a dict expression that did nothing before) both print ``hi``; then the kind (tags of any name, text around them, JSON
objects with other keys and a tool call's envelope, a script indented as a whole), what is never touched, hostile
input, and two jobs through ``POST /execute``.
"""

from __future__ import annotations

import httpx

from tests.conftest import execute


def test_wrapped_scripts_run_through_the_service(api: httpx.Client) -> None:
    for script, kind in [
        ("<code>\nprint('hi')\n</code>", "tag_wrapper"),
        ('{"code": "print(\'hi\')"}', "json_wrapper"),
    ]:
        view = execute(api, script)
        assert view["status"] == "succeeded" and view["stdout"] == "hi\n", view
        assert [r["kind"] for r in view["normalization"]] == [kind]
        assert view["original_script"] == script and view["normalized_script"] == "print('hi')"


def test_an_indented_tool_call_runs_through_the_service(api: httpx.Client) -> None:
    tool = {
        "name": "search",
        "description": "Echo.",
        "parameters": {"type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]},
        "endpoint": {"kind": "echo"},
    }
    view = execute(api, " import tools\n print(tools.search(q='x')['args']['q'])", [tool])
    assert view["status"] == "succeeded" and view["stdout"] == "x\n", view
    assert [r["kind"] for r in view["normalization"]] == ["indent"]
    assert len(view["calls"]) == 1
