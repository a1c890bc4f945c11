"""OCI runtimes: sandboxes really run under the configured one (runc, gVisor), and see nothing of the host.

The hostile-script tests of ``test_bad_input.py``, ``test_jobs.py`` and
``sandbox/test_docker.py`` run under both runtimes through the ``runtime``
fixtures of ``conftest.py``; this module adds what only a runtime can show.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import docker
import httpx
import pytest

from tests.conftest import Service, execute, labelled_containers, start_service, wait_until


def test_sandboxes_run_under_the_configured_runtime(
    runtime: str, runtime_api: httpx.Client, runtime_service: Service, engine: docker.DockerClient
) -> None:
    script = "import time\nprint('up', flush=True)\ntime.sleep(60)\n"
    job = runtime_api.post("/execute", json={"script": script, "wait_s": 0}).json()
    try:
        wait_until(lambda: runtime_api.get(f"/jobs/{job['job_id']}").json()["stdout"] == "up\n", 20)
        container = engine.containers.get(runtime_api.get(f"/jobs/{job['job_id']}").json()["sandbox_id"])
        assert container.attrs["HostConfig"]["Runtime"] == runtime
        pooled = labelled_containers(engine, runtime_service.instance_id, include_pool=True)
        assert {c.attrs["HostConfig"]["Runtime"] for c in pooled} == {runtime}  # the warm pool's too
    finally:
        stopped = runtime_api.post(f"/jobs/{job['job_id']}/stop").json()
    assert stopped["status"] == "stopped"


def test_sandbox_sees_only_its_own_processes_and_cannot_reach_the_service(
    runtime_api: httpx.Client, runtime_service: Service
) -> None:
    port = runtime_service.url.rsplit(":", 1)[1]
    script = f"""
import os, socket
cmdlines = [open(f"/proc/{{p}}/cmdline", "rb").read() for p in os.listdir("/proc") if p.isdigit()]
print("processes", len(cmdlines))
print("host processes", [c for c in cmdlines if b"dockerd" in c or b"containerd" in c or b"service" in c])
print("engine socket", os.path.exists("/var/run/docker.sock") or os.path.exists("/run/docker.sock"))
try:
    socket.create_connection(("127.0.0.1", {port}), timeout=2)
    print("service: reachable")
except OSError:
    print("service: unreachable")
print("run dir", sorted(os.listdir("/run/ptc")))
"""
    view = execute(runtime_api, script)
    lines = view["stdout"].splitlines()
    assert int(lines[0].split()[1]) <= 4, view["stdout"]  # init, the runtime, the script: nothing of the host
    assert lines[1:4] == ["host processes []", "engine socket False", "service: unreachable"], view["stdout"]
    assert "tools.sock" in lines[4]


def test_readyz_names_a_runtime_the_engine_lacks(engine: docker.DockerClient, scratch: Path) -> None:
    svc = start_service(
        "pytest-no-runtime",
        scratch / "no-runtime",
        probe="/healthz",
        PTC_RUNTIME="ptc-no-such-runtime",
        PTC_WARM_POOL_SIZE="0",
    )
    try:
        response = httpx.get(f"{svc.url}/readyz", timeout=10)
        assert response.status_code == 503
        assert "no runtime 'ptc-no-such-runtime'" in response.json()["detail"]
        with svc.client() as api:
            answer = api.post("/execute", json={"script": "print(1)"})
        view = answer.json()
        assert (answer.status_code, view["status"], view["error"]["type"]) == (200, "failed", "sandbox_error")
        assert "Unknown runtime" in view["error"]["message"]
        assert labelled_containers(engine, svc.instance_id, include_pool=True) == []
    finally:
        svc.stop()


@pytest.mark.parametrize("session", [False, True], ids=["one-shot", "session"])
def test_the_mount_table_shows_no_host_path_of_the_work_dir(
    runtime_api: httpx.Client, runtime_service: Service, session: bool
) -> None:
    body: dict[str, Any] = {}
    if session:
        created = runtime_api.post("/sessions", json={})
        assert created.status_code == 201, created.text
        body["session_id"] = created.json()["session_id"]
    try:
        view = execute(runtime_api, "print(open('/proc/self/mountinfo').read())", **body)
    finally:
        if session:
            runtime_api.delete(f"/sessions/{body['session_id']}")
    mounts = view["stdout"]
    assert " /run/ptc " in mounts, mounts
    for path in {str(runtime_service.work_dir), str(runtime_service.work_dir.resolve())}:
        assert path not in mounts, mounts
