"""Authentication (service/auth.py): bearer API keys by SHA-256, compared in constant time.

In-process tests drive the app through ``httpx.ASGITransport`` (no engine
needed: authentication answers before any route runs); the last ones go
through the real service process, started with a key by ``start_service``.
"""

from __future__ import annotations

import hashlib
import hmac
import io
import logging
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI, Request

from service.__main__ import main
from service.api import create_app
from service.errors import InsecureConfig
from service.settings import Settings
from service.tenancy import KeyRing, configure, hash_token, is_loopback, parse_keys
from tests.conftest import ROOT

ALICE, BOB = "alice-token-0123456789", "bob-token-9876543210"


KEYS = f"alice:{hash_token(ALICE)},bob:{hash_token(BOB)}"


def settings(tmp_path: Path, **overrides: Any) -> Settings:
    values: dict[str, Any] = {"work_dir": tmp_path, "auth": "required", "api_keys": KEYS, **overrides}
    return Settings(**values)


def whoami_app(config: Settings) -> FastAPI:
    app = create_app(config)

    @app.get("/whoami")
    async def whoami(request: Request) -> dict[str, Any]:
        return {"key_name": request.state.key_name}

    return app


@pytest.fixture
async def client(tmp_path: Path) -> AsyncIterator[httpx.AsyncClient]:
    app = whoami_app(settings(tmp_path))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as c:
        yield c


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def test_keys_are_configured_by_name_and_sha256() -> None:
    keys = parse_keys(f"alice:{hash_token(ALICE)}\n# a comment\nbob:{hash_token(BOB).upper()}, ")
    assert [k.name for k in keys] == ["alice", "bob"]
    assert keys[0].digest == hashlib.sha256(ALICE.encode()).digest()
    ring = KeyRing(keys)
    assert ring.identify(ALICE.encode()) == "alice"
    assert ring.identify(BOB.encode()) == "bob"
    assert ring.identify(b"alice-token-012345678") is None
    assert ring.identify(hash_token(ALICE).encode()) is None  # the hash itself is no key


@pytest.mark.parametrize(
    "entry", ["alice", "alice:", "alice:abc", f"al ice:{hash_token('x')}", f":{hash_token('x')}", f"a:{'g' * 64}"]
)
def test_malformed_key_entries_are_refused_without_echoing_them(entry: str) -> None:
    with pytest.raises(ValueError, match="PTC_API_KEYS") as caught:
        parse_keys(entry)
    assert hash_token("x") not in str(caught.value)


def test_every_key_is_compared_whichever_matches(monkeypatch: pytest.MonkeyPatch) -> None:
    """No early exit: compare_digest runs over every configured hash for a right, a wrong and a near token."""
    tokens = [f"token-{i:02d}-abcdefghijklmnop" for i in range(10)]
    ring = KeyRing(parse_keys(",".join(f"k{i}:{hash_token(t)}" for i, t in enumerate(tokens))))
    compared: list[tuple[bytes, bytes]] = []
    real = hmac.compare_digest

    def counting(a: bytes, b: bytes) -> bool:
        compared.append((a, b))
        return real(a, b)

    monkeypatch.setattr("service.tenancy.hmac.compare_digest", counting)
    for token, expected in [
        (tokens[0], "k0"),
        (tokens[9], "k9"),
        ("wrong", None),
        ("Xoken-00-abcdefghijklmnop", None),  # differs at the first byte
        ("token-00-abcdefghijklmnoX", None),  # differs at the last byte
    ]:
        compared.clear()
        assert ring.identify(token.encode()) == expected
        assert len(compared) == 10
        assert all(len(a) == len(b) == 32 for a, b in compared)  # digests, never the token's own bytes


