"""Versioned migrations of the job store (Alembic, ``service/store/migrations/``), run at every start and by
``ptc-sandbox migrate``.

Both stores run the same revisions: ``0001`` makes today's tables (on SQLite it adopts a ``jobs.sqlite3`` made
before migrations: its rows stay, and what it lacks is added), ``0002`` adds ``job_blobs``, ``0003`` the
replicas' registry, ``0004`` ``sessions``, ``0006`` ``callbacks``, ``0007`` the idempotency keys' claims, ``0008``
durable jobs' run specs and call logs (``job_runs``, ``job_calls``). Upgrading a store at ``HEAD`` changes
nothing. Blocking: call it from a thread, never on the event loop.
"""

from __future__ import annotations

from pathlib import Path

import sqlalchemy as sa
from alembic import command
from alembic.config import Config

from service.store.migrations import HEAD

__all__ = ["HEAD", "current", "upgrade", "upgrade_connection"]

_SCRIPTS = Path(__file__).parent / "migrations"


def _config(connection: sa.Connection) -> Config:
    config = Config()
    config.set_main_option("script_location", str(_SCRIPTS).replace("%", "%%"))
    config.attributes["connection"] = connection
    return config


def upgrade_connection(connection: sa.Connection) -> None:
    """Upgrade the store on ``connection`` (a synchronous SQLAlchemy connection) to ``HEAD``, and commit."""
    command.upgrade(_config(connection), "head")
    connection.commit()


def upgrade(url: str | sa.URL, connect_args: dict[str, object] | None = None) -> None:
    """Upgrade the store at ``url`` (``sqlite:///path`` or ``postgresql+psycopg://…``) to ``HEAD``.

    Raises:
        sqlalchemy.exc.SQLAlchemyError: the database cannot be reached or refused a statement.
    """
    engine = sa.create_engine(url, connect_args=connect_args or {}, poolclass=sa.NullPool)
    try:
        with engine.connect() as connection:
            upgrade_connection(connection)
    finally:
        engine.dispose()


def current(url: str | sa.URL, connect_args: dict[str, object] | None = None) -> str | None:
    """The revision the store at ``url`` is at (None: never migrated)."""
    engine = sa.create_engine(url, connect_args=connect_args or {}, poolclass=sa.NullPool)
    try:
        with engine.connect() as connection:
            if not sa.inspect(connection).has_table("alembic_version"):
                return None
            return connection.exec_driver_sql("SELECT version_num FROM alembic_version").scalar()
    finally:
        engine.dispose()
