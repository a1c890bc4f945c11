"""No sandbox outlives its job: start-up sweep after a crash (kill -9), and every container labelled."""

from __future__ import annotations

import secrets
from pathlib import Path

import pytest

from tests.conftest import start_service


def test_a_second_instance_cannot_share_a_work_dir(scratch: Path) -> None:
    first = start_service(f"pytest-{secrets.token_hex(4)}", scratch / "shared")
    try:
        with pytest.raises(RuntimeError, match="another ptc-sandbox instance is using"):
            start_service(f"pytest-{secrets.token_hex(4)}", scratch / "shared")
        assert first.process.poll() is None
    finally:
        first.stop()
