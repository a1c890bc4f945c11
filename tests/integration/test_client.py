"""The Python client (clients/python, ``ptc_sandbox_client``) against the real service: execute, a background job
streamed and stopped, a session, a client-executed tool answered by a Python callable, a problem raised as a typed
exception, and a real completion callback verified."""

from __future__ import annotations

import base64
import json
import os
import secrets
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import docker
import pytest
from ptc_sandbox_client import (
    AsyncClient,
    Client,
    ConflictError,
    InvalidRequestError,
    NotFoundError,
    verify_callback,
)

from tests.conftest import Service, start_service, wait_until
from tests.receiver import Receiver

P = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}


@pytest.fixture
def client(service: Service) -> Iterator[Client]:
    with Client(service.url, service.token, timeout=120) as c:
        yield c


def test_execute_get_output_and_typed_calls(client: Client) -> None:
    view = client.execute(
        "import tools\nprint(tools.echo_tool(x=1))\nprint('done')",
        tools=[{"name": "echo_tool", "description": "Echo.", "parameters": P, "endpoint": {"kind": "echo"}}],
        wait_s=60,
    )
    assert view.status == "succeeded" and view.exit_code == 0 and view.stdout.endswith("done\n"), view
    assert [(c.tool, c.status) for c in view.call_records] == [("echo_tool", "ok")]
    assert client.get(view.job_id, fields="job_id,status").status == "succeeded"
    assert client.output(view.job_id, "stdout", offset=0, length=3) == view.stdout.encode()[:3]
    toolset = client.register_toolset([{"name": "echo_tool", "parameters": P, "endpoint": {"kind": "echo"}}])
    assert "def echo_tool(" in client.stubs(toolset=toolset["toolset_id"])["module"]
    again = client.execute("import tools\nprint(tools.echo_tool(x=2))", toolset=toolset["toolset_id"], wait_s=60)
    assert again.status == "succeeded" and again.call_records[0].args == {"x": 2}, again


def test_a_background_job_streamed_and_stopped(client: Client) -> None:
    view = client.execute("import time\nfor i in range(600):\n    print(i, flush=True)\n    time.sleep(0.2)", wait_s=0)
    assert not view.ended
    text = ""
    kinds = []
    for event in client.stream(view.job_id):
        kinds.append(event.event)
        if event.event == "stdout":
            text += event.data["text"]
            if "3\n" in text:
                stopped = client.stop(view.job_id)
                assert stopped.status == "stopped"
        if event.event == "end":
            assert event.view is not None and event.view.status == "stopped"
    assert kinds[-1] == "end" and text.startswith("0\n1\n2\n3\n")
    # Resuming after the end event: nothing follows (204).
    assert list(client.stream(view.job_id, last_event_id=last_id(client, view.job_id))) == []


def last_id(client: Client, job_id: str) -> str:
    ids = [e.id for e in client.stream(job_id)]
    last = ids[-1]
    assert last is not None
    return last


def test_a_session_as_a_context_manager_with_files(client: Client) -> None:
    with client.session(idle_timeout_s=120) as session:
        session.put_file("in.txt", "21")
        first = session.execute("n = int(open('/tmp/in.txt').read())\nopen('/tmp/out.txt', 'w').write(str(2 * n))")
        assert first.status == "succeeded", first
        assert session.execute("print(open('/tmp/out.txt').read())").stdout == "42\n"
        assert session.get_file("out.txt") == b"42"
        assert {f.path for f in session.list_files()} >= {"in.txt", "out.txt"}
    assert client.get_session(session.session_id).status == "closed"
    with pytest.raises(ConflictError) as raised:
        session.execute("print(1)")
    assert raised.value.name == "session-ended"


