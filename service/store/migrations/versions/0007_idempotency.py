"""Idempotency-Key claims in the store (docs/scaling.md, Idempotency keys): a row is ``claimed`` by the request
being admitted (``claim_token``, and the incarnation ``claimed_by``/``claimed_epoch`` that admits it), then
``bound`` to the job or session it created; ``resource_id`` is NULL while claimed. Existing rows are bound.

Revision ID: 0007
Revises: 0003
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("idempotency_keys") as batch:  # SQLite: the table is copied (a NOT NULL dropped)
        batch.add_column(sa.Column("state", sa.Text, nullable=False, server_default="bound"))
        batch.add_column(sa.Column("claim_token", sa.Text))
        batch.add_column(sa.Column("claimed_by", sa.Text))
        batch.add_column(sa.Column("claimed_epoch", sa.BigInteger))
        batch.alter_column("resource_id", existing_type=sa.Text, nullable=True)


def downgrade() -> None:
    op.execute("DELETE FROM idempotency_keys WHERE state = 'claimed'")  # claims of requests in flight: nothing made
    with op.batch_alter_table("idempotency_keys") as batch:
        batch.alter_column("resource_id", existing_type=sa.Text, nullable=False)
        batch.drop_column("claimed_epoch")
        batch.drop_column("claimed_by")
        batch.drop_column("claim_token")
        batch.drop_column("state")
