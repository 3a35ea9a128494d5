"""G4 with agents as real processes, killed (SIGKILL) or hung (SIGSTOP): a dead holder's VRAM comes back
within its TTL + 1 s; a dead waiter leaves the queue within its TTL; a hung requester's eviction notices
are withdrawn with its session, so its victims keep their leases. Every test ends with the history checker.
"""
from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from agent_client import Client
from tests.support.cluster import Cluster, queue
from tests.support.processes import spawn_agent
from tests.support.waiting import pass_time, wait_for

pytestmark = pytest.mark.usefixtures("history_checked")


def test_sigkilled_client_frees_its_vram_within_ttl_plus_1s(cluster: Cluster, tmp_path: Path) -> None:
    cluster.start_node("h1", "1x16GiB")
    addr = cluster.start_coordinator()
    ttl = 3
    proc, answer = spawn_agent(addr, "h1", "agent-k", 8000, ttl, log_path=str(tmp_path / "agent.log"))
    try:
        assert answer.startswith("GRANTED"), answer
        assert len(cluster.leases()) == 1
        killed_at = time.monotonic()
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        wait_for(lambda: cluster.leases() == [], ttl + 1, "the killed agent's lease to expire")
        freed_after = time.monotonic() - killed_at
        assert freed_after <= ttl + 1
        assert cluster.get_prefix(cluster.keys.sessions()) == []
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    # The freed VRAM is admissible again.
    with Client(addr, agent="agent-b", host="h1") as c:
        assert c.acquire(16384).vram_mb == 16384


def test_killed_waiter_leaves_the_queue_within_its_ttl(cluster: Cluster, tmp_path: Path) -> None:
    cluster.start_node("h1", "1x8GiB")
    addr = cluster.start_coordinator()
    with Client(addr, agent="a", host="h1") as a:
        a.acquire(8000, preemptible=False)
        ttl = 3
        proc, _ = spawn_agent(addr, "h1", "waiter", 4000, ttl, log_path=str(tmp_path / "w.log"), wait=60,
                              read_answer=False)
        try:
            wait_for(lambda: len(queue(cluster)) == 1, 15, "the waiter process to be queued")
            killed = time.monotonic()
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
            wait_for(lambda: queue(cluster) == [], ttl + 1, "the dead waiter's entry to go")
            assert time.monotonic() - killed <= ttl + 1
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def test_the_notices_of_a_requester_whose_session_expired_are_withdrawn(cluster: Cluster, tmp_path: Path) -> None:
    """A waiting requester that hangs (SIGSTOP past its TTL, or a partitioned host) loses its queue entry
    with its session, and its eviction notices are withdrawn too: at their deadline the leader revokes
    nothing, and the victim keeps its lease (README: "If it gives up first (its wait ends, its caller
    leaves), its notices are withdrawn and the victims are not revoked"). (Review finding R10: notices were
    withdrawn only where a replica deleted the entry itself, so the victim was revoked for nobody.)"""
    cluster.start_node("h1", "1x8GiB")
    addr = cluster.start_coordinator(eviction_grace_s=6)
    with Client(addr, agent="low", host="h1", ttl=30) as low:
        victim = low.acquire(8000, priority=0)
        proc, _ = spawn_agent(addr, "h1", "high", 6000, 2, log_path=str(tmp_path / "high.log"), wait=60,
                              read_answer=False, extra=["--priority", "5"])
        try:
            wait_for(lambda: victim.evicting.is_set(), 10, "the eviction notice")
            deadline = victim.notice.deadline_unix
            os.kill(proc.pid, signal.SIGSTOP)   # the requester hangs; its session expires after 2 s
            wait_for(lambda: queue(cluster) == [], 5, "the hung requester's entry to go with its session")
            pass_time(max(0.0, deadline - time.time()) + 1.5, "the victim's deadline to pass")
            assert [x.id for x in cluster.leases()] == [victim.id], \
                "the victim was revoked for a requester that is gone"
        finally:
            os.kill(proc.pid, signal.SIGCONT)
            proc.kill()
            proc.wait()
