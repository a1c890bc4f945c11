"""Command line.

``ptc-sandbox serve [--host H] [--port P]`` runs the service (settings come from ``PTC_*`` variables);
``ptc-sandbox hash-key NAME [--generate]`` prints the ``PTC_API_KEYS`` entry of a token (read from stdin,
or a new one printed first); ``ptc-sandbox mcp [--url URL] [--token T] [--toolset ID]`` serves MCP over stdio,
forwarding to a running service (``mcp.stdio``); ``ptc-sandbox migrate`` upgrades the job store;
``ptc-sandbox sweep --instance ID [--unregistered]`` removes a retired replica's sandboxes (``service.replicas.sweep``).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import resource
import secrets
import sys

import prometheus_client
import uvicorn
from pydantic import ValidationError

from service import workdir
from service.api import create_app
from service.api.connections import ConnectionGuard, guarded_protocol, parse_networks
from service.api.draining import DrainingServer
from service.errors import InsecureConfig, InstanceIdInUse, SandboxError, StoreUnavailable, WorkDirBusy
from service.observability import logs
from service.settings import Settings
from service.tenancy import KEY_NAME, hash_token

TOKEN_PREFIX = "ptc_"


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``ptc-sandbox`` console script; returns the exit code."""
    parser = argparse.ArgumentParser(prog="ptc-sandbox", description="Programmatic Tool Calling execution service.")
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="run the HTTP service")
    serve.add_argument("--host", help="bind address (default: PTC_HOST or 127.0.0.1)")
    serve.add_argument("--port", type=int, help="port (default: PTC_PORT or 8080)")
    hash_key = commands.add_parser(
        "hash-key", help="print the PTC_API_KEYS entry (NAME:sha256hex) of a token read from stdin"
    )
    hash_key.add_argument("name", help="the key's name (letters, digits, _ . -), shown in logs and metrics")
    hash_key.add_argument(
        "--generate", action="store_true", help="make a new random token and print it on the line before the entry"
    )
    mcp = commands.add_parser(
        "mcp", help="serve MCP over stdio, forwarding to a running service (its /execute and /jobs routes)"
    )
    mcp.add_argument("--url", default=os.environ.get("PTC_URL"), help="the service's base URL (default: PTC_URL)")
    mcp.add_argument(
        "--token",
        default=os.environ.get("PTC_TOKEN"),
        help="the API key's bearer token (default: PTC_TOKEN; prefer the variable: arguments are visible to ps)",
    )
    mcp.add_argument(
        "--toolset",
        default=os.environ.get("PTC_MCP_TOOLSET"),
        help="toolset execute uses when a call names none (default: PTC_MCP_TOOLSET)",
    )
    sweep = commands.add_parser(
        "sweep",
        help="remove the sandboxes a retired replica left on this engine (refused while the registry shows it live)",
    )
    sweep.add_argument("--instance", required=True, help="the retired replica's instance id (its PTC_INSTANCE_ID)")
    sweep.add_argument(
        "--unregistered",
        action="store_true",
        help="also when the store's registry has no row of it (you know it is not running)",
    )
    commands.add_parser(
        "migrate",
        help="upgrade the job store (PTC_STORE_URL, else the SQLite file) to the newest schema; serve does it too",
    )
    args = parser.parse_args(argv)
    if args.command == "mcp":
        return _mcp(args.url, args.token, args.toolset)
    if args.command == "hash-key":
        return _hash_key(args.name, args.generate)
    pairs = (("host", getattr(args, "host", None)), ("port", getattr(args, "port", None)))
    overrides = {k: v for k, v in pairs if v is not None}
    try:
        settings = Settings(**overrides)
    except ValidationError as exc:
        print(f"ptc-sandbox: refusing to start: {_settings_errors(exc)}", file=sys.stderr)
        return 2
    if args.command == "migrate":
        return _migrate(settings)
    if args.command == "sweep":
        return _sweep(settings, args.instance, args.unregistered)
    _raise_open_files_limit()
    logs.configure(settings.log_level, settings.log_format, settings.instance())
    prometheus_client.disable_created_metrics()  # type: ignore[no-untyped-call]  # no *_created series
    try:
        app = create_app(settings)
        workdir.check_free(settings.work_dir)
    except (InsecureConfig, WorkDirBusy) as exc:
        logging.getLogger("service").critical("refusing to start: %s", exc)
        return 2
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level,
        log_config=None,  # uvicorn's records go through the handler of logs.configure
        access_log=False,  # the service logs each request itself (the "request" event)
        timeout_graceful_shutdown=10,
        http=guarded_protocol(
            ConnectionGuard(
                settings.max_connections,
                settings.max_connections_per_address,
                parse_networks(settings.trusted_proxies),
            ),
            settings.header_timeout_s,
            settings.body_timeout_s,
        ),
    )
    DrainingServer(config, app, settings.drain_s, settings.retry_after_s).run()
    return 0


