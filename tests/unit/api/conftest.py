"""The app in-process without its lifespan (no engine): answers that need no service, as a running service gives."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI

from service.api import create_app
from service.settings import Settings
from service.tenancy import hash_token

TOKEN = "unit-api-token-0123456789"


@pytest.fixture
def app(tmp_path: Path) -> FastAPI:
    return create_app(Settings(work_dir=tmp_path, api_keys=f"unit:{hash_token(TOKEN)}"))


@pytest.fixture
async def client(app: FastAPI) -> AsyncIterator[httpx.AsyncClient]:
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    headers = {"Authorization": f"Bearer {TOKEN}"}
    async with httpx.AsyncClient(transport=transport, base_url="http://test", headers=headers) as c:
        yield c
