"""Files in and out through the whole service on the fake backend (no engine): ``files`` on /execute and
POST /sessions, outputs/ collected into the view and served, a session's PUT/GET/listing, another key's 404."""

from __future__ import annotations

import base64
import hashlib
import shutil
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from service.api import create_app
from service.sandbox.fake import FakeBackend
from service.sandbox.labels import FEATURE_PRIVSEP, FEATURE_SESSION, LABEL_RUNTIME
from service.settings import Settings
from service.tenancy import hash_token

ALICE, BOB = "alice-token-0123456789abcdef", "bob-token-0123456789abcdefgh"


@pytest.fixture
async def api() -> AsyncIterator[tuple[httpx.AsyncClient, httpx.AsyncClient]]:
    work_dir = Path(tempfile.mkdtemp(prefix="ptcf", dir="/tmp"))
    settings = Settings(
        work_dir=work_dir,
        api_keys=f"alice:{hash_token(ALICE)},bob:{hash_token(BOB)}",
        sandbox_folders_tmpfs_mb=0,
        warm_pool_size=0,
        instance_id="fake-" + work_dir.name,
        max_files=3,
        max_files_bytes=1000,
        max_output_files=2,
        max_output_files_bytes=100,
    )
    backend = FakeBackend()
    app = create_app(settings, backend)
    try:
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with (
                httpx.AsyncClient(
                    transport=transport,
                    base_url="http://fake",
                    timeout=60,
                    headers={"Authorization": f"Bearer {ALICE}"},
                ) as alice,
                httpx.AsyncClient(
                    transport=transport, base_url="http://fake", timeout=60, headers={"Authorization": f"Bearer {BOB}"}
                ) as bob,
            ):
                yield alice, bob
    finally:
        shutil.rmtree(work_dir, ignore_errors=True)


SCRIPT = """
import os
with open("data/in.txt") as f:
    text = f.read()
print(text.upper(), open("raw.bin", "rb").read().hex())
os.makedirs("outputs/sub", exist_ok=True)
with open("outputs/sub/out.txt", "w") as f:
    f.write(text * 2)
os.symlink("/etc/passwd", "outputs/link")
"""


async def test_files_in_and_out_of_a_job(api: tuple[httpx.AsyncClient, httpx.AsyncClient]) -> None:
    alice, bob = api
    files = [
        {"path": "data/in.txt", "content": "héllo"},
        {"path": "./raw.bin", "content_base64": base64.b64encode(b"\x00\xff").decode()},
    ]
    view = (await alice.post("/execute", json={"script": SCRIPT, "files": files})).json()
    assert (view["status"], view["stdout"]) == ("succeeded", "HÉLLO 00ff\n"), view
    out = "héllohéllo".encode()
    assert view["files"] == [
        {
            "path": "outputs/sub/out.txt",
            "bytes": len(out),
            "sha256": hashlib.sha256(out).hexdigest(),
            "content_type": "text/plain",
        }
    ]
    assert view["files_omitted"] == 1
    assert view["files_skipped"] == [{"path": "outputs/link", "reason": "symlink"}]
    got = await alice.get(f"/jobs/{view['job_id']}/files/outputs/sub/out.txt")
    assert (got.status_code, got.content, got.headers["content-type"].split(";")[0]) == (200, out, "text/plain")
    assert (got.headers["content-disposition"], got.headers["x-content-type-options"]) == ("attachment", "nosniff")
    assert (await alice.get(f"/jobs/{view['job_id']}/files/outputs/link")).status_code == 404
    assert (await alice.get(f"/jobs/{view['job_id']}/files/stdout")).status_code == 404
    assert (await alice.get(f"/jobs/{view['job_id']}/files/../owner")).status_code == 404
    other = await bob.get(f"/jobs/{view['job_id']}/files/outputs/sub/out.txt")
    assert other.status_code == 404 and other.json()["type"].endswith("job-not-found")


