"""Issue 14 review: how much a job whose tool calls each wait 1 ms (an approval that never comes, or a client that
never answers) makes the service write, while another key's ``print(1)`` jobs run beside it.

``python -m bench.status_flaps [calls] [arg_bytes] [approval|client]`` runs the service in-process on the fake
backend (no engine) and prints one JSON object: the job's status and calls, the store's saves and bytes written,
and the other key's job's round trip (s). Each call flips the job ``running`` / ``waiting`` twice. Measured on the
review's 2-core machine, 2,000 calls of 5 KB arguments (``bench/results/status_flaps_*.json``): a save of the whole
view per flip wrote 1,068 views, 1.5 GB (11 s); saves coalesced and 0.5 s apart (``runner.STATUS_SAVE_INTERVAL_S``):
21 views, 59 MB (6 s).
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from typing import Any

from service.store import StoredJob
from service.store.sqlite_jobs import SQLiteJobRecords
from tests.unit.test_approvals import ALICE, BOB, ECHO, auth, service


async def _measure(calls: int, arg_bytes: int, kind: str) -> dict[str, Any]:
    saves = {"count": 0, "bytes": 0}
    put = SQLiteJobRecords.put

    async def counted(self: SQLiteJobRecords, job: StoredJob) -> None:
        saves["count"] += 1
        saves["bytes"] += len(job.view)
        await put(self, job)

    SQLiteJobRecords.put = counted  # type: ignore[method-assign]
    tool: dict[str, Any] = {"name": "w", "parameters": {"properties": {"p": {"type": "string"}}}}
    if kind == "approval":
        tool.update(approval="always", approval_timeout_s=0.001, endpoint=ECHO)
    else:
        tool.update(timeout_s=0.001, endpoint={"kind": "client"})
    script = (
        f"import tools\nfor i in range({calls}):\n    try:\n        tools.w(p='x' * {arg_bytes})\n"
        "    except tools.ToolError:\n        pass\nprint('done')\n"
    )
    out: dict[str, Any] = {"calls": calls, "arg_bytes": arg_bytes, "kind": kind, "other_key_s": []}
    try:
        async with service() as (client, _):
            started = time.perf_counter()
            body = {"script": script, "tools": [tool], "wait_s": 0, "timeout_s": 600}
            job_id = (await client.post("/execute", json=body, headers=auth(ALICE))).json()["job_id"]
            while True:
                await asyncio.sleep(2)
                t0 = time.perf_counter()
                await client.post("/execute", json={"script": "print(1)", "wait_s": 60}, headers=auth(BOB))
                out["other_key_s"].append(round(time.perf_counter() - t0, 3))
                view = (await client.get(f"/jobs/{job_id}", headers=auth(ALICE))).json()
                if view["status"] not in ("queued", "running", "waiting"):
                    break
            out.update(status=view["status"], job_calls=len(view["calls"]), job_s=round(time.perf_counter() - started))
    finally:
        SQLiteJobRecords.put = put  # type: ignore[method-assign]
    out.update(saves=saves["count"], saved_mb=round(saves["bytes"] / 1e6, 1))
    return out


def main() -> None:
    calls = int(sys.argv[1]) if len(sys.argv) > 1 else 2000
    arg_bytes = int(sys.argv[2]) if len(sys.argv) > 2 else 5000
    kind = sys.argv[3] if len(sys.argv) > 3 else "approval"
    print(json.dumps(asyncio.run(_measure(calls, arg_bytes, kind))))


if __name__ == "__main__":
    main()
