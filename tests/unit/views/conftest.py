"""The job service's parts on the fake backend (``tests/unit/jobs/conftest.py``), for reading its jobs."""

from tests.unit.jobs.conftest import parts

__all__ = ["parts"]
