"""Files in and out of real sandboxes (issue 15, points 4, 5 and 7; docs/files.md).

One service of this module's own (two keys, small caps, no warm pool). A 10,000-row CSV goes in with ``files``;
the script reads it with the standard library's csv, prints a column's mean, writes ``outputs/summary.csv`` and a
PNG it makes by hand; both come back listed and byte for byte. A session takes a file with PUT and gives one
with GET; another session and another key see nothing of it. Symlinks a script plants (to /etc, to /run/ptc) are
never followed: not by PUT, GET, ``files`` nor the outputs' collection. Caps answer 413/422 before any sandbox
starts; a full tmpfs is a clear error. Everything runs under runc and under gVisor. Sandboxes started here:
about ten per runtime.
"""

from __future__ import annotations

import base64
import hashlib
import random
import secrets
import struct
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import docker
import httpx
import pytest

from service.sandbox.labels import LABEL_SANDBOX, LABEL_UID
from service.tenancy import hash_token
from tests.conftest import RUNTIMES, Service, require_runtime, start_service, stop_clean

OTHER_TOKEN = secrets.token_urlsafe(32)


@pytest.fixture(scope="module", params=RUNTIMES)
def files_service(request: pytest.FixtureRequest, engine: docker.DockerClient, scratch: Path) -> Iterator[Service]:
    """The module's service, once per runtime (gVisor's openat follows a symlink to a folder despite O_NOFOLLOW
    when O_DIRECTORY is set: ptc_runtime.files.open_at checks what it opened)."""
    runtime = request.param
    if runtime != "runc":
        require_runtime(engine, runtime)
    token = secrets.token_urlsafe(32)
    svc = start_service(
        f"pytest-{secrets.token_hex(4)}",
        scratch / f"files-{runtime}",
        PTC_RUNTIME=runtime,
        PTC_WARM_POOL_SIZE="0",
        PTC_API_KEYS=f"pytest:{hash_token(token)},other:{hash_token(OTHER_TOKEN)}",
        PTC_MAX_FILES="5",
        PTC_MAX_FILES_BYTES=str(2 * 1024 * 1024),
        PTC_MAX_OUTPUT_FILES="3",
        PTC_MAX_OUTPUT_FILES_BYTES=str(1024 * 1024),
    )
    svc.token = token
    yield svc
    stop_clean(engine, svc)


@pytest.fixture(scope="module")
def api(files_service: Service) -> Iterator[httpx.Client]:
    with files_service.client() as client:
        yield client


@pytest.fixture(scope="module")
def other(files_service: Service) -> Iterator[httpx.Client]:
    with httpx.Client(
        base_url=files_service.url, timeout=120, headers={"Authorization": f"Bearer {OTHER_TOKEN}"}
    ) as client:
        yield client


def run(api: httpx.Client, script: str, **body: Any) -> dict[str, Any]:
    answer = api.post("/execute", json={"script": script, "wait_s": 120, **body})
    assert answer.status_code == 200, answer.text
    view: dict[str, Any] = answer.json()
    return view


CSV_SCRIPT = r"""
import csv, struct, zlib
with open("data/measurements.csv", newline="") as f:
    rows = list(csv.DictReader(f))
values = [float(row["value"]) for row in rows]
mean = sum(values) / len(values)
print(repr(mean))
with open("outputs/summary.csv", "w", newline="") as f:
    writer = csv.writer(f)
    writer.writerow(["rows", "mean", "max"])
    writer.writerow([len(values), repr(mean), repr(max(values))])

def chunk(kind, data):
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

width, height = 40, 30
raw = b"".join(b"\x00" + b"".join(bytes((x * 6 % 256, y * 8 % 256, 128)) for x in range(width)) for y in range(height))
png = (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
       + chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b""))
with open("outputs/chart.png", "wb") as f:
    f.write(png)
"""


