"""Background jobs: wait budget, offsets, wait, stop, listing, durability, backpressure, callbacks, SSE."""

from __future__ import annotations

import base64
import json
import os
import secrets
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import docker
import httpx
import pytest
from standardwebhooks import Webhook
from standardwebhooks.webhooks import WebhookVerificationError

from service.callbacks import SIGNATURE_HEADER, verify
from tests.conftest import Service, container_gone, execute, labelled_containers, start_service, wait_until
from tests.receiver import Receiver, receiver  # noqa: F401

TICKER = "import time\nfor i in range(15):\n    print(f'tick {i}', flush=True)\n    time.sleep(0.2)\n"


def test_wait_zero_answers_202_and_offsets_reassemble_the_output(api: httpx.Client) -> None:
    started = time.monotonic()
    response = api.post("/execute", json={"script": TICKER, "wait_s": 0})
    assert response.status_code == 202
    assert time.monotonic() - started < 1
    job = response.json()
    assert job["status"] in ("queued", "running")
    job_id, offset, pieces, polls = job["job_id"], 0, [], 0
    while True:
        view = api.get(f"/jobs/{job_id}", params={"stdout_offset": offset}).json()
        assert view["stdout_offset"] == offset
        pieces.append(view["stdout"])
        offset = view["stdout_next_offset"]
        polls += 1
        if view["status"] not in ("queued", "running") and offset == view["stdout_bytes"]:
            break
        time.sleep(0.1)
    assert "".join(pieces) == "".join(f"tick {i}\n" for i in range(15))
    assert polls > 3  # it really was read while running
    final = api.post(f"/jobs/{job_id}/wait", params={"timeout_s": 10}).json()
    assert final["status"] == "succeeded"


def test_wait_returns_at_its_timeout_while_the_job_runs_on(api: httpx.Client) -> None:
    job = api.post("/execute", json={"script": "import time\ntime.sleep(2)\nprint('end')", "wait_s": 0.2}).json()
    assert job["status"] in ("queued", "running")
    started = time.monotonic()
    view = api.post(f"/jobs/{job['job_id']}/wait", params={"timeout_s": 0.5}).json()
    assert 0.4 < time.monotonic() - started < 1.5
    assert view["status"] == "running"
    waiters = ThreadPoolExecutor(4)
    views = list(
        waiters.map(lambda _: api.post(f"/jobs/{job['job_id']}/wait", params={"timeout_s": 20}).json(), range(4))
    )
    assert {v["status"] for v in views} == {"succeeded"}
    assert {v["stdout"] for v in views} == {"end\n"}


def test_stop_ends_a_script_that_ignores_sigterm_and_has_a_child(
    runtime_api: httpx.Client, engine: docker.DockerClient
) -> None:
    script = (
        "import signal, subprocess, time\n"
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "child = subprocess.Popen(['sleep', '300'])\n"
        "print('ready', flush=True)\n"
        "while True:\n    time.sleep(1)\n"
    )
    job = runtime_api.post("/execute", json={"script": script, "wait_s": 0}).json()
    wait_until(lambda: runtime_api.get(f"/jobs/{job['job_id']}").json()["stdout"] == "ready\n", 20)
    started = time.monotonic()
    stopped = runtime_api.post(f"/jobs/{job['job_id']}/stop").json()
    assert time.monotonic() - started < 3
    assert stopped["status"] == "stopped"
    assert stopped["error"]["type"] == "stopped"
    wait_until(lambda: container_gone(engine, stopped["sandbox_id"]), 10)
    again = runtime_api.post(f"/jobs/{job['job_id']}/stop")
    assert again.status_code == 200
    assert again.json() == stopped


def test_stop_on_an_ended_job_returns_the_final_view_unchanged(api: httpx.Client) -> None:
    view = execute(api, "print('x')")
    response = api.post(f"/jobs/{view['job_id']}/stop")
    assert response.status_code == 200
    assert response.json() == view


