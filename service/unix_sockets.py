"""Listening unix sockets whose recorded address names no host path.

A unix socket's address is the path given to ``bind``, and Linux keeps it on every socket of the connection: the
socket the service accepts is made in the *connecting* process's network namespace, so a sandbox's
``/proc/net/unix`` lists it with that address. Bound at ``/srv/work/runs/ses_x/control.sock`` the service's work dir
would show there; bound through ``/proc/self/fd/N/control.sock`` (``N`` a descriptor of the socket's folder, the
kernel's way to name a folder without its path) the address is that neutral string, and the socket file is the
same one in the same folder.
"""

from __future__ import annotations

import contextlib
import os
import socket
import stat
from pathlib import Path


def bind_unix(path: Path) -> socket.socket:
    """A ``SOCK_STREAM`` unix socket bound to the file ``path`` (created; its folder must exist) under an address
    that names no folder: ``/proc/self/fd/<n>/<name>``. Not listening yet (``asyncio.start_unix_server(sock=...)``
    listens); mode as the process's umask gives it. A socket file already at ``path`` (an earlier listener's, e.g.
    the broker of a session's previous run) is replaced, as ``asyncio.start_unix_server(path=...)`` does.

    Raises:
        OSError: the folder cannot be opened or the name is taken (``EADDRINUSE``).
    """
    with contextlib.suppress(FileNotFoundError):
        if stat.S_ISSOCK(os.lstat(path).st_mode):
            os.unlink(path)
    folder = os.open(path.parent, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.bind(f"/proc/self/fd/{folder}/{path.name}")
        except BaseException:
            sock.close()
            raise
    finally:
        with contextlib.suppress(OSError):
            os.close(folder)
    return sock
