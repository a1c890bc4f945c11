"""OpenAI Agents SDK adapter (docs/adapters/openai-agents.md): a ``FunctionTool`` that runs the model's Python script
in this service with the agent's other function tools as client-executed tools, each call answered in the agent
process by the tool's own ``on_invoke_tool``.

Needs ``openai-agents`` (``pip install 'ptc-sandbox-client[openai-agents]'``).
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from agents import FunctionTool
from agents.tool_context import ToolContext
from openai.types.responses import ResponseFunctionToolCall

from .._tools import client_manifest
from ..client import AsyncClient
from ..models import JobView
from ._common import (
    SCRIPT_DESCRIPTION,
    TOLD_TO_THE_MODEL,
    describe,
    job_text,
    jsonable,
    problem_text,
    script_of,
    unique_names,
)

__all__ = ["code_tool", "manifest_of"]


def _check(tool: object) -> FunctionTool:
    if not isinstance(tool, FunctionTool):
        raise TypeError(f"{tool!r}: only FunctionTools can be called from a script")
    if tool.needs_approval is not False or tool.tool_input_guardrails or tool.tool_output_guardrails:
        # The runner applies these, not on_invoke_tool: calling the tool from a script would bypass them.
        raise ValueError(f"{tool.name}: a tool with needs_approval or tool guardrails cannot be called from a script")
    return tool


def _placeholder(tool: FunctionTool) -> Callable[..., Any]:
    def call(**kwargs: Any) -> Any:
        raise RuntimeError(f"{tool.name} is answered by the code tool")

    call.__doc__ = tool.description or tool.name
    return call


def manifest_of(tools: Sequence[FunctionTool]) -> list[dict[str, Any]]:
    """The manifest the script runs with: per tool ``{"name", "description", "parameters":
    tool.params_json_schema, "endpoint": {"kind": "client"}}``.

    Raises:
        TypeError: a tool is not a ``FunctionTool``.
        ValueError: two tools share a name, or a tool has ``needs_approval`` or tool guardrails (the runner's,
            which a script's call would bypass).
    """
    checked = [_check(t) for t in tools]
    unique_names([t.name for t in checked])
    return client_manifest({t.name: _placeholder(t) for t in checked}, {t.name: t.params_json_schema for t in checked})


async def code_tool(
    client: AsyncClient,
    tools: Sequence[FunctionTool],
    *,
    name: str = "run_python",
    description: str | None = None,
    wait_s: float = 30.0,
    on_view: Callable[[JobView], object] | None = None,
    **execute: Any,
) -> FunctionTool:
    """A ``FunctionTool`` named ``name`` whose one argument ``script`` (a string) runs in this service with ``tools``
    as its ``tools`` module; each call the script makes is answered by invoking that tool here (its
    ``on_invoke_tool`` with a ``ToolContext`` derived from the code tool's, so the tool sees the run's context,
    agent and usage); the pending calls of one moment run concurrently. The model gets the script's stdout, or a
    compact failure text (status, exit code, error, stdout and stderr tails) when it did not succeed.

    The description is ``description`` (or a default) followed by the service's stub usage text and the ``tools``
    module (``POST /stubs``, fetched once here). ``execute`` goes to each ``POST /execute`` (``timeout_s``,
    ``limits``, ``image``, ``metadata``, ...); ``on_view`` is called with each job's final view (its ``job_id``,
    status and call records: for logs). A tool's failure is what its ``on_invoke_tool`` returns (by default
    the SDK's error text, which the script receives as the result; a tool built with
    ``failure_error_function=None`` raises, and the script gets ``tools.ToolError``).

    When the service refuses a script with a problem the model can act on (``invalid-request``,
    ``limit-exceeded``, ``queue-full``, ``quota-exceeded``, ``engine-unavailable``, ...), the model gets
    ``The service did not run the script: <status> <name>: <detail>``; any other problem (a bad key, say) raises.

    Raises:
        TypeError, ValueError: as :func:`manifest_of`.
        ProblemError: the service refused the manifest (``POST /stubs``).
    """
    by_name = {t.name: t for t in tools}
    manifest = manifest_of(tools)
    stubs = await client.stubs(tools=manifest)
    counter = itertools.count(1)

    async def invoke(ctx: ToolContext[Any], arguments: str) -> str:
        script = script_of(arguments)
        if script is None:
            return "The argument `script` (a string of Python code) is missing."

        def answer(tool: FunctionTool) -> Callable[..., Awaitable[Any]]:
            async def call(**kwargs: Any) -> Any:
                payload = json.dumps(kwargs)
                call_id = f"{ctx.tool_call_id}/{next(counter)}"
                inner = ToolContext(
                    ctx.context,
                    ctx.usage,
                    tool.name,
                    call_id,
                    payload,
                    ResponseFunctionToolCall(arguments=payload, call_id=call_id, name=tool.name, type="function_call"),
                    agent=ctx.agent,
                    run_config=ctx.run_config,
                    turn_input=list(ctx.turn_input),
                )
                return jsonable(await tool.on_invoke_tool(inner, payload))

            call.__doc__ = tool.description or tool.name  # the manifest's description, as in manifest_of
            return call

        try:
            view = await client.run_with_tools(
                script,
                {t.name: answer(t) for t in by_name.values()},
                schemas={t.name: t.params_json_schema for t in by_name.values()},
                wait_s=wait_s,
                **execute,
            )
        except TOLD_TO_THE_MODEL as error:
            return problem_text(error)
        if on_view is not None:
            on_view(view)
        return job_text(view)

    return FunctionTool(
        name=name,
        description=describe(stubs, description),
        params_json_schema={
            "type": "object",
            "properties": {"script": {"type": "string", "description": SCRIPT_DESCRIPTION}},
            "required": ["script"],
            "additionalProperties": False,
        },
        on_invoke_tool=invoke,
    )
