"""smolagents' ``CodeAgent`` with ``PtcExecutor`` (clients/python/ptc_sandbox_client/adapters/smolagents.py) against
the real service: a scripted model (smolagents ships no fake model: ``ScriptedModel`` below is the smallest ``Model``
subclass) writes a step that fans out over three tools and a step that answers from the first step's variables; the
tools run in this process, and the final answer, the tool calls made here and the jobs' call records are exact."""

from __future__ import annotations

import datetime
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from ptc_sandbox_client import Client
from ptc_sandbox_client.adapters.smolagents import PtcExecutor, SandboxExecutionError
from smolagents import CodeAgent, tool
from smolagents.models import ChatMessage, MessageRole, Model

from tests.conftest import Service


class ScriptedModel(Model):  # type: ignore[misc]  # smolagents ships no type information
    """A model that answers each request with the next of ``replies`` (and records the requests)."""

    def __init__(self, replies: list[str]) -> None:
        super().__init__(model_id="scripted")
        self.replies = list(replies)
        self.requests: list[Any] = []

    def generate(self, messages: list[Any], **kwargs: Any) -> ChatMessage:
        self.requests.append(messages)
        return ChatMessage(role=MessageRole.ASSISTANT, content=self.replies.pop(0))


@pytest.fixture
def client(service: Service) -> Iterator[Client]:
    with Client(service.url, service.token, timeout=120) as c:
        yield c


def make_tools(calls: list[tuple[str, dict[str, Any]]]) -> list[Any]:
    @tool  # type: ignore[untyped-decorator]  # smolagents ships no type information
    def get_weather(city: str) -> dict[str, Any]:
        """The weather of a city now.

        Args:
            city: The city's name.
        """
        calls.append(("get_weather", {"city": city}))
        return {"city": city, "temp_c": {"Oslo": 4, "Lima": 19, "Pune": 31}[city]}

    @tool  # type: ignore[untyped-decorator]  # smolagents ships no type information
    def get_population(city: str, year: int | None = None) -> int:
        """The population of a city.

        Args:
            city: The city's name.
            year: The census year (the latest when left out).
        """
        calls.append(("get_population", {"city": city, "year": year}))
        return {"Oslo": 709_000, "Lima": 10_092_000, "Pune": 7_764_000}[city]

    @tool  # type: ignore[untyped-decorator]  # smolagents ships no type information
    def get_timezone(city: str) -> str:
        """The IANA time zone of a city.

        Args:
            city: The city's name.
        """
        calls.append(("get_timezone", {"city": city}))
        return {"Oslo": "Europe/Oslo", "Lima": "America/Lima", "Pune": "Asia/Kolkata"}[city]

    return [get_weather, get_population, get_timezone]


STEP_1 = """Thought: I look the three cities up with the three tools.
<code>
import datetime
cities = ["Oslo", "Lima", "Pune"]
report = {}
for city in cities:
    report[city] = (get_weather(city)["temp_c"], get_population(city=city), get_timezone(city=city))
def warmest(rep):
    return max(rep, key=lambda c: rep[c][0])
print("looked up", len(report), "cities")
sorted(report)
</code>"""

STEP_2 = """Thought: The variables of the first step are still there.
<code>
final_answer({"warmest": warmest(report), "report": report, "when": datetime.date(2026, 1, 2), "n": len(cities)})
</code>"""


def test_code_agent_runs_its_steps_in_a_session_with_tools_answered_here(client: Client) -> None:
    calls: list[tuple[str, dict[str, Any]]] = []
    model = ScriptedModel([STEP_1, STEP_2])
    executor = PtcExecutor(client, timeout_s=60)
    with CodeAgent(tools=make_tools(calls), model=model, executor=executor, max_steps=4) as agent:
        answer = agent.run("Which city is the warmest?")
        session_id = executor.session.session_id if executor.session else None
    assert answer == {
        "warmest": "Pune",
        "report": {
            "Oslo": (4, 709_000, "Europe/Oslo"),
            "Lima": (19, 10_092_000, "America/Lima"),
            "Pune": (31, 7_764_000, "Asia/Kolkata"),
        },
        "when": datetime.date(2026, 1, 2),
        "n": 3,
    }
    expected = [
        (name, {"city": city, **({"year": None} if name == "get_population" else {})})
        for city in ("Oslo", "Lima", "Pune")
        for name in ("get_weather", "get_population", "get_timezone")
    ]
    assert calls == expected
    # Two steps, two jobs of one session, now closed; the first step's output and value came back to the agent.
    first, second = executor.views
    assert first.session_id == second.session_id == session_id and session_id is not None
    assert client.get_session(session_id).status == "closed"
    assert first.stdout == "looked up 3 cities\n"
    step_1 = agent.memory.steps[1]
    assert step_1.action_output == ["Lima", "Oslo", "Pune"]
    assert "looked up 3 cities" in step_1.observations
    # The broker's records of the first job: the nine calls, in order, as the script sent them (positional
    # arguments bound to their names), each answered ok by this process.
    records = client.get(first.job_id, calls="full").call_records
    assert [(r.tool, r.args, r.status) for r in records] == [
        (name, {"city": city}, "ok")
        for city in ("Oslo", "Lima", "Pune")
        for name in ("get_weather", "get_population", "get_timezone")
    ]
    assert records[0].result == {"city": "Oslo", "temp_c": 4}
    assert client.get(second.job_id, calls="full").call_records == []


