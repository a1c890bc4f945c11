"""Deployment: gVisor set-up in deploy/local.sh, the Compose file, the Kubernetes manifests, the service image.

- ``deploy/local.sh engine`` is run against a fake ``docker``/``dockerd`` pair (a PATH of stand-ins and a
  temporary daemon.json), so its fresh-machine and reload paths are exercised without touching the engine.
- The Compose file is checked with ``docker compose config`` (or Debian's ``docker-compose``), and its
  service part is built (offline: wheels from deploy/build-service-image.sh) and started for real.
- The Kubernetes manifests are checked against the Kubernetes JSON schemas bundled by
  ``kubernetes-validate`` (strict: unknown fields fail), and against each other (selectors, ports, names).
"""

from __future__ import annotations

import hashlib
import os
import secrets
import shutil
import socket
import subprocess
from pathlib import Path

import docker
import httpx
import pytest

from tests.conftest import IMAGE, ROOT, free_port, in_ci, labelled_containers, missing, script_uids, wait_until
from tests.unit.test_deploy import clean_env, compose_command


def _base_image(engine: docker.DockerClient) -> str:
    for candidate in ("ptc-sandbox-base:bookworm", "python:3.12-slim"):
        try:
            engine.images.get(candidate)
            return candidate
        except docker.errors.ImageNotFound:
            continue
    problem = "no base image (sandbox_image/build.sh --base offline makes ptc-sandbox-base:bookworm)"
    if in_ci():
        pytest.fail(problem)
    pytest.skip(problem)


