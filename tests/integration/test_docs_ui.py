"""/docs and /redoc in a real browser with the network off (issue 14, point 6), authentication on.

Debian's Chromium (``deploy/local.sh`` installs it for the tests) runs headless, driven over the Chrome DevTools
protocol on a pipe (``--remote-debugging-pipe``: no library, no port). "Network off": every host name but
127.0.0.1 resolves to nothing (``--host-resolver-rules``) and every request not to 127.0.0.1 goes to a proxy
where nothing listens, so a page that needs a CDN fails; ``test_the_rule_bites`` shows it does, with FastAPI's
stock Swagger UI page (its assets on a CDN) served from 127.0.0.1. The browser's requests are recorded: every
one must go to the service. Screenshots land in the test's artifacts folder (``artifacts/docs-ui/`` under
pytest's temporary directory: ``--basetemp`` decides where; nothing is committed).

Without a ``chromium`` binary these tests skip, except under ``CI=true``, where they fail.
"""

from __future__ import annotations

import base64
import fcntl
import json
import os
import secrets
import shutil
import subprocess
import threading
import time
from collections.abc import Iterator
from functools import partial
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi.openapi.docs import get_swagger_ui_html

from tests.conftest import Service, in_ci, start_service

LOOPBACK = "127.0.0.1"
NETWORK_OFF = [
    f"--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE {LOOPBACK}",
    "--proxy-server=http://127.0.0.1:9",  # the discard port: nothing listens there
    f"--proxy-bypass-list={LOOPBACK}",
]
FLAGS = [
    "--headless",
    "--no-sandbox",  # the tests run as root
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
    "--window-size=1280,1600",
    "--remote-debugging-pipe",
]
PAGE_TIMEOUT_S = 60.0


@pytest.fixture(scope="module")
def chromium() -> str:
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found is None:
        message = "no chromium binary (deploy/local.sh setup installs Debian's chromium for the tests)"
        if in_ci():
            pytest.fail(message)
        pytest.skip(message)
    return found


