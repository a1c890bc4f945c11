"""Command line.

``ptc-sandbox serve [--host H] [--port P]`` runs the service (settings come from ``PTC_*`` variables);
``ptc-sandbox hash-key NAME [--generate]`` prints the ``PTC_API_KEYS`` entry of a token (read from stdin,
or a new one printed first).
"""

from __future__ import annotations

import argparse
import logging
import resource
import secrets
import sys

import prometheus_client
import uvicorn
from pydantic import ValidationError

from service import logs, workdir
from service.api import create_app
from service.auth import KEY_NAME, hash_token
from service.connections import ConnectionGuard, guarded_protocol, parse_networks
from service.errors import InsecureConfig, WorkDirBusy
from service.settings import Settings

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
    args = parser.parse_args(argv)
    if args.command == "hash-key":
        return _hash_key(args.name, args.generate)
    overrides = {k: v for k, v in (("host", args.host), ("port", args.port)) if v is not None}
    try:
        settings = Settings(**overrides)
    except ValidationError as exc:
        print(f"ptc-sandbox: refusing to start: {_settings_errors(exc)}", file=sys.stderr)
        return 2
    _raise_open_files_limit()
    logs.configure(settings.log_level, settings.log_format)
    prometheus_client.disable_created_metrics()  # type: ignore[no-untyped-call]  # no *_created series
    try:
        app = create_app(settings)
        workdir.check_free(settings.work_dir)
    except (InsecureConfig, WorkDirBusy) as exc:
        logging.getLogger("service").critical("refusing to start: %s", exc)
        return 2
    uvicorn.run(
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
    return 0


def _settings_errors(exc: ValidationError) -> str:
    """Each error of the settings on one line, as ``PTC_<NAME>: <message>`` (the message alone when it concerns
    several settings and names them), without the input values pydantic would print (secrets among them)."""
    lines = []
    for error in exc.errors():
        names = ".".join(str(part) for part in error["loc"])
        lines.append(f"PTC_{names.upper()}: {error['msg']}" if names else error["msg"])
    return "\n".join(lines)


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


def _raise_open_files_limit() -> None:
    """Use the hard RLIMIT_NOFILE: each running job holds a few descriptors (broker connections, output files)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


if __name__ == "__main__":
    sys.exit(main())