async def test_outputs_past_the_caps_are_counted(api: tuple[httpx.AsyncClient, httpx.AsyncClient]) -> None:
    alice, _ = api
    script = "for n in range(5):\n    open(f'outputs/{n}.txt', 'w').write('x' * 30)\n"
    view = (await alice.post("/execute", json={"script": script})).json()
    assert [f["path"] for f in view["files"]] == ["outputs/0.txt", "outputs/1.txt"], view
    assert view["files_omitted"] == 3
    assert {s["reason"] for s in view["files_skipped"]} == {"cap"}


@pytest.mark.parametrize(
    ("files", "status", "where"),
    [
        ([{"path": "../x", "content": ""}], 422, ["body", "files", 0, "path"]),
        ([{"path": "a", "content": ""}, {"path": "/etc/x", "content": ""}], 422, ["body", "files", 1, "path"]),
        ([{"path": "a\x00b", "content": ""}], 422, ["body", "files", 0, "path"]),
        ([{"path": "outputs/x", "content": ""}], 422, ["body", "files", 0, "path"]),
        ([{"path": "a", "content": "", "content_base64": ""}], 422, ["body", "files", 0]),
        ([{"path": "a", "content_base64": "%%%"}], 422, ["body", "files", 0]),
        ([{"path": str(n), "content": ""} for n in range(4)], 413, ["body", "files"]),
        ([{"path": "a", "content": "x" * 1001}], 413, ["body", "files"]),
    ],
)
async def test_bad_files_are_refused_before_any_sandbox(
    api: tuple[httpx.AsyncClient, httpx.AsyncClient], files: list[dict[str, str]], status: int, where: list[Any]
) -> None:
    alice, _ = api
    for route, body in (("/execute", {"script": "pass", "files": files}), ("/sessions", {"files": files})):
        answer = await alice.post(route, json=body)
        assert answer.status_code == status, answer.text
        assert answer.json()["errors"][0]["loc"][: len(where)] == where, answer.text
    assert (await alice.get("/jobs")).json()["jobs"] == []


async def test_a_session_takes_and_gives_files(api: tuple[httpx.AsyncClient, httpx.AsyncClient]) -> None:
    alice, bob = api
    created = await alice.post("/sessions", json={"files": [{"path": "seed.txt", "content": "seed"}]})
    assert created.status_code == 201, created.text
    sid = created.json()["session_id"]
    put = await alice.put(f"/sessions/{sid}/files/dir/up.csv", content=b"a,b\n1,2\n")
    assert put.status_code == 200, put.text
    assert put.json() == {"path": "dir/up.csv", "bytes": 8, "sha256": hashlib.sha256(b"a,b\n1,2\n").hexdigest()}
    script = (
        "import os\nprint(open('seed.txt').read(), open('dir/up.csv').read().split()[1])\n"
        "open('made.txt', 'w').write('made')\nos.symlink('/etc/passwd', 'link')\n"
        "open('outputs/o.txt', 'w').write('o')\n"
    )
    view = (await alice.post("/execute", json={"script": script, "session_id": sid})).json()
    assert (view["status"], view["stdout"]) == ("succeeded", "seed 1,2\n"), view
    assert [f["path"] for f in view["files"]] == ["outputs/o.txt"]
    got = await alice.get(f"/sessions/{sid}/files/made.txt")
    assert (got.status_code, got.content) == (200, b"made")
    assert (got.headers["content-disposition"], got.headers["x-content-type-options"]) == ("attachment", "nosniff")
    listing = (await alice.get(f"/sessions/{sid}/files")).json()
    paths = {entry["path"]: entry for entry in listing["files"]}
    assert paths["made.txt"]["bytes"] == 4 and paths["dir/up.csv"]["bytes"] == 8
    assert paths["link"] == {"path": "link", "bytes": None, "skipped": "symlink"}
    assert "outputs/o.txt" not in paths  # collected, then emptied: each script's outputs are its own
    link = await alice.get(f"/sessions/{sid}/files/link")
    assert (link.status_code, link.json()["code"]) == (422, "not_a_file")
    through = await alice.put(f"/sessions/{sid}/files/link", content=b"x")  # never written through the symlink
    assert (through.status_code, through.json()["code"]) == (422, "not_a_file")
    assert through.json()["loc"] is None  # a PUT has no body files to point at (as a GET)
    assert (await alice.get(f"/sessions/{sid}/files/missing")).status_code == 404
    assert (await alice.get(f"/sessions/{sid}/files/a/%2E%2E/%2E%2E/x")).status_code == 422
    assert (await alice.put(f"/sessions/{sid}/files/big", content=b"x" * 1001)).status_code == 413
    for request in (
        bob.get(f"/sessions/{sid}/files/made.txt"),
        bob.get(f"/sessions/{sid}/files"),
        bob.put(f"/sessions/{sid}/files/x", content=b"x"),
    ):
        answer = await request
        assert answer.status_code == 404 and answer.json()["type"].endswith("session-not-found")
    other = (await bob.post("/sessions", json={})).json()["session_id"]
    assert (await bob.get(f"/sessions/{other}/files/made.txt")).status_code == 404