@pytest.mark.parametrize("route", ["/jobs/job_nope", "/jobs/job_nope/events", "/jobs/job_nope/output/stdout"])
def test_unknown_jobs_are_404_problems(api: httpx.Client, route: str) -> None:
    response = api.get(route)
    assert response.status_code == 404
    assert response.headers["content-type"] == "application/problem+json"
    for action in ("wait", "stop"):
        assert api.post(f"/jobs/job_nope/{action}").status_code == 404


def test_full_output_is_kept_past_the_inline_cap_and_read_by_range(api: httpx.Client) -> None:
    script = "import sys\nfor i in range(20000):\n    sys.stdout.write('%09d\\n' % i)\n"
    view = execute(api, script, limits={"output_bytes": 2048})
    assert view["stdout_truncated"] and view["stdout_bytes"] == 200_000 == view["stdout_retained_bytes"]
    raw = api.get(f"/jobs/{view['job_id']}/output/stdout", params={"offset": 100_000, "length": 20}).content
    assert raw == b"000010000\n000010001\n"
    whole = b""
    offset = 0
    while offset < view["stdout_bytes"]:
        page = api.get(f"/jobs/{view['job_id']}", params={"stdout_offset": offset}).json()
        whole += page["stdout"].encode()
        offset = page["stdout_next_offset"]
    assert whole == b"".join(b"%09d\n" % i for i in range(20000))


def test_list_filters_and_pages(api: httpx.Client) -> None:
    marker = secrets.token_hex(4)
    ids = [execute(api, f"print({i})", metadata={"marker": marker})["job_id"] for i in range(3)]
    failed = execute(api, "raise SystemExit(2)", metadata={"marker": marker})["job_id"]
    created_after = api.get(f"/jobs/{ids[0]}").json()["created_at"]
    first = api.get("/jobs", params={"created_after": created_after, "limit": 2}).json()
    assert [j["job_id"] for j in first["jobs"]] == [failed, ids[2]]
    second = api.get("/jobs", params={"created_after": created_after, "limit": 2, "cursor": first["next_cursor"]})
    assert [j["job_id"] for j in second.json()["jobs"]] == [ids[1]]
    assert second.json()["next_cursor"] is None
    only_failed = api.get("/jobs", params={"status": "failed", "created_after": created_after}).json()
    assert [j["job_id"] for j in only_failed["jobs"]] == [failed]
    assert only_failed["jobs"][0]["exit_code"] == 2 and only_failed["jobs"][0]["metadata"] == {"marker": marker}
    assert api.get("/jobs", params={"cursor": "garbage"}).status_code == 422
    assert api.get("/jobs", params={"status": "nonsense"}).status_code == 422


def test_events_stream_shows_every_call_and_the_final_status(api: httpx.Client) -> None:
    tools = [{"name": "ping", "parameters": {"properties": {"i": {"type": "integer"}}}, "endpoint": {"kind": "echo"}}]
    script = (
        "import time, tools\nfor i in range(5):\n    tools.ping(i=i)\n    print(i, flush=True)\n    time.sleep(0.2)\n"
    )
    job = api.post("/execute", json={"script": script, "tools": tools, "wait_s": 0}).json()
    events: list[tuple[str, Any]] = []
    with api.stream("GET", f"/jobs/{job['job_id']}/events", timeout=30) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        event = None
        for line in response.iter_lines():
            if line.startswith("event:"):
                event = line.split(":", 1)[1].strip()
            elif line.startswith("data:") and event:
                events.append((event, json.loads(line.split(":", 1)[1])))
                if event == "end":
                    break
    kinds = [e for e, _ in events]
    assert kinds[0] == "status" and kinds[-1] == "end"
    assert [d["args"]["i"] for e, d in events if e == "call"] == [0, 1, 2, 3, 4]
    assert "".join(d["text"] for e, d in events if e == "stdout") == "0\n1\n2\n3\n4\n"
    assert events[-1][1]["status"] == "succeeded"
    assert ("status", {"status": "succeeded"}) in events
    # an ended job replays everything at once
    replay = api.get(f"/jobs/{job['job_id']}/events", timeout=10).text
    assert replay.count("event: call") == 5 and "event: end" in replay


