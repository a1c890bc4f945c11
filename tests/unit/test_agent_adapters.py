"""The OpenAI Agents SDK and LangChain adapters (``ptc_sandbox_client.adapters``) without an engine: the manifests
built from each framework's tools (names, descriptions, JSON schemas), the description given to the model, the
text a finished job gives back, and the answers the code tools send for their tools' results and failures against
a scripted service (``httpx.MockTransport``)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Annotated, Any

import httpx
import pytest
from agents import FunctionTool, function_tool, set_tracing_disabled
from agents.tool_context import ToolContext
from langchain_core.tools import BaseTool, InjectedToolArg, tool
from langchain_core.utils.function_calling import convert_to_openai_tool
from ptc_sandbox_client import AsyncClient, Client, JobView, UnauthorizedError
from ptc_sandbox_client.adapters import langchain as lc
from ptc_sandbox_client.adapters import openai_agents as oa
from ptc_sandbox_client.adapters._common import TAIL_CHARS, describe, job_text
from ptc_sandbox_client.errors import PROBLEM_PREFIX

set_tracing_disabled(True)  # the SDK never exports a trace from these tests (no network)

STUBS = {"module": "def lookup(key: str) -> Any: ...\n", "usage": "Call tools from Python: `import tools`.\n"}


@function_tool
def lookup(key: str, limit: int = 3) -> dict[str, Any]:
    """Look a key up."""
    return {"key": key, "limit": limit}


@tool
def search(query: str, top_k: int = 5) -> list[str]:
    """Search the index."""
    return [query] * top_k


def test_openai_agents_manifest_is_the_tools_names_descriptions_and_schemas() -> None:
    (entry,) = oa.manifest_of([lookup])
    assert entry == {
        "name": "lookup",
        "description": "Look a key up.",
        "parameters": lookup.params_json_schema,
        "endpoint": {"kind": "client"},
    }
    assert entry["parameters"]["properties"]["limit"]["default"] == 3


def test_openai_agents_refuses_what_a_script_cannot_call_safely() -> None:
    gated = function_tool(lambda key: key, name_override="gated", needs_approval=True)
    with pytest.raises(ValueError, match="gated: a tool with needs_approval"):
        oa.manifest_of([gated])
    with pytest.raises(TypeError, match="only FunctionTools"):
        oa.manifest_of([search])  # type: ignore[list-item]


def test_langchain_manifest_is_the_tools_names_descriptions_and_schemas() -> None:
    (entry,) = lc.manifest_of([search])
    function = convert_to_openai_tool(search)["function"]
    assert entry == {
        "name": "search",
        "description": "Search the index.",
        "parameters": function["parameters"],
        "endpoint": {"kind": "client"},
    }
    assert set(entry["parameters"]["properties"]) == {"query", "top_k"}
    with pytest.raises(TypeError, match="only LangChain BaseTools"):
        lc.manifest_of([lookup])  # type: ignore[list-item]


def test_the_description_and_the_text_of_a_job() -> None:
    text = describe(STUBS, "Intro.")
    assert text == (
        "Intro.\n\nCall tools from Python: `import tools`.\n\nThe `tools` module:\n\n```python\n"
        "def lookup(key: str) -> Any: ...\n```"
    )
    assert job_text(JobView(job_id="j", status="succeeded", stdout="42\n")) == "42\n"
    failed = job_text(
        JobView(
            job_id="j",
            status="failed",
            exit_code=1,
            stdout="partial\n",
            stderr="x" * (TAIL_CHARS + 50) + "ValueError: boom\n",
            error={"type": "nonzero_exit", "message": "the script exited with code 1"},
        )
    )
    head, _, tail = failed.partition("stderr (tail):\n")
    assert head == (
        "The script did not succeed: status failed, exit code 1.\n"
        "error: nonzero_exit: the script exited with code 1\nstdout (tail):\npartial\n\n"
    )
    assert tail.startswith("...") and tail.endswith("ValueError: boom\n") and len(tail) == TAIL_CHARS + 3


class ScriptedService:
    """Answers ``/stubs``, an ``/execute`` that waits on ``calls`` (client-executed), each answer (kept), and then a
    final view ``final``."""

    def __init__(self, calls: list[dict[str, Any]], final: dict[str, Any]) -> None:
        self.calls, self.final = calls, final
        self.answers: dict[str, Any] = {}
        self.manifest: list[dict[str, Any]] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        if path == "/stubs":
            return httpx.Response(200, json=STUBS)
        if path == "/execute":
            self.manifest = json.loads(request.content)["tools"]
            pending = [{**c, "awaiting": "client"} for c in self.calls]
            return httpx.Response(202, json={"job_id": "job_1", "status": "waiting", "pending_calls": pending})
        if path.startswith("/jobs/job_1/calls/"):
            self.answers[path.rsplit("/", 1)[1]] = json.loads(request.content)
            done = len(self.answers) == len(self.calls)
            if not done:
                pending = [{**c, "awaiting": "client"} for c in self.calls if c["call_id"] not in self.answers]
                return httpx.Response(200, json={"job_id": "job_1", "status": "waiting", "pending_calls": pending})
            return httpx.Response(200, json={"job_id": "job_1", **self.final})
        raise AssertionError(f"unexpected {request.method} {path}")


def failing(key: str) -> str:
    """Always fails."""
    raise ValueError(f"no {key}")


async def test_openai_agents_code_tool_answers_results_and_failures() -> None:
    strict = function_tool(failing, name_override="strict", failure_error_function=None)
    lenient = function_tool(failing, name_override="lenient")
    calls = [
        {"call_id": "c1", "tool": "lookup", "args": {"key": "a"}},
        {"call_id": "c2", "tool": "strict", "args": {"key": "b"}},
        {"call_id": "c3", "tool": "lenient", "args": {"key": "c"}},
    ]
    final = {"status": "failed", "exit_code": 2, "stdout": "", "stderr": "SystemExit: 2\n", "error": None}
    service = ScriptedService(calls, final)
    http = httpx.AsyncClient(base_url="http://t", transport=httpx.MockTransport(service))
    async with AsyncClient("http://t", "tok", http=http) as client:
        code = await oa.code_tool(client, [lookup, strict, lenient], name="py", description="Run it.")
        assert isinstance(code, FunctionTool) and code.name == "py"
        assert code.description == describe(STUBS, "Run it.")
        assert code.params_json_schema["required"] == ["script"]
        ctx: ToolContext[Any] = ToolContext(None, tool_name="py", tool_call_id="call_x", tool_arguments="{}")
        text = await code.on_invoke_tool(ctx, json.dumps({"script": "import tools"}))
    assert text == "The script did not succeed: status failed, exit code 2.\nstderr (tail):\nSystemExit: 2\n"
    assert service.manifest == oa.manifest_of([lookup, strict, lenient])  # what the description's stubs were made of
    assert service.answers["c1"] == {"result": {"key": "a", "limit": 3}}
    assert service.answers["c2"] == {"error": {"type": "ValueError", "message": "no b"}}
    # The SDK's default failure handler turns the error into its text, which the script gets as the result.
    assert service.answers["c3"] == {"result": "An error occurred while running the tool. Please try again."}


def test_langchain_code_tool_answers_results_and_failures() -> None:
    @tool
    def broken(key: str) -> str:
        """Always fails."""
        raise ValueError(f"no {key}")

    calls = [
        {"call_id": "c1", "tool": "search", "args": {"query": "q", "top_k": 2}},
        {"call_id": "c2", "tool": "broken", "args": {"key": "b"}},
    ]
    service = ScriptedService(calls, {"status": "succeeded", "exit_code": 0, "stdout": "ok\n"})
    http = httpx.Client(base_url="http://t", transport=httpx.MockTransport(service))
    with Client("http://t", "tok", http=http) as client:
        code = lc.PtcCodeTool(client=client, tools=[search, broken])
        assert isinstance(code, BaseTool) and code.name == "run_python" and code.description == describe(STUBS)
        assert code.invoke({"script": "import tools"}) == "ok\n"
    assert service.manifest == lc.manifest_of([search, broken])
    assert service.answers == {
        "c1": {"result": ["q", "q"]},
        "c2": {"error": {"type": "ValueError", "message": "no b"}},
    }
    with pytest.raises(ValueError, match="needs client="):
        lc.PtcCodeTool(tools=[search])


@pytest.mark.parametrize(
    ("page", "example"), [("openai-agents.md", "openai_agents_example.py"), ("langchain.md", "langchain_example.py")]
)
def test_each_page_shows_its_example_program(page: str, example: str) -> None:
    """The smallest working program of each adapter page is the example file the integration test runs."""
    root = Path(__file__).resolve().parents[2]
    text = (root / "docs" / "adapters" / page).read_text()
    program = (root / "clients" / "python" / "examples" / example).read_text()
    assert f"```python\n{program}```\n" in text


def refusing(status: int, name: str) -> httpx.MockTransport:
    """A service whose /stubs answers and whose /execute refuses with the problem ``name``."""

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/stubs":
            return httpx.Response(200, json=STUBS)
        body = {"type": PROBLEM_PREFIX + name, "title": name, "status": status, "detail": f"detail of {name}"}
        return httpx.Response(status, json=body, headers={"content-type": "application/problem+json"})

    return httpx.MockTransport(handler)


async def test_a_refusal_the_model_can_act_on_is_told_and_others_raise() -> None:
    ctx: ToolContext[Any] = ToolContext(None, tool_name="run_python", tool_call_id="c", tool_arguments="{}")
    arguments = json.dumps({"script": "print(1)"})
    http = httpx.AsyncClient(base_url="http://t", transport=refusing(422, "limit-exceeded"))
    async with AsyncClient("http://t", "tok", http=http, max_retries=0) as client:
        code = await oa.code_tool(client, [lookup])
        told = await code.on_invoke_tool(ctx, arguments)
        assert told == "The service did not run the script: 422 limit-exceeded: detail of limit-exceeded"
        assert await code.on_invoke_tool(ctx, "[1]") == "The argument `script` (a string of Python code) is missing."
    http = httpx.AsyncClient(base_url="http://t", transport=refusing(401, "unauthorized"))
    async with AsyncClient("http://t", "tok", http=http, max_retries=0) as client:
        code = await oa.code_tool(client, [lookup])
        with pytest.raises(UnauthorizedError):
            await code.on_invoke_tool(ctx, arguments)
    sync_http = httpx.Client(base_url="http://t", transport=refusing(429, "quota-exceeded"))
    with Client("http://t", "tok", http=sync_http, max_retries=0) as sync_client:
        assert lc.PtcCodeTool(client=sync_client, tools=[search]).invoke({"script": "print(1)"}) == (
            "The service did not run the script: 429 quota-exceeded: detail of quota-exceeded"
        )


def test_two_tools_of_one_name_are_refused() -> None:
    with pytest.raises(ValueError, match="lookup: two tools with this name"):
        oa.manifest_of([lookup, function_tool(lambda key: key, name_override="lookup")])
    with pytest.raises(ValueError, match="search: two tools with this name"):
        lc.manifest_of([search, search])


def test_langchain_a_script_cannot_set_an_injected_argument() -> None:
    """An ``InjectedToolArg`` is the application's to set: it is not in the manifest's schema, and a script that
    passes it anyway (the broker refuses it unless the schema sets ``additionalProperties``; the adapter holds
    whatever the schema says) gets a ``ToolError``; the tool is not run."""
    ran: list[str] = []

    @tool
    def transfer(amount: int, user_id: Annotated[str, InjectedToolArg]) -> str:
        """Move money from the user's account."""
        ran.append(user_id)
        return f"{user_id} pays {amount}"

    calls = [{"call_id": "c1", "tool": "transfer", "args": {"amount": 5, "user_id": "victim"}}]
    service = ScriptedService(calls, {"status": "succeeded", "exit_code": 0, "stdout": "ok\n"})
    http = httpx.Client(base_url="http://t", transport=httpx.MockTransport(service))
    with Client("http://t", "tok", http=http) as client:
        code = lc.PtcCodeTool(client=client, tools=[transfer])
        assert set(service_parameters(code)["properties"]) == {"amount"}
        assert code.invoke({"script": "import tools"}) == "ok\n"
    assert ran == []
    assert service.answers["c1"] == {
        "error": {"type": "TypeError", "message": "transfer: unexpected argument(s) user_id"}
    }


