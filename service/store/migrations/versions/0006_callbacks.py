"""Completion callbacks as rows of their own (``callbacks``), claimed by any replica (docs/scaling.md, Callbacks,
exactly once); the pending callbacks of ``jobs.callback_pending`` move there, due at once.

``jobs.callback_pending`` stays (a downgrade needs it, and saves still write it) but is read by nothing from this
revision on: the ``callbacks`` rows say what is left to deliver.

Revision ID: 0006
Revises: 0003
"""

from __future__ import annotations

from datetime import UTC, datetime

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "callbacks",
        sa.Column("job_id", sa.Text, sa.ForeignKey("jobs.job_id", ondelete="CASCADE"), primary_key=True),
        sa.Column("state", sa.Text, nullable=False),
        sa.Column("claimed_by", sa.Text),
        sa.Column("claimed_epoch", sa.BigInteger),
        sa.Column("attempts", sa.Integer, nullable=False, server_default="0"),
        sa.Column("next_attempt_at", sa.DateTime(timezone=True), nullable=False),
    )
    op.create_index("callbacks_due", "callbacks", ["next_attempt_at"], postgresql_where=sa.text("state = 'pending'"))
    bind = op.get_bind()
    due: object = datetime.now(UTC)
    if bind.dialect.name == "sqlite":  # times as the SQLite store writes them: ISO text
        due = datetime.now(UTC).isoformat()
    bind.execute(
        sa.text(
            "INSERT INTO callbacks (job_id, state, attempts, next_attempt_at) "
            "SELECT job_id, 'pending', 0, :due FROM jobs WHERE callback_pending = 1"
        ),
        {"due": due},
    )


def downgrade() -> None:
    op.execute(
        "UPDATE jobs SET callback_pending = 1 WHERE job_id IN "
        "(SELECT job_id FROM callbacks WHERE state IN ('pending', 'delivering'))"
    )
    op.drop_index("callbacks_due", "callbacks")
    op.drop_table("callbacks")
