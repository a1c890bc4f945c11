"""The real service on the real engine with the PostgreSQL job store (``PTC_STORE_URL``, issue 17 point 1): a job
runs end to end; after a restart of the service its view, output and calls come back from PostgreSQL, and a
service on another work dir (another replica) serves its output from PostgreSQL; the store's password appears
nowhere in the log nor in ``/readyz``."""

from __future__ import annotations

import secrets
from pathlib import Path

import docker
import sqlalchemy as sa

from tests.conftest import execute, start_service, stop_clean

SCRIPT = "import tools\nfor i in range(3):\n    print('line', i, tools.t(n=i)['args'], flush=True)\n"
TOOLS = [{"name": "t", "parameters": {"properties": {"n": {"type": "integer"}}}, "endpoint": {"kind": "echo"}}]


def test_a_job_on_postgresql_outlives_a_restart(engine: docker.DockerClient, scratch: Path, postgres_url: str) -> None:
    password = sa.make_url(postgres_url).password
    assert password
    instance = f"pytest-pg-{secrets.token_hex(4)}"
    work_dir = scratch / "pg-store"
    svc = start_service(instance, work_dir, PTC_STORE_URL=postgres_url)
    try:
        with svc.client() as api:
            ready = api.get("/readyz")
            assert ready.status_code == 200, ready.text
            view = execute(api, SCRIPT, TOOLS)
            assert view["status"] == "succeeded", (view["stderr"], view.get("error"))
            output = api.get(f"/jobs/{view['job_id']}/output/stdout").content
    finally:
        stop_clean(engine, svc)
    assert view["stdout"] == "line 0 {'n': 0}\nline 1 {'n': 1}\nline 2 {'n': 2}\n"
    assert output == view["stdout"].encode()

    svc = start_service(instance, work_dir, PTC_STORE_URL=postgres_url)
    try:
        with svc.client() as api:
            again = api.get(f"/jobs/{view['job_id']}").json()
            assert (again["status"], again["stdout"]) == ("succeeded", view["stdout"])
            assert [call["args"] for call in again["calls"]] == [{"n": 0}, {"n": 1}, {"n": 2}]
            assert api.get(f"/jobs/{view['job_id']}/output/stdout").content == output
            assert [job["job_id"] for job in api.get("/jobs").json()["jobs"]] == [view["job_id"]]
            assert password not in api.get("/readyz").text
    finally:
        stop_clean(engine, svc)
    log = svc.log()
    assert "***@127.0.0.1" in log  # the start line names the store, password hidden
    assert password not in log

    other = start_service(f"{instance}-b", scratch / "pg-store-b", PTC_STORE_URL=postgres_url)  # another replica
    try:
        with other.client() as api:
            assert api.get(f"/jobs/{view['job_id']}").json()["stdout"] == view["stdout"]
            assert api.get(f"/jobs/{view['job_id']}/output/stdout").content == output  # from PostgreSQL
    finally:
        stop_clean(engine, other)
