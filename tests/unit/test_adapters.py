"""The adapters' manifests from each framework's own tools (clients/python/ptc_sandbox_client/adapters/), engine-free:
the client talks to an httpx mock transport that records the requests and answers as the service would."""

from __future__ import annotations

import ast
import json
import sys
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

import fastmcp
import httpx
import pytest
from fastmcp.experimental.transforms.code_mode import CodeMode
from ptc_sandbox_client import AsyncClient, Client
from ptc_sandbox_client.adapters import fastmcp as fastmcp_adapter
from ptc_sandbox_client.adapters import smolagents as smolagents_adapter
from smolagents import Tool, tool


class FakeService:
    """Records each request; ``/sessions`` opens one, ``/execute`` ends at once with ``outcome`` as the result file."""

    def __init__(self, result_path: str, outcome: dict[str, Any]) -> None:
        self.result_path = result_path
        self.outcome = outcome
        self.requests: list[tuple[str, str, Any]] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content) if request.content else None
        self.requests.append((request.method, request.url.path, body))
        if request.url.path == "/sessions" and request.method == "POST":
            return httpx.Response(201, json={"session_id": "ses_1", "status": "ready"})
        if request.url.path == "/sessions/ses_1":
            return httpx.Response(200, json={"session_id": "ses_1", "status": "closed"})
        if request.url.path == "/execute":
            files = [{"path": self.result_path, "bytes": 1}]
            return httpx.Response(
                200, json={"job_id": "job_1", "status": "succeeded", "stdout": "hi\n", "files": files}
            )
        if request.url.path == f"/jobs/job_1/files/{self.result_path}":
            return httpx.Response(200, json=self.outcome)
        return httpx.Response(404, json={"type": "about:blank#route-not-found", "status": 404})

    def executes(self) -> list[Any]:
        return [body for method, path, body in self.requests if path == "/execute"]


def transport(handler: Callable[[httpx.Request], httpx.Response]) -> httpx.MockTransport:
    return httpx.MockTransport(handler)


def test_smolagents_inputs_become_json_schema() -> None:
    schema = smolagents_adapter.input_schema(
        {
            "q": {"type": "string", "description": "The query."},
            "n": {"type": "integer", "description": "How many.", "nullable": True},
            "tags": {"type": "array", "items": {"type": "string"}, "description": "Tags."},
            "x": {"type": "any", "description": "Anything."},
            "pic": {"type": "image", "description": "A picture."},
            "either": {"type": ["string", "number"], "description": "One of two."},
        }
    )
    assert schema == {
        "type": "object",
        "properties": {
            "q": {"type": "string", "description": "The query."},
            "n": {"type": ["integer", "null"], "description": "How many."},
            "tags": {"type": "array", "items": {"type": "string"}, "description": "Tags."},
            "x": {"description": "Anything."},
            "pic": {"description": "A picture."},
            "either": {"type": ["string", "number"], "description": "One of two."},
        },
        "required": ["q", "tags", "x", "pic", "either"],
    }


def test_smolagents_executor_sends_the_agents_tools_as_client_executed_tools() -> None:
    @tool  # type: ignore[untyped-decorator]  # smolagents ships no type information
    def lookup(city: str, days: int | None = None) -> str:
        """Looks a city up.

        Args:
            city: The city.
            days: How many days ahead.
        """
        return city

    class Shout(Tool):  # type: ignore[misc]
        name = "shout"
        description = "Upper-cases a text."
        inputs: ClassVar[dict[str, Any]] = {"text": {"type": "string", "description": "The text."}}
        output_type = "string"

        def forward(self, text: str) -> str:
            return text.upper()

    service = FakeService(smolagents_adapter.RESULT_PATH, {"final": True, "value": {"__type__": "tuple", "data": [1]}})
    client = Client("http://ptc", http=httpx.Client(base_url="http://ptc", transport=transport(service)))
    executor = smolagents_adapter.PtcExecutor(client, session={"idle_timeout_s": 60}, timeout_s=5)
    executor.send_tools({"lookup": lookup, "shout": Shout(), "final_answer": object()})
    executor.final_answer_tool = None
    out = executor("final_answer((1,))")
    assert (out.output, out.logs, out.is_final_answer) == ((1,), "hi\n", True)
    (body,) = service.executes()
    assert body["session_id"] == "ses_1" and body["timeout_s"] == 5
    assert body["tools"] == [
        {
            "name": "lookup",
            "description": "Looks a city up.",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "description": "The city."},
                    "days": {"type": ["integer", "null"], "description": "How many days ahead."},
                },
                "required": ["city"],
            },
            "endpoint": {"kind": "client"},
        },
        {
            "name": "shout",
            "description": "Upper-cases a text.",
            "parameters": {
                "type": "object",
                "properties": {"text": {"type": "string", "description": "The text."}},
                "required": ["text"],
            },
            "endpoint": {"kind": "client"},
        },
    ]
    assert lookup.inputs["days"]["nullable"] is True
    ast.parse(body["script"])  # the step program compiles
    assert service.requests[0][:2] == ("POST", "/sessions") and service.requests[0][2] == {"idle_timeout_s": 60}
    executor.cleanup()
    assert service.requests[-1][:2] == ("DELETE", "/sessions/ses_1")


