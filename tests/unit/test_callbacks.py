"""Completion callbacks signed as Standard Webhooks (issue 14, item 4), checked by the ``standardwebhooks`` library.

The first tests are the signing functions alone: the specification's published vector, the library's verifier,
rotation, another key's secret, the deprecated header. The last ones run the whole service on the fake backend (no
engine) with two API keys and a real HTTP receiver on 127.0.0.1 that fails each message's first delivery: the
retried callback keeps its ``webhook-id``, and the library verifies it with the older and with the newer secret.
"""

from __future__ import annotations

import asyncio
import base64
import hmac
import json
import secrets
import shutil
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
from standardwebhooks import Webhook
from standardwebhooks.webhooks import WebhookVerificationError

from service.api import create_app
from service.callbacks import (
    OWNER_HEADER,
    SIGNATURE_HEADER,
    TIMESTAMP_HEADER,
    WEBHOOK_ID_HEADER,
    WEBHOOK_SIGNATURE_HEADER,
    WEBHOOK_TIMESTAMP_HEADER,
    CallbackSecret,
    load_secrets,
    message_id,
    parse_secret_list,
    signed_headers,
    standard_signature,
    verify,
)
from service.errors import InsecureConfig
from service.jobs import webhooks
from service.sandbox.fake import FakeBackend
from service.settings import Settings
from service.tenancy import hash_token

# The specification's repository publishes this vector with its reference libraries' tests
# (libraries/python/tests/test_webhooks.py, test_sign_function, of standard-webhooks/standard-webhooks).
VECTOR_SECRET = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"
VECTOR_ID = "msg_p5jXN8AQM9LWM0D4loKWxJek"
VECTOR_TIMESTAMP = 1614265330
VECTOR_BODY = b'{"test": 2432232314}'
VECTOR_SIGNATURE = "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE="


def whsec() -> str:
    """A new secret in the specification's form (32 random bytes)."""
    return "whsec_" + base64.b64encode(secrets.token_bytes(32)).decode()


def library_verifies(secret: str | bytes, body: bytes, headers: dict[str, str]) -> bool:
    """Whether the ``standardwebhooks`` library's own ``Webhook(secret).verify`` accepts the delivery."""
    try:
        Webhook(secret).verify(body, headers)
    except WebhookVerificationError:
        return False
    return True


def test_the_specifications_vector() -> None:
    key = CallbackSecret.parse(VECTOR_SECRET).key
    assert standard_signature([key], VECTOR_ID, VECTOR_TIMESTAMP, VECTOR_BODY) == VECTOR_SIGNATURE
    when = datetime.fromtimestamp(VECTOR_TIMESTAMP, UTC)
    assert Webhook(VECTOR_SECRET).sign(VECTOR_ID, when, VECTOR_BODY.decode()) == VECTOR_SIGNATURE
    unpadded = VECTOR_SECRET.rstrip("=")  # the vector's base64 needs no padding; one that does may leave it out
    assert CallbackSecret.parse(unpadded).key == base64.b64decode(VECTOR_SECRET.removeprefix("whsec_"))


def test_the_library_verifies_what_is_signed_now() -> None:
    secret = whsec()
    body = json.dumps({"job_id": "job_1", "owner": "alice", "text": "é ✓"}).encode()
    headers = signed_headers(parse_secret_list(secret), message_id("job_1"), int(time.time()), body)
    assert headers[WEBHOOK_ID_HEADER] == "msg_job_1"
    assert Webhook(secret).verify(body, headers)["owner"] == "alice"
    assert not library_verifies(whsec(), body, headers)
    assert not library_verifies(secret, body.replace(b"alice", b"bob  "), headers)
    stale = signed_headers(parse_secret_list(secret), "msg_job_1", int(time.time()) - 600, body)
    assert not library_verifies(secret, body, stale)  # the library's 5-minute tolerance: no replay of old ones


def test_a_free_form_secret_signs_with_its_utf8_bytes() -> None:
    body = b'{"job_id": "job_2"}'
    headers = signed_headers(parse_secret_list("plain-old-secret"), "msg_job_2", int(time.time()), body)
    assert library_verifies(b"plain-old-secret", body, headers)  # bytes: the library takes them as the key
    assert not library_verifies(b"another-secret", body, headers)


