#!/usr/bin/env python3
"""Register an OCI runtime (gVisor's runsc) in a Docker daemon.json, keeping every other setting.

    python3 deploy/register_runtime.py CONFIG NAME PATH [ARG ...]

Writes ``{"runtimes": {NAME: {"path": PATH, "runtimeArgs": [ARG, ...]}}}`` into
CONFIG (created when missing, replaced atomically, mode 0644) and prints
``changed``; prints ``unchanged`` and leaves the file alone when it already
says exactly that. Exit 2 when CONFIG is not a JSON object. It never touches
the engine: ``deploy/local.sh`` writes the file before it starts dockerd, or
sends a running dockerd SIGHUP (which reloads ``runtimes`` without
restarting it or its containers).

Standard library only: ``deploy/local.sh`` runs it with the system python3
before any venv exists.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any


def register(config: Path, name: str, path: str, args: list[str]) -> bool:
    """Put runtime ``name`` into ``config``; returns True when the file was (re)written.

    Raises:
        ValueError: ``config`` exists but is not a JSON object (it is left as it is).
    """
    settings: dict[str, Any] = {}
    if config.exists() and config.read_text().strip():
        loaded = json.loads(config.read_text())
        if not isinstance(loaded, dict):
            raise ValueError(f"{config} is not a JSON object")
        settings = loaded
    runtimes = settings.get("runtimes") or {}
    if not isinstance(runtimes, dict):
        raise ValueError(f"{config}: 'runtimes' is not a JSON object")
    wanted = {"path": path, "runtimeArgs": list(args)}
    if runtimes.get(name) == wanted:
        return False
    settings["runtimes"] = {**runtimes, name: wanted}
    config.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=config.parent, prefix=f".{config.name}.")
    try:
        with os.fdopen(fd, "w") as out:
            json.dump(settings, out, indent=2)
            out.write("\n")
        os.chmod(tmp, 0o644)
        os.replace(tmp, config)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return True


def main(argv: list[str]) -> int:
    if len(argv) < 3:
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    config, name, path, *args = argv
    try:
        changed = register(Path(config), name, path, args)
    except ValueError as exc:  # json.JSONDecodeError included
        print(f"register_runtime.py: {exc}", file=sys.stderr)
        return 2
    print("changed" if changed else "unchanged")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
