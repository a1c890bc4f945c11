"""Answers sent a slice at a time (service/api/reads.py) on the real engine, under runc and gVisor: a session's
file comes from the sandbox through the spool whole and exact, and a key's answers under way are given back."""

from __future__ import annotations

import hashlib

import httpx

from tests.conftest import execute

FILE_BYTES = 3 * 1024 * 1024 + 17  # past several control frames and output slices, not a multiple of either


def test_a_session_file_comes_whole_through_the_spool(runtime_api: httpx.Client) -> None:
    created = runtime_api.post("/sessions", json={})
    assert created.status_code == 201, created.text
    sid = created.json()["session_id"]
    try:
        script = (
            f"import hashlib, os\ndata = os.urandom({FILE_BYTES})\nopen('big.bin', 'wb').write(data)\n"
            "print(hashlib.sha256(data).hexdigest())\n"
        )
        view = execute(runtime_api, script, session_id=sid)
        assert view["status"] == "succeeded", (view["error"], view["stderr"])
        for _ in range(3):  # more answers than a key may have under way at once: each gave its slot back
            with runtime_api.stream("GET", f"/sessions/{sid}/files/big.bin") as answer:
                assert answer.status_code == 200
                assert answer.headers["content-length"] == str(FILE_BYTES)
                digest = hashlib.sha256()
                for piece in answer.iter_bytes():
                    digest.update(piece)
            assert digest.hexdigest() == view["stdout"].strip()
        for _ in range(5):
            assert runtime_api.get("/jobs", params={"limit": 500}).status_code == 200
        missing = runtime_api.get(f"/sessions/{sid}/files/missing")
        assert missing.status_code == 404  # an error before any byte: its slot given back too
    finally:
        runtime_api.delete(f"/sessions/{sid}")
