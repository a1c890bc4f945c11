"""Background jobs: wait budget, offsets, wait, stop, listing, durability, backpressure, callbacks, SSE."""

from __future__ import annotations

import base64
import json
import os
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from standardwebhooks import Webhook
from standardwebhooks.webhooks import WebhookVerificationError

from service.callbacks import SIGNATURE_HEADER, verify
from tests.conftest import execute, start_service, wait_until


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


class Receiver:
    """A callback receiver on 127.0.0.1 that answers 500 to the first ``failures`` deliveries."""

    def __init__(self, failures: int, port: int = 0) -> None:
        self.deliveries: list[tuple[int, dict[str, str], bytes]] = []
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, format: str, *args: Any) -> None:
                pass

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["content-length"]))
                status = 500 if len(receiver.deliveries) < failures else 204
                receiver.deliveries.append((status, dict(self.headers), body))
                self.send_response(status)
                self.send_header("content-length", "0")
                self.end_headers()

        self.httpd = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/hook"

    def close(self) -> None:
        """Stop serving and close the listening socket (``shutdown`` alone leaves it open)."""
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    r = Receiver(failures=2)
    yield r
    r.close()


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
