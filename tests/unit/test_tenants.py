"""Tenants (issue 11, items 1-3): what one API key creates, another cannot see, touch, run in, or sign for.

One service runs with three keys besides the suite's own: ``alice`` and ``bob`` (tenants) and ``root``
(``PTC_ADMIN_KEYS``). Each attack of item 1 has its test: another key's job, session or toolset answers
exactly like an unknown id. The last tests start services of their own: authentication disabled (one
implicit owner), a restart on the same store, and a store of the schema before owners, migrated when opened.
Sandboxes started in this module: six, all trivial scripts (echo and client-executed tools).
"""

from __future__ import annotations

import json
import secrets
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import docker
import httpx
import pytest

from service.tenancy import hash_token
from tests.conftest import Service, labelled_containers, start_service
from tests.toolserver import ToolServer

TOKENS = {name: f"{name}-{secrets.token_urlsafe(24)}" for name in ("alice", "bob", "root")}


ALICE_CALLBACK_SECRET = "alice-own-callback-secret"


SERVER_CALLBACK_SECRET = "the-server-callback-secret"


class Receiver:
    """A callback receiver on 127.0.0.1: answers 204 and keeps ``(headers, body)`` of every delivery."""

    def __init__(self) -> None:
        self.deliveries: list[tuple[dict[str, str], bytes]] = []
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, format: str, *args: Any) -> None:
                pass

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["content-length"]))
                receiver.deliveries.append((dict(self.headers), body))
                self.send_response(204)
                self.send_header("content-length", "0")
                self.end_headers()

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        self.port = int(self.httpd.server_address[1])
        self.url = f"http://127.0.0.1:{self.port}/hook"

    def close(self) -> None:
        """Stop serving and close the listening socket (``shutdown`` alone leaves it open)."""
        self.httpd.shutdown()
        self.httpd.server_close()

    def delivery_of(self, job_id: str) -> tuple[dict[str, str], bytes]:
        for headers, body in self.deliveries:
            if json.loads(body)["job_id"] == job_id:
                return headers, body
        raise AssertionError(f"no callback of {job_id}")


def keys_file(folder: Path, *names: str) -> Path:
    path = folder / f"tenant-keys-{secrets.token_hex(4)}"
    path.write_text("".join(f"{name}:{hash_token(TOKENS[name])}\n" for name in names))
    return path


def client_of(service: Service, name: str) -> httpx.Client:
    return httpx.Client(base_url=service.url, timeout=60, headers={"Authorization": f"Bearer {TOKENS[name]}"})


@pytest.fixture(scope="module")
def receiver() -> Iterator[Receiver]:
    r = Receiver()
    yield r
    r.close()


@pytest.fixture(scope="module")
def tenants(
    engine: docker.DockerClient, scratch: Path, receiver: Receiver, tool_server: ToolServer
) -> Iterator[Service]:
    """The service with keys alice, bob and root (admin); alice has her own callback secret."""
    tool_port = tool_server.url("").rsplit(":", 1)[1].split("/")[0]
    svc = start_service(
        f"pytest-tenants-{secrets.token_hex(4)}",
        scratch / "tenants",
        PTC_API_KEYS_FILE=str(keys_file(scratch, "alice", "bob", "root")),
        PTC_ADMIN_KEYS="root",
        PTC_WARM_POOL_SIZE="0",
        PTC_CALLBACK_SECRET=SERVER_CALLBACK_SECRET,
        PTC_CALLBACK_SECRETS=f"alice:{ALICE_CALLBACK_SECRET}",
        PTC_EGRESS_ALLOW=f"http://127.0.0.1:{receiver.port},http://127.0.0.1:{tool_port}",
    )
    yield svc
    svc.stop()
    assert not labelled_containers(engine, svc.instance_id, include_pool=True)


@pytest.fixture(scope="module")
def alice(tenants: Service) -> Iterator[httpx.Client]:
    with client_of(tenants, "alice") as c:
        yield c


@pytest.fixture(scope="module")
def bob(tenants: Service) -> Iterator[httpx.Client]:
    with client_of(tenants, "bob") as c:
        yield c


@pytest.fixture(scope="module")
def root(tenants: Service) -> Iterator[httpx.Client]:
    with client_of(tenants, "root") as c:
        yield c


"""The store's schema before owners were recorded (main before issue 11), written by hand."""


def test_an_admin_name_that_is_no_key_refuses_to_start(tmp_path: Path) -> None:
    from service.errors import InsecureConfig
    from service.settings import Settings
    from service.tenancy import configure

    keys = f"alice:{hash_token(TOKENS['alice'])}"
    with pytest.raises(InsecureConfig, match="PTC_ADMIN_KEYS names rooot"):
        configure(Settings(work_dir=tmp_path, api_keys=keys, admin_keys="rooot"))


@pytest.mark.parametrize(
    "entry", ["alice", "alice:", ":TOPSECRET", "al ice:TOPSECRET", "alice:TOPSECRET,alice:TOPSECRET2"]
)
def test_malformed_callback_secrets_refuse_to_start_without_echoing_them(tmp_path: Path, entry: str) -> None:
    from service.callbacks import load_secrets
    from service.errors import InsecureConfig
    from service.settings import Settings

    with pytest.raises(InsecureConfig, match="PTC_CALLBACK_SECRETS") as caught:
        load_secrets(Settings(work_dir=tmp_path, callback_secrets=entry))
    assert "TOPSECRET" not in str(caught.value)


def test_callback_secrets_per_key_from_the_variable_and_a_file(tmp_path: Path) -> None:
    from service.callbacks import load_secrets
    from service.errors import InsecureConfig
    from service.settings import Settings

    secrets_file = tmp_path / "callback-secrets"
    secrets_file.write_text("# tenants' receivers\ncarol:carol-secret\n")
    loaded = load_secrets(
        Settings(
            work_dir=tmp_path,
            callback_secret="server-secret",
            callback_secrets="alice:alice-secret, bob:bob-secret",
            callback_secrets_file=secrets_file,
        )
    )
    assert [[s.text for s in loaded.for_owner(o) or ()] for o in ("alice", "bob", "carol", "dave", None)] == [
        [b"alice-secret"],
        [b"bob-secret"],
        [b"carol-secret"],
        [b"server-secret"],
        [b"server-secret"],
    ]
    assert load_secrets(Settings(work_dir=tmp_path, callback_secrets="alice:a")).for_owner("bob") is None
    with pytest.raises(InsecureConfig, match="carol"):
        load_secrets(Settings(work_dir=tmp_path, callback_secrets="carol:x", callback_secrets_file=secrets_file))
