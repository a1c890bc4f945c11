"""A large tool result is parsed, checked and encoded with the collector paused until its parsed value is gone
(``service.broker.checks.check_result``): no collection walks its objects, which held the event loop (the cause of
the ``/healthz`` stalls of ``tests/integration/test_broker_limits.py``: ~150 ms per collection for 8 MiB results)."""

from __future__ import annotations

import gc
from typing import Any

from service.broker.checks import check_result
from service.toolkit.cache import compile_manifest
from service.toolkit.endpoints import RawJson


def test_a_large_results_objects_never_meet_the_collector() -> None:
    (tool,) = compile_manifest([{"name": "big", "endpoint": {"kind": "echo"}}]).tools.values()
    body = b"[" + b",".join(b"[1]" for _ in range(200_000)) + b"]"  # 200,001 lists: each one a tracked object
    started: list[int] = []

    def seen(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            started.append(info["generation"])

    gc.collect()
    gc.callbacks.append(seen)
    try:
        checked = check_result(tool, RawJson(body))
    finally:
        gc.callbacks.remove(seen)
    assert checked.result_json is not None and checked.problem is None
    assert started == [], f"collections while the result's objects lived: generations {started[:10]}"