def test_wrong_keys_take_the_same_time_wherever_they_differ() -> None:
    """A token whose SHA-256 differs from every key's at its first byte, and one whose SHA-256 differs at its last
    byte: the fastest of interleaved batches within 1.5x.

    What is compared is the token's digest, so the keys here are built from the digest itself (flipped at the first
    or the last byte): an early-exit comparison of digests stops at once for one and reads all 32 bytes for the
    other, 32 keys each. (Tokens that differ at their first or last byte would not show it: their digests differ
    everywhere.) The bound is loose on purpose, to fail only on a gross dependence, not on scheduling noise.
    """
    token = b"k" * 43
    digest = hashlib.sha256(token).digest()

    def ring(flip_at: int) -> KeyRing:
        keys = []
        for i in range(32):
            other = bytearray(digest)
            other[flip_at] ^= 1 + i  # a different wrong key each time, differing from the digest only there
            keys.append(f"n{i}:{other.hex()}")
        return KeyRing(parse_keys(",".join(keys)))

    first, last = ring(0), ring(31)
    samples: dict[int, list[float]] = {id(first): [], id(last): []}
    for _ in range(40):
        for keys in (first, last):
            started = time.perf_counter()
            for _ in range(200):
                assert keys.identify(token) is None
            samples[id(keys)].append(time.perf_counter() - started)
    ratio = min(samples[id(first)]) / min(samples[id(last)])  # the fastest batch: least disturbed by the machine
    assert 1 / 1.5 < ratio < 1.5, ratio


async def test_no_key_is_401_problem_with_www_authenticate(client: httpx.AsyncClient) -> None:
    response = await client.post("/execute", json={"script": "print(1)"})
    assert response.status_code == 401
    assert response.headers["content-type"] == "application/problem+json"
    assert response.headers["www-authenticate"] == 'Bearer realm="ptc-sandbox"'
    problem = response.json()
    assert problem["status"] == 401 and problem["title"] == "Unauthorized"
    assert "Authorization: Bearer" in problem["detail"]


@pytest.mark.parametrize(
    "authorization",
    [
        "Bearer wrong",
        f"Bearer {ALICE}x",
        f"Bearer {ALICE[:-1]}",
        f"Bearer {hash_token(ALICE)}",
        f"Basic {ALICE}",
        ALICE,
        "Bearer ",
    ],
)
async def test_wrong_key_is_401(client: httpx.AsyncClient, authorization: str) -> None:
    response = await client.get("/whoami", headers={"Authorization": authorization})
    assert response.status_code == 401
    assert response.headers["content-type"] == "application/problem+json"
    assert response.headers["www-authenticate"].startswith("Bearer")


async def test_right_key_passes_and_names_itself(client: httpx.AsyncClient) -> None:
    assert (await client.get("/whoami", headers=bearer(ALICE))).json() == {"key_name": "alice"}
    assert (await client.get("/whoami", headers={"authorization": f"bearer {BOB}"})).json() == {"key_name": "bob"}


@pytest.mark.parametrize("path", ["/no/such/route", "/docs/assets/other.js", "/jobs", "/metrics"])
async def test_every_other_path_needs_a_key(client: httpx.AsyncClient, path: str) -> None:
    assert (await client.get(path)).status_code == 401


async def test_healthz_is_open(client: httpx.AsyncClient) -> None:
    response = await client.get("/healthz")
    assert response.status_code == 200 and response.json() == {"status": "ok"}


async def test_metrics_is_open_only_when_configured(tmp_path: Path) -> None:
    app = create_app(settings(tmp_path, metrics_auth="open"))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as c:
        assert (await c.get("/metrics")).status_code == 200
        assert (await c.get("/metrics", headers=bearer(BOB))).status_code == 200  # any key too, when open
        assert (await c.get("/jobs")).status_code == 401


PROM = "prom-token-5555555555"


