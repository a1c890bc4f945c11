"""The job store's tables as SQLAlchemy Core metadata: the PostgreSQL store's queries use them, and a test checks
that the migrations (``service/store/migrations/``) make exactly these tables on PostgreSQL.

Times are ISO 8601 text (``datetime.isoformat()`` of UTC times), as in the SQLite store, so that both stores
order and compare them the same way (cursors of ``GET /jobs`` are the same on both). Bytes are ``BLOB`` on
SQLite and ``bytea`` on PostgreSQL.

``job_blobs`` holds, for the PostgreSQL store, what the SQLite store keeps as files beside it: an ended job's
retained output (``stdout``, ``stderr``) and its output files (``files/<index>``), so that any replica can serve
them (issue 17). Its rows go with their job (``JobRecords.purge``).

``replicas`` is the registry of service processes sharing the store (docs/scaling.md, Replicas and leases): one
row per instance id, its ``epoch`` counting its starts; ``jobs.instance_epoch`` says which incarnation of its
``instance_id`` owns an unfinished job (NULL on rows saved before replicas were registered). The lease columns
are ``timestamptz`` on PostgreSQL, set and compared with the database's ``now()`` (no replica's clock); on SQLite
(one replica) ISO text of the service's UTC clock.

``idempotency_keys`` rows are ``claimed`` (``claim_token``, ``claimed_by``/``claimed_epoch``: the incarnation
admitting the key's first request; ``resource_id`` NULL) and then ``bound`` to the job or session it created
(``service.idempotency``).
"""

from __future__ import annotations

from datetime import datetime

import sqlalchemy as sa


def iso(value: datetime | None) -> str | None:
    """A time as both stores keep it in their text columns (ISO 8601), None as NULL."""
    return value.isoformat() if value is not None else None


metadata = sa.MetaData()

jobs = sa.Table(
    "jobs",
    metadata,
    sa.Column("job_id", sa.Text, primary_key=True),
    sa.Column("status", sa.Text, nullable=False),
    sa.Column("instance_id", sa.Text, nullable=False),
    sa.Column("created_at", sa.Text, nullable=False),
    sa.Column("ended_at", sa.Text),
    sa.Column("view", sa.LargeBinary, nullable=False),
    sa.Column("summary", sa.LargeBinary, nullable=False),
    sa.Column("callback_pending", sa.Integer, nullable=False, server_default="0"),
    sa.Column("owner", sa.Text),
    sa.Column("instance_epoch", sa.BigInteger),
)
sa.Index("jobs_by_created", jobs.c.created_at.desc(), jobs.c.job_id.desc())
sa.Index("jobs_by_ended", jobs.c.ended_at, postgresql_where=jobs.c.ended_at.isnot(None))
sa.Index("jobs_unfinished", jobs.c.instance_id, postgresql_where=jobs.c.ended_at.is_(None))
sa.Index("jobs_callback_pending", jobs.c.instance_id, postgresql_where=jobs.c.callback_pending == 1)
sa.Index("jobs_by_owner", jobs.c.owner, jobs.c.created_at.desc(), jobs.c.job_id.desc())

toolsets = sa.Table(
    "toolsets",
    metadata,
    sa.Column("toolset_id", sa.Text, primary_key=True),
    sa.Column("manifest", sa.LargeBinary, nullable=False),
    sa.Column("created_at", sa.Text, nullable=False),
)

toolset_owners = sa.Table(
    "toolset_owners",
    metadata,
    sa.Column("toolset_id", sa.Text, primary_key=True),
    sa.Column("owner", sa.Text, primary_key=True),
)

idempotency_keys = sa.Table(
    "idempotency_keys",
    metadata,
    sa.Column("owner", sa.Text, primary_key=True),
    sa.Column("key", sa.Text, primary_key=True),
    sa.Column("fingerprint", sa.Text, nullable=False),
    sa.Column("kind", sa.Text, nullable=False),
    sa.Column("resource_id", sa.Text),
    sa.Column("created_at", sa.Text, nullable=False),
    sa.Column("ends_by", sa.Text),
    sa.Column("state", sa.Text, nullable=False, server_default="bound"),
    sa.Column("claim_token", sa.Text),
    sa.Column("claimed_by", sa.Text),
    sa.Column("claimed_epoch", sa.BigInteger),
)
sa.Index("idempotency_keys_by_resource", idempotency_keys.c.resource_id)
sa.Index("idempotency_keys_by_end", idempotency_keys.c.ends_by, postgresql_where=idempotency_keys.c.ends_by.isnot(None))

job_blobs = sa.Table(
    "job_blobs",
    metadata,
    sa.Column("job_id", sa.Text, primary_key=True),
    sa.Column("name", sa.Text, primary_key=True),
    sa.Column("data", sa.LargeBinary, nullable=False),
)

replicas = sa.Table(
    "replicas",
    metadata,
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

callbacks = sa.Table(
    "callbacks",
    metadata,
    sa.Column("job_id", sa.Text, sa.ForeignKey("jobs.job_id", ondelete="CASCADE"), primary_key=True),
    sa.Column("state", sa.Text, nullable=False),
    sa.Column("claimed_by", sa.Text),
    sa.Column("claimed_epoch", sa.BigInteger),
    sa.Column("attempts", sa.Integer, nullable=False, server_default="0"),
    sa.Column("next_attempt_at", sa.DateTime(timezone=True), nullable=False),
)
"""One row per ended job with a completion callback (docs/scaling.md, Callbacks, exactly once): ``state``
``pending`` (due at ``next_attempt_at``, any replica claims it), ``delivering`` (claimed by the incarnation
``(claimed_by, claimed_epoch)``), ``delivered`` or ``failed``. ``next_attempt_at`` is ``timestamptz`` of the
database's ``now()`` on PostgreSQL, ISO text of the service's UTC clock on SQLite (as the lease columns)."""
sa.Index("callbacks_due", callbacks.c.next_attempt_at, postgresql_where=callbacks.c.state == "pending")
sessions = sa.Table(
    "sessions",
    metadata,
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
"""Sessions (docs/scaling.md, Sessions): each one's owning incarnation and its view (JSON) as last saved, at its
creation and at its end."""
sa.Index("sessions_open", sessions.c.instance_id, postgresql_where=sessions.c.ended_at.is_(None))
sa.Index("sessions_by_owner", sessions.c.owner, sessions.c.created_at)

job_runs = sa.Table(
    "job_runs",
    metadata,
    sa.Column("job_id", sa.Text, primary_key=True),
    sa.Column("spec", sa.LargeBinary, nullable=False),
)
"""Durable jobs' run specs (``CallLog``): what a job's replay is made from (JSON bytes). Its rows go with their job
(``JobRecords.purge``), or earlier once the job has ended (``CallLog.forget``)."""

job_calls = sa.Table(
    "job_calls",
    metadata,
    sa.Column("job_id", sa.Text, primary_key=True),
    sa.Column("seq", sa.Integer, primary_key=True),
    sa.Column("call_id", sa.Text, nullable=False),
    sa.Column("tool", sa.Text, nullable=False),
    sa.Column("args", sa.LargeBinary, nullable=False),
    sa.Column("outcome", sa.LargeBinary),
)
"""Durable jobs' call logs (``CallLog``): one row per tool call at its place ``seq`` (from 1), its arguments and,
once it has one, its ``outcome`` (JSON bytes; NULL: the intent only). Its rows go as ``job_runs``'."""
