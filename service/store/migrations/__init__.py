"""Alembic migrations of the job store (both SQLite and PostgreSQL), run by ``service.store.migrate``; the
revisions are in ``versions/``."""

HEAD = "0008"
"""The newest revision: a store whose ``alembic_version`` holds it needs nothing (kept here, free of imports, so
that opening a SQLite store at ``HEAD`` does not import Alembic)."""


def refuse_to_drop_rows(*tables: str) -> None:
    """Stop a downgrade before it drops a table that holds rows (jobs, outputs, keys): a downgrade is never
    silently destructive. Empty the store first (or restore a backup) to go below the revision that made them.

    Raises:
        alembic.util.CommandError: one of ``tables`` holds a row.
    """
    from alembic import op
    from alembic.util import CommandError

    bind = op.get_bind()
    for table in tables:
        if bind.exec_driver_sql(f"SELECT 1 FROM {table} LIMIT 1").first() is not None:  # names of ours, not input
            raise CommandError(f"refusing to drop the table {table}: it holds rows (back the store up, then empty it)")