async def test_an_old_runtime_refuses_files_clearly() -> None:
    work_dir = Path(tempfile.mkdtemp(prefix="ptcf", dir="/tmp"))
    settings = Settings(
        work_dir=work_dir, auth="disabled", sandbox_folders_tmpfs_mb=0, instance_id="fake-" + work_dir.name
    )
    image = settings.sandbox_image
    backend = FakeBackend(images={image: {LABEL_RUNTIME: f"{FEATURE_SESSION},{FEATURE_PRIVSEP}"}})
    app = create_app(settings, backend)
    try:
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://fake", timeout=60) as client:
                plain = (await client.post("/execute", json={"script": "open('outputs/x', 'w')"})).json()
                assert plain["files"] == [] and plain["status"] == "failed", plain  # no outputs/ made
                view = (
                    await client.post("/execute", json={"script": "pass", "files": [{"path": "a", "content": ""}]})
                ).json()
                assert view["status"] == "failed" and "rebuild it" in view["error"]["message"], view
    finally:
        shutil.rmtree(work_dir, ignore_errors=True)


async def test_files_that_cannot_be_written_end_the_job_or_the_session(
    api: tuple[httpx.AsyncClient, httpx.AsyncClient],
) -> None:
    alice, _ = api
    clash = [{"path": "a", "content": "x"}, {"path": "a/b", "content": "y"}]  # a is a file: a/b cannot be made
    view = (await alice.post("/execute", json={"script": "print('never')", "files": clash})).json()
    assert (view["status"], view["error"]["type"], view["stdout"]) == ("failed", "files_refused", ""), view
    assert "a/b" in view["error"]["message"]
    answer = await alice.post("/sessions", json={"files": clash})
    assert answer.status_code == 422, answer.text
    problem = answer.json()
    assert (problem["type"].rsplit("/", 1)[1], problem["code"], problem["loc"]) == (
        "file-refused",
        "not_a_file",
        ["body", "files", 1],
    )
    assert (await alice.get("/sessions")).json()["sessions"] == []  # ended, its sandbox removed


async def test_puts_waiting_for_a_busy_session_hold_at_most_max_files_bytes(
    api: tuple[httpx.AsyncClient, httpx.AsyncClient],
) -> None:
    """PUT bodies wait in the service's memory for the session's turn (a script may run for minutes): together at
    most ``max_files_bytes`` (1,000 here) per session, past it 429; once the turn comes they are written."""
    import asyncio

    alice, _ = api
    sid = (await alice.post("/sessions", json={})).json()["session_id"]
    started = await alice.post(
        "/execute", json={"script": "import time\ntime.sleep(2)\n", "session_id": sid, "wait_s": 0}
    )
    assert started.status_code in (200, 202), started.text
    for _ in range(100):  # the script holds the turn
        if (await alice.get(f"/sessions/{sid}")).json()["current_job_id"] is not None:
            break
        await asyncio.sleep(0.05)
    puts = [alice.put(f"/sessions/{sid}/files/f{n}", content=b"x" * 400) for n in range(3)]
    answers = await asyncio.gather(*puts)
    assert sorted(answer.status_code for answer in answers) == [200, 200, 429], [a.text for a in answers]
    refused = next(answer for answer in answers if answer.status_code == 429)
    assert refused.headers["content-type"] == "application/problem+json"
    assert (await alice.put(f"/sessions/{sid}/files/after", content=b"x" * 900)).status_code == 200  # all returned
