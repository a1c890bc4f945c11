"""Races between a script's own end and what the service does to it (issue 12, item 4).

Each test hammers one pair with a bounded number of trials, stepping the delay of the service's action
(stop, timeout, the sandbox's loss) across the moment the script exits, and checks every trial: the status
says what really ended the job, and its exit code, error and output agree with it; the stop's answer, ``GET``,
``wait`` and the list give the same final view. Most trials run in sessions (cheap: no container per trial,
several sessions in parallel); fewer run on a warm pool and cold. The trial counts are printed (``-s``).

No timing is asserted: a slow machine only moves where the trials fall, never what each one must show.
"""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.mark.parametrize(
    ("fields", "killed"),
    [
        (b'"signal": 15, "killed": true', True),
        (b'"signal": 15, "killed": false', False),  # the script died by a SIGTERM the runtime did not send
        (b'"signal": 15, "killed": "yes"', False),  # anything but true is no claim (a script may own the server)
        (b'"signal": null', False),  # a legacy-shaped message: the service sent no signal, so it killed nothing
    ],
)
async def test_the_service_takes_killed_only_as_the_runtime_says_it(
    tmp_path: Path, fields: bytes, killed: bool
) -> None:
    """Unit: the control protocol's ``killed`` (see ``sandbox_image/ptc_runtime/session.py``) reaches ExitStatus."""
    from tests.unit.test_control_protocol import run_once

    message = b'{"op": "exit", "id": "job_1", "exit_code": 143, "oom_killed": false, ' + fields + b"}\n"
    status, _, broken = await run_once(tmp_path, lambda run: message)
    assert status.killed is killed and status.exit_code == 143 and not broken
