"""Sessions in the store (``sessions``): where each session lives (its owning incarnation), saved when it is created
and when it ends, so that any replica lists a caller's sessions and forwards requests to the one holding it
(docs/scaling.md, Sessions; issue 17, step 4).

Revision ID: 0004
Revises: 0003
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "sessions",
        sa.Column("session_id", sa.Text, primary_key=True),
        sa.Column("owner", sa.Text, nullable=False),
        sa.Column("instance_id", sa.Text, nullable=False),
        sa.Column("instance_epoch", sa.BigInteger, nullable=False),
        sa.Column("status", sa.Text, nullable=False),
        sa.Column("created_at", sa.Text, nullable=False),
        sa.Column("ended_at", sa.Text),
        sa.Column("ends_by", sa.Text, nullable=False),
        sa.Column("view", sa.LargeBinary, nullable=False),
    )
    op.create_index("sessions_open", "sessions", ["instance_id"], postgresql_where=sa.text("ended_at IS NULL"))
    op.create_index("sessions_by_owner", "sessions", ["owner", "created_at"])


def downgrade() -> None:
    op.drop_index("sessions_by_owner", "sessions")
    op.drop_index("sessions_open", "sessions")
    op.drop_table("sessions")
