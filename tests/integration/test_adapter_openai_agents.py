"""The OpenAI Agents SDK adapter (``ptc_sandbox_client.adapters.openai_agents``) with the real ``openai-agents``
package: the SDK's own scripted model (``agents.testing.ScriptedModel``) "writes" a script that fans out over three
function tools, ``Runner.run`` runs the agent, the script runs in a real sandbox through the real service, each
tool runs here in the agent process with the exact arguments, and the final answer and the job's call records are
exact. No network: the model is scripted and tracing is disabled."""

from __future__ import annotations

import os
from typing import Any

from agents import Agent, RunContextWrapper, Runner, function_tool, set_tracing_disabled
from agents.testing import ModelCall, ModelStep, ScriptedModel, assistant_message, function_call
from ptc_sandbox_client import AsyncClient, JobView
from ptc_sandbox_client.adapters.openai_agents import code_tool

from tests.conftest import Service
from tests.integration.client_examples import POPULATION, RECORDS, SCRIPT, STDOUT, WEATHER, load_example

set_tracing_disabled(True)


def tool_output(call: ModelCall, call_id: str) -> str:
    """The output the runner gave the model for its function call ``call_id``."""
    for item in call.input:
        if isinstance(item, dict) and item.get("type") == "function_call_output" and item.get("call_id") == call_id:
            return str(item["output"])
    raise AssertionError(f"no output of {call_id} in {call.input!r}")


async def test_an_agent_fans_out_over_three_tools_through_the_service(service: Service) -> None:
    seen: list[tuple[str, dict[str, Any], int, str | None]] = []
    main_pid = os.getpid()

    @function_tool
    def get_weather(ctx: RunContextWrapper[dict[str, str]], city: str) -> dict[str, Any]:
        """The current weather of a city."""
        seen.append(("get_weather", {"city": city}, os.getpid(), ctx.context.get("user")))
        return {"city": city, "temp_c": WEATHER[city]}

    @function_tool
    async def get_population(city: str) -> int:
        """The population of a city."""
        seen.append(("get_population", {"city": city}, os.getpid(), None))
        return POPULATION[city]

    @function_tool
    def format_report(city: str, temp_c: int, population: int) -> str:
        """One line of the report."""
        seen.append(("format_report", {"city": city, "temp_c": temp_c, "population": population}, os.getpid(), None))
        return f"{city}: {temp_c} C, {population} people"

    views: list[JobView] = []
    async with AsyncClient(service.url, service.token, timeout=120) as client:
        code = await code_tool(client, [get_weather, get_population, format_report], on_view=views.append, timeout_s=60)
        model = ScriptedModel(
            [
                [function_call("run_python", {"script": SCRIPT}, call_id="call_script")],
                ModelStep.respond(lambda call: [assistant_message("Report:\n" + tool_output(call, "call_script"))]),
            ]
        )
        agent = Agent(name="analyst", instructions="Answer with a script.", model=model, tools=[code])
        result = await Runner.run(agent, "Compare Oslo and Lima.", context={"user": "ada"})
        model.assert_complete()

        assert result.final_output == "Report:\n" + STDOUT
        # The model was told the stubs it can call.
        assert model.first_call is not None
        (offered,) = model.first_call.tools
        assert offered.name == "run_python"
        description = getattr(offered, "description", "")
        for signature in ("def get_weather(city: str)", "def get_population(city: str)", "def format_report("):
            assert signature in description, description
        assert "import tools" in description
        # Each tool ran here, in the agent process, with the exact arguments (and the run's context).
        assert seen == [
            ("get_weather", {"city": "Oslo"}, main_pid, "ada"),
            ("get_population", {"city": "Oslo"}, main_pid, None),
            ("format_report", {"city": "Oslo", "temp_c": 4, "population": 709_000}, main_pid, None),
            ("get_weather", {"city": "Lima"}, main_pid, "ada"),
            ("get_population", {"city": "Lima"}, main_pid, None),
            ("format_report", {"city": "Lima", "temp_c": 19, "population": 10_092_000}, main_pid, None),
        ]
        # The job's call records, read back through the client.
        (view,) = views
        job = await client.get(view.job_id)
    assert job.status == "succeeded" and job.stdout == STDOUT, job
    assert [(c.seq, c.tool, c.args, c.status, c.result) for c in job.call_records] == RECORDS


async def test_the_example_with_the_scripted_model(service: Service) -> None:
    """clients/python/examples/openai_agents_example.py (the program of docs/adapters/openai-agents.md) with the
    SDK's scripted model in place of a real one."""
    example = load_example("openai_agents_example")
    model = ScriptedModel(
        [
            [function_call("run_python", {"script": SCRIPT}, call_id="call_script")],
            ModelStep.respond(lambda call: [assistant_message(tool_output(call, "call_script"))]),
        ]
    )
    async with AsyncClient(service.url, service.token, timeout=120) as client:
        agent = await example.build_agent(client, model)
        result = await Runner.run(agent, "Report the weather and population of Oslo and Lima.")
    model.assert_complete()
    assert result.final_output == STDOUT
