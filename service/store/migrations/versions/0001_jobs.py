"""The job store as the service made it before migrations (issue 17): jobs, toolsets, owners, idempotency keys.

On SQLite this adopts a store made by the code before migrations: its statements are the ones that code ran at
each start (``CREATE ... IF NOT EXISTS``, and the columns added since the first release of ``jobs``), so an
existing ``jobs.sqlite3`` keeps every row and gets what it lacks. On PostgreSQL it creates the same tables.

Revision ID: 0001
Revises:
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from service.store.migrations import refuse_to_drop_rows

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None

_SQLITE_TABLES = (
    """CREATE TABLE IF NOT EXISTS jobs (
    job_id      TEXT PRIMARY KEY,
    status      TEXT NOT NULL,
    instance_id TEXT NOT NULL,
    created_at  TEXT NOT NULL,
    ended_at    TEXT,
    view        BLOB NOT NULL,
    summary     BLOB NOT NULL,
    callback_pending INTEGER NOT NULL DEFAULT 0
)""",
    """CREATE TABLE IF NOT EXISTS toolsets (
    toolset_id  TEXT PRIMARY KEY,
    manifest    BLOB NOT NULL,
    created_at  TEXT NOT NULL DEFAULT (strftime('%Y-%m-%dT%H:%M:%fZ', 'now'))
)""",
    """CREATE TABLE IF NOT EXISTS toolset_owners (
    toolset_id  TEXT NOT NULL,
    owner       TEXT NOT NULL,
    PRIMARY KEY (toolset_id, owner)
) WITHOUT ROWID""",
    """CREATE TABLE IF NOT EXISTS idempotency_keys (
    owner       TEXT NOT NULL,
    key         TEXT NOT NULL,
    fingerprint TEXT NOT NULL,
    kind        TEXT NOT NULL,
    resource_id TEXT NOT NULL,
    created_at  TEXT NOT NULL,
    ends_by     TEXT,
    PRIMARY KEY (owner, key)
) WITHOUT ROWID""",
)

# Columns added after the first release of the table, for stores made before them (owner NULL: legacy rows).
_SQLITE_ADDED_COLUMNS = (
    ("summary", "BLOB NOT NULL DEFAULT x''"),
    ("callback_pending", "INTEGER NOT NULL DEFAULT 0"),
    ("owner", "TEXT"),
)

_SQLITE_INDEXES = (
    "CREATE INDEX IF NOT EXISTS jobs_by_created ON jobs (created_at DESC, job_id DESC)",
    "CREATE INDEX IF NOT EXISTS jobs_by_ended ON jobs (ended_at) WHERE ended_at IS NOT NULL",
    "CREATE INDEX IF NOT EXISTS jobs_unfinished ON jobs (instance_id) WHERE ended_at IS NULL",
    "CREATE INDEX IF NOT EXISTS jobs_callback_pending ON jobs (instance_id) WHERE callback_pending = 1",
    "CREATE INDEX IF NOT EXISTS jobs_by_owner ON jobs (owner, created_at DESC, job_id DESC)",
    "CREATE INDEX IF NOT EXISTS idempotency_keys_by_resource ON idempotency_keys (resource_id)",
    "CREATE INDEX IF NOT EXISTS idempotency_keys_by_end ON idempotency_keys (ends_by) WHERE ends_by IS NOT NULL",
)


def _sqlite() -> None:
    bind = op.get_bind()
    for statement in _SQLITE_TABLES:
        bind.exec_driver_sql(statement)
    present = {row[1] for row in bind.exec_driver_sql("PRAGMA table_info(jobs)")}
    for name, declaration in _SQLITE_ADDED_COLUMNS:
        if name not in present:
            bind.exec_driver_sql(f"ALTER TABLE jobs ADD COLUMN {name} {declaration}")
    for statement in _SQLITE_INDEXES:
        bind.exec_driver_sql(statement)


def _postgresql() -> None:
    op.create_table(
        "jobs",
        sa.Column("job_id", sa.Text, primary_key=True),
        sa.Column("status", sa.Text, nullable=False),
        sa.Column("instance_id", sa.Text, nullable=False),
        sa.Column("created_at", sa.Text, nullable=False),
        sa.Column("ended_at", sa.Text),
        sa.Column("view", sa.LargeBinary, nullable=False),
        sa.Column("summary", sa.LargeBinary, nullable=False),
        sa.Column("callback_pending", sa.Integer, nullable=False, server_default="0"),
        sa.Column("owner", sa.Text),
    )
    op.create_index("jobs_by_created", "jobs", [sa.text("created_at DESC"), sa.text("job_id DESC")])
    op.create_index("jobs_by_ended", "jobs", ["ended_at"], postgresql_where=sa.text("ended_at IS NOT NULL"))
    op.create_index("jobs_unfinished", "jobs", ["instance_id"], postgresql_where=sa.text("ended_at IS NULL"))
    op.create_index("jobs_callback_pending", "jobs", ["instance_id"], postgresql_where=sa.text("callback_pending = 1"))
    op.create_index("jobs_by_owner", "jobs", ["owner", sa.text("created_at DESC"), sa.text("job_id DESC")])
    op.create_table(
        "toolsets",
        sa.Column("toolset_id", sa.Text, primary_key=True),
        sa.Column("manifest", sa.LargeBinary, nullable=False),
        sa.Column("created_at", sa.Text, nullable=False),
    )
    op.create_table(
        "toolset_owners",
        sa.Column("toolset_id", sa.Text, primary_key=True),
        sa.Column("owner", sa.Text, primary_key=True),
    )
    op.create_table(
        "idempotency_keys",
        sa.Column("owner", sa.Text, primary_key=True),
        sa.Column("key", sa.Text, primary_key=True),
        sa.Column("fingerprint", sa.Text, nullable=False),
        sa.Column("kind", sa.Text, nullable=False),
        sa.Column("resource_id", sa.Text, nullable=False),
        sa.Column("created_at", sa.Text, nullable=False),
        sa.Column("ends_by", sa.Text),
    )
    op.create_index("idempotency_keys_by_resource", "idempotency_keys", ["resource_id"])
    op.create_index(
        "idempotency_keys_by_end", "idempotency_keys", ["ends_by"], postgresql_where=sa.text("ends_by IS NOT NULL")
    )


def upgrade() -> None:
    if op.get_bind().dialect.name == "sqlite":
        _sqlite()
    else:
        _postgresql()


def downgrade() -> None:
    tables = ("idempotency_keys", "toolset_owners", "toolsets", "jobs")
    refuse_to_drop_rows(*tables)
    for table in tables:
        op.drop_table(table)