def test_restart_keeps_ended_jobs_and_marks_running_ones_lost(engine: docker.DockerClient, scratch: Path) -> None:
    """A job that is not durable is lost with the service (a durable one resumes: test_durable.py)."""
    instance = f"pytest-durable-{secrets.token_hex(4)}"
    first = start_service(instance, scratch / "durable", PTC_WARM_POOL_SIZE="0")
    tools = [{"name": "t", "endpoint": {"kind": "echo"}}]
    with first.client() as api:
        ended = [execute(api, f"import tools\ntools.t()\nprint({i})", tools) for i in range(3)]
        ended.append(execute(api, "raise ValueError('x')"))
        running = api.post(
            "/execute", json={"script": "import time\ntime.sleep(60)", "wait_s": 0, "durable": False}
        ).json()
        wait_until(lambda: api.get(f"/jobs/{running['job_id']}").json()["status"] == "running", 20)
        time.sleep(0.5)  # the view in memory says running as the store's save of it starts: let that save land
    first.process.send_signal(signal.SIGKILL)
    first.process.wait()
    second = start_service(instance, scratch / "durable", PTC_WARM_POOL_SIZE="0")
    try:
        with second.client() as api:
            for view in ended:
                assert api.get(f"/jobs/{view['job_id']}").json() == view
            lost = api.get(f"/jobs/{running['job_id']}").json()
            assert lost["status"] == "lost"
            assert lost["error"]["type"] == "service_restarted" and "running" in lost["error"]["message"]
            assert lost["ended_at"] is not None
        # (a removal the killed service had asked for may still be finishing in the engine)
        wait_until(lambda: labelled_containers(engine, instance) == [], 10)
    finally:
        second.stop()


def test_callback_url_needs_a_configured_secret(api: httpx.Client) -> None:
    response = api.post("/execute", json={"script": "print(1)", "callback_url": "http://127.0.0.1:9/x"})
    assert response.status_code == 422
    assert response.json()["detail"].startswith("callback_url")


def test_multibyte_output_is_never_split_across_reads(api: httpx.Client) -> None:
    view = execute(api, "print('€' * 400_000, end='')")
    offset, text = 0, ""
    while offset < view["stdout_bytes"]:
        page = api.get(f"/jobs/{view['job_id']}", params={"stdout_offset": offset}).json()
        assert not page["stdout_invalid_utf8"]
        text += page["stdout"]
        offset = page["stdout_next_offset"]
    assert text == "€" * 400_000
    events = api.get(f"/jobs/{view['job_id']}/events", timeout=30).text
    pieces = [
        json.loads(line[5:])["text"] for line in events.splitlines() if line.startswith("data:") and '"offset"' in line
    ]
    assert "".join(pieces) == "€" * 400_000


def test_offsets_and_dates_out_of_range_are_handled(api: httpx.Client) -> None:
    view = execute(api, "print('x')")
    far = api.get(f"/jobs/{view['job_id']}", params={"stdout_offset": 2**62})
    assert far.status_code == 200 and far.json()["stdout"] == ""
    raw = api.get(f"/jobs/{view['job_id']}/output/stdout", params={"offset": 2**63 - 1})
    assert raw.status_code == 200 and raw.content == b""
    assert api.get("/jobs", params={"created_after": "9999-12-31T23:59:59-05:00"}).status_code == 422
    assert api.get("/jobs", params={"created_before": "0001-01-01T00:00:00+05:00"}).status_code == 422


def test_work_dir_and_store_are_private(service: Service) -> None:
    assert service.work_dir.stat().st_mode & 0o777 == 0o700
    assert (service.work_dir / "jobs.sqlite3").stat().st_mode & 0o777 == 0o600


