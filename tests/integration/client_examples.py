"""The client's runnable examples (clients/python/examples/) loaded as modules, for the tests that run them with a
framework's scripted model; and the fan-out the OpenAI Agents SDK and LangChain adapter tests script their models
to write: two cities over three tools, with its exact output and call records."""

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


SCRIPT = """import tools
lines = []
for city in ["Oslo", "Lima"]:
    weather = tools.get_weather(city=city)
    people = tools.get_population(city=city)
    lines.append(tools.format_report(city=city, temp_c=weather["temp_c"], population=people))
print("\\n".join(lines))
"""
WEATHER = {"Oslo": 4, "Lima": 19}
POPULATION = {"Oslo": 709_000, "Lima": 10_092_000}
STDOUT = "Oslo: 4 C, 709000 people\nLima: 19 C, 10092000 people\n"
RECORDS = [  # (seq, tool, args, status, result) of each call SCRIPT makes
    (1, "get_weather", {"city": "Oslo"}, "ok", {"city": "Oslo", "temp_c": 4}),
    (2, "get_population", {"city": "Oslo"}, "ok", 709_000),
    (3, "format_report", {"city": "Oslo", "temp_c": 4, "population": 709_000}, "ok", "Oslo: 4 C, 709000 people"),
    (4, "get_weather", {"city": "Lima"}, "ok", {"city": "Lima", "temp_c": 19}),
    (5, "get_population", {"city": "Lima"}, "ok", 10_092_000),
    (6, "format_report", {"city": "Lima", "temp_c": 19, "population": 10_092_000}, "ok", "Lima: 19 C, 10092000 people"),
]
