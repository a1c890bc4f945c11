"""A LangChain agent whose one tool runs Python in ptc-sandbox: the script calls three LangChain tools (answered
here, in this process) and only its output goes back to the model (docs/adapters/langchain.md).

    pip install -e 'clients/python[langchain]' langchain-openai
    PTC_URL=http://127.0.0.1:8080 PTC_TOKEN=... OPENAI_API_KEY=... python langchain_example.py

tests/integration/test_adapter_langchain.py runs ``build_agent`` with LangChain's fake chat model instead.
"""

from __future__ import annotations

import os
from typing import Any

from langchain.agents import create_agent
from langchain.chat_models import init_chat_model
from langchain_core.language_models import BaseChatModel
from langchain_core.tools import tool
from ptc_sandbox_client import Client
from ptc_sandbox_client.adapters.langchain import PtcCodeTool


@tool
def get_weather(city: str) -> dict[str, object]:
    """The current weather of a city."""
    return {"city": city, "temp_c": {"Oslo": 4, "Lima": 19}.get(city, 15)}


@tool
def get_population(city: str) -> int:
    """The population of a city."""
    return {"Oslo": 709_000, "Lima": 10_092_000}.get(city, 0)


@tool
def format_report(city: str, temp_c: int, population: int) -> str:
    """One line of the report."""
    return f"{city}: {temp_c} C, {population} people"


def build_agent(client: Client, model: BaseChatModel) -> Any:
    """The agent (LangChain's ``create_agent``): its only tool is ``run_python``, whose description lists the three
    tools' stubs."""
    code = PtcCodeTool(client=client, tools=[get_weather, get_population, format_report], execute={"timeout_s": 60})
    return create_agent(
        model,
        tools=[code],
        system_prompt="Call the tools from one script with run_python, then answer with the script's output.",
    )


def main() -> None:
    with Client(os.environ.get("PTC_URL", "http://127.0.0.1:8080"), os.environ.get("PTC_TOKEN")) as client:
        agent = build_agent(client, init_chat_model("openai:gpt-4.1-mini"))
        state = agent.invoke(
            {"messages": [{"role": "user", "content": "Report the weather and population of Oslo and Lima."}]}
        )
        print(state["messages"][-1].content)


if __name__ == "__main__":
    main()