def test_callbacks_and_lost_jobs_survive_a_crash(engine: docker.DockerClient, scratch: Path) -> None:
    instance = f"pytest-cb-crash-{secrets.token_hex(4)}"
    env = {"PTC_CALLBACK_SECRET": "k", "PTC_CALLBACK_BACKOFF_S": "60"}
    receiver = Receiver(failures=0)
    receiver.close()  # down for now: the first attempt fails and the retry waits 60 s
    first = start_service(instance, scratch / "cb-crash", **env)
    with first.client() as api:
        ended = execute(api, "print('ended')", callback_url=receiver.url)
        running = api.post(
            "/execute",
            json={
                "script": "print('r', flush=True)\nimport time\ntime.sleep(60)",
                "wait_s": 0,
                "callback_url": receiver.url,
                "durable": False,  # else resumed at the restart (test_durable.py)
            },
        ).json()
        wait_until(lambda: api.get(f"/jobs/{running['job_id']}").json()["stdout"] == "r\n", 20)
    first.process.send_signal(signal.SIGKILL)
    first.process.wait()
    receiver = Receiver(failures=0, port=int(receiver.url.split(":")[2].split("/")[0]))
    second = start_service(instance, scratch / "cb-crash", **env)
    try:
        wait_until(lambda: len(receiver.deliveries) >= 2, 20)
        delivered = {json.loads(body)["job_id"]: json.loads(body) for _, _, body in receiver.deliveries}
        assert delivered[ended["job_id"]]["status"] == "succeeded"
        assert delivered[running["job_id"]]["status"] == "lost"
        with second.client() as api:
            lost = api.get(f"/jobs/{running['job_id']}").json()
            assert (lost["stdout"], lost["stdout_bytes"], lost["stdout_retained_bytes"]) == ("r\n", 2, 2)
    finally:
        second.stop()
        receiver.close()


def test_a_trailing_slash_is_not_redirected_to_the_hosts_a_request_names(api: httpx.Client) -> None:
    for path in ("/jobs/", "/sessions/", "/execute/"):
        answer = api.get(path, headers={"Host": "evil.example"})
        assert not answer.is_redirect, (path, answer.status_code, answer.headers)
        assert "evil.example" not in answer.headers.get("location", ""), answer.headers
        assert answer.status_code in (404, 405) and answer.headers["content-type"] == "application/problem+json"


def test_backpressure_admits_cap_plus_queue_and_refuses_the_rest(scratch: Path) -> None:
    svc = start_service(  # the one key may take every slot and the whole queue: the global limits are tested
        "pytest-queue",
        scratch / "queue",
        PTC_MAX_CONCURRENT_SANDBOXES="2",
        PTC_MAX_QUEUE="2",
        PTC_QUOTA_RUNNING_JOBS="2",
        PTC_QUOTA_QUEUED_JOBS="2",
    )
    try:
        with svc.client() as api, ThreadPoolExecutor(10) as pool:
            body = {"script": "import time\ntime.sleep(3)\nprint('ok')", "wait_s": 0}
            responses = list(pool.map(lambda _: api.post("/execute", json=body), range(10)))
            accepted = [r.json() for r in responses if r.status_code == 202]
            refused = [r for r in responses if r.status_code == 429]
            assert len(accepted) == 4 and len(refused) == 6
            assert all(r.headers["Retry-After"] == "2" for r in refused)
            assert refused[0].headers["content-type"] == "application/problem+json"
            assert refused[0].json()["reason"] == "queue_full"
            time.sleep(1)
            statuses = sorted(api.get(f"/jobs/{j['job_id']}").json()["status"] for j in accepted)
            assert statuses == ["queued", "queued", "running", "running"]
            finals = [api.post(f"/jobs/{j['job_id']}/wait", params={"timeout_s": 30}).json() for j in accepted]
            assert [f["status"] for f in finals] == ["succeeded"] * 4
            assert all(f["stdout"] == "ok\n" for f in finals)
            assert sum(f["queue_ms"] > 2000 for f in finals) == 2
    finally:
        svc.stop()


