"""``gpucoord run`` under a notice that is withdrawn (its requester's wait ended): it says ``notice withdrawn``
and sends no SIGKILL; the command (which ignores SIGTERM) keeps running past the notice's deadline, and its
lease stays. The history checker ends it."""
from __future__ import annotations

import os
import signal
import time

import pytest

from agent_client import Client, errors
from tests.support.cluster import Cluster
from tests.support.run_victim import start_victim
from tests.support.waiting import LIVENESS_S, pass_time, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("history_checked")]

GRACE_S = 3.0


def test_run_hears_a_withdrawn_notice_and_sends_no_sigkill(cluster: Cluster, victim_py: str) -> None:
    cluster.start_node("h1", "1x16GiB", heartbeat_s=3600)
    addr = cluster.start_coordinator(eviction_grace_s=GRACE_S, eviction_kill_margin_s=1.0)
    started: list[int] = []
    run, pid = start_victim(addr, "h1", victim_py, "ignore", started)
    try:
        with Client(addr, agent="high", host="h1") as c:
            with pytest.raises(errors.ResourceExhausted):
                c.acquire(16384, priority=9, wait=1.0)
            notice_gone_at = time.monotonic()
            wait_for(lambda: not cluster.get_prefix(cluster.keys.evictions()), LIVENESS_S, "the notice withdrawn")
        # Past the deadline the notice had, and its kill margin: the command still runs, its lease stays.
        pass_time(max(0.0, notice_gone_at + GRACE_S + 1.5 - time.monotonic()), "the deadline to pass")
        assert run.poll() is None, "run ended although the notice was withdrawn"
        os.kill(pid, 0)
        assert [x.agent for x in cluster.leases()] == ["low"]
    finally:
        for p in started:
            try:
                os.kill(p, signal.SIGINT)
            except ProcessLookupError:
                pass
        _, err = run.communicate(timeout=20)
    assert "notice withdrawn" in err, err[-2000:]
