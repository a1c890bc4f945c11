"""What every adapter shares: the code tool's description (the service's stub usage text and the ``tools`` module
the script imports) and the text a finished job gives back to the model."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from pydantic_core import to_jsonable_python

from ..errors import InvalidRequestError, ProblemError, RateLimitedError, UnavailableError
from ..models import JobView

SCRIPT_DESCRIPTION = "A complete Python 3 script. It may `import tools` and call the functions described above."
TAIL_CHARS = 2000


def describe(stubs: Mapping[str, Any], intro: str | None = None) -> str:
    """The code tool's description from a ``POST /stubs`` answer (``{"module", "usage"}``): ``intro``, the usage
    text, then the ``tools`` module (every function's signature and docstring), so a model knows what to call."""
    head = intro or (
        "Run a Python script in a sandbox. Use it to call several tools in one step: loop, branch and combine "
        "their results in code, and print only the answer."
    )
    usage, module = str(stubs.get("usage", "")).strip(), stubs.get("module", "")
    return f"{head}\n\n{usage}\n\nThe `tools` module:\n\n```python\n{module}```"


def _tail(text: str) -> str:
    return text if len(text) <= TAIL_CHARS else "..." + text[-TAIL_CHARS:]


def job_text(view: JobView) -> str:
    """What the model sees of a finished job: its stdout when it succeeded, else a compact failure text (the
    status, exit code, the service's error, and the last ``TAIL_CHARS`` characters of stdout and stderr)."""
    if view.status == "succeeded":
        return view.stdout
    lines = [f"The script did not succeed: status {view.status}, exit code {view.exit_code}."]
    if view.error:
        lines.append(f"error: {view.error.get('type', '')}: {view.error.get('message', '')}".rstrip(": "))
    if view.stdout:
        lines.append("stdout (tail):\n" + _tail(view.stdout))
    if view.stderr:
        lines.append("stderr (tail):\n" + _tail(view.stderr))
    return "\n".join(lines)


#: Problems a model can act on (shorten the script, try again later): told to the model rather than raised.
TOLD_TO_THE_MODEL = (InvalidRequestError, RateLimitedError, UnavailableError)


def problem_text(error: ProblemError) -> str:
    """What the model sees when the service refused to run its script (``TOLD_TO_THE_MODEL``)."""
    retry = f" Retry after {error.retry_after:g} s." if error.retry_after else ""
    return f"The service did not run the script: {error.status} {error.name}: {error.detail}{retry}"


def unique_names(names: list[str]) -> None:
    """Raises ``ValueError`` when two tools share a name (the script could reach only one of them)."""
    seen: set[str] = set()
    for name in names:
        if name in seen:
            raise ValueError(f"{name}: two tools with this name")
        seen.add(name)


def script_of(arguments: str) -> str | None:
    """The ``script`` argument of a code tool's JSON arguments, or None when there is none."""
    try:
        parsed = json.loads(arguments or "{}")
    except ValueError:
        return None
    script = parsed.get("script") if isinstance(parsed, dict) else None
    return script if isinstance(script, str) else None


def jsonable(value: Any) -> Any:
    """A tool's return value as a JSON value (pydantic models and dataclasses as objects; anything else not JSON as
    its ``str``)."""
    return to_jsonable_python(value, fallback=str)
