"""JavaScript and TypeScript scripts on the real engine (``language`` on ``/execute`` and ``POST /sessions``): the node
image (``sandbox_image/build.sh --node``, offered as ``node``), the ``tools`` module and globals, the broker's records,
errors and reports, exit codes, sessions, files, and hostile scripts, under runc and gVisor.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import docker
import httpx
import pytest

from tests.conftest import IMAGE, Service, execute, require_runtime, start_service, stop_clean

NODE_IMAGE = os.environ.get("PTC_NODE_IMAGE", "ptc-sandbox-node:latest")
ECHO = {"name": "echo", "parameters": {"properties": {"x": {}}}, "endpoint": {"kind": "echo"}}


def node_images(engine: docker.DockerClient) -> str:
    engine.images.get(NODE_IMAGE)  # present, or the test fails here naming it (deploy/local.sh setup builds it)
    return f"default={IMAGE},node={NODE_IMAGE}"


@pytest.fixture(scope="module", params=("runc", "runsc"))
def js_service(request: pytest.FixtureRequest, engine: docker.DockerClient, scratch: Path) -> Iterator[Service]:
    """A service offering the node image, its sandboxes under runc, then gVisor (each test runs under both)."""
    runtime: str = request.param
    require_runtime(engine, runtime)
    svc = start_service(
        f"pytest-js-{runtime}-{secrets.token_hex(3)}",
        scratch / f"svc-js-{runtime}",
        PTC_IMAGES=node_images(engine),
        PTC_RUNTIME=runtime,
        PTC_WARM_POOL_SIZE="1",
    )
    yield svc
    stop_clean(engine, svc)


@pytest.fixture(scope="module")
def js(js_service: Service) -> Iterator[httpx.Client]:
    with js_service.client() as client:
        yield client


def run_js(api: httpx.Client, script: str, tools: list[dict[str, Any]] | None = None, **body: Any) -> dict[str, Any]:
    return execute(api, script, tools, **{"language": "javascript", **body})


def test_console_log_and_one_tool_call(js: httpx.Client) -> None:
    script = 'import tools from "tools";\nconst r = await tools.echo({ x: 41 });\nconsole.log(JSON.stringify(r));\n'
    view = run_js(js, script, [ECHO])
    assert view["status"] == "succeeded", view
    assert view["language"] == "javascript" and view["image"] == "node"
    assert view["stdout"] == '{"tool":"echo","args":{"x":41}}\n'
    assert [(c["tool"], c["args"], c["status"]) for c in view["calls"]] == [("echo", {"x": 41}, "ok")]