async def test_langchain_async_a_script_cannot_set_an_injected_argument() -> None:
    @tool
    async def transfer(amount: int, user_id: Annotated[str, InjectedToolArg]) -> str:
        """Move money from the user's account."""
        return f"{user_id} pays {amount}"

    calls = [{"call_id": "c1", "tool": "transfer", "args": {"amount": 5, "user_id": "victim"}}]
    service = ScriptedService(calls, {"status": "succeeded", "exit_code": 0, "stdout": "ok\n"})
    http = httpx.AsyncClient(base_url="http://t", transport=httpx.MockTransport(service))
    async with AsyncClient("http://t", "tok", http=http) as client:
        code = await lc.PtcCodeTool.acreate(async_client=client, tools=[transfer])
        assert await code.ainvoke({"script": "import tools"}) == "ok\n"
    assert service.answers["c1"]["error"]["type"] == "TypeError"


def service_parameters(code: lc.PtcCodeTool) -> dict[str, Any]:
    (entry,) = lc.manifest_of(code.tools)
    return dict(entry["parameters"])


class RefusingLargeAnswers(ScriptedService):
    """A ScriptedService whose call answers larger than ``limit`` bytes get the service's ``413``."""

    limit = 4096

    def __call__(self, request: httpx.Request) -> httpx.Response:
        if request.url.path.startswith("/jobs/job_1/calls/") and len(request.content) > self.limit:
            body = {"type": PROBLEM_PREFIX + "payload-too-large", "title": "Request body too large", "status": 413}
            return httpx.Response(413, json=body, headers={"content-type": "application/problem+json"})
        return super().__call__(request)


