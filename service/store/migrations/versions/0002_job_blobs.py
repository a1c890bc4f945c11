"""Ended jobs' retained output and output files in the store (``job_blobs``), for a store shared by replicas.

Revision ID: 0002
Revises: 0001
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from service.store.migrations import refuse_to_drop_rows

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "job_blobs",
        sa.Column("job_id", sa.Text, primary_key=True),
        sa.Column("name", sa.Text, primary_key=True),
        sa.Column("data", sa.LargeBinary, nullable=False),
    )


def downgrade() -> None:
    refuse_to_drop_rows("job_blobs")
    op.drop_table("job_blobs")
