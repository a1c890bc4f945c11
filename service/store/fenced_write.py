"""The fenced write (docs/scaling.md, The store is the fencing point): how an incarnation saves a row it owns, a
job's (``JobRecords.save``) or a session's (``SessionRecords.save``), on both stores.

One statement: the row is inserted only while the incarnation (the row's ``instance_id`` and ``instance_epoch``)
is ``live`` or ``draining`` in the registry, and replaced only while it is still that incarnation's and not ended
(``ended_at IS NULL``). A replica whose lease was taken (expired, or replaced by a later epoch) thus writes
nothing, and learns it from the empty ``RETURNING``.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa

from service.store.registry import LIVE_STATES
from service.store.tables import jobs, sessions


def fenced_upsert(table: sa.Table, updated: Sequence[str]) -> str:
    """The fenced save of a row of ``table`` as SQL text that both SQLite and PostgreSQL run.

    Args:
        table: a table with ``instance_id``, ``instance_epoch`` and ``ended_at`` columns, keyed by its first
            primary-key column.
        updated: the columns a later save replaces (the others keep their first save's value).

    Returns:
        ``INSERT … SELECT … WHERE <live> ON CONFLICT … DO UPDATE … WHERE <still its, not ended> RETURNING <key>``,
        with one named parameter (``:column``) per column of ``table``; a row comes back when it was written.
    """
    columns = [column.name for column in table.columns]
    key = table.primary_key.columns.values()[0].name
    live = ", ".join(f"'{state}'" for state in LIVE_STATES)
    name = table.name
    return (
        f"INSERT INTO {name} ({', '.join(columns)}) SELECT {', '.join(f':{c}' for c in columns)} "
        f"WHERE EXISTS (SELECT 1 FROM replicas WHERE instance_id = :instance_id AND epoch = :instance_epoch "
        f"AND state IN ({live})) "
        f"ON CONFLICT ({key}) DO UPDATE SET {', '.join(f'{c} = excluded.{c}' for c in updated)} "
        f"WHERE {name}.instance_id = excluded.instance_id AND {name}.instance_epoch = excluded.instance_epoch "
        f"AND {name}.ended_at IS NULL RETURNING {key}"
    )


FENCED_JOB_SAVE = fenced_upsert(jobs, ("status", "ended_at", "view", "summary", "callback_pending"))
"""A job's save by its owning incarnation (``JobRecords.save``)."""

FENCED_SESSION_SAVE = fenced_upsert(sessions, ("status", "ended_at", "view"))
"""A session's save by its owning incarnation (``SessionRecords.save``)."""
