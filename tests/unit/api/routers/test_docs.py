"""The API documents (service/api/routers/docs.py): /docs and /redoc from the service's own assets, open
without a key while every operation still needs one. The browser test is tests/integration/test_docs_ui.py."""

from __future__ import annotations

import re

import httpx
import pytest
from fastapi import FastAPI

from service.api import problems
from service.api.routers.docs import ASSETS, load_assets

NO_KEY = {"Authorization": ""}


@pytest.mark.parametrize("page", ["/docs", "/redoc"])
async def test_the_pages_load_only_the_services_own_assets_without_a_key(client: httpx.AsyncClient, page: str) -> None:
    response = await client.get(page, headers=NO_KEY)
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/html")
    urls = re.findall(r"""(?:src|href)=["']([^"']+)""", response.text)
    assert urls and all(url.startswith("/docs/assets/") for url in urls), urls  # before: a CDN's
    assert "https://" not in response.text and "http://" not in response.text
    policy = response.headers["content-security-policy"]
    assert "default-src 'self'" in policy and "connect-src 'self'" in policy and "frame-ancestors 'none'" in policy
    for url in urls:
        asset = await client.get(url, headers=NO_KEY)
        assert asset.status_code == 200 and asset.content, url


async def test_each_asset_is_the_packages_file_with_its_media_type(client: httpx.AsyncClient) -> None:
    files = load_assets()
    for name, media_type in ASSETS.items():
        response = await client.get(f"/docs/assets/{name}", headers=NO_KEY)
        assert response.headers["content-type"] == media_type
        assert response.content == files[name] and len(files[name]) > 1000
        assert response.headers["x-content-type-options"] == "nosniff"


async def test_swagger_ui_asks_no_online_validator_and_keeps_no_key(client: httpx.AsyncClient) -> None:
    text = (await client.get("/docs", headers=NO_KEY)).text
    assert '"validatorUrl": null' in text and '"persistAuthorization": false' in text


async def test_the_document_is_open_and_offers_the_bearer_scheme(client: httpx.AsyncClient) -> None:
    """Swagger UI's Authorize button comes from ``bearerAuth``; the operations still need the key."""
    spec = (await client.get("/openapi.json", headers=NO_KEY)).json()
    assert spec["components"]["securitySchemes"]["bearerAuth"] == {
        "type": "http",
        "scheme": "bearer",
        "description": spec["components"]["securitySchemes"]["bearerAuth"]["description"],
    }
    assert spec["security"] == [{"bearerAuth": []}]
    assert not any(path.startswith(("/docs", "/redoc")) for path in spec["paths"])
    refused = await client.get("/sessions", headers=NO_KEY)
    assert refused.status_code == 401 and refused.json()["type"] == problems.UNAUTHORIZED.uri


async def test_only_the_listed_assets_are_served(client: httpx.AsyncClient) -> None:
    assert (await client.get("/docs/assets/other.js", headers=NO_KEY)).status_code == 401  # not an open path
    missing = await client.get("/docs/assets/../../pyproject.toml")
    assert missing.status_code == 404 and missing.json()["type"] == problems.ROUTE_NOT_FOUND.uri
    missing = await client.get("/docs/assets/other.js")
    assert missing.status_code == 404 and missing.json()["type"] == problems.ROUTE_NOT_FOUND.uri


def test_fastapis_cdn_pages_are_not_installed(app: FastAPI) -> None:
    assert app.docs_url is None and app.redoc_url is None
