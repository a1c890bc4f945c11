"""LangChain adapter (docs/adapters/langchain.md): a ``BaseTool`` that runs the model's Python script in this
service with a list of LangChain tools as client-executed tools, each call answered in this process by the tool's
own ``invoke`` (``ainvoke`` when run asynchronously).

Needs ``langchain-core`` (``pip install 'ptc-sandbox-client[langchain]'``).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from langchain_core.callbacks import AsyncCallbackManagerForToolRun, CallbackManagerForToolRun
from langchain_core.runnables import RunnableConfig
from langchain_core.tools import BaseTool
from langchain_core.utils.function_calling import convert_to_openai_tool
from pydantic import BaseModel, ConfigDict, Field

from .._tools import client_manifest
from ..client import AsyncClient, Client
from ..models import JobView
from ._common import SCRIPT_DESCRIPTION, TOLD_TO_THE_MODEL, describe, job_text, jsonable, problem_text, unique_names

__all__ = ["PtcCodeTool", "ScriptInput", "manifest_of"]


class ScriptInput(BaseModel):
    """The code tool's one argument."""

    script: str = Field(description=SCRIPT_DESCRIPTION)


def _entries(tools: Sequence[BaseTool]) -> dict[str, dict[str, Any]]:
    unique_names([getattr(t, "name", "") for t in tools])
    out: dict[str, dict[str, Any]] = {}
    for tool in tools:
        if not isinstance(tool, BaseTool):
            raise TypeError(f"{tool!r}: only LangChain BaseTools can be called from a script")
        function = convert_to_openai_tool(tool)["function"]
        out[tool.name] = {"description": function.get("description") or tool.name, "parameters": function["parameters"]}
    return out


def _with_doc(func: Callable[..., Any], doc: str) -> Callable[..., Any]:
    func.__doc__ = doc
    return func


def _arguments(name: str, kwargs: dict[str, Any], parameters: dict[str, Any]) -> dict[str, Any]:
    """``kwargs`` (a script's arguments to tool ``name``) when each is a property of the tool's ``parameters`` (its
    ``tool_call_schema``). Raises ``TypeError`` (the script gets ``tools.ToolError``) for any other: an injected
    argument (``InjectedToolArg``, ``InjectedToolCallId``, ...) is left out of the schema because the application
    sets it, never the model. The service's broker refuses unknown keys too, unless the schema sets
    ``additionalProperties`` (a pydantic ``args_schema`` with ``extra="allow"``): this check holds whatever the
    schema says, in the process the injected argument protects."""
    extra = sorted(set(kwargs) - set(parameters.get("properties") or {}))
    if extra:
        raise TypeError(f"{name}: unexpected argument(s) {', '.join(extra)}")
    return kwargs


def _placeholder(doc: str) -> Callable[..., Any]:
    def call(**kwargs: Any) -> Any:
        raise RuntimeError("answered by PtcCodeTool")

    return _with_doc(call, doc)


def manifest_of(tools: Sequence[BaseTool]) -> list[dict[str, Any]]:
    """The manifest the script runs with: per tool ``{"name": tool.name, "description", "parameters"}`` from
    ``convert_to_openai_tool(tool)`` (its ``tool_call_schema``: injected arguments left out) and ``"endpoint":
    {"kind": "client"}``.

    Raises:
        TypeError: an entry is not a ``BaseTool``.
        ValueError: two tools share a name.
    """
    entries = _entries(tools)
    return client_manifest(
        {name: _placeholder(e["description"]) for name, e in entries.items()},
        {name: e["parameters"] for name, e in entries.items()},
    )


