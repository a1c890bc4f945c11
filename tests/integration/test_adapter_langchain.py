"""The LangChain adapter (``ptc_sandbox_client.adapters.langchain.PtcCodeTool``) with the real ``langchain-core``
and ``langchain`` packages: a scripted chat model from ``langchain_core.language_models.fake_chat_models``
"writes" a script that fans out over three tools, ``langchain.agents.create_agent`` (the LangGraph agent loop) runs
it, the script runs in a real sandbox through the real service, each tool runs here in the agent process with the
exact arguments, and the final answer and the job's call records are exact; sync (``invoke``, ``Client``) and async
(``ainvoke``, ``AsyncClient``). No network, no API key."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from langchain.agents import create_agent
from langchain_core.callbacks import CallbackManagerForLLMRun
from langchain_core.language_models.fake_chat_models import FakeMessagesListChatModel
from langchain_core.messages import AIMessage, BaseMessage, ToolMessage
from langchain_core.outputs import ChatGeneration, ChatResult
from langchain_core.runnables import Runnable
from langchain_core.tools import BaseTool, tool
from ptc_sandbox_client import AsyncClient, Client, JobView
from ptc_sandbox_client.adapters.langchain import PtcCodeTool

from tests.conftest import Service
from tests.integration.client_examples import POPULATION, RECORDS, SCRIPT, STDOUT, WEATHER, load_example


class ScriptedChatModel(FakeMessagesListChatModel):
    """LangChain's ``FakeMessagesListChatModel`` (its responses in order) that accepts ``bind_tools`` (as the agent
    loop asks) and fills ``{tool_output}`` in a response with the last tool message's content."""

    def bind_tools(self, tools: Sequence[Any], **kwargs: Any) -> Runnable[Any, AIMessage]:
        return self

    def _generate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        response = self.responses[self.i]
        self.i += 1
        if isinstance(response.content, str) and "{tool_output}" in response.content:
            last = next(m for m in reversed(messages) if isinstance(m, ToolMessage))
            response = AIMessage(content=response.content.format(tool_output=last.content))
        return ChatResult(generations=[ChatGeneration(message=response)])


def scripted_model() -> ScriptedChatModel:
    return ScriptedChatModel(
        responses=[
            AIMessage(content="", tool_calls=[{"name": "run_python", "args": {"script": SCRIPT}, "id": "call_script"}]),
            AIMessage(content="Report:\n{tool_output}"),
        ],
    )


def make_tools(seen: list[tuple[str, dict[str, Any], int]], coroutine: bool) -> list[BaseTool]:
    """Three tools that note each call; with ``coroutine`` get_population is a coroutine function (LangChain
    invokes such a tool only asynchronously)."""

    @tool
    def get_weather(city: str) -> dict[str, Any]:
        """The current weather of a city."""
        seen.append(("get_weather", {"city": city}, os.getpid()))
        return {"city": city, "temp_c": WEATHER[city]}

    def population(city: str) -> int:
        seen.append(("get_population", {"city": city}, os.getpid()))
        return POPULATION[city]

    @tool
    def get_population(city: str) -> int:
        """The population of a city."""
        return population(city)

    @tool("get_population")
    async def aget_population(city: str) -> int:
        """The population of a city."""
        return population(city)

    @tool
    def format_report(city: str, temp_c: int, population: int) -> str:
        """One line of the report."""
        seen.append(("format_report", {"city": city, "temp_c": temp_c, "population": population}, os.getpid()))
        return f"{city}: {temp_c} C, {population} people"

    return [get_weather, aget_population if coroutine else get_population, format_report]


def expected_calls() -> list[tuple[str, dict[str, Any], int]]:
    pid = os.getpid()
    return [
        ("get_weather", {"city": "Oslo"}, pid),
        ("get_population", {"city": "Oslo"}, pid),
        ("format_report", {"city": "Oslo", "temp_c": 4, "population": 709_000}, pid),
        ("get_weather", {"city": "Lima"}, pid),
        ("get_population", {"city": "Lima"}, pid),
        ("format_report", {"city": "Lima", "temp_c": 19, "population": 10_092_000}, pid),
    ]


def check_description(code: PtcCodeTool) -> None:
    for signature in ("def get_weather(city: str)", "def get_population(city: str)", "def format_report("):
        assert signature in code.description, code.description
    assert "import tools" in code.description


def test_an_agent_fans_out_over_three_tools_sync(service: Service) -> None:
    seen: list[tuple[str, dict[str, Any], int]] = []
    views: list[JobView] = []
    with Client(service.url, service.token, timeout=120) as client:
        code = PtcCodeTool(
            client=client, tools=make_tools(seen, False), on_view=views.append, execute={"timeout_s": 60}
        )
        check_description(code)
        model = scripted_model()
        agent = create_agent(model, tools=[code], system_prompt="Answer with a script.")
        state = agent.invoke({"messages": [{"role": "user", "content": "Compare Oslo and Lima."}]})
        assert state["messages"][-1].content == "Report:\n" + STDOUT
        assert model.i == 2
        tool_message = state["messages"][-2]
        assert isinstance(tool_message, ToolMessage) and tool_message.content == STDOUT
        assert seen == expected_calls()
        (view,) = views
        job = client.get(view.job_id)
    assert job.status == "succeeded" and job.stdout == STDOUT, job
    assert [(c.seq, c.tool, c.args, c.status, c.result) for c in job.call_records] == RECORDS


async def test_an_agent_fans_out_over_three_tools_async(service: Service) -> None:
    seen: list[tuple[str, dict[str, Any], int]] = []
    views: list[JobView] = []
    async with AsyncClient(service.url, service.token, timeout=120) as client:
        code = await PtcCodeTool.acreate(
            async_client=client, tools=make_tools(seen, True), on_view=views.append, execute={"timeout_s": 60}
        )
        check_description(code)
        model = scripted_model()
        agent = create_agent(model, tools=[code], system_prompt="Answer with a script.")
        state = await agent.ainvoke({"messages": [{"role": "user", "content": "Compare Oslo and Lima."}]})
        assert state["messages"][-1].content == "Report:\n" + STDOUT
        assert seen == expected_calls()
        (view,) = views
        job = await client.get(view.job_id)
    assert job.status == "succeeded" and job.stdout == STDOUT, job
    assert [(c.seq, c.tool, c.args, c.status, c.result) for c in job.call_records] == RECORDS


def test_the_example_with_the_scripted_model(service: Service) -> None:
    """clients/python/examples/langchain_example.py (the program of docs/adapters/langchain.md) with LangChain's
    fake chat model in place of a real one."""
    example = load_example("langchain_example")
    model = scripted_model()
    model.responses[-1] = AIMessage(content="{tool_output}")
    with Client(service.url, service.token, timeout=120) as client:
        agent = example.build_agent(client, model)
        state = agent.invoke({"messages": [{"role": "user", "content": "Report Oslo and Lima."}]})
    assert state["messages"][-1].content == STDOUT
