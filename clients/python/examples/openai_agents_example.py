"""An OpenAI Agents SDK agent whose one tool runs Python in ptc-sandbox: the script calls the agent's three function
tools (answered here, in this process) and only its output goes back to the model (docs/adapters/openai-agents.md).

    pip install -e 'clients/python[openai-agents]'
    PTC_URL=http://127.0.0.1:8080 PTC_TOKEN=... OPENAI_API_KEY=... python openai_agents_example.py

tests/integration/test_adapter_openai_agents.py runs ``build_agent`` with the SDK's scripted model instead.
"""

from __future__ import annotations

import asyncio
import os

from agents import Agent, Model, Runner, function_tool
from ptc_sandbox_client import AsyncClient
from ptc_sandbox_client.adapters.openai_agents import code_tool


@function_tool
def get_weather(city: str) -> dict[str, object]:
    """The current weather of a city."""
    return {"city": city, "temp_c": {"Oslo": 4, "Lima": 19}.get(city, 15)}


@function_tool
def get_population(city: str) -> int:
    """The population of a city."""
    return {"Oslo": 709_000, "Lima": 10_092_000}.get(city, 0)


@function_tool
def format_report(city: str, temp_c: int, population: int) -> str:
    """One line of the report."""
    return f"{city}: {temp_c} C, {population} people"


async def build_agent(client: AsyncClient, model: str | Model = "gpt-4.1-mini") -> Agent:
    """The agent: its only tool is ``run_python``, whose description lists the three tools' stubs."""
    code = await code_tool(client, [get_weather, get_population, format_report], timeout_s=60)
    return Agent(
        name="analyst",
        instructions="Call the tools from one script with run_python, then answer with the script's output.",
        model=model,
        tools=[code],
    )


async def main() -> None:
    async with AsyncClient(os.environ.get("PTC_URL", "http://127.0.0.1:8080"), os.environ.get("PTC_TOKEN")) as client:
        agent = await build_agent(client)
        result = await Runner.run(agent, "Report the weather and population of Oslo and Lima.")
        print(result.final_output)


if __name__ == "__main__":
    asyncio.run(main())