async def test_metrics_answer_only_the_admin_role_and_metrics_keys(tmp_path: Path) -> None:
    config = settings(tmp_path, api_keys=f"{KEYS},prom:{hash_token(PROM)}", admin_keys="alice", metrics_keys="prom")
    app = create_app(config)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as c:
        refused = await c.get("/metrics", headers=bearer(BOB))  # a tenant: the metrics name others' tools
        assert refused.status_code == 403 and refused.headers["content-type"] == "application/problem+json"
        assert "PTC_METRICS_KEYS" in refused.json()["detail"] and "ptc_" not in refused.text
        for token in (ALICE, PROM):  # the admin role, a metrics key
            answer = await c.get("/metrics", headers=bearer(token))
            assert answer.status_code == 200 and "# TYPE ptc_executions_total counter" in answer.text
        assert (await c.get("/metrics")).status_code == 401  # no key at all: as on every path
    with pytest.raises(InsecureConfig, match="PTC_METRICS_KEYS names prometheus"):
        configure(settings(tmp_path, metrics_keys="prometheus"))


async def test_401_comes_before_the_body_is_read(client: httpx.AsyncClient) -> None:
    chunks_read = 0

    async def body() -> AsyncIterator[bytes]:
        nonlocal chunks_read
        for _ in range(64):
            chunks_read += 1
            yield b"x" * 65536

    response = await client.post("/execute", content=body())
    assert response.status_code == 401
    assert chunks_read < 64


def test_required_without_keys_refuses_to_start(tmp_path: Path) -> None:
    with pytest.raises(InsecureConfig, match="PTC_API_KEYS"):
        configure(settings(tmp_path, api_keys=None))


def test_keys_may_come_from_a_file(tmp_path: Path) -> None:
    keys_file = tmp_path / "keys"
    keys_file.write_text(f"# agents\ncarol:{hash_token('carol-token')}\n")
    ring = configure(settings(tmp_path, api_keys_file=keys_file))
    assert ring is not None and len(ring) == 3
    assert ring.identify(b"carol-token") == "carol"


def test_disabled_is_loud_and_only_on_loopback(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="service.tenancy"):
        assert configure(settings(tmp_path, auth="disabled", host="127.0.0.1")) is None
    assert "AUTHENTICATION DISABLED" in caplog.text
    for host in ("0.0.0.0", "::", "10.1.2.3", "example.com"):
        with pytest.raises(InsecureConfig, match="not a loopback address"):
            configure(settings(tmp_path, auth="disabled", host=host))
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="service.tenancy"):
        assert configure(settings(tmp_path, auth="disabled", host="0.0.0.0", auth_force_insecure=True)) is None
    assert any(r.levelno == logging.CRITICAL for r in caplog.records)


@pytest.mark.parametrize(
    ("host", "loopback"),
    [("127.0.0.1", True), ("localhost", True), ("::1", True), ("127.0.0.2", True), ("0.0.0.0", False), ("", False)],
)
def test_loopback_hosts(host: str, loopback: bool) -> None:
    assert is_loopback(host) is loopback


def test_disabled_on_a_public_bind_stops_the_process_with_exit_2(tmp_path: Path) -> None:
    env = {"PATH": "/usr/bin:/bin", "PTC_AUTH": "disabled", "PTC_HOST": "0.0.0.0", "PTC_WORK_DIR": str(tmp_path)}
    done = subprocess.run(
        [sys.executable, "-m", "service", "serve"], cwd=ROOT, env=env, capture_output=True, timeout=60
    )
    assert done.returncode == 2
    assert b"refusing to start" in done.stderr and b"PTC_AUTH_FORCE_INSECURE" in done.stderr


def test_hash_key_prints_the_entry(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(sys, "stdin", io.StringIO(ALICE + "\n"))
    assert main(["hash-key", "alice"]) == 0
    assert capsys.readouterr().out == f"alice:{hash_token(ALICE)}\n"
    assert main(["hash-key", "new-agent", "--generate"]) == 0
    token, entry = capsys.readouterr().out.splitlines()
    assert token.startswith("ptc_") and len(token) > 40
    assert parse_keys(entry)[0].name == "new-agent"
    assert KeyRing(parse_keys(entry)).identify(token.encode()) == "new-agent"
