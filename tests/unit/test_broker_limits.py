"""One job cannot hurt the service or other jobs through its broker, and its records are final once it ends."""

from __future__ import annotations

from pathlib import Path

from tests.conftest import execute, start_service

ECHO = {"kind": "echo"}


def test_records_past_the_record_cap_keep_the_call_but_not_its_data(scratch: Path) -> None:
    svc = start_service("pytest-budget", scratch / "budget", PTC_MAX_RECORD_BYTES="100000")
    try:
        with svc.client() as api:
            script = "import tools\nfor i in range(10):\n    print(len(tools.f(x='y' * 20000)['args']['x']))\n"
            view = execute(api, script, [{"name": "f", "parameters": {"properties": {"x": {}}}, "endpoint": ECHO}])
            assert view["status"] == "succeeded"
            assert view["stdout"] == "20000\n" * 10  # every call worked: the cap thins records, not calls
            assert [c["status"] for c in view["calls"]] == ["ok"] * 10
            kept = [c for c in view["calls"] if c["args"] is not None]
            dropped = [c for c in view["calls"] if c["args_dropped_bytes"] is not None]
            assert kept and dropped and len(kept) + len(dropped) == 10
            assert kept[0]["args"] == {"x": "y" * 20000} and kept[0]["result"]["args"] == {"x": "y" * 20000}
            assert all(c["args"] is None and c["args_dropped_bytes"] == len('{"x":""}') + 20000 for c in dropped)
            assert all(c["result"] is None and c["result_dropped_bytes"] > 20000 for c in dropped)
    finally:
        svc.stop()