def test_a_client_executed_tool_answered_by_a_python_callable(client: Client) -> None:
    asked: list[tuple[str, int]] = []

    def lookup(city: str, days: int = 1) -> dict[str, object]:
        """Forecast of a city."""
        asked.append((city, days))
        if city == "Atlantis":
            raise LookupError("no such city")
        return {"city": city, "temp": 20 + days}

    script = (
        "import tools\n"
        "print(tools.lookup(city='Oslo', days=2)['temp'])\n"
        "try:\n    tools.lookup(city='Atlantis')\nexcept tools.ToolError as e:\n    print(e.type, e.message)\n"
    )
    view = client.run_with_tools(script, {"lookup": lookup}, wait_s=30)
    assert view.status == "succeeded", view
    assert view.stdout == "22\nLookupError no such city\n"
    assert asked == [("Oslo", 2), ("Atlantis", 1)]
    assert [(c.tool, c.status) for c in view.call_records] == [("lookup", "ok"), ("lookup", "error")]


async def test_the_async_client_runs_tools_and_a_session(service: Service) -> None:
    async def add(a: int, b: int) -> int:
        """Sum."""
        return a + b

    async with AsyncClient(service.url, service.token, timeout=120) as client:
        script = "import asyncio, tools\nasync def main():\n    print(sum(await asyncio.gather("
        script += "*(tools.aio.add(a=i, b=1) for i in range(3)))))\nasyncio.run(main())"
        view = await client.run_with_tools(script, {"add": add})
        assert (view.status, view.stdout) == ("succeeded", "6\n"), view
        async with await client.session() as session:
            await session.put_file("x", b"abc")
            assert (await session.execute("print(open('/tmp/x').read())")).stdout == "abc\n"
        with pytest.raises(NotFoundError):
            await client.get("job_000000000000000000000000")


def test_problems_are_typed_exceptions(client: Client) -> None:
    with pytest.raises(NotFoundError) as missing:
        client.get("job_000000000000000000000000")
    assert (missing.value.status, missing.value.name) == (404, "job-not-found")
    with pytest.raises(InvalidRequestError) as invalid:
        client.execute("print(1)", timeout_s="soon")
    assert invalid.value.status == 422 and invalid.value.detail.startswith("timeout_s")


def test_a_real_callback_verifies(engine: docker.DockerClient, scratch: Path) -> None:
    secret = "whsec_" + base64.b64encode(secrets.token_bytes(32)).decode()
    receiver = Receiver(failures=0)
    svc = start_service(f"pytest-client-cb-{secrets.token_hex(4)}", scratch / "client-cb", PTC_CALLBACK_SECRET=secret)
    try:
        with Client(svc.url, svc.token, timeout=120) as client:
            view = client.execute("print('hi')", callback_url=receiver.url, wait_s=60)
            wait_until(lambda: len(receiver.deliveries) >= 1, 30)
        _, headers, body = receiver.deliveries[0]
        assert json.loads(body)["job_id"] == view.job_id
        assert verify_callback(body, headers, secret)
        assert verify_callback(body, headers, ["whsec_" + base64.b64encode(b"o" * 32).decode(), secret])
        assert not verify_callback(body.replace(b"hi", b"ho"), headers, secret)
        assert not verify_callback(body, headers, "whsec_" + base64.b64encode(b"o" * 32).decode())
    finally:
        svc.stop()
        receiver.close()


def test_the_docs_program_runs(service: Service) -> None:
    """docs/client.md's whole program, run as it is against the test service (its printed lines are its comments)."""
    text = (Path(__file__).resolve().parents[2] / "docs" / "client.md").read_text()
    program = text.split("```python\n", 1)[1].split("```", 1)[0]
    env = {**os.environ, "PTC_URL": service.url, "PTC_TOKEN": service.token}
    done = subprocess.run([sys.executable, "-c", program], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    lines = [line.strip() for line in program.splitlines()]
    expected = [line.split("# ", 1)[1] for line in lines if line.startswith("print") and "# " in line]
    assert done.stdout.splitlines() == expected, done.stdout
