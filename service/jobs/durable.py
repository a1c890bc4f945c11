"""Durable jobs on the job service's side (docs/durability.md): the run spec a resume is made from, and the broker's
call log (``service.broker.durable``) stored in the job store (``store.runs``).

A durable job's run spec is written once its sandbox is ready and before its script starts (its interpreter's
string-hash seed is known then): the request as admitted (script, files, env, manifest or toolset, limits, image,
metadata, callback), its owner, engine and creation time. At start-up a job this instance left unfinished is
resumed from its spec and its call log when it has both (``Intake.readmit``), else it is marked ``lost`` as before.
Both are dropped once the job's final view is saved.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any

import orjson

from service.broker.durable import CallLogPort, Logged
from service.schemas.job_models import ExecuteRequest
from service.store import JobStore, StoredJob
from service.store.call_log import LoggedCall

if TYPE_CHECKING:
    from service.jobs.admission import Admitted

SPEC_VERSION = 1


@dataclass(frozen=True)
class RunSpec:
    """What a durable job's runs are made from (see the module)."""

    job_id: str
    owner: str
    admin: bool
    engine: str
    image: str
    created_at: datetime
    hash_seed: int | None
    request: ExecuteRequest
    resumes: tuple[dict[str, Any], ...] = ()  # the earlier resumes its last saved view lists (not stored here)
    stored: StoredJob | None = None  # its row as last saved, when read back to resume it (not stored here)

    def encode(self) -> bytes:
        """The spec as stored (JSON)."""
        return orjson.dumps(
            {
                "version": SPEC_VERSION,
                "job_id": self.job_id,
                "owner": self.owner,
                "admin": self.admin,
                "engine": self.engine,
                "image": self.image,
                "created_at": self.created_at.isoformat(),
                "hash_seed": self.hash_seed,
                "request": self.request.model_dump(mode="json"),
            }
        )

    @classmethod
    def decode(cls, data: bytes) -> RunSpec:
        """A stored spec. Raises ValueError (and pydantic's ValidationError, a ValueError) for one this version
        cannot read."""
        spec = orjson.loads(data)
        if not isinstance(spec, dict) or spec.get("version") != SPEC_VERSION:
            raise ValueError("a run spec of another version")
        return cls(
            job_id=spec["job_id"],
            owner=spec["owner"],
            admin=bool(spec["admin"]),
            engine=spec["engine"],
            image=spec["image"],
            created_at=datetime.fromisoformat(spec["created_at"]),
            hash_seed=spec["hash_seed"],
            request=ExecuteRequest.model_validate(spec["request"]),
        )


def run_spec(admitted: Admitted) -> RunSpec:
    """The run spec of an admitted durable job whose sandbox is ready (``job.hash_seed`` set)."""
    job = admitted.job
    return RunSpec(
        job.id, job.owner, admitted.admin, job.engine, job.image, job.created_at, job.hash_seed, admitted.request
    )


def log_port(store: JobStore, job_id: str) -> CallLogPort:
    """Where the broker of ``job_id`` stores its call log: ``store.runs``."""

    def write(entries: Sequence[Logged]) -> Any:
        rows = [LoggedCall(e.seq, e.call_id, e.tool, e.args, e.outcome) for e in entries]
        return store.runs.write(job_id, rows)

    return write


async def logged_calls(store: JobStore, job_id: str) -> list[Logged]:
    """The call log of ``job_id``'s earlier runs, as its broker replays it."""
    return [Logged(c.seq, c.call_id, c.tool, c.args, c.outcome) for c in await store.runs.calls(job_id)]
