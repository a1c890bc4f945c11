"""The registry of replicas sharing the store (``replicas``) and the owning incarnation of each job
(``jobs.instance_epoch``): docs/scaling.md, Tables.

Revision ID: 0003
Revises: 0002
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "replicas",
        sa.Column("instance_id", sa.Text, primary_key=True),
        sa.Column("epoch", sa.BigInteger, nullable=False),
        sa.Column("internal_url", sa.Text, nullable=False),
        sa.Column("work_dir_token", sa.Text, nullable=False),
        sa.Column("version", sa.Text, nullable=False),
        sa.Column("state", sa.Text, nullable=False),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("heartbeat_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("lease_until", sa.DateTime(timezone=True), nullable=False),
        sa.Column("ended_at", sa.DateTime(timezone=True)),
        sa.Column("expired_by", sa.Text),
    )
    op.add_column("jobs", sa.Column("instance_epoch", sa.BigInteger))


def downgrade() -> None:
    op.drop_column("jobs", "instance_epoch")
    op.drop_table("replicas")