async def test_fastmcp_provider_sends_the_servers_tools_with_their_input_schemas() -> None:
    service = FakeService(fastmcp_adapter.RESULT_PATH, {"value": 7})
    client = AsyncClient("http://ptc", http=httpx.AsyncClient(base_url="http://ptc", transport=transport(service)))
    transform = fastmcp_adapter.code_mode(client, provider={"timeout_s": 9, "metadata": {"app": "cities"}})
    server = fastmcp.FastMCP("cities", transforms=[transform])

    @server.tool
    def area(base: int, height: int = 1) -> float:
        """Area of a triangle."""
        return base * height / 2

    async with fastmcp.Client(server) as model:
        result = await model.call_tool("execute", {"code": "return await area(base=2)"})
    assert result.content[0].text == "7"
    (body,) = service.executes()
    assert body["timeout_s"] == 9 and body["metadata"] == {"app": "cities"}
    (entry,) = body["tools"]
    assert entry["name"] == "area" and entry["description"] == "Area of a triangle."
    assert entry["endpoint"] == {"kind": "client"}
    assert entry["parameters"]["properties"] == {
        "base": {"type": "integer"},
        "height": {"default": 1, "type": "integer"},
    }
    assert entry["parameters"]["required"] == ["base"]
    ast.parse(body["script"])
    await client.aclose()


async def test_fastmcp_provider_unbound_offers_a_generic_call_tool() -> None:
    service = FakeService(fastmcp_adapter.RESULT_PATH, {"error": "ValueError: no"})
    client = AsyncClient("http://ptc", http=httpx.AsyncClient(base_url="http://ptc", transport=transport(service)))
    server = fastmcp.FastMCP("x", transforms=[CodeMode(sandbox_provider=fastmcp_adapter.PtcSandboxProvider(client))])
    async with fastmcp.Client(server) as model:
        result = await model.call_tool("execute", {"code": "raise ValueError('no')"}, raise_on_error=False)
    assert result.is_error and "ValueError: no" in str(result.content)
    (body,) = service.executes()
    assert [t["name"] for t in body["tools"]] == ["call_tool"]
    assert body["tools"][0]["parameters"] == fastmcp_adapter.CALL_TOOL_SCHEMA
    await client.aclose()


def test_the_docs_pages_show_the_examples_as_they_are() -> None:
    root = Path(__file__).resolve().parents[2]
    for page, example in (("smolagents.md", "smolagents_agent.py"), ("fastmcp.md", "fastmcp_code_mode.py")):
        text = (root / "docs" / "adapters" / page).read_text()
        program = text.split("```python\n", 1)[1].split("```", 1)[0]
        assert program == (root / "clients" / "python" / "examples" / example).read_text(), page