def test_a_step_that_raises_is_an_error_the_agent_shows_its_model(client: Client) -> None:
    calls: list[tuple[str, dict[str, Any]]] = []
    model = ScriptedModel(
        [
            "<code>\nx = 41\nprint('before')\n1 / 0\n</code>",
            "<code>\nfinal_answer(x + 1)\n</code>",
        ]
    )
    executor = PtcExecutor(client, timeout_s=60)
    with CodeAgent(tools=make_tools(calls), model=model, executor=executor, max_steps=3) as agent:
        assert agent.run("Count.") == 42
    failed = executor.views[0]
    assert failed.status == "failed" and "ZeroDivisionError" in failed.stderr
    error = agent.memory.steps[1].error
    assert error is not None and "ZeroDivisionError: division by zero" in str(error)
    assert "before" in (agent.memory.steps[1].observations or "")
    assert calls == []


def test_an_executor_error_carries_the_view(client: Client) -> None:
    executor = PtcExecutor(client, timeout_s=60)
    try:
        with pytest.raises(SandboxExecutionError) as raised:
            executor("def f(:\n    pass")
        assert "SyntaxError" in str(raised.value) and raised.value.view.status == "failed"
        executor.send_variables({"pair": (1, 2), "raw": b"\x00\x01"})
        out = executor("(pair, raw)")
        assert out.output == ((1, 2), b"\x00\x01") and not out.is_final_answer
        # What the next step finds: modules, functions and classes defined, instances of them; not what does not
        # pickle (a generator).
        executor(
            "import math as m\nfrom collections import Counter\nclass P:\n    def __init__(self, x):\n"
            "        self.x = x\ndef double(v):\n    return 2 * v\np = P(3)\nc = Counter('aab')\n"
            "gen = (i for i in range(3))"
        )
        out = executor("(m.sqrt(double(p.x) * 6), type(p).__name__, c['a'], 'gen' in globals(), pair)")
        assert out.output == (6.0, "P", 2, False, (1, 2)), out
        # A step cut short by its time limit: an error, and the state of the step before stays.
        executor.timeout_s = 2
        with pytest.raises(SandboxExecutionError) as raised:
            executor("p.x = 100\nimport time\ntime.sleep(30)")
        assert str(raised.value).startswith("the step's script ended "), raised.value
        assert raised.value.view.status != "succeeded"
        executor.timeout_s = 60
        assert executor("p.x").output == 3
    finally:
        executor.cleanup()


EXAMPLE_MODEL = """from smolagents.models import ChatMessage, MessageRole, Model


class ScriptedModel(Model):
    def generate(self, messages, **kwargs):
        code = "temps = {c: get_weather(c)['temp_c'] for c in ['Oslo', 'Lima']}\\n"
        code += "final_answer(max(temps, key=temps.get))"
        return ChatMessage(role=MessageRole.ASSISTANT, content=f"<code>\\n{code}\\n</code>")


model = ScriptedModel()
"""


def test_the_example_runs_with_a_scripted_model(service: Service, tmp_path: Path) -> None:
    """clients/python/examples/smolagents_agent.py (docs/adapters/smolagents.md's program) with its model line replaced
    by a scripted model: its printed lines are its comments."""
    path = Path(__file__).resolve().parents[2] / "clients" / "python" / "examples" / "smolagents_agent.py"
    source = path.read_text()
    model_line = next(line for line in source.splitlines() if line.startswith("model = "))
    program = source.replace(model_line + "\n", EXAMPLE_MODEL)
    env = {**os.environ, "PTC_URL": service.url, "PTC_TOKEN": service.token}
    (tmp_path / "example.py").write_text(program)  # smolagents' @tool reads its function's source from the file
    done = subprocess.run(
        [sys.executable, str(tmp_path / "example.py")], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    lines = [line.strip() for line in source.splitlines()]
    expected = [line.split("  # ", 1)[1] for line in lines if line.startswith("print(") and "  # " in line]
    assert done.stdout.splitlines() == expected, done.stdout
