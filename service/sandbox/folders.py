"""Where the per-sandbox folders live on the host: a tmpfs of their own, so that sandboxes learn no host path.

A sandbox's mount table (``/proc/self/mountinfo``) shows, for the bind mount of its folder at ``/run/ptc``,
the folder's path *within the file system it lives on*. On the work dir's disk that is the host path
(``/var/lib/ptc-sandbox/jobs/job_...``, or a test's temporary folder); on a tmpfs mounted at
``work_dir/run`` it is only ``/jobs/job_...``. So the service mounts a private tmpfs there at start
(``nosuid,nodev,noexec``, mode 0700, ``PTC_SANDBOX_FOLDERS_TMPFS_MB``) and unmounts it when it stops; the
folders hold only what a running sandbox needs (socket, ``tools`` package, script), all of it transient.

Mounting needs root with ``CAP_SYS_ADMIN`` in the mount namespace the engine uses (the service on the host,
as ``deploy/local.sh serve`` runs it). Where the service may not mount (the Compose deployment runs it
without capabilities) it keeps the folders on the work dir's disk and logs that sandboxes can see their host
path; an operator can mount a tmpfs at ``work_dir/run`` before starting the service, which then uses it as
it is. Under gVisor the mount table shows no host path either way (runsc's gofer serves the folder at ``/``).
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
from pathlib import Path

log = logging.getLogger(__name__)

MS_NOSUID, MS_NODEV, MS_NOEXEC = 0x2, 0x4, 0x8  # <sys/mount.h>
MNT_DETACH = 0x2
OWN_MARK = ".ptc-sandbox-tmpfs"
"""File the service leaves in a tmpfs it mounted itself (so that a restart after a crash unmounts it too)."""


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


class SandboxFolders:
    """The host folder under which every sandbox's folder is made (``jobs/``, ``pool/``, ``sessions/``).

    Args:
        path: ``work_dir/run``.
        tmpfs_mb: size of the tmpfs to mount there (MiB); 0 = none (folders on the work dir's disk).
    """

    def __init__(self, path: Path, tmpfs_mb: int) -> None:
        self.path = path
        self._tmpfs_mb = tmpfs_mb
        self._mounted = False

    def open(self) -> bool:
        """Create ``path`` and mount a tmpfs on it unless one is there; returns whether a tmpfs holds the folders.

        Blocking (a few system calls): call it off the event loop. Never raises for a mount the service may
        not make: it logs a warning and keeps the folders on disk.
        """
        self.path.mkdir(parents=True, exist_ok=True)
        os.chmod(self.path, 0o700)
        if os.path.ismount(self.path):
            self._mounted = (self.path / OWN_MARK).exists()  # ours, from a run that did not unmount it
            return True
        if self._tmpfs_mb <= 0:
            return False
        options = f"mode=0700,size={self._tmpfs_mb}m".encode()
        flags = MS_NOSUID | MS_NODEV | MS_NOEXEC
        if _libc().mount(b"tmpfs", str(self.path).encode(), b"tmpfs", flags, options) != 0:
            code = ctypes.get_errno()
            log.warning(
                "cannot mount a tmpfs at %s (%s): sandboxes see that host path in their mount table; "
                "mount one there before the service starts, or run the service as root",
                self.path,
                errno.errorcode.get(code, code),
            )
            return False
        self._mounted = True
        (self.path / OWN_MARK).touch(mode=0o600)
        return True

    def close(self) -> None:
        """Unmount the tmpfs this service mounted (lazily: a removal still under way keeps it until done)."""
        if not self._mounted:
            return
        if _libc().umount2(str(self.path).encode(), MNT_DETACH) != 0:
            code = ctypes.get_errno()
            log.warning("cannot unmount %s: %s", self.path, errno.errorcode.get(code, code))
        self._mounted = False
