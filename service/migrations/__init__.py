"""Alembic migrations of the job store (both SQLite and PostgreSQL), run by ``service.migrate``; the revisions are
in ``versions/``."""

HEAD = "0003"
"""The newest revision: a store whose ``alembic_version`` holds it needs nothing (kept here, free of imports, so
that opening a SQLite store at ``HEAD`` does not import Alembic)."""