@pytest.fixture(scope="module")
def docs_service(scratch: Path) -> Iterator[Service]:
    """A service with authentication on (its key in ``token``); the pages need no engine."""
    service = start_service(
        f"pytest-docs-{secrets.token_hex(4)}", scratch / f"docs-{secrets.token_hex(4)}", probe="/healthz"
    )
    yield service
    service.stop()


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where the screenshots go: ``<basetemp>/artifacts/docs-ui``."""
    path = tmp_path_factory.getbasetemp() / "artifacts" / "docs-ui"
    path.mkdir(parents=True, exist_ok=True)
    return path


class Browser:
    """One headless Chromium, one page, driven over the DevTools protocol on fds 3 (commands) and 4 (replies
    and events), each message JSON ended by a NUL byte. Records the URL of every request the page makes."""

    def __init__(self, binary: str, profile: Path, network: list[str]) -> None:
        commands, self._commands = os.pipe()
        self._replies, replies = os.pipe()
        # Chromium reads the pipe on fds 3 and 4: bash (dash reads no fd past 9) puts the child's ends there
        # (from fds >= 10, so that neither is 3 or 4 already), then becomes Chromium.
        commands_read, replies_write = (fcntl.fcntl(fd, fcntl.F_DUPFD, 10) for fd in (commands, replies))
        os.close(commands)
        os.close(replies)
        script = f'exec "$@" 3<&{commands_read} 4>&{replies_write} {commands_read}<&- {replies_write}>&-'
        self._process = subprocess.Popen(
            ["/bin/bash", "-c", script, "bash", binary, *FLAGS, *network, f"--user-data-dir={profile}", "about:blank"],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            pass_fds=(commands_read, replies_write),
        )
        os.close(commands_read)
        os.close(replies_write)
        self._buffer = b""
        self._next_id = 0
        self._session = ""
        self.requests: dict[str, str] = {}  # request id -> URL
        self.failed: dict[str, str] = {}  # request id -> why (the errorText, or "blocked:<reason>")
        try:
            target = next(t for t in self.call("Target.getTargets")["targetInfos"] if t["type"] == "page")
            attached = self.call("Target.attachToTarget", targetId=target["targetId"], flatten=True)
            self._session = attached["sessionId"]
            self.call("Network.enable", session=True)
            self.call("Page.enable", session=True)
        except BaseException:
            self.close()
            raise

    def call(self, method: str, session: bool = False, **params: Any) -> dict[str, Any]:
        """Send a command and wait for its reply (events met meanwhile are recorded)."""
        self._next_id += 1
        message: dict[str, Any] = {"id": self._next_id, "method": method, "params": params}
        if session:
            message["sessionId"] = self._session
        os.write(self._commands, json.dumps(message).encode() + b"\0")
        while True:
            reply = self._receive()
            if reply.get("id") == self._next_id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                result: dict[str, Any] = reply.get("result", {})
                return result
            self._event(reply)

    def _receive(self) -> dict[str, Any]:
        while b"\0" not in self._buffer:
            chunk = os.read(self._replies, 1 << 20)
            if not chunk:
                raise RuntimeError("chromium closed its DevTools pipe")
            self._buffer += chunk
        message, _, self._buffer = self._buffer.partition(b"\0")
        parsed: dict[str, Any] = json.loads(message)
        return parsed

    def _event(self, event: dict[str, Any]) -> None:
        params = event.get("params", {})
        if event.get("method") == "Network.requestWillBeSent":
            self.requests[params["requestId"]] = params["request"]["url"]
        elif event.get("method") == "Network.loadingFailed":
            reason = params.get("blockedReason")
            self.failed[params["requestId"]] = f"blocked:{reason}" if reason else params.get("errorText", "")

    def open(self, url: str) -> None:
        self.call("Page.navigate", session=True, url=url)

    def evaluate(self, expression: str) -> Any:
        """The value of a JavaScript expression (a promise is awaited), at most ``PAGE_TIMEOUT_S`` seconds."""
        result = self.call(
            "Runtime.evaluate",
            session=True,
            expression=expression,
            awaitPromise=True,
            returnByValue=True,
            timeout=PAGE_TIMEOUT_S * 1000,
        )
        if "exceptionDetails" in result:
            raise AssertionError(f"in the page: {result['exceptionDetails']}")
        return result["result"].get("value")

    def wait_for(self, condition: str, timeout_s: float = PAGE_TIMEOUT_S) -> Any:
        """Poll a JavaScript expression until it is truthy; its value, or None when ``timeout_s`` passed."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            value = self.evaluate(condition)
            if value:
                return value
            time.sleep(0.2)
        return None

    def screenshot(self, path: Path) -> None:
        data = self.call("Page.captureScreenshot", session=True, format="png")["data"]
        path.write_bytes(base64.b64decode(data))

    def close(self) -> None:
        self._process.terminate()
        try:
            self._process.wait(10)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()
        os.close(self._commands)
        os.close(self._replies)


@pytest.fixture
def browser(chromium: str, tmp_path: Path) -> Iterator[Browser]:
    instance = Browser(chromium, tmp_path / "profile", NETWORK_OFF)
    yield instance
    instance.close()


OPERATIONS = "document.querySelectorAll('.opblock .opblock-summary-path').length"
STATUS = "((document.querySelector('.live-responses-table tbody .response-col_status') || {}).textContent || '').trim()"


def click(selector: str) -> str:
    return f"(() => {{ const e = document.querySelector({json.dumps(selector)}); e && e.click(); return !!e; }})()"


def assert_only_the_service(browser: Browser, base: str) -> None:
    """Every request the page made went to ``base`` (or stayed in the page: data:, blob:), but those the pages'
    Content-Security-Policy stopped before they were sent (ReDoc's bundle always shows a logo from its maker's
    CDN: the policy's img-src refuses it, the page renders without it)."""
    local = (base + "/", "data:", "blob:", "about:")
    outside = {i: u for i, u in browser.requests.items() if not u.startswith(local)}
    sent = {u for i, u in outside.items() if browser.failed.get(i) != "blocked:csp"}
    assert not sent, (sent, browser.failed)


