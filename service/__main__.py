"""Command line: ``ptc-sandbox serve [--host H] [--port P]`` (settings come from ``PTC_*`` variables)."""

from __future__ import annotations

import argparse
import resource
import sys

import prometheus_client
import uvicorn

from service import logs
from service.api import create_app
from service.settings import Settings


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``ptc-sandbox`` console script; returns the exit code."""
    parser = argparse.ArgumentParser(prog="ptc-sandbox", description="Programmatic Tool Calling execution service.")
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="run the HTTP service")
    serve.add_argument("--host", help="bind address (default: PTC_HOST or 127.0.0.1)")
    serve.add_argument("--port", type=int, help="port (default: PTC_PORT or 8080)")
    args = parser.parse_args(argv)
    overrides = {k: v for k, v in (("host", args.host), ("port", args.port)) if v is not None}
    settings = Settings(**overrides)
    _raise_open_files_limit()
    logs.configure(settings.log_level, settings.log_format)
    prometheus_client.disable_created_metrics()  # type: ignore[no-untyped-call]  # no *_created series
    uvicorn.run(
        create_app(settings),
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level,
        log_config=None,  # uvicorn's records go through the handler of logs.configure
        access_log=False,  # the service logs each request itself (the "request" event)
        timeout_graceful_shutdown=10,
    )
    return 0


def _raise_open_files_limit() -> None:
    """Use the hard RLIMIT_NOFILE: each running job holds a few descriptors (broker connections, output files)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


if __name__ == "__main__":
    sys.exit(main())