async def test_a_tool_answer_the_service_refuses_reaches_the_script_as_an_error() -> None:
    """A script that makes a tool return more than the service takes (``413``) neither crashes the agent's run nor
    leaves its call pending until the job's timeout: the call is answered with an ``AnswerRefused`` error."""

    @function_tool
    def repeat(text: str, times: int) -> str:
        """Repeat a text."""
        return text * times

    calls = [{"call_id": "c1", "tool": "repeat", "args": {"text": "x", "times": 100_000}}]
    final = {"status": "succeeded", "exit_code": 0, "stdout": "handled\n"}
    service = RefusingLargeAnswers(calls, final)
    http = httpx.AsyncClient(base_url="http://t", transport=httpx.MockTransport(service))
    async with AsyncClient("http://t", "tok", http=http, max_retries=0) as client:
        code = await oa.code_tool(client, [repeat])
        ctx: ToolContext[Any] = ToolContext(None, tool_name="run_python", tool_call_id="c", tool_arguments="{}")
        assert await code.on_invoke_tool(ctx, json.dumps({"script": "import tools"})) == "handled\n"
    assert service.answers["c1"] == {
        "error": {"type": "AnswerRefused", "message": "the service refused this tool's answer: 413 payload-too-large"}
    }
    # The synchronous client (LangChain's invoke, smolagents) alike.
    service = RefusingLargeAnswers(
        [{"call_id": "c1", "tool": "search", "args": {"query": "q" * 100, "top_k": 100}}], final
    )
    with Client("http://t", "tok", http=httpx.Client(base_url="http://t", transport=httpx.MockTransport(service))) as c:
        assert lc.PtcCodeTool(client=c, tools=[search]).invoke({"script": "import tools"}) == "handled\n"
    assert service.answers["c1"]["error"]["type"] == "AnswerRefused"


