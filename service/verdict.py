"""A failed script's job ``error``: what the service observed, with the script's own report kept apart.

The in-sandbox runtime tells the broker about a script's uncaught exception
(``{"op": "report"}``, see ``service.broker``), but anything in the sandbox is
untrusted: a script can send any report it likes (claim ``MemoryError`` and
exit 3). So the job's ``error`` of a script that exited non-zero is built from
what the service saw itself:

- the service's own compile of the script (``service.normalize``) failed:
  that error (``SyntaxError`` with ``line``, ``column``, ``text``, and a
  ``hint`` when a mechanical cause was recognized);
- otherwise ``{"type": "nonzero_exit", "message": "the script exited with
  code N"}`` (for 128+N, the signal N is named: the usual cause).

The script's report, when there is one, rides along as ``script_report``
(``type``, ``message``, ``line``, and for a SyntaxError ``column``, ``text``):
the traceback's last line as the runtime saw it, unverified. Timeouts, stops,
OOM kills and sandbox failures are the job manager's own verdicts and never
carry a report.
"""

from __future__ import annotations

import signal
from typing import Any

from service.normalize import Normalized, with_hint

SIGNAL_BASE = 128  # a process killed by signal N ends with status 128+N (shell and engine convention)


def failure(exit_code: int, normalized: Normalized | None, script_report: dict[str, Any] | None) -> dict[str, Any]:
    """The ``error`` of a job whose script exited with ``exit_code`` (non-zero) on its own.

    Args:
        exit_code: the sandbox's exit status of the script.
        normalized: the script's normalization (its ``compile_error`` is the service's compile verdict),
            None when the request switched normalization off.
        script_report: what the runtime reported (``Broker.script_report``), None when nothing was reported.

    Returns:
        ``{"type", "message", ...}`` as the job view's ``error``, with ``script_report`` added when given.
    """
    error: dict[str, Any]
    if normalized is not None and normalized.compile_error is not None:
        error = with_hint(dict(normalized.compile_error), normalized) or {}
    else:
        error = {"type": "nonzero_exit", "message": _exit_message(exit_code)}
    if script_report is not None:
        error["script_report"] = dict(script_report)
    return error


def _exit_message(exit_code: int) -> str:
    message = f"the script exited with code {exit_code}"
    number = exit_code - SIGNAL_BASE
    if 0 < number < signal.NSIG:
        try:
            name = signal.Signals(number).name
        except ValueError:
            name = f"signal {number}"
        message += f" (128+{number}: killed by {name}, unless the script chose that code itself)"
    return message
