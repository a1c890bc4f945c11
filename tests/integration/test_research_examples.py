"""The three worked examples of the PTC research, each one script in one request, tools on a real HTTP server."""

from __future__ import annotations

import math
from typing import Any

import httpx

from tests.conftest import execute
from tests.toolserver import POPULATIONS, ToolServer


def http_tool(
    server: ToolServer, name: str, route: str, properties: dict[str, Any], description: str
) -> dict[str, Any]:
    return {
        "name": name,
        "description": description,
        "parameters": {"type": "object", "properties": properties, "required": list(properties)},
        "endpoint": {"kind": "http", "url": server.url(route)},
    }


def test_single_call_triangle_area(api: httpx.Client, tool_server: ToolServer) -> None:
    tools = [
        http_tool(
            tool_server,
            "calculate_triangle_area",
            "triangle_area",
            {"base": {"type": "integer", "description": "The base."}, "height": {"type": "integer"}},
            "Calculate the area of a triangle given its base and height.",
        )
    ]
    script = "import tools\nprint(tools.calculate_triangle_area(base=10, height=5))\n"
    view = execute(api, script, tools)
    assert view["status"] == "succeeded", view
    assert view["stdout"] == "25.0\n"
    [call] = view["calls"]
    assert (call["tool"], call["args"], call["status"], call["result"]) == (
        "calculate_triangle_area",
        {"base": 10, "height": 5},
        "ok",
        25.0,
    )


def test_chain_passes_a_computed_value(api: httpx.Client, tool_server: ToolServer) -> None:
    tools = [
        http_tool(tool_server, "geometry_circumference", "circumference", {"radius": {"type": "float"}}, "2·π·r."),
        http_tool(tool_server, "geometry_square_perimeter", "square_perimeter", {"side": {"type": "float"}}, "4·side."),
    ]
    script = (
        "import math\nimport tools\n"
        "c = tools.geometry_circumference(radius=7)\n"
        "side = 2 * math.pi * 7\n"
        "p = tools.geometry_square_perimeter(side=side)\n"
        "print(round(p, 3))\n"
    )
    view = execute(api, script, tools)
    assert view["status"] == "succeeded", view
    first, second = view["calls"]
    assert (first["tool"], first["args"]) == ("geometry_circumference", {"radius": 7})
    assert first["result"] == 2 * math.pi * 7
    assert second["tool"] == "geometry_square_perimeter"
    assert second["args"] == {"side": 2 * math.pi * 7}
    assert view["stdout"] == f"{round(4 * 2 * math.pi * 7, 3)}\n"


def test_fan_out_populations(api: httpx.Client, tool_server: ToolServer) -> None:
    tools = [
        http_tool(
            tool_server, "get_population", "population", {"country": {"type": "string"}}, "Population of a country."
        )
    ]
    script = (
        "import asyncio\nimport tools\n\n"
        f"COUNTRIES = {list(POPULATIONS)!r}\n\n"
        "async def main():\n"
        "    results = await asyncio.gather(*(tools.aio.get_population(country=c) for c in COUNTRIES))\n"
        "    top = sorted(results, key=lambda r: r['population'], reverse=True)[:3]\n"
        "    print(', '.join(r['country'] for r in top))\n\n"
        "asyncio.run(main())\n"
    )
    view = execute(api, script, tools)
    assert view["status"] == "succeeded", view
    expected_top = sorted(POPULATIONS, key=lambda c: POPULATIONS[c], reverse=True)[:3]
    assert view["stdout"] == ", ".join(expected_top) + "\n"  # only the answer, no raw results
    assert len(view["calls"]) == 7
    assert sorted(c["args"]["country"] for c in view["calls"]) == sorted(POPULATIONS)
    assert all(c["status"] == "ok" for c in view["calls"])


def test_hundred_concurrent_calls_all_recorded(api: httpx.Client) -> None:
    tools = [
        {
            "name": "ping",
            "parameters": {"type": "object", "properties": {"i": {"type": "integer"}}},
            "endpoint": {"kind": "echo"},
        }
    ]
    script = (
        "import asyncio, threading, tools\n"
        "async def main():\n"
        "    return await asyncio.gather(*(tools.aio.ping(i=i) for i in range(60)))\n"
        "results = asyncio.run(main())\n"
        "threads = [threading.Thread(target=tools.ping, kwargs={'i': 60 + i}) for i in range(40)]\n"
        "[t.start() for t in threads]; [t.join() for t in threads]\n"
        "print(len(results))\n"
    )
    view = execute(api, script, tools)
    assert view["status"] == "succeeded", view
    calls = view["calls"]
    assert len(calls) == 100
    assert len({c["call_id"] for c in calls}) == 100
    assert sorted(c["args"]["i"] for c in calls) == list(range(100))
    assert [c["seq"] for c in calls] == list(range(1, 101))


def test_dotted_names_and_unsafe_parameter_names(api: httpx.Client) -> None:
    tools = [
        {
            "name": "mail.send",
            "parameters": {
                "type": "object",
                "required": ["from", "Content-Type"],
                "properties": {
                    "from": {"type": "string"},
                    "Content-Type": {"type": "string"},
                    "cc": {"type": "string", "default": "nobody"},
                },
            },
            "endpoint": {"kind": "echo"},
        }
    ]
    script = (
        "import asyncio, tools\n"
        "tools.mail.send(from_='a@x', Content_Type='text/plain')\n"
        "tools.mail.send(**{'from': 'b@x', 'Content-Type': 'text/html', 'cc': 'c@x'})\n"
        "print(asyncio.run(tools.aio.mail.send('c@x', 'x/y'))['args'])\n"
    )
    view = execute(api, script, tools)
    assert view["status"] == "succeeded", view
    assert [c["args"] for c in view["calls"]] == [
        {"from": "a@x", "Content-Type": "text/plain"},
        {"from": "b@x", "Content-Type": "text/html", "cc": "c@x"},
        {"from": "c@x", "Content-Type": "x/y"},
    ]
    assert view["stdout"] == "{'from': 'c@x', 'Content-Type': 'x/y'}\n"