def test_rotation_signs_with_each_secret_and_either_verifies() -> None:
    new, old = whsec(), "legacy-free-form-secret"
    body = b'{"job_id": "job_3"}'
    headers = signed_headers(parse_secret_list(f"{new}  {old}"), "msg_job_3", int(time.time()), body)
    assert len(headers[WEBHOOK_SIGNATURE_HEADER].split(" ")) == 2
    assert library_verifies(new, body, headers)
    assert library_verifies(old.encode(), body, headers)
    assert not library_verifies(whsec(), body, headers)
    # The deprecated header: one v1= per secret, each keyed with the secret's text; either verifies.
    assert headers[SIGNATURE_HEADER].count("v1=") == 2
    assert headers[TIMESTAMP_HEADER] == headers[WEBHOOK_TIMESTAMP_HEADER]
    assert verify(new, headers[SIGNATURE_HEADER], body) and verify(old, headers[SIGNATURE_HEADER], body)
    assert not verify("neither", headers[SIGNATURE_HEADER], body)


def test_the_deprecated_header_with_one_secret_is_as_before() -> None:
    body = b'{"job_id": "job_4"}'
    now = int(time.time())
    header = signed_headers(parse_secret_list("k"), "msg_job_4", now, body)[SIGNATURE_HEADER]
    t, v1 = (part.split("=", 1)[1] for part in header.split(","))  # the hand-written check of docs/api.md
    assert t == str(now) and hmac.compare_digest(v1, hmac.new(b"k", f"{t}.".encode() + body, "sha256").hexdigest())
    for forged in ("", "t=1", f"t={now}", f"v1={v1}", f"t={now},t={now},v1={v1}", f"t=x,v1={v1}", f"t={now},v1=é"):
        assert not verify("k", forged, body), forged


def test_a_key_with_its_own_secret_never_gets_another_keys(tmp_path: Path) -> None:
    alice_new, alice_old, bob = whsec(), whsec(), whsec()
    loaded = load_secrets(
        Settings(
            work_dir=tmp_path,
            callback_secret="server-plain",
            callback_secrets=f"alice:{alice_new} {alice_old}, bob:{bob}",
        )
    )
    body = b'{"owner": "bob"}'
    bobs = loaded.for_owner("bob")
    assert bobs is not None
    headers = signed_headers(bobs, "msg_job_5", int(time.time()), body)
    assert library_verifies(bob, body, headers)
    assert not any(library_verifies(s, body, headers) for s in (alice_new, alice_old, b"server-plain"))
    carols = loaded.for_owner("carol")
    assert carols is not None and [s.text for s in carols] == [b"server-plain"]


@pytest.mark.parametrize(
    "settings",
    [
        {"callback_secrets": "alice:whsec_TOPSECRET!!"},  # not base64
        {"callback_secrets": "alice:whsec_" + base64.b64encode(b"TOPSECRET").decode()},  # 9 bytes: fewer than 24
        {"callback_secrets": "alice:ok whsec_TOPSECRET%"},  # the second of two
        {"callback_secret": "whsec_TOPSECRET*"},
        {"callback_secret": "   "},
        # a passphrase (taken whole by the releases before): each word would sign alone, an oracle per word
        {"callback_secret": "correct horse TOPSECRET staple"},
        {"callback_secrets": "alice:my TOPSECRET phrase"},
    ],
)
def test_a_whsec_secret_that_is_not_one_refuses_to_start_without_echoing_it(
    tmp_path: Path, settings: dict[str, str]
) -> None:
    with pytest.raises(InsecureConfig, match="PTC_CALLBACK_SECRET") as caught:
        load_secrets(Settings(work_dir=tmp_path, **settings))  # type: ignore[arg-type]
    assert "TOPSECRET" not in str(caught.value) and "VE9QU0VDUkVU" not in str(caught.value)
    assert "TOPSECRET" not in repr(CallbackSecret.parse("TOPSECRET"))


@pytest.mark.parametrize(
    "value",
    ["whsec_" + base64.b64encode(b"n" * 32).decode() + " short-old", "a" * 24 + " " + "b" * 24, "one-secret"],
)
def test_rotation_from_a_free_form_secret_or_between_long_ones_still_starts(tmp_path: Path, value: str) -> None:
    loaded = load_secrets(Settings(work_dir=tmp_path, callback_secret=value))
    assert len(loaded.for_owner(None) or ()) == len(value.split())


