"""Attacks on the replicated mode with the real cluster (issue 17; tests/integration/replicas.py): a replica paused
(SIGSTOP) past its lease and then resumed must fence itself without writing anything: its job stays ``lost`` as
the survivor marked it (once), and its callback is delivered once, by the survivor."""

from __future__ import annotations

import os
import signal
import time
from collections import Counter
from contextlib import closing

import orjson

from tests.conftest import wait_until
from tests.integration import replicas
from tests.integration.replicas import Cluster
from tests.integration.test_replicas import KILL_BOUND_S, epoch_of, started
from tests.receiver import Receiver

cluster = replicas.cluster

ENDS_DURING_THE_PAUSE = "import time\nprint('before', flush=True)\ntime.sleep(5)\nprint('after', flush=True)\n"
"""A job whose script ends while its replica is paused: on resuming, the replica finds it ended and tries to save it."""


def test_a_replica_paused_past_its_lease_fences_itself_without_writing(cluster: Cluster) -> None:
    receiver = Receiver(failures=0)
    with cluster.client(cluster.t1.url) as c1, cluster.client(cluster.t2.url) as c2, closing(receiver):
        epoch, _ = epoch_of(cluster, "t2")
        job_id = started(c2, ENDS_DURING_THE_PAUSE, callback_url=receiver.url, durable=False)  # else resumed on t1
        time.sleep(1.0)  # progress saves (PTC_PROGRESS_SAVE_S=0.5): "before" is in the store
        pid = cluster.t2.process.pid
        os.kill(pid, signal.SIGSTOP)
        paused = time.monotonic()
        try:
            wait_until(lambda: c1.get(f"/jobs/{job_id}").json()["status"] == "lost", KILL_BOUND_S)
            lost = c1.get(f"/jobs/{job_id}").content
            assert epoch_of(cluster, "t2") == (epoch, "expired")
            time.sleep(max(0.0, 7.0 - (time.monotonic() - paused)))  # the script has ended meanwhile
        finally:
            os.kill(pid, signal.SIGCONT)
        assert cluster.t2.process.wait(timeout=60) == 75  # fenced: it exits for its supervisor to restart it

        view = orjson.loads(c1.get(f"/jobs/{job_id}").content)
        assert (view["status"], view["error"]["type"], view["stdout"]) == ("lost", "replica_lost", "before\n"), view
        assert orjson.loads(lost)["stdout"] == "before\n"

        def ids() -> list[str | None]:
            return [{k.lower(): v for k, v in h.items()}.get("webhook-id") for _, h, _ in receiver.deliveries]

        wait_until(lambda: f"msg_{job_id}" in ids(), 30)
        time.sleep(3)  # for a duplicate (the resumed owner's) to arrive
        assert Counter(ids()) == {f"msg_{job_id}": 1}, receiver.deliveries
        delivered = orjson.loads(receiver.deliveries[0][2])
        assert delivered["status"] == "lost", delivered
        assert c1.get(f"/jobs/{job_id}").json()["status"] == "lost"