def test_swagger_ui_renders_offline_and_calls_operations_with_a_key(
    browser: Browser, docs_service: Service, artifacts: Path
) -> None:
    browser.open(f"{docs_service.url}/docs")
    count = browser.wait_for(f"{OPERATIONS} >= 10 && {OPERATIONS}")
    browser.screenshot(artifacts / "docs.png")
    assert count, "no operations rendered (see docs.png)"
    paths = browser.evaluate(
        "[...document.querySelectorAll('.opblock .opblock-summary-path')].map(e => e.dataset.path)"
    )
    assert {"/execute", "/jobs/{job_id}", "/sessions"} <= set(paths), paths
    assert browser.evaluate("!!document.querySelector('button.authorize')"), "no Authorize button"

    # Try it out on GET /sessions without a key: 401; then Authorize with the key: 200.
    block = "#operations-default-list_sessions_sessions_get"
    assert browser.evaluate(click(f"{block} .opblock-summary-control"))
    assert browser.wait_for(click(f"{block} .try-out__btn"))
    assert browser.wait_for(click(f"{block} .execute"))
    assert browser.wait_for(STATUS) == "401", browser.evaluate(STATUS)
    assert browser.evaluate(click("button.authorize"))
    assert browser.wait_for("!!document.querySelector('.modal-ux input')")
    token = json.dumps(docs_service.token)
    browser.evaluate(
        "(() => { const input = document.querySelector('.modal-ux input');"
        " Object.getOwnPropertyDescriptor(HTMLInputElement.prototype, 'value').set.call(input, " + token + ");"
        " input.dispatchEvent(new Event('input', {bubbles: true})); })()"
    )
    assert browser.evaluate(click(".modal-ux .auth-btn-wrapper button.authorize"))
    assert browser.wait_for(click(".modal-ux .btn-done"))
    assert browser.wait_for("!document.querySelector('.modal-ux')")
    assert browser.evaluate(click(f"{block} .btn-clear")) is not None
    assert browser.wait_for(click(f"{block} .execute"))
    status = browser.wait_for(f"{STATUS} === '200' && {STATUS}")
    browser.screenshot(artifacts / "docs-authorized.png")
    assert status == "200", browser.evaluate(STATUS)
    assert_only_the_service(browser, docs_service.url)


def test_redoc_renders_offline(browser: Browser, docs_service: Service, artifacts: Path) -> None:
    browser.open(f"{docs_service.url}/redoc")
    found = browser.wait_for(
        "[...document.querySelectorAll('[data-section-id^=\"operation/\"]')].map(e => e.dataset.sectionId)"
        ".filter((v, i, a) => a.indexOf(v) === i)"
    )
    browser.screenshot(artifacts / "redoc.png")
    assert found and len(found) >= 10, found
    assert "operation/execute_execute_post" in found
    assert_only_the_service(browser, docs_service.url)


def test_the_rule_bites(browser: Browser, docs_service: Service, artifacts: Path, tmp_path: Path) -> None:
    """FastAPI's stock page (Swagger UI from a CDN), served from 127.0.0.1, renders nothing with the network
    off: the rendering above is the service's own assets at work, not a reachable CDN."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "openapi.json").write_bytes(httpx.get(f"{docs_service.url}/openapi.json", timeout=10).content)
    (site / "index.html").write_bytes(get_swagger_ui_html(openapi_url="openapi.json", title="stock").body)
    handler = partial(_QuietHandler, directory=str(site))
    server = ThreadingHTTPServer((LOOPBACK, 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        browser.open(f"http://{LOOPBACK}:{server.server_address[1]}/index.html")
        rendered = browser.wait_for(OPERATIONS, timeout_s=10)
        browser.screenshot(artifacts / "stock-page-offline.png")
    finally:
        server.shutdown()
        server.server_close()
    assert not rendered
    cdn = {i for i, u in browser.requests.items() if u.startswith("https://")}
    assert cdn, browser.requests  # it asked for the CDN's assets...
    assert all(browser.failed.get(i, "").startswith("net::ERR_") for i in cdn), browser.failed  # ...in vain


class _QuietHandler(SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass
