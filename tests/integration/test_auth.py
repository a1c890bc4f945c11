"""Authentication (service/auth.py): bearer API keys by SHA-256, compared in constant time.

In-process tests drive the app through ``httpx.ASGITransport`` (no engine
needed: authentication answers before any route runs); the last ones go
through the real service process, started with a key by ``start_service``.
"""

from __future__ import annotations

import httpx

from tests.conftest import Service
from tests.unit.test_auth import bearer

ALICE, BOB = "alice-token-0123456789", "bob-token-9876543210"


def test_service_no_key_wrong_key_right_key(service: Service) -> None:
    with httpx.Client(base_url=service.url, timeout=30) as anonymous:
        assert anonymous.get("/healthz").status_code == 200
        assert anonymous.get("/readyz").status_code == 200
        missing = anonymous.get("/jobs")
        assert missing.status_code == 401 and missing.headers["www-authenticate"].startswith("Bearer")
        wrong = anonymous.get(
            "/jobs", headers=bearer(service.token[:-1] + ("B" if service.token.endswith("A") else "A"))
        )
        assert wrong.status_code == 401 and "invalid_token" in wrong.headers["www-authenticate"]
        assert anonymous.post("/execute", json={"script": "print(1)"}).status_code == 401
        assert anonymous.get("/jobs", headers=service.headers).status_code == 200
