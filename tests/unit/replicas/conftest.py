"""The job service's parts on the fake backend (``tests/unit/jobs/conftest.py``), for the replica modules that act
on its jobs."""

from tests.unit.jobs.conftest import parts

__all__ = ["parts"]
