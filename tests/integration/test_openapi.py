"""The served OpenAPI document (service/api/openapi.py), and schemathesis against the running service.

The schemathesis run is bounded: a few examples per operation (``-n``), one
worker, a request timeout above the service's longest wait, and a hard limit on
the whole run. It runs against ``restricted_service``, whose timeouts and waits
are at most 10 s (so no generated job runs long) and whose egress rules let no
generated manifest reach anything but the test tool server.

Checks: every built-in response check (no 5xx, status codes, content types,
headers and bodies as documented, invalid requests refused, missing auth
refused, undeclared methods answered 405 with ``Allow``) except
``positive_data_acceptance``: the service refuses, by design, schema-valid
values past its configured maxima (``timeout_s`` over ``PTC_MAX_TIMEOUT_S``,
a manifest entry without a usable ``name``), which that check counts as failures.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import Service

CHECKS = [
    "not_a_server_error",
    "status_code_conformance",
    "content_type_conformance",
    "response_headers_conformance",
    "response_schema_conformance",
    "negative_data_rejection",
    "missing_required_header",
    "unsupported_method",
    "ignored_auth",
]


EXAMPLES_PER_OPERATION = 8


RUN_LIMIT_S = 300


def test_schemathesis_finds_no_server_error_and_no_spec_violation(restricted_service: Service, tmp_path: Path) -> None:
    with restricted_service.client() as api:
        response = api.get("/openapi.json")
        assert response.status_code == 200
        (tmp_path / "openapi.json").write_text(json.dumps(response.json()))
    command = [
        str(Path(sys.executable).parent / "schemathesis"),
        "run",
        str(tmp_path / "openapi.json"),
        "--url",
        restricted_service.url,
        "--header",
        f"Authorization: Bearer {restricted_service.token}",
        "--checks",
        ",".join(CHECKS),
        "--max-examples",
        str(EXAMPLES_PER_OPERATION),
        "--workers",
        "1",
        "--request-timeout",
        "30",
        "--seed",
        "20261130",
        "--no-color",
    ]
    try:
        done = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=RUN_LIMIT_S)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"schemathesis did not end within {RUN_LIMIT_S} s:\n{exc.stdout!s}"[-20000:])
    assert done.returncode == 0, (done.stdout + done.stderr)[-20000:]
    assert " passed" in done.stdout
    with restricted_service.client() as api:
        assert api.get("/healthz").status_code == 200