def test_smolagents_a_steps_value_builds_no_image_and_no_array_of_the_sandboxs_size(monkeypatch: Any) -> None:
    """The step's value comes from the (hostile) sandbox: a ``PIL.Image`` tag is not handed to an image decoder, and
    an ``ndarray`` tag with a string dtype of the sandbox's size (``U1000000000``: 4 GB per item) is not built, even
    nested where ``SafeSerializer.from_json_safe`` would reach them; a malformed tag is a step error, not a crash."""
    made: list[tuple[str, Any]] = []
    image = types.ModuleType("PIL.Image")
    image.open = lambda data: made.append(("open", data))  # type: ignore[attr-defined]
    pil = types.ModuleType("PIL")
    pil.Image = image  # type: ignore[attr-defined]
    numpy = types.ModuleType("numpy")

    def array(data: Any, dtype: Any = None) -> Any:
        made.append(("array", dtype))
        return ("array", data, dtype)

    numpy.array = array  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "PIL", pil)
    monkeypatch.setitem(sys.modules, "PIL.Image", image)
    monkeypatch.setitem(sys.modules, "numpy", numpy)
    hostile = {
        "__type__": "tuple",
        "data": [
            {"__type__": "PIL.Image", "data": "iVBORw0KGgo="},
            {"__type__": "ndarray", "data": ["a"], "dtype": "U1000000000"},
            {"__type__": "ndarray", "data": [1.5], "dtype": "float64"},
        ],
    }
    service = FakeService(smolagents_adapter.RESULT_PATH, {"final": False, "value": hostile})
    client = Client("http://ptc", http=httpx.Client(base_url="http://ptc", transport=transport(service)))
    executor = smolagents_adapter.PtcExecutor(client)
    out = executor("x")
    assert out.output == (
        {"__type__": "PIL.Image", "data": "iVBORw0KGgo="},
        ["a"],
        ("array", [1.5], "float64"),
    )
    assert made == [("array", "float64")]
    service.outcome = {"final": False, "value": {"__type__": "timedelta", "total_seconds": 1e300}}
    with pytest.raises(smolagents_adapter.SandboxExecutionError, match="the step's value could not be read"):
        executor("x")


def test_smolagents_a_script_passes_a_tool_only_its_inputs() -> None:
    """A call whose arguments name anything but the tool's ``inputs`` is refused (the script's ``ToolError``) in the
    agent process too (the broker refuses it first): they would reach a managed agent's ``run`` (``max_steps``: a run
    without end) or ``Tool.__call__``'s ``sanitize_inputs_outputs``."""
    runs: list[dict[str, Any]] = []

    class Helper:  # what CodeAgent hands the executor for a managed agent: name, description, inputs, __call__
        name = "helper"
        description = "A managed agent."
        inputs: ClassVar[dict[str, Any]] = {
            "task": {"type": "string", "description": "The task."},
            "additional_args": {"type": "object", "description": "More.", "nullable": True},
        }

        def __call__(self, task: str, **kwargs: Any) -> str:
            runs.append({"task": task, **kwargs})
            return "done"

    answers: dict[str, Any] = {}
    calls = [
        {"call_id": "c1", "tool": "helper", "args": {"task": "t", "max_steps": 10**9}, "awaiting": "client"},
        {"call_id": "c2", "tool": "helper", "args": {"task": "ok"}, "awaiting": "client"},
    ]

    def handler(request: httpx.Request) -> httpx.Response:
        path = request.url.path
        if path == "/sessions":
            return httpx.Response(201, json={"session_id": "ses_1", "status": "ready"})
        if path == "/execute":
            return httpx.Response(202, json={"job_id": "job_1", "status": "waiting", "pending_calls": calls})
        if path.startswith("/jobs/job_1/calls/"):
            answers[path.rsplit("/", 1)[1]] = json.loads(request.content)
            if len(answers) < len(calls):
                return httpx.Response(200, json={"job_id": "job_1", "status": "waiting", "pending_calls": []})
            files = [{"path": smolagents_adapter.RESULT_PATH, "bytes": 1}]
            return httpx.Response(200, json={"job_id": "job_1", "status": "succeeded", "files": files})
        if path == f"/jobs/job_1/files/{smolagents_adapter.RESULT_PATH}":
            return httpx.Response(200, json={"final": False, "value": None})
        raise AssertionError(f"unexpected {request.method} {path}")

    client = Client("http://ptc", http=httpx.Client(base_url="http://ptc", transport=transport(handler)))
    executor = smolagents_adapter.PtcExecutor(client)
    executor.send_tools({"helper": Helper()})
    executor("helper(task='t', max_steps=10**9)")
    assert answers["c1"] == {"error": {"type": "TypeError", "message": "helper: unexpected argument(s) max_steps"}}
    assert answers["c2"] == {"result": "done"}
    assert runs == [{"task": "ok"}]
