"""MCP endpoints, and BFCL's multi-turn tools as real endpoints.

A BFCL multi-turn entry's ground-truth call sequence, run as a script through
``POST /execute`` against BFCL's own tool classes served over plain HTTP and
over MCP (``tests.bfcl_servers``), must end in the state that the same calls
made in Python on a fresh instance end in, and give the same results.
"""

from __future__ import annotations

from typing import Any

import pytest

from service.errors import ManifestError
from service.toolkit.manifest import parse_endpoint, parse_tool
from service.toolkit.specs import Endpoint


def test_mcp_endpoint_parses_with_its_remote_tool_name() -> None:
    raw = {"kind": "mcp", "url": "http://127.0.0.1:9/mcp", "tool": "cd", "headers": {"a": "b"}, "timeout_s": 5}
    assert parse_endpoint(raw, ("endpoint",)) == Endpoint(
        kind="mcp", url="http://127.0.0.1:9/mcp", headers={"a": "b"}, timeout_s=5.0, tool="cd"
    )
    entry = {"name": "ls", "inputSchema": {"type": "object"}, "endpoint": {"kind": "mcp", "url": "https://h/mcp"}}
    assert parse_tool(entry, ("tools", 0)).endpoint.tool is None


@pytest.mark.parametrize(
    ("raw", "field"),
    [
        ({"kind": "mcp"}, "url"),
        ({"kind": "mcp", "url": "stdio://server"}, "url"),
        ({"kind": "mcp", "url": "http://h/mcp", "tool": ""}, "tool"),
        ({"kind": "mcp", "url": "http://h/mcp", "tool": 3}, "tool"),
        ({"kind": "mcp", "url": "http://h/mcp", "headers": {"a": 1}}, "headers"),
    ],
)
def test_bad_mcp_endpoint_is_refused_naming_the_field(raw: dict[str, Any], field: str) -> None:
    with pytest.raises(ManifestError) as caught:
        parse_endpoint(raw, ("endpoint",))
    assert caught.value.loc[-1] == field
