"""The API documents for people: Swagger UI at ``GET /docs``, ReDoc at ``GET /redoc`` (both render
``GET /openapi.json``), usable with no internet access.

Their scripts, styles and icon come from the ``fastapi-offline`` package (the Swagger UI and ReDoc bundles it
ships, MIT), read once by ``load_assets`` when the app is built and served from memory at
``GET /docs/assets/<name>``: no page loads anything from another origin. The pages carry a
``Content-Security-Policy`` that says so to the browser (``default-src 'self'``: a script or style from a CDN
would be refused even where the network would allow it), and ``frame-ancestors 'none'`` (the pages take an
API key: no other site may frame them).

``OPEN_PATHS`` (the pages, their assets and ``/openapi.json``) answer without an API key (``app.create_app``
adds them to ``auth.open_paths``): the document describes the API the code defines, the same for every key and
every tenant, and holds no tenant's data. Swagger UI's Authorize button takes a key (the ``bearerAuth`` scheme
of ``service.api.openapi``), which its "Try it out" calls then send.
"""

from __future__ import annotations

from importlib import metadata, resources

from fastapi import APIRouter, Request
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.responses import HTMLResponse, Response

from service.api.bodies import ParsedOffLoop

OPENAPI_PATH = "/openapi.json"
ASSET_PREFIX = "/docs/assets/"
ASSET_PACKAGE = "fastapi_offline"
ASSETS: dict[str, str] = {
    "swagger-ui-bundle.js": "text/javascript; charset=utf-8",
    "swagger-ui.css": "text/css; charset=utf-8",
    "redoc.standalone.js": "text/javascript; charset=utf-8",
    "favicon.png": "image/png",
}
"""The files of ``fastapi_offline/static`` that are served, and their media types."""

OPEN_PATHS = frozenset({"/docs", "/redoc", OPENAPI_PATH, *(ASSET_PREFIX + name for name in ASSETS)})

# Inline scripts: FastAPI's pages start Swagger UI and ReDoc from one. Images as data: URIs and ReDoc's web
# worker (a blob: URL) are the bundles' own. connect-src 'self': the key a user enters goes nowhere else.
PAGE_POLICY = (
    "default-src 'self'; script-src 'self' 'unsafe-inline'; style-src 'self' 'unsafe-inline'; "
    "img-src 'self' data:; font-src 'self' data:; worker-src 'self' blob:; connect-src 'self'; "
    "frame-ancestors 'none'; base-uri 'none'; form-action 'self'"
)
SWAGGER_UI_PARAMETERS = {
    "validatorUrl": None,  # else Swagger UI asks an online validator about the document
    "persistAuthorization": False,  # the key stays in the page, not in the browser's storage
    "displayRequestDuration": True,
}
ASSET_CACHE = "public, max-age=86400"

router = APIRouter(route_class=ParsedOffLoop, include_in_schema=False)


def load_assets() -> dict[str, bytes]:
    """The bytes of each file in ``ASSETS``, from the installed ``fastapi-offline`` package (about 2.8 MB).

    Raises:
        ModuleNotFoundError: the package is not installed (it is a dependency of this project).
        FileNotFoundError: the package has no longer one of the files.
    """
    static = resources.files(ASSET_PACKAGE) / "static"
    return {name: (static / name).read_bytes() for name in ASSETS}


def _asset_url(request: Request, name: str) -> str:
    """The URL of an asset, below the app's root path, versioned by the package's version (for caches)."""
    return f"{request.scope.get('root_path', '')}{ASSET_PREFIX}{name}?v={metadata.version(ASSET_PACKAGE)}"


def _page(response: HTMLResponse) -> HTMLResponse:
    response.headers["Content-Security-Policy"] = PAGE_POLICY
    response.headers["X-Content-Type-Options"] = "nosniff"
    response.headers["Referrer-Policy"] = "no-referrer"
    return response


@router.get("/docs")
async def swagger_ui(request: Request) -> HTMLResponse:
    """Swagger UI on ``/openapi.json``, from the service's own assets."""
    return _page(
        get_swagger_ui_html(
            openapi_url=request.scope.get("root_path", "") + OPENAPI_PATH,
            title=f"{request.app.title} - Swagger UI",
            swagger_js_url=_asset_url(request, "swagger-ui-bundle.js"),
            swagger_css_url=_asset_url(request, "swagger-ui.css"),
            swagger_favicon_url=_asset_url(request, "favicon.png"),
            oauth2_redirect_url=None,
            swagger_ui_parameters=SWAGGER_UI_PARAMETERS,
        )
    )


@router.get("/redoc")
async def redoc(request: Request) -> HTMLResponse:
    """ReDoc on ``/openapi.json``, from the service's own assets (no web fonts)."""
    return _page(
        get_redoc_html(
            openapi_url=request.scope.get("root_path", "") + OPENAPI_PATH,
            title=f"{request.app.title} - ReDoc",
            redoc_js_url=_asset_url(request, "redoc.standalone.js"),
            redoc_favicon_url=_asset_url(request, "favicon.png"),
            with_google_fonts=False,
        )
    )


def _asset_route(name: str, media_type: str) -> None:
    """``GET /docs/assets/<name>``: one route per file (an explicit table, no path parameter)."""

    async def asset(request: Request) -> Response:
        body: bytes = request.app.state.docs_assets[name]
        headers = {"Cache-Control": ASSET_CACHE, "X-Content-Type-Options": "nosniff"}
        return Response(body, media_type=media_type, headers=headers)

    asset.__name__ = asset.__qualname__ = "asset_" + name.replace("-", "_").replace(".", "_")
    asset.__module__ = __name__
    router.add_api_route(ASSET_PREFIX + name, asset, methods=["GET"])


for _name, _media_type in ASSETS.items():
    _asset_route(_name, _media_type)
