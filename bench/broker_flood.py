"""Issue 11 review, fault 1, measured in-process: how long does the broker's event loop stall while a script
floods ~1 MiB argument lines of ``[[],[],...]`` (8 echo calls) and while an http tool answers 8 MiB of it?

``python -m bench.broker_flood`` runs a real ``Broker`` on a real unix socket (the script's side in a thread)
and prints one JSON object: the loop's longest gaps between 10 ms ticks (s) and the count over 100 ms.
"""

from __future__ import annotations

import asyncio
import json
import tempfile
from pathlib import Path

import orjson

from tests.toolserver import ToolServer
from tests.unit.test_broker_work import ANY_ARGS, FLAT, Script, broker, long_stalls, stalls_while


async def _measure(tmp: Path) -> dict[str, object]:
    out: dict[str, object] = {}
    line = orjson.dumps({"id": 1, "tool": "e", "args": {"x": FLAT}}) + b"\n"
    async with broker(tmp / "a", [{"name": "e", "parameters": ANY_ARGS, "endpoint": {"kind": "echo"}}]):
        script = Script(tmp / "a" / "tools.sock")
        gaps, _ = await stalls_while(lambda: [script.call_raw(line) for _ in range(8)])
        script.close()
    out["arguments_1MiB_x8"] = {"max_gap_s": round(max(gaps), 3), "gaps_over_100ms": long_stalls(gaps)}
    server = ToolServer().start()
    tool = {"name": "big", "parameters": ANY_ARGS, "endpoint": {"kind": "http", "url": server.url("nested")}}
    async with broker(tmp / "b", [tool], budget_s=30.0):
        script = Script(tmp / "b" / "tools.sock")
        gaps, _ = await stalls_while(lambda: [script.call_raw(b'{"id":1,"tool":"big","args":{}}\n') for _ in range(3)])
        script.close()
    server.stop()
    out["http_result_8MiB_x3"] = {"max_gap_s": round(max(gaps), 3), "gaps_over_100ms": long_stalls(gaps)}
    return out


def main() -> None:
    tmp = Path(tempfile.mkdtemp(prefix="ptc-flood-"))
    for part in ("a", "b"):
        (tmp / part).mkdir()
    print(json.dumps(asyncio.run(_measure(tmp))))


if __name__ == "__main__":
    main()