async def test_a_cancelled_agent_run_stops_its_job() -> None:
    """Cancelling the agent's run while its script waits on a tool (the SDK cancels the code tool's task) stops the
    job, instead of leaving it and its sandbox until its ``timeout_s``."""
    started = asyncio.Event()

    @function_tool
    async def slow(key: str) -> str:
        """Never answers."""
        started.set()
        await asyncio.Event().wait()
        return key

    service = ScriptedService([{"call_id": "c1", "tool": "slow", "args": {"key": "k"}}], {"status": "succeeded"})
    stopped: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/jobs/job_1/stop":
            stopped.append(request.method)
            return httpx.Response(200, json={"job_id": "job_1", "status": "stopped"})
        return service(request)

    http = httpx.AsyncClient(base_url="http://t", transport=httpx.MockTransport(handler))
    async with AsyncClient("http://t", "tok", http=http) as client:
        code = await oa.code_tool(client, [slow])
        ctx: ToolContext[Any] = ToolContext(None, tool_name="run_python", tool_call_id="c", tool_arguments="{}")

        async def invoke() -> Any:
            return await code.on_invoke_tool(ctx, json.dumps({"script": "import tools"}))

        run = asyncio.create_task(invoke())
        await started.wait()
        run.cancel()
        with pytest.raises(asyncio.CancelledError):
            await run
    assert stopped == ["POST"]
