"""PostgreSQL for the store tests: the server ``deploy/local.sh`` starts, a fresh database per test.

``PTC_TEST_STORE_URL`` (set by ``deploy/local.sh test``, e.g. ``postgresql://ptc_test:ptc_test@127.0.0.1:5432/
ptc_test``) names a role that may create databases; each test gets its own (``ptc_t_<hex>``), dropped after.
Without it, or without a server answering, the PostgreSQL cases skip, and fail under ``CI=true``.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterator
from contextlib import contextmanager

import psycopg
import sqlalchemy as sa
from tenacity import Retrying, retry_if_exception_type, stop_after_attempt, wait_fixed

ENV = "PTC_TEST_STORE_URL"


def base_url() -> str | None:
    return os.environ.get(ENV) or None


def problem() -> str | None:
    """Why the PostgreSQL cases cannot run here (None: they can)."""
    url = base_url()
    if url is None:
        return f"no PostgreSQL for the store tests: {ENV} is not set (deploy/local.sh test sets it)"
    try:
        with psycopg.connect(_libpq(url), connect_timeout=3):
            pass
    except psycopg.Error as exc:
        return f"PostgreSQL of {ENV} does not answer: {type(exc).__name__}"
    return None


def _libpq(url: str) -> str:
    return sa.make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)


@contextmanager
def fresh_database() -> Iterator[str]:
    """A new empty database on the server of ``PTC_TEST_STORE_URL``; yields its ``postgresql://`` URL."""
    url = base_url()
    assert url is not None
    name = "ptc_t_" + secrets.token_hex(6)
    with psycopg.connect(_libpq(url), autocommit=True) as admin:
        admin.execute(f"CREATE DATABASE {name}")
    try:
        yield sa.make_url(url).set(drivername="postgresql", database=name).render_as_string(hide_password=False)
    finally:
        # FORCE ends the database's connections; one still logging in has no role yet, and ending it needs
        # pg_signal_backend, which the test role lacks ("must be a member of the role whose process is being
        # terminated"): a moment later it has logged in as the test role and is ended.
        for attempt in Retrying(
            retry=retry_if_exception_type(psycopg.errors.InsufficientPrivilege),
            stop=stop_after_attempt(20),
            wait=wait_fixed(0.1),
            reraise=True,
        ):
            with attempt, psycopg.connect(_libpq(url), autocommit=True) as admin:
                admin.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