def _settings_errors(exc: ValidationError) -> str:
    """Each error of the settings on one line, as ``PTC_<NAME>: <message>`` (the message alone when it concerns
    several settings and names them), without the input values pydantic would print (secrets among them)."""
    lines = []
    for error in exc.errors():
        names = ".".join(str(part) for part in error["loc"])
        lines.append(f"PTC_{names.upper()}: {error['msg']}" if names else error["msg"])
    return "\n".join(lines)


def _migrate(settings: Settings) -> int:
    """``ptc-sandbox migrate``: open the store chosen by the settings (which runs its migrations), then close it;
    prints the store (never its password) and the revision. Exit 1 when the store cannot be reached."""
    from service.store import job_store
    from service.store.migrations import HEAD

    store = job_store(settings)

    async def run() -> None:
        await store.open()
        await store.close()

    try:
        asyncio.run(run())
    except StoreUnavailable as exc:
        print(f"ptc-sandbox migrate: {store.describe()}: {exc}", file=sys.stderr)
        return 1
    print(f"{store.describe()}: at revision {HEAD}")
    return 0


def _sweep(settings: Settings, instance_id: str, unregistered: bool) -> int:
    """``ptc-sandbox sweep --instance ID``: ``replicas.sweep.sweep_instance`` on the store and engine of the settings;
    prints how many sandboxes it removed. Exit 1 when refused (the instance is live, or unknown without
    ``--unregistered``) or when the store or the engine does not answer."""
    from service.replicas.sweep import sweep_instance
    from service.sandbox.docker import DockerBackend
    from service.store import job_store

    store = job_store(settings)

    async def run() -> int:
        await store.open()
        backend = DockerBackend(settings.docker_host, max_workers=2)
        try:
            return await sweep_instance(store, backend, instance_id, unregistered)
        finally:
            await backend.close()
            await store.close()

    try:
        removed = asyncio.run(run())
    except (InstanceIdInUse, StoreUnavailable, SandboxError) as exc:
        print(f"ptc-sandbox sweep: refused: {exc}", file=sys.stderr)
        return 1
    print(f"removed {removed} sandbox(es) of instance {instance_id}")
    return 0


def _hash_key(name: str, generate: bool) -> int:
    """``hash-key``: the entry for a new token (printed first) or for the token on stdin."""
    if not KEY_NAME.match(name):
        print("hash-key: NAME must be 1-64 letters, digits, _ . or -", file=sys.stderr)
        return 2
    if generate:
        token = TOKEN_PREFIX + secrets.token_urlsafe(32)
        print(token)
    else:
        token = sys.stdin.readline().rstrip("\r\n")
        if not token:
            print("hash-key: no token on stdin", file=sys.stderr)
            return 2
    print(f"{name}:{hash_token(token)}")
    return 0


def _mcp(url: str | None, token: str | None, toolset: str | None) -> int:
    """``mcp``: MCP over stdio until stdin closes (nothing but MCP messages on stdout)."""
    if not url:
        print("mcp: give the service's URL (--url or PTC_URL)", file=sys.stderr)
        return 2
    from service.mcp import stdio as mcp_stdio

    asyncio.run(mcp_stdio.serve(url, token, toolset))
    return 0


def _raise_open_files_limit() -> None:
    """Use the hard RLIMIT_NOFILE: each running job holds a few descriptors (broker connections, output files)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


if __name__ == "__main__":
    sys.exit(main())
