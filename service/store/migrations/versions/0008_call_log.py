"""Durable jobs' run specs (``job_runs``) and call logs (``job_calls``), what a job is resumed from (``CallLog``).

Revision ID: 0008
Revises: 0007
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from service.store.migrations import refuse_to_drop_rows

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "job_runs",
        sa.Column("job_id", sa.Text, primary_key=True),
        sa.Column("spec", sa.LargeBinary, nullable=False),
    )
    op.create_table(
        "job_calls",
        sa.Column("job_id", sa.Text, primary_key=True),
        sa.Column("seq", sa.Integer, primary_key=True),
        sa.Column("call_id", sa.Text, nullable=False),
        sa.Column("tool", sa.Text, nullable=False),
        sa.Column("args", sa.LargeBinary, nullable=False),
        sa.Column("outcome", sa.LargeBinary),
    )


def downgrade() -> None:
    refuse_to_drop_rows("job_calls", "job_runs")
    op.drop_table("job_calls")
    op.drop_table("job_runs")
