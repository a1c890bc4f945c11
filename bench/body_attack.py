"""Issue 11 review, fault 2, measured: large, deeply built request bodies; does the event loop stall?

``python -m bench.body_attack [--clients 8] [--requests 16]`` starts a service (as the tests do), then
``--clients`` threads of key ``mallory`` send ``--requests`` bodies in all of ``POST /execute``
``{"script": "print(1)", "wait_s": 0, "metadata": {"x": [[], [], ...]}}`` (7 MiB: 2.4 million empty arrays;
refused with 422, metadata over 64 KiB) while ``/healthz`` is sampled every 50 ms. Prints one JSON object: the
attack's status codes and wall time, and ``/healthz`` latency (median, max, in ms) during it.
"""

from __future__ import annotations

import argparse
import json
import secrets
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

from service.tenancy import hash_token
from tests.conftest import start_service
from tests.probe import HealthProbe

MALLORY = secrets.token_urlsafe(32)


def attack_body(mib: float = 7.0) -> bytes:
    """An ``/execute`` body whose metadata is ``mib`` MiB of empty arrays (cheap to send, costly to parse)."""
    count = int(mib * 1024 * 1024) // 3
    return b'{"script":"print(1)","wait_s":0,"metadata":{"x":[' + b"[]," * (count - 1) + b"[]]}}"


def _post(client: httpx.Client, body: bytes, headers: dict[str, str]) -> int | str:
    """The status code, or the name of the transport error (a stalled service resets connections)."""
    try:
        return client.post("/execute", content=body, headers=headers).status_code
    except httpx.HTTPError as exc:
        return type(exc).__name__


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--requests", type=int, default=16)
    args = parser.parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="ptc-body-attack-"))
    keys = scratch / "keys"
    keys.write_text(f"mallory:{hash_token(MALLORY)}\n")
    service = start_service(f"bench-body-{secrets.token_hex(4)}", scratch / "svc", PTC_API_KEYS_FILE=str(keys))
    body = attack_body()
    headers = {"authorization": f"Bearer {MALLORY}", "content-type": "application/json"}
    try:

        def attack() -> tuple[list[int | str], float]:
            started = time.perf_counter()
            with (
                httpx.Client(base_url=service.url, timeout=300) as client,
                ThreadPoolExecutor(args.clients) as pool,
            ):
                codes = list(pool.map(lambda _: _post(client, body, headers), range(args.requests)))
            return codes, time.perf_counter() - started

        with HealthProbe(service.url, strict=False) as probe:
            codes, wall_s = attack()
        result: dict[str, Any] = {
            "body_bytes": len(body),
            "clients": args.clients,
            "requests": args.requests,
            "answers": {str(code): codes.count(code) for code in set(codes)},
            "attack_wall_s": round(wall_s, 2),
            **probe.summary_ms(),
        }
        print(json.dumps(result))
    finally:
        service.stop()


if __name__ == "__main__":
    main()