def png_size(data: bytes) -> tuple[int, int]:
    """(width, height) of a PNG, after checking its signature, every chunk's CRC and that its image data inflates."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    offset, kinds, idat = 8, [], b""
    width = height = 0
    while offset < len(data):
        (length,) = struct.unpack(">I", data[offset : offset + 4])
        kind, body = data[offset + 4 : offset + 8], data[offset + 8 : offset + 8 + length]
        (crc,) = struct.unpack(">I", data[offset + 8 + length : offset + 12 + length])
        assert crc == zlib.crc32(kind + body) & 0xFFFFFFFF, kind
        if kind == b"IHDR":
            width, height = struct.unpack(">II", body[:8])
        if kind == b"IDAT":
            idat += body
        kinds.append(kind)
        offset += 12 + length
    assert kinds[0] == b"IHDR" and kinds[-1] == b"IEND"
    assert len(zlib.decompress(idat)) == height * (1 + 3 * width)
    return width, height


def test_a_csv_in_and_a_table_and_a_picture_out(api: httpx.Client, other: httpx.Client) -> None:
    rng = random.Random(15)
    values = [round(rng.uniform(-50, 150), 3) for _ in range(10_000)]
    lines = ["id,value,label"] + [f"{n},{value},row-{n}" for n, value in enumerate(values)]
    csv_text = "\n".join(lines) + "\n"
    view = run(api, CSV_SCRIPT, files=[{"path": "data/measurements.csv", "content": csv_text}])
    assert view["status"] == "succeeded", (view["error"], view["stderr"])
    mean = sum(values) / len(values)
    assert float(view["stdout"]) == pytest.approx(mean, rel=1e-12)
    summary = f"rows,mean,max\r\n{len(values)},{float(view['stdout'])!r},{max(values)!r}\r\n".encode()
    listed = {entry["path"]: entry for entry in view["files"]}
    assert set(listed) == {"outputs/summary.csv", "outputs/chart.png"}, view["files"]
    assert listed["outputs/summary.csv"]["bytes"] == len(summary)
    assert listed["outputs/summary.csv"]["sha256"] == hashlib.sha256(summary).hexdigest()
    assert listed["outputs/summary.csv"]["content_type"] == "text/csv"
    assert listed["outputs/chart.png"]["content_type"] == "image/png"
    assert (view["files_omitted"], view["files_skipped"]) == (0, [])
    got = api.get(f"/jobs/{view['job_id']}/files/outputs/summary.csv")
    assert (got.status_code, got.content) == (200, summary)
    picture = api.get(f"/jobs/{view['job_id']}/files/outputs/chart.png")
    assert picture.status_code == 200 and picture.headers["content-type"] == "image/png"
    assert len(picture.content) == listed["outputs/chart.png"]["bytes"]
    assert hashlib.sha256(picture.content).hexdigest() == listed["outputs/chart.png"]["sha256"]
    assert png_size(picture.content) == (40, 30)
    stored = api.get(f"/jobs/{view['job_id']}").json()  # the saved view lists them too
    assert stored["files"] == view["files"]
    for path in ("outputs/missing.csv", "stdout", "owner", "%2E%2E/owner", "files/0"):
        assert api.get(f"/jobs/{view['job_id']}/files/{path}").status_code == 404, path
    foreign = other.get(f"/jobs/{view['job_id']}/files/outputs/summary.csv")
    assert foreign.status_code == 404 and foreign.json()["type"].endswith("job-not-found")


def test_a_session_takes_a_file_and_gives_one(
    api: httpx.Client, other: httpx.Client, engine: docker.DockerClient
) -> None:
    session = api.post("/sessions", json={"files": [{"path": "seed.bin", "content_base64": "AAEC"}]}).json()
    sid = session["session_id"]
    second = api.post("/sessions", json={}).json()["session_id"]
    foreign = other.post("/sessions", json={}).json()["session_id"]
    try:
        put = api.put(f"/sessions/{sid}/files/in/numbers.txt", content=b"1\n2\n3\n")
        assert put.status_code == 200, put.text
        script = (
            "total = sum(int(line) for line in open('in/numbers.txt'))\n"
            "import os\nprint(total, open('seed.bin', 'rb').read().hex(), os.stat('in/numbers.txt').st_uid)\n"
            "open('result.txt', 'w').write(str(total * 10))\n"
        )
        view = run(api, script, session_id=sid)
        (container,) = engine.containers.list(filters={"label": f"{LABEL_SANDBOX}={sid}"})
        uid = container.labels.get(LABEL_UID, "10001")
        assert (view["status"], view["stdout"]) == ("succeeded", f"6 000102 {uid}\n"), view  # the sandbox's user
        got = api.get(f"/sessions/{sid}/files/result.txt")
        assert (got.status_code, got.content) == (200, b"60")
        listing = api.get(f"/sessions/{sid}/files").json()
        paths = {entry["path"]: entry["bytes"] for entry in listing["files"]}
        assert paths["result.txt"] == 2 and paths["in/numbers.txt"] == 6 and paths["seed.bin"] == 3, listing
        assert api.get(f"/sessions/{second}/files/result.txt").status_code == 404  # another session's /tmp
        assert run(api, "import os; print(os.path.exists('result.txt'))", session_id=second)["stdout"] == "False\n"
        for answer in (
            other.get(f"/sessions/{sid}/files/result.txt"),
            other.get(f"/sessions/{sid}/files"),
            other.put(f"/sessions/{sid}/files/x", content=b"x"),
            api.get(f"/sessions/{foreign}/files"),
        ):
            assert answer.status_code == 404 and answer.json()["type"].endswith("session-not-found"), answer.text
    finally:
        api.delete(f"/sessions/{sid}")
        api.delete(f"/sessions/{second}")
        other.delete(f"/sessions/{foreign}")


PLANT = """
import os
os.symlink("/etc/passwd", "passwd")
os.symlink("/etc", "etc")
os.symlink("/run/ptc", "run")
os.symlink("/etc/passwd", "outputs/passwd")
os.symlink("/run/ptc", "outputs/run")
os.mkfifo("outputs/fifo")
open("outputs/real.txt", "w").write("real")
"""


def test_symlinks_a_script_plants_are_never_followed(api: httpx.Client) -> None:
    sid = api.post("/sessions", json={}).json()["session_id"]
    try:
        view = run(api, PLANT, session_id=sid)
        assert view["status"] == "succeeded", view
        assert [entry["path"] for entry in view["files"]] == ["outputs/real.txt"]
        reasons = {entry["path"]: entry["reason"] for entry in view["files_skipped"]}
        assert reasons == {
            "outputs/passwd": "symlink",
            "outputs/run": "symlink",
            "outputs/fifo": "not a regular file",
        }, view
        for path in ("passwd", "etc/passwd", "run/script.py", "run/control.sock"):
            answer = api.get(f"/sessions/{sid}/files/{path}")
            assert (answer.status_code, answer.json()["code"]) == (422, "not_a_file"), (path, answer.text)
        for path in ("passwd", "etc/evil", "run/script.py"):
            answer = api.put(f"/sessions/{sid}/files/{path}", content=b"evil")
            assert (answer.status_code, answer.json()["code"]) == (422, "not_a_file"), (path, answer.text)
        through = run(api, "print(1)", session_id=sid, files=[{"path": "etc/x", "content": "evil"}])
        assert through["status"] == "failed" and through["error"]["type"] == "files_refused", through
        for path in ("%2E%2E/etc/passwd", "a/%2E%2E/%2E%2E/x", "%2Fetc%2Fpasswd", "x%00y"):
            assert api.get(f"/sessions/{sid}/files/{path}").status_code == 422, path
            assert api.put(f"/sessions/{sid}/files/{path}", content=b"evil").status_code == 422, path
        for files in ([{"path": "../x", "content": "evil"}], [{"path": "/etc/x", "content": "evil"}]):
            assert api.post("/execute", json={"script": "pass", "session_id": sid, "files": files}).status_code == 422
        check = run(api, "print(open('/etc/passwd').read().count('evil'), open('passwd').read()[:4])", session_id=sid)
        assert check["stdout"] == "0 root\n", check  # /etc untouched; the link still points where it did
    finally:
        api.delete(f"/sessions/{sid}")


def test_outputs_are_collected_whatever_ends_the_script(api: httpx.Client, request: pytest.FixtureRequest) -> None:
    script = "open('outputs/partial.txt', 'w').write('so far')\nimport time\ntime.sleep(60)\n"
    # A cold job's time limit includes its sandbox's start (no warm pool here): with 2 s, a loaded CI run under
    # gVisor once got timed_out with no file (passes alone), most likely ended before the script's first line.
    view = run(api, script, timeout_s=6)
    assert view["status"] == "timed_out", view
    assert [(f["path"], f["bytes"]) for f in view["files"]] == [("outputs/partial.txt", 6)]
    crashed = run(api, "open('outputs/before.txt', 'w').write('x')\nimport os\nos.abort()\n")
    assert crashed["status"] == "failed" and [f["path"] for f in crashed["files"]] == ["outputs/before.txt"]
    hungry = "open('outputs/before.txt', 'w').write('x')\nhog = bytearray(1024 ** 3)\n"
    oom = run(api, hungry, limits={"memory_mb": 64})
    assert oom["status"] == "oom_killed", oom
    if request.node.callspec.params["files_service"] == "runc":  # gVisor's OOM kill ends the whole sandbox
        assert [f["path"] for f in oom["files"]] == ["outputs/before.txt"], oom


def test_outputs_past_the_caps_are_reported(api: httpx.Client) -> None:
    script = "for n in range(5):\n    open(f'outputs/{n}.txt', 'w').write('x')\n"
    view = run(api, script)
    assert [f["path"] for f in view["files"]] == ["outputs/0.txt", "outputs/1.txt", "outputs/2.txt"]
    assert view["files_omitted"] == 2 and {s["reason"] for s in view["files_skipped"]} == {"cap"}
    big = run(api, "open('outputs/big.bin', 'wb').write(b'x' * (2 * 1024 * 1024))\n")
    assert big["files"] == [] and big["files_skipped"] == [{"path": "outputs/big.bin", "reason": "cap"}], big


def test_outputs_the_service_would_refuse_leave_the_job_its_result(api: httpx.Client) -> None:
    """A file 15 folders deep in outputs/ (17 path components) and a name with a newline: once, the sandbox sent
    them, the service ended it as broken, and a script that exited 0 was a failed job (sandbox_error) with no
    files. Now both are skipped and counted; a folder of more entries than a walk holds is counted too."""
    script = (
        "import os\n"
        "deep = 'outputs/' + '/'.join('d%d' % n for n in range(15))\n"
        "os.makedirs(deep)\n"
        "open(deep + '/deep.txt', 'w').write('deep')\n"
        "open('outputs/new\\nline.txt', 'w').write('nl')\n"
        "open('outputs/ok.txt', 'w').write('ok')\n"
        "os.mkdir('outputs/many')\n"
        "for n in range(3000):\n"
        "    open('outputs/many/%05d' % n, 'w').close()\n"
        "print('done')\n"
    )
    view = run(api, script)
    assert (view["status"], view["exit_code"], view["stdout"]) == ("succeeded", 0, "done\n"), view
    collected = [f["path"] for f in view["files"]]  # the cap: 3, of the first 2,048 the folder lists, in name order
    assert len(collected) == 3 and collected == sorted(collected), collected
    assert all(path.startswith("outputs/many/") for path in collected), collected
    assert view["files_omitted"] == 1 + 3000 + 1 + 1 - 3, view["files_omitted"]  # every entry counted
    reasons = {s["path"]: s["reason"] for s in view["files_skipped"]}
    assert reasons["outputs/d0/d1/d2/d3/d4/d5/d6/d7/d8/d9/d10/d11/d12/d13/d14/deep.txt"].startswith("path not allowed")


def test_caps_refuse_before_any_sandbox_starts(api: httpx.Client) -> None:
    before = len(api.get("/jobs").json()["jobs"])
    six = [{"path": f"f{n}", "content": ""} for n in range(6)]
    large = [{"path": "big", "content_base64": base64.b64encode(b"x" * (2 * 1024 * 1024 + 1)).decode()}]
    for files, status in ((six, 413), (large, 413), ([{"path": "../x", "content": ""}], 422)):
        for route, body in (("/execute", {"script": "pass", "files": files}), ("/sessions", {"files": files})):
            answer = api.post(route, json=body)
            assert answer.status_code == status, answer.text
    assert len(api.get("/jobs").json()["jobs"]) == before


def test_a_full_tmpfs_is_a_clear_error(api: httpx.Client) -> None:
    files = [{"path": "big.bin", "content_base64": base64.b64encode(b"x" * (1536 * 1024)).decode()}]
    view = run(api, "print('never')", files=files, limits={"tmp_mb": 1})
    assert view["status"] == "failed" and view["error"]["type"] == "files_refused", view
    assert "no space" in view["error"]["message"], view
    filler = "open('fill.bin', 'wb').write(b'x' * (2 * 1024 * 1024))\n"
    full = run(api, filler, limits={"tmp_mb": 1})
    assert full["status"] == "failed" and "No space left on device" in full["stderr"], full
