"""Every ``io.ptc-sandbox.*`` label the service reads or writes, and the runtime features an image's label lists.

Containers (written by the service when it creates a sandbox; read by the start-up sweep and the tests):

- ``LABEL_MANAGED`` ``"1"`` and ``LABEL_INSTANCE`` the instance id: every sandbox of the service. The start-up
  sweep removes whatever carries both for this instance (a previous run's leftovers).
- ``LABEL_JOB``: the job id of a one-shot job's sandbox (absent on pooled and session sandboxes).
- ``LABEL_SESSION`` ``"1"``: a session's sandbox.
- ``LABEL_POOL``: a pooled sandbox's profile name (``default`` or a short hash).
- ``LABEL_SANDBOX``: unique per sandbox (its folder's name): a start that failed late removes only that one.
- ``LABEL_UID``: the uid the sandbox's scripts run as, one of its image's ``LABEL_UIDS`` range, unique among the live
  sandboxes of the engine (every replica's and instance's: the backend looks at them all, ``docker.DockerBackend``).

Images (written by ``sandbox_image/Dockerfile`` and the service's ``Dockerfile``; read by the service):

- ``LABEL_RUNTIME``: the runtime's features, comma-separated (``FEATURE_SESSION``: a resident interpreter that
  forks one process per script, used by every run; ``FEATURE_PRIVSEP``: started as root with three capabilities,
  it runs every script as 10001 and ends each run with ``kill(-1)``; ``FEATURE_FILES``: files in and out of
  ``/tmp`` over the control protocol, ``ptc_runtime.files``; the runtime also says so in its hello).
- ``LABEL_ROLE``: ``sandbox-image`` or ``service``.
- ``LABEL_UIDS``: ``"first-last"``, the uids the image's ``/etc/passwd`` lists as ``sandbox`` users, from which each
  sandbox gets its own (``LABEL_UID``); an image without it runs every script as 10001.
"""

from __future__ import annotations

from collections.abc import Mapping

from ptc_runtime import protocol

PREFIX = "io.ptc-sandbox."
LABEL_MANAGED = PREFIX + "managed"
LABEL_INSTANCE = PREFIX + "instance"
LABEL_JOB = PREFIX + "job"
LABEL_SESSION = PREFIX + "session"
LABEL_POOL = PREFIX + "pool"
LABEL_SANDBOX = PREFIX + "sandbox"
LABEL_RUNTIME = PREFIX + "runtime"
LABEL_ROLE = PREFIX + "role"
LABEL_UID = PREFIX + "uid"
LABEL_UIDS = protocol.UIDS_LABEL

FEATURE_SESSION = "session"
FEATURE_PRIVSEP = "privsep"
FEATURE_FILES = "files"


def instance_labels(instance: str) -> dict[str, str]:
    """The labels on every sandbox of the service instance ``instance`` (what the start-up sweep removes)."""
    return {LABEL_MANAGED: "1", LABEL_INSTANCE: instance}


def uid_range(image_labels: Mapping[str, str]) -> range | None:
    """The uids an image's ``LABEL_UIDS`` offers its sandboxes, or None when it has none (or one that is not
    ``"first-last"`` with 10001 < first <= last < 2**31 - 1, at most 1,048,576 of them)."""
    first, _, last = str(image_labels.get(LABEL_UIDS, "")).partition("-")
    try:
        ids = range(int(first), int(last) + 1)
    except ValueError:
        return None
    if not (ids and ids.start > 10001 and ids.stop <= 2**31 - 1 and len(ids) <= 2**20):
        return None
    return ids


def features(image_labels: Mapping[str, str]) -> frozenset[str]:
    """The runtime features an image's labels list (``LABEL_RUNTIME``); empty for an image without the label."""
    return frozenset(name for name in str(image_labels.get(LABEL_RUNTIME, "")).split(",") if name)
