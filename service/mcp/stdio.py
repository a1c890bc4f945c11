"""``ptc-sandbox mcp``: the MCP server over stdio, forwarding each tool call to a running service over HTTP
(``--url``, ``--token``; or ``PTC_URL``, ``PTC_TOKEN``), so an MCP client that spawns processes (a desktop agent,
an IDE) uses the service as the token's key. The tools are those of ``/mcp`` (``mcp_tools``); a problem+json
answer becomes a tool error ``<problem type>: <detail>``.
"""

from __future__ import annotations

import re
from typing import Any

import httpx
from mcp.server.mcpserver import Context

from service.mcp.server import OperationFailed, build_server

JOB_ID = re.compile(r"[A-Za-z0-9_-]{1,128}")
SUMMARY = {"calls": "summary"}  # call records without arguments or results
CONNECT_TIMEOUT_S = 10.0
READ_TIMEOUT_S = 660.0  # past the largest wait a service allows by default (PTC_MAX_WAIT_S: 300 s)


def _failure(response: httpx.Response) -> OperationFailed:
    """The tool error of a refused request: ``<problem type>: <detail>`` (the type's last path part)."""
    try:
        problem = response.json()
    except ValueError:
        return OperationFailed(f"http-error: HTTP {response.status_code}")
    if not isinstance(problem, dict):
        return OperationFailed(f"http-error: HTTP {response.status_code}")
    name = str(problem.get("type", "http-error")).rsplit("/", 1)[-1]
    return OperationFailed(f"{name}: {problem.get('detail', '')}")


class OverHttp:
    """``mcp_tools.Operations`` on a running service's HTTP API, as the key of ``client``'s bearer token."""

    def __init__(self, client: httpx.AsyncClient) -> None:
        self._client = client

    async def _call(self, method: str, path: str, **kwargs: Any) -> Any:
        """The JSON of a 200/202 answer; raises OperationFailed for any other (or no) answer."""
        try:
            response = await self._client.request(method, path, **kwargs)
        except httpx.HTTPError as exc:
            raise OperationFailed(f"unreachable: {type(exc).__name__}: {exc}") from None
        if response.status_code not in (200, 202):
            raise _failure(response)
        return response.json()

    async def execute(
        self,
        ctx: Context[Any, Any],
        script: str,
        toolset: str | None,
        timeout_s: float | None,
        wait_s: float | None,
    ) -> dict[str, Any]:
        """``POST /execute``."""
        body: dict[str, Any] = {"script": script}
        for name, value in (("toolset", toolset), ("timeout_s", timeout_s), ("wait_s", wait_s)):
            if value is not None:
                body[name] = value
        view: dict[str, Any] = await self._call("POST", "/execute", params=SUMMARY, json=body)
        return view

    async def get(self, ctx: Context[Any, Any], job_id: str) -> dict[str, Any]:
        """``GET /jobs/{id}``."""
        view: dict[str, Any] = await self._call("GET", f"/jobs/{_segment(job_id)}", params=SUMMARY)
        return view

    async def wait(self, ctx: Context[Any, Any], job_id: str, timeout_s: float | None) -> dict[str, Any]:
        """``POST /jobs/{id}/wait``."""
        params: dict[str, Any] = dict(SUMMARY)
        if timeout_s is not None:
            params["timeout_s"] = timeout_s
        view: dict[str, Any] = await self._call("POST", f"/jobs/{_segment(job_id)}/wait", params=params)
        return view

    async def stop(self, ctx: Context[Any, Any], job_id: str) -> dict[str, Any]:
        """``POST /jobs/{id}/stop``."""
        view: dict[str, Any] = await self._call("POST", f"/jobs/{_segment(job_id)}/stop", params=SUMMARY)
        return view

    async def stubs(self, ctx: Context[Any, Any], toolset: str) -> str:
        """``POST /stubs`` with the toolset: its ``module``."""
        answer = await self._call("POST", "/stubs", json={"toolset": toolset})
        return str(answer["module"])


def _segment(job_id: str) -> str:
    """A job id as one path segment; raises OperationFailed (``job-not-found``) for anything but letters, digits,
    ``_`` and ``-`` (the service's ids are ``job_<hex>``): an id with ``/``, ``..`` or ``?`` never reaches another
    route."""
    if not JOB_ID.fullmatch(job_id):
        raise OperationFailed(f"job-not-found: no job {job_id[:80]!r}")
    return job_id


async def serve(url: str, token: str | None, toolset: str | None) -> None:
    """Serve MCP on stdin/stdout until stdin closes, forwarding to the service at ``url`` (warnings and errors
    only on stderr: no line per request)."""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    timeout = httpx.Timeout(READ_TIMEOUT_S, connect=CONNECT_TIMEOUT_S)
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=timeout) as client:
        await build_server(OverHttp(client), toolset, log_level="WARNING").run_stdio_async()