def test_compose_stack_builds_starts_and_executes(engine: docker.DockerClient, scratch: Path) -> None:
    compose = compose_command()
    base = _base_image(engine)
    token = secrets.token_hex(4)
    project, instance = f"ptc-test-{token}", f"pytest-compose-{token}"
    service_image, sandbox_image = f"ptc-sandbox:test-{token}", f"{IMAGE.split(':')[0]}:compose-{token}"
    work_dir, port, api_key = scratch / f"compose-{token}", free_port(), secrets.token_urlsafe(24)
    env = clean_env(
        PTC_BASE_IMAGE=base,
        PTC_SERVICE_IMAGE=service_image,
        PTC_SANDBOX_IMAGE=sandbox_image,
        PTC_WORK_DIR=str(work_dir),
        PTC_PORT=str(port),
        PTC_INSTANCE_ID=instance,
        PTC_DOCKER_GID=str(os.stat("/var/run/docker.sock").st_gid),
        PTC_API_KEYS=f"pytest:{hashlib.sha256(api_key.encode()).hexdigest()}",
        PTC_WARM_POOL_SIZE="1",
    )

    def run(*args: str, timeout: float) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [*compose, "-p", project, "-f", str(ROOT / "docker-compose.yml"), *args],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    wheels = subprocess.run(
        [str(ROOT / "deploy" / "build-service-image.sh"), "--wheels-only", base],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert wheels.returncode == 0, wheels.stderr
    try:
        built = run("build", timeout=600)
        assert built.returncode == 0, built.stdout + built.stderr
        started = run("up", "-d", "ptc-sandbox", timeout=180)
        assert started.returncode == 0, started.stdout + started.stderr
        url = f"http://127.0.0.1:{port}"

        def ready() -> bool:
            try:
                return httpx.get(f"{url}/readyz", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        wait_until(ready, 60, 0.5)
        headers = {"Authorization": f"Bearer {api_key}"}
        script = "import os, tools\nprint(os.getuid(), tools.t(x=1)['args'])\n"
        tools = [{"name": "t", "parameters": {"properties": {"x": {"type": "integer"}}}, "endpoint": {"kind": "echo"}}]
        answer = httpx.post(f"{url}/execute", json={"script": script, "tools": tools}, headers=headers, timeout=60)
        assert answer.status_code == 200, answer.text
        view = answer.json()
        uid, _, args = view["stdout"].partition(" ")
        assert (view["status"], args) == ("succeeded", "{'x': 1}\n"), view
        assert int(uid) in script_uids(engine, sandbox_image), view  # the sandbox's own uid
        assert [c["status"] for c in view["calls"]] == ["ok"]

        [container] = engine.containers.list(filters={"label": f"com.docker.compose.project={project}"})
        attrs = container.attrs
        assert attrs["Config"]["User"] == "10002:10002"  # the image's non-root user
        assert attrs["HostConfig"]["NetworkMode"] == "host" and attrs["HostConfig"]["ReadonlyRootfs"] is True
        assert engine.networks.list(names=[f"{project}_default"]) == []
        cid = str(container.id)
        wait_until(lambda: engine.containers.get(cid).attrs["State"]["Health"]["Status"] == "healthy", 45, 1)
        assert work_dir.stat().st_uid == 10002 and work_dir.stat().st_mode & 0o777 == 0o700
    finally:
        down = run("down", "--timeout", "10", timeout=120)
        for left in labelled_containers(engine, instance, include_pool=True):
            left.remove(force=True)
        for tag in (service_image, sandbox_image):
            try:
                engine.images.remove(tag)
            except docker.errors.APIError:
                pass
        shutil.rmtree(work_dir, ignore_errors=True)
    assert down.returncode == 0, down.stderr
    assert engine.containers.list(all=True, filters={"label": f"com.docker.compose.project={project}"}) == []


REPLICAS_PORTS = (8080, 8081, 8082, 5433)  # the balancer, the replicas, the store: deploy/local.sh's defaults


def _port_in_use(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def test_local_sh_replicas_up_job_through_balancer_down(engine: docker.DockerClient, scratch: Path) -> None:
    """``deploy/local.sh replicas`` end to end: images, env file, store, two replicas, HAProxy on 127.0.0.1:8080;
    a job through the balancer is the same job on both replicas; a tool call aimed at the balancer is refused
    (``egress_denied``: the default egress names the demo tool server only); ``down`` leaves no container behind.

    1.75 to 4 minutes with the store and balancer images cached (most of it building the service image), about 1
    to 3 more from nothing (deploy/replicas/build-images.sh), on a 2-core machine (docs/operations.md, Deployment:
    Replicas). Uses the fixed ports 8080-8082 and 5433 of the profile: skipped when one is taken."""
    busy = [port for port in REPLICAS_PORTS if _port_in_use(port)]
    if busy:
        missing(f"ports in use on 127.0.0.1: {busy}")
    token = secrets.token_hex(4)
    project, api_key = f"ptc-test-replicas-{token}", secrets.token_urlsafe(24)
    ids = (f"pytest-replica-{token}-1", f"pytest-replica-{token}-2")
    folder = scratch / "replicas"
    env = clean_env(
        PTC_REPLICAS_DIR=str(folder),
        COMPOSE_PROJECT_NAME=project,
        PTC_REPLICA1_ID=ids[0],
        PTC_REPLICA2_ID=ids[1],
        PTC_SERVICE_IMAGE="ptc-sandbox:replicas-test",  # kept: the next run's build is cached
        PTC_SANDBOX_IMAGE=IMAGE,
        PTC_WARM_POOL_SIZE="0",
        PTC_API_KEYS=f"pytest:{hashlib.sha256(api_key.encode()).hexdigest()}",
    )

    def local_sh(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(ROOT / "deploy" / "local.sh"), "replicas", *args],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=900,
        )

    try:
        up = local_sh("up", "--build")  # its tag may hold an older build of this tree
        assert up.returncode == 0, up.stdout + up.stderr
        assert (folder / "replicas.env").stat().st_mode & 0o777 == 0o600
        headers = {"Authorization": f"Bearer {api_key}"}
        ready = httpx.get("http://127.0.0.1:8080/readyz", timeout=10)
        assert ready.status_code == 200, ready.text
        script = "import tools\nprint(tools.t(x=1)['args'])\n"
        tools = [{"name": "t", "parameters": {"properties": {"x": {"type": "integer"}}}, "endpoint": {"kind": "echo"}}]
        answer = httpx.post(
            "http://127.0.0.1:8080/execute", json={"script": script, "tools": tools}, headers=headers, timeout=60
        )
        assert answer.status_code == 200, answer.text
        view = answer.json()
        assert (view["status"], view["stdout"]) == ("succeeded", "{'x': 1}\n"), view
        # The balancer is no destination (the env file names only the demo tool server): no nested /execute.
        assert "PTC_EGRESS_ALLOW=http://127.0.0.1:8765\n" in (folder / "replicas.env").read_text()
        nested = {"name": "lb", "parameters": {"type": "object", "additionalProperties": True},
                  "endpoint": {"kind": "http", "url": "http://127.0.0.1:8080/execute"}}  # fmt: skip
        probe = "import tools\ntry:\n    tools.lb(script='print(1)')\nexcept tools.ToolError as e:\n    print(e.type)\n"
        refused = httpx.post(
            "http://127.0.0.1:8080/execute", json={"script": probe, "tools": [nested]}, headers=headers, timeout=60
        )
        assert refused.status_code == 200 and refused.json()["stdout"] == "egress_denied\n", refused.text
        # The same job, ended, from each replica directly (one ran it, the other reads it from the store).
        for port in (8081, 8082):
            seen = httpx.get(f"http://127.0.0.1:{port}/jobs/{view['job_id']}", headers=headers, timeout=10)
            assert seen.status_code == 200, (port, seen.text)
            assert (seen.json()["status"], seen.json()["stdout"]) == ("succeeded", view["stdout"])
        running = engine.containers.list(filters={"label": f"com.docker.compose.project={project}"})
        services = {c.labels["com.docker.compose.service"] for c in running}
        assert services == {"ptc-sandbox", "ptc-sandbox-2", "store", "balancer"}, services
        assert engine.networks.list(names=[f"{project}_default"]) == []  # host network only
    finally:
        down = local_sh("down")
        for left in engine.containers.list(all=True, filters={"label": f"com.docker.compose.project={project}"}):
            left.remove(force=True)
        for instance in ids:
            for left in labelled_containers(engine, instance, include_pool=True):
                left.remove(force=True)
        shutil.rmtree(folder, ignore_errors=True)
    assert down.returncode == 0, down.stdout + down.stderr
    assert engine.containers.list(all=True, filters={"label": f"com.docker.compose.project={project}"}) == []
    for instance in ids:
        assert labelled_containers(engine, instance, include_pool=True) == []
    assert [port for port in REPLICAS_PORTS if _port_in_use(port)] == []
