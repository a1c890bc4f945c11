"""Issue 11 review, fault 3, measured: one key compiles large manifests; how long does another key's print(1) take?

``python -m bench.manifest_attack [--manifests 8] [--tools 1000]`` starts a service (as the tests do), times
key ``pytest``'s ``POST /execute`` of ``print(1)`` alone, then again while key ``alice`` sends ``--manifests``
manifests to ``POST /stubs`` at once: ``--tools`` tools of 25 parameters each
``{"anyOf": [{"type": "string", "pattern": "^(a|b)*c$"}, {"enum": [0, ..., 19]}]}``, each manifest different
(by its first tool's description, so none is a cache hit). Prints one JSON object: the two times (s), alice's
answers by status and her wall time.
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

ALICE = secrets.token_urlsafe(32)
PARAMETER = {"anyOf": [{"type": "string", "pattern": "^(a|b)*c$"}, {"enum": list(range(20))}]}


def manifest(n: int, tools: int) -> list[dict[str, Any]]:
    """``tools`` tools of 25 such parameters; ``n`` makes the manifest differ from the others."""
    return [
        {
            "name": f"t{i}",
            "description": f"manifest {n}" if i == 0 else "",
            "parameters": {"type": "object", "properties": {f"p{j}": PARAMETER for j in range(25)}},
            "endpoint": {"kind": "echo"},
        }
        for i in range(tools)
    ]


def _print_1(api: httpx.Client) -> float:
    started = time.perf_counter()
    answer = api.post("/execute", json={"script": "print(1)", "wait_s": 120})
    assert answer.status_code == 200, answer.text
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--manifests", type=int, default=8)
    parser.add_argument("--tools", type=int, default=1000)
    args = parser.parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="ptc-manifest-attack-"))
    keys = scratch / "keys"
    keys.write_text(f"alice:{hash_token(ALICE)}\n")
    service = start_service(f"bench-manifest-{secrets.token_hex(4)}", scratch / "svc", PTC_API_KEYS_FILE=str(keys))
    manifests = [manifest(n, args.tools) for n in range(args.manifests)]
    try:
        with (
            service.client(timeout=300) as api,
            httpx.Client(base_url=service.url, timeout=600, headers={"Authorization": f"Bearer {ALICE}"}) as alice,
            ThreadPoolExecutor(args.manifests) as pool,
        ):
            _print_1(api)  # warm
            alone = _print_1(api)
            started = time.perf_counter()
            sent = [pool.submit(alice.post, "/stubs", json={"tools": tools}) for tools in manifests]
            time.sleep(1)  # the compiles are under way
            attacked = _print_1(api)
            codes = [future.result().status_code for future in sent]
            alice_s = time.perf_counter() - started
        result = {
            "manifest_bytes": len(json.dumps(manifests[0])),
            "print_1_alone_s": round(alone, 2),
            "print_1_during_s": round(attacked, 2),
            "alice_answers": {str(code): codes.count(code) for code in set(codes)},
            "alice_wall_s": round(alice_s, 1),
        }
        print(json.dumps(result))
    finally:
        service.stop()


if __name__ == "__main__":
    main()
