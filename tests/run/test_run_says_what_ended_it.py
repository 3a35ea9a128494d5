"""``gpucoord run``'s stderr when its lease ends: one line saying what ended the command (an eviction, an
operator's revoke, Ctrl-C, the session's loss), by whom, and the status it passes on; no traceback or asyncio
noise."""
from __future__ import annotations

import re
import signal
import sys

import pytest

from agent_client import Client
from agent_client.api import coordinator_pb2 as pb
from tests.support.cluster import Cluster
from tests.support.noise import assert_no_asyncio_noise
from tests.support.rpcs import coordinator_stub
from tests.support.run_victim import GRACE_S, start_victim
from tests.support.waiting import wait_for

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("history_checked")]

# -- gpucoord run's stderr: one line saying what happened, by whom, and the status it passes on ---------------

LEASE_LINE = re.compile(r"gpucoord run: lease [0-9a-f]{20}: GPU 0 \(GPU-sim-h1-0\), 16384 MiB, token \d+; "
                        r"started \S+ as pid (\d+)$")


def _stderr_lines(err: str) -> list[str]:
    assert "Traceback" not in err and "Exception ignored" not in err, err
    assert_no_asyncio_noise(err, "gpucoord run")
    return err.splitlines()


@pytest.mark.parametrize("event", ["eviction", "revoke", "ctrl-c", "session loss"])
def test_run_says_in_one_line_what_ended_the_command_by_whom_and_its_status(
        cluster: Cluster, victim_py: str, started: list[int], event: str) -> None:
    cluster.start_node("h1", "1x16GiB")
    addr = cluster.start_coordinator(eviction_grace_s=GRACE_S)
    run, pid = start_victim(addr, "h1", victim_py, "ignore", started)
    (victim,) = wait_for(lambda: cluster.leases(), 10, "the lease")
    wait_for(lambda: victim.pgid or [x for x in cluster.leases() if x.pgid], 10, "the lease to record the group")
    python = re.escape(sys.executable)
    if event == "eviction":
        with Client(addr, agent="high", host="h1") as c:
            lease = c.acquire(16384, priority=9, wait=30)
            rid = lease.request_id
            lease.release()
        final = (rf"gpucoord run: evicted by high/{rid} \(priority 9 request for 16384 MiB needs the room\): "
                 rf"SIGTERM at the notice, SIGKILL at the eviction deadline; {python} \(pid {pid}\) was killed by "
                 rf"SIGKILL \(status 137\)$")
        status = 137
    elif event == "revoke":
        coordinator_stub(addr).RevokeLease(pb.RevokeLeaseRequest(lease_id=victim.id), timeout=10)
        final = (rf"gpucoord run: revoked by operator: SIGKILL at once; {python} \(pid {pid}\) was killed by "
                 rf"SIGKILL \(status 137\)$")
        status = 137
    elif event == "ctrl-c":
        run.send_signal(signal.SIGINT)
        final = (rf"gpucoord run: interrupted: SIGINT forwarded to the command; {python} \(pid {pid}\) was killed "
                 rf"by SIGINT \(status 130\)$")
        status = 130
    else:
        cluster.lt.run(cluster.store.revoke(victim.etcd_lease))   # the session is gone from etcd
        final = (rf"gpucoord run: lease lost \(the session expired or was revoked: the coordinator no longer keeps "
                 rf"it alive\): "
                 rf"SIGKILL at once; {python} \(pid {pid}\) was killed by SIGKILL \(status 137\)$")
        status = 137
    _, err = run.communicate(timeout=60)
    lines = _stderr_lines(err)
    assert len(lines) == 2, err
    started_line = LEASE_LINE.match(lines[0])
    assert started_line is not None and started_line.group(1) == str(pid), lines[0]
    assert re.match(final, lines[1]), f"{lines[1]!r} does not match {final!r}"
    assert run.returncode == status