def test_callback_is_retried_and_signed(scratch: Path, receiver: Receiver) -> None:
    secret = "s3cret-for-tests"  # the older, free-form secret, rotated to a whsec_ one (issue 14, item 4)
    newer = "whsec_" + base64.b64encode(os.urandom(32)).decode()
    svc = start_service(
        "pytest-callback",
        scratch / "callback",
        PTC_CALLBACK_SECRET=f"{newer} {secret}",
        PTC_CALLBACK_BACKOFF_S="0.2",
    )
    try:
        with svc.client() as api:
            view = execute(api, "print('done')", callback_url=receiver.url)
            wait_until(lambda: len(receiver.deliveries) >= 3, 20)
            statuses = [status for status, _, _ in receiver.deliveries]
            assert statuses == [500, 500, 204]
            _, headers, body = receiver.deliveries[2]
            assert verify(secret.encode(), headers[SIGNATURE_HEADER], body)
            assert not verify(b"wrong", headers[SIGNATURE_HEADER], body)
            # Standard Webhooks: one webhook-id across the retries; the library verifies with either secret.
            assert {h["webhook-id"] for _, h, _ in receiver.deliveries} == {f"msg_{view['job_id']}"}
            assert Webhook(newer).verify(body, headers)["job_id"] == view["job_id"]
            assert Webhook(secret.encode()).verify(body, headers)["job_id"] == view["job_id"]
            with pytest.raises(WebhookVerificationError):
                Webhook(b"wrong").verify(body, headers)
            delivered = json.loads(body)
            assert (delivered["job_id"], delivered["status"], delivered["stdout"]) == (
                view["job_id"],
                "succeeded",
                "done\n",
            )
            wait_until(lambda: api.get(f"/jobs/{view['job_id']}").json()["callback"]["state"] == "delivered", 5)
            attempts = api.get(f"/jobs/{view['job_id']}").json()["callback"]["attempts"]
            assert [a["status_code"] for a in attempts] == [500, 500, 204]
    finally:
        svc.stop()


def test_ended_jobs_are_purged_after_the_retention(scratch: Path) -> None:
    svc = start_service("pytest-retention", scratch / "retention", PTC_JOB_RETENTION_S="1", PTC_PURGE_INTERVAL_S="0.5")
    try:
        with svc.client() as api:
            view = execute(api, "print('bye')")
            output = svc.work_dir / "output" / view["job_id"]
            assert (output / "stdout").read_bytes() == b"bye\n"
            wait_until(lambda: api.get(f"/jobs/{view['job_id']}").status_code == 404, 10)
            wait_until(lambda: not output.exists(), 2)  # removed right after the store forgets the job
    finally:
        svc.stop()


def test_slow_callback_receiver_is_cut_off_at_the_timeout(scratch: Path) -> None:
    hang = ThreadingHTTPServer(("127.0.0.1", 0), _Sleeper)
    threading.Thread(target=hang.serve_forever, daemon=True).start()
    svc = start_service(
        "pytest-cb-slow",
        scratch / "cb-slow",
        PTC_CALLBACK_SECRET="k",
        PTC_CALLBACK_TIMEOUT_S="1",
        PTC_CALLBACK_MAX_ATTEMPTS="2",
        PTC_CALLBACK_BACKOFF_S="0.1",
    )
    try:
        with svc.client() as api:
            view = execute(api, "print(1)", callback_url=f"http://127.0.0.1:{hang.server_address[1]}/")
            deadline = time.monotonic() + 15
            while (cb := api.get(f"/jobs/{view['job_id']}").json()["callback"])["state"] == "pending":
                assert time.monotonic() < deadline
                time.sleep(0.2)
            assert cb["state"] == "failed"
            assert [a["error"] for a in cb["attempts"]] == ["no answer within 1 s"] * 2
            assert all(a["duration_ms"] < 3000 for a in cb["attempts"])
    finally:
        svc.stop()
        hang.shutdown()
        hang.server_close()


class _Sleeper(BaseHTTPRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass

    def do_POST(self) -> None:
        time.sleep(5)
        self.send_response(204)
        self.end_headers()