class PtcCodeTool(BaseTool):
    """Runs a Python script in ptc-sandbox; the script's ``tools`` module calls ``tools`` (answered here).

    ``PtcCodeTool(client=Client(...), tools=[...])`` fetches the stub usage text for its description with the
    synchronous client; with only an ``AsyncClient`` build it with ``await PtcCodeTool.acreate(async_client=...,
    tools=[...])``. ``_run`` needs ``client`` and invokes each tool with ``invoke``; ``_arun`` uses ``async_client``
    and ``ainvoke`` (else ``_run`` in a worker thread). The result is the script's stdout, or a compact failure text
    (status, exit code, error, stdout and stderr tails). ``execute`` goes to each ``POST /execute`` (``timeout_s``,
    ``limits``, ``image``, ``metadata``, ...); ``on_view`` is called with each job's final view (its ``job_id``,
    status and call records: for logs). A tool that raises gives the script ``tools.ToolError`` (``type`` the
    exception's class name); a tool with ``handle_tool_error`` returns its error text as the result instead. A
    problem the model can act on (``invalid-request``, ``limit-exceeded``, ``queue-full``, ``quota-exceeded``,
    ``engine-unavailable``, ...) is returned as ``The service did not run the script: <status> <name>: <detail>``;
    any other problem raises.
    """

    model_config = ConfigDict(arbitrary_types_allowed=True)

    name: str = "run_python"
    description: str = ""
    args_schema: type[BaseModel] = ScriptInput
    client: Client | None = None
    async_client: AsyncClient | None = None
    tools: list[BaseTool] = Field(default_factory=list)
    execute: dict[str, Any] = Field(default_factory=dict)
    wait_s: float = 30.0
    intro: str | None = None
    on_view: Callable[[JobView], object] | None = None

    def __init__(self, **data: Any) -> None:
        """As the pydantic model; when ``description`` is not given it is built from ``POST /stubs`` with
        ``client`` (a ``ValueError`` without one: use :meth:`acreate`)."""
        super().__init__(**data)
        if not self.description:
            if self.client is None:
                raise ValueError("PtcCodeTool needs client= to fetch its description, or use PtcCodeTool.acreate")
            self.description = describe(self.client.stubs(tools=manifest_of(self.tools)), self.intro)

    @classmethod
    async def acreate(cls, *, async_client: AsyncClient, tools: Sequence[BaseTool], **data: Any) -> PtcCodeTool:
        """A ``PtcCodeTool`` whose description is fetched with ``async_client`` (``POST /stubs``)."""
        stubs = await async_client.stubs(tools=manifest_of(tools))
        data.setdefault("description", describe(stubs, data.get("intro")))
        return cls(async_client=async_client, tools=list(tools), **data)

    def _run(self, script: str, run_manager: CallbackManagerForToolRun | None = None) -> str:
        if self.client is None:
            raise ValueError("PtcCodeTool without client= runs only asynchronously (ainvoke)")
        config = RunnableConfig(callbacks=run_manager.get_child()) if run_manager else None
        entries = _entries(self.tools)

        def answer(tool: BaseTool) -> Callable[..., Any]:
            def call(**kwargs: Any) -> Any:
                return jsonable(tool.invoke(_arguments(tool.name, kwargs, entries[tool.name]["parameters"]), config))

            return _with_doc(call, entries[tool.name]["description"])

        try:
            view = self.client.run_with_tools(
                script,
                {t.name: answer(t) for t in self.tools},
                schemas={name: e["parameters"] for name, e in entries.items()},
                wait_s=self.wait_s,
                **self.execute,
            )
        except TOLD_TO_THE_MODEL as error:
            return problem_text(error)
        if self.on_view is not None:
            self.on_view(view)
        return job_text(view)

    async def _arun(self, script: str, run_manager: AsyncCallbackManagerForToolRun | None = None) -> str:
        if self.async_client is None:
            return str(await super()._arun(script, run_manager=run_manager))
        config = RunnableConfig(callbacks=run_manager.get_child()) if run_manager else None
        entries = _entries(self.tools)

        def answer(tool: BaseTool) -> Callable[..., Awaitable[Any]]:
            async def call(**kwargs: Any) -> Any:
                arguments = _arguments(tool.name, kwargs, entries[tool.name]["parameters"])
                return jsonable(await tool.ainvoke(arguments, config))

            return _with_doc(call, entries[tool.name]["description"])

        try:
            view = await self.async_client.run_with_tools(
                script,
                {t.name: answer(t) for t in self.tools},
                schemas={name: e["parameters"] for name, e in entries.items()},
                wait_s=self.wait_s,
                **self.execute,
            )
        except TOLD_TO_THE_MODEL as error:
            return problem_text(error)
        if self.on_view is not None:
            self.on_view(view)
        return job_text(view)
