"""A smolagents CodeAgent whose code runs in the service (docs/adapters/smolagents.md)."""

import os
from typing import Any

from ptc_sandbox_client import Client
from ptc_sandbox_client.adapters.smolagents import PtcExecutor
from smolagents import CodeAgent, InferenceClientModel, tool


@tool
def get_weather(city: str) -> dict[str, Any]:
    """The weather of a city now.

    Args:
        city: The city's name.
    """
    return {"city": city, "temp_c": {"Oslo": 4, "Lima": 19}.get(city, 12)}


client = Client(os.environ.get("PTC_URL", "http://127.0.0.1:8080"), os.environ.get("PTC_TOKEN"))
model = InferenceClientModel()  # any smolagents model: OpenAIModel, LiteLLMModel, TransformersModel, ...
with CodeAgent(tools=[get_weather], model=model, executor=PtcExecutor(client), verbosity_level=0) as agent:
    print(agent.run("Is it warmer in Oslo or in Lima? Answer with the city's name."))  # Lima
    calls = [(c.tool, c.args) for view in agent.python_executor.views for c in view.call_records]
    print(calls)  # [('get_weather', {'city': 'Oslo'}), ('get_weather', {'city': 'Lima'})]
client.close()