# -- the whole service on the fake backend, a real receiver ------------------------------------------------------


class Receiver:
    """A callback receiver on 127.0.0.1: answers 500 to the first delivery of each ``webhook-id``, then 204."""

    def __init__(self) -> None:
        self.deliveries: list[tuple[int, dict[str, str], bytes]] = []
        self.hung: list[bytes] = []  # deliveries to /hang, held open
        self.release = threading.Event()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, format: str, *args: Any) -> None:
                pass

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["content-length"]))
                if self.path == "/hang":  # a receiver that never answers in time (until the test releases it)
                    receiver.hung.append(body)
                    receiver.release.wait(30)
                    return
                seen = [h for _, h, _ in receiver.deliveries if h.get(WEBHOOK_ID_HEADER) == self.headers["webhook-id"]]
                status = 204 if seen else 500
                receiver.deliveries.append((status, {k.lower(): v for k, v in self.headers.items()}, body))
                self.send_response(status)
                self.send_header("content-length", "0")
                self.end_headers()

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        self.origin = f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def of(self, job_id: str) -> list[tuple[int, dict[str, str], bytes]]:
        return [d for d in self.deliveries if json.loads(d[2])["job_id"] == job_id]

    def close(self) -> None:
        self.release.set()
        self.httpd.shutdown()
        self.httpd.server_close()


@dataclass
class Tenants:
    alice: httpx.AsyncClient
    bob: httpx.AsyncClient
    receiver: Receiver


ALICE_NEW, ALICE_OLD = whsec(), whsec()
SERVER_SECRET = "the-server-secret-free-form"


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    r = Receiver()
    yield r
    r.close()


@pytest.fixture
async def tenants(receiver: Receiver) -> AsyncIterator[Tenants]:
    """The service with keys alice (her own secrets, rotating: new and old) and bob (the server's secret)."""
    tokens = {name: secrets.token_urlsafe(24) for name in ("alice", "bob")}
    work_dir = Path(tempfile.mkdtemp(prefix="ptcs", dir="/tmp"))
    settings = Settings(
        work_dir=work_dir,
        api_keys=",".join(f"{name}:{hash_token(token)}" for name, token in tokens.items()),
        sandbox_folders_tmpfs_mb=0,
        warm_pool_size=0,
        instance_id="fake-" + work_dir.name,
        callback_secret=SERVER_SECRET,
        callback_secrets=f"alice:{ALICE_NEW} {ALICE_OLD}",
        callback_backoff_s=0.05,
        egress_allow=[receiver.origin],
    )
    backend = FakeBackend()
    app = create_app(settings, backend)
    transport = httpx.ASGITransport(app=app)

    def client(name: str) -> httpx.AsyncClient:
        headers = {"Authorization": f"Bearer {tokens[name]}"}
        return httpx.AsyncClient(transport=transport, base_url="http://fake", timeout=60, headers=headers)

    try:
        async with app.router.lifespan_context(app), client("alice") as alice, client("bob") as bob:
            yield Tenants(alice, bob, receiver)
    finally:
        shutil.rmtree(work_dir, ignore_errors=True)


async def until(condition: Callable[[], bool], timeout_s: float = 20) -> None:
    """Wait (on the event loop, which the service shares) until ``condition()``."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "not in time"
        await asyncio.sleep(0.05)


async def test_a_retried_callback_keeps_its_id_and_verifies_with_the_older_and_the_newer_secret(
    tenants: Tenants,
) -> None:
    body = {"script": "print('done')", "callback_url": tenants.receiver.origin + "/hook", "metadata": {"n": 1}}
    view = (await tenants.alice.post("/execute", json=body)).json()
    job_id = view["job_id"]
    assert view["status"] == "succeeded", view
    await until(lambda: len(tenants.receiver.of(job_id)) >= 2)
    (failed, failed_headers, failed_body), (ok, headers, raw) = tenants.receiver.of(job_id)
    assert (failed, ok) == (500, 204)
    assert failed_headers[WEBHOOK_ID_HEADER] == headers[WEBHOOK_ID_HEADER] == f"msg_{job_id}"  # dedup by it
    assert failed_body == raw
    for delivered in (failed_headers, headers):  # each attempt is signed anew, with both of alice's secrets
        assert Webhook(ALICE_NEW).verify(raw, delivered)["owner"] == "alice"
        assert Webhook(ALICE_OLD).verify(raw, delivered)["job_id"] == job_id
        assert not library_verifies(SERVER_SECRET.encode(), raw, delivered)
        assert verify(ALICE_OLD, delivered[SIGNATURE_HEADER.lower()], raw)  # the deprecated header too
        assert verify(ALICE_NEW, delivered[SIGNATURE_HEADER.lower()], raw)
    assert headers[OWNER_HEADER.lower()] == "alice"
    deadline = time.monotonic() + 10
    while (callback := (await tenants.alice.get(f"/jobs/{job_id}")).json()["callback"])["state"] == "pending":
        assert time.monotonic() < deadline
        await asyncio.sleep(0.05)
    assert callback["state"] == "delivered" and [a["status_code"] for a in callback["attempts"]] == [500, 204]


async def test_another_keys_secret_does_not_verify_a_callback(tenants: Tenants) -> None:
    """Bob copies alice's metadata: his callback names bob, is signed with the server's secret, not alice's."""
    body = {"script": "print('x')", "callback_url": tenants.receiver.origin + "/hook", "metadata": {"tenant": "alice"}}
    job_id = (await tenants.bob.post("/execute", json=body)).json()["job_id"]
    await until(lambda: any(status == 204 for status, _, _ in tenants.receiver.of(job_id)))
    _, headers, raw = tenants.receiver.of(job_id)[-1]
    assert Webhook(SERVER_SECRET.encode()).verify(raw, headers)["owner"] == "bob"
    assert not library_verifies(ALICE_NEW, raw, headers)
    assert not library_verifies(ALICE_OLD, raw, headers)
    assert not verify(ALICE_NEW, headers[SIGNATURE_HEADER.lower()], raw)


@pytest.fixture
def few_slots(monkeypatch: pytest.MonkeyPatch) -> None:
    """4 callback deliveries at once, 2 per owner (read when the service builds its webhooks: before ``tenants``)."""
    monkeypatch.setattr(webhooks, "CALLBACK_DELIVERIES", 4)
    monkeypatch.setattr(webhooks, "CALLBACK_DELIVERIES_PER_OWNER", 2)


async def test_one_keys_hanging_receivers_leave_callback_slots_for_another_key(
    few_slots: None, tenants: Tenants
) -> None:
    """Alice's callbacks go to a receiver that never answers: each holds its delivery slot. Bob's callback is
    still delivered at once, while every one of hers is still hanging (without a per-owner share, hers took all the
    slots and his waited for her timeouts)."""
    hang = {"script": "print('x')", "callback_url": tenants.receiver.origin + "/hang"}
    for _ in range(2 * webhooks.CALLBACK_DELIVERIES):
        assert (await tenants.alice.post("/execute", json=hang)).json()["status"] == "succeeded"
    await until(lambda: len(tenants.receiver.hung) >= 2)
    his = {"script": "print('y')", "callback_url": tenants.receiver.origin + "/hook"}
    job_id = (await tenants.bob.post("/execute", json=his)).json()["job_id"]
    await until(lambda: len(tenants.receiver.of(job_id)) >= 1, timeout_s=10)
    assert len(tenants.receiver.hung) == 2  # hers: her share of the slots, all still held open
    tenants.receiver.release.set()


def test_the_by_hand_check_of_the_docs_verifies_and_refuses() -> None:
    text = (Path(__file__).resolve().parents[2] / "docs" / "webhooks.md").read_text()
    block = text.split("## Verifying by hand", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    scope: dict[str, Any] = {}
    exec(compile(block, "docs/webhooks.md", "exec"), scope)
    by_hand: Callable[[str, dict[str, str], bytes], bool] = scope["verify"]
    new, old, body = whsec().rstrip("="), "free-form old secret".replace(" ", "-"), b'{"job_id": "job_6"}'
    headers = signed_headers(parse_secret_list(f"{new} {old}"), "msg_job_6", int(time.time()), body)
    assert by_hand(new, headers, body) and by_hand(old, headers, body)
    assert not by_hand(whsec(), headers, body) and not by_hand(new, headers, body + b" ")
    stale = signed_headers(parse_secret_list(new), "msg_job_6", int(time.time()) - 301, body)
    assert not by_hand(new, stale, body)
