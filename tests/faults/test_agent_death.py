"""G4 with agents as real processes, killed (SIGKILL) or hung (SIGSTOP): a dead holder's VRAM comes back; a
dead waiter leaves the queue; a hung requester's eviction notices are withdrawn with its session, so its
victims keep their leases. Every test ends with the history checker.

G4's times (a lease gone within TTL + 1 s, a waiter's entry within the TTL): the lease and the queue entry
are keys on their session's etcd_lease, and the replica that keeps the session alive revokes that etcd_lease
when no keepalive came for the session's TTL (``replica/liveness.py``; the etcd_lease's own TTL is the long
``session_etcd_ttl_s``), so etcd deletes them together, with no sweeper of gpucoord's (a dead waiter's entry
goes sooner, as its call ends). That binding is what these tests assert, with the keys' going (within a
deadline no loaded machine misses); how soon they went is printed, and measured by ``gpucoord bench`` P6.
"""
from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from agent_client import Client
from coordinator.config import CoordinatorConfig
from tests.support.cluster import Cluster, queue
from tests.support.processes import spawn_agent
from tests.support.waiting import LIVENESS_S, pass_time, wait_for

pytestmark = pytest.mark.usefixtures("history_checked")


def _on_its_sessions_etcd_lease(cluster: Cluster, kv: Any, agent: str, ttl: int) -> int:
    """The etcd_lease ``kv`` is bound to: its session's (that of the agent's session record), live, with at
    most the etcd_lease's long TTL left (the session's own TTL is kept by its replica). Returns it."""
    sessions = [s.etcd_lease for s in cluster.get_prefix(cluster.keys.sessions(agent))]
    assert sessions == [kv.etcd_lease], f"{kv.key!r} is on etcd_lease {kv.etcd_lease}, its session on {sessions}"
    left = cluster.lt.run(cluster.store.time_to_live(kv.etcd_lease))
    assert 0 < left <= max(CoordinatorConfig().session_etcd_ttl_s, 3 * ttl), f"{kv.key!r}: its etcd_lease has {left}s left"
    return int(kv.etcd_lease)


def _etcd_lease_gone(cluster: Cluster, etcd_lease: int) -> bool:
    return int(cluster.lt.run(cluster.store.time_to_live(etcd_lease))) < 0


def test_sigkilled_client_frees_its_vram_with_its_etcd_lease(cluster: Cluster, tmp_path: Path) -> None:
    cluster.start_node("h1", "1x16GiB")
    addr = cluster.start_coordinator()
    ttl = 3
    proc, answer = spawn_agent(addr, "h1", "agent-k", 8000, ttl, log_path=str(tmp_path / "agent.log"))
    try:
        assert answer.startswith("GRANTED"), answer
        (lease_kv,) = cluster.get_prefix(cluster.keys.leases())
        etcd_lease = _on_its_sessions_etcd_lease(cluster, lease_kv, "agent-k", ttl)
        killed_at = time.monotonic()
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        wait_for(lambda: cluster.leases() == [], LIVENESS_S, "the killed agent's lease to expire")
        print(f"freed {time.monotonic() - killed_at:.2f}s after the SIGKILL (TTL {ttl}s; G4: TTL + 1 s, bench P6)")
        assert _etcd_lease_gone(cluster, etcd_lease), "the lease went, but not with its session's etcd_lease"
        assert cluster.get_prefix(cluster.keys.sessions()) == []
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    # The freed VRAM is admissible again.
    with Client(addr, agent="agent-b", host="h1") as c:
        assert c.acquire(16384).vram_mb == 16384


def test_killed_waiter_leaves_the_queue_with_its_etcd_lease(cluster: Cluster, tmp_path: Path) -> None:
    cluster.start_node("h1", "1x8GiB")
    addr = cluster.start_coordinator()
    with Client(addr, agent="a", host="h1") as a:
        a.acquire(8000, preemptible=False)
        ttl = 3
        proc, _ = spawn_agent(addr, "h1", "waiter", 4000, ttl, log_path=str(tmp_path / "w.log"), wait=60,
                              read_answer=False)
        try:
            wait_for(lambda: len(queue(cluster)) == 1, 15, "the waiter process to be queued")
            (entry_kv,) = cluster.get_prefix(cluster.keys.queue("h1"))
            etcd_lease = _on_its_sessions_etcd_lease(cluster, entry_kv, "waiter", ttl)
            killed = time.monotonic()
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
            wait_for(lambda: queue(cluster) == [], LIVENESS_S, "the dead waiter's entry to go")
            print(f"the entry went {time.monotonic() - killed:.2f}s after the SIGKILL (TTL {ttl}s; G4: within "
                  "the TTL)")
            # The replica removes the entry as soon as the dead process's call ends (its connection closes);
            # at the latest it goes with its session's etcd_lease, and the session goes with that too.
            wait_for(lambda: _etcd_lease_gone(cluster, etcd_lease), LIVENESS_S, "the waiter's etcd_lease to expire")
            assert cluster.get_prefix(cluster.keys.sessions("waiter")) == []
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
    # A grace far longer than the requester's TTL (2 s), so that its session is over well before the
    # victim's deadline even on a loaded machine: what the test is about is what happens then.
    addr = cluster.start_coordinator(eviction_grace_s=15)
    with Client(addr, agent="low", host="h1", ttl=30) as low:
        victim = low.acquire(8000, priority=0)
        proc, _ = spawn_agent(addr, "h1", "high", 6000, 2, log_path=str(tmp_path / "high.log"), wait=60,
                              read_answer=False, extra=["--priority", "5"])
        try:
            wait_for(lambda: victim.evicting.is_set(), LIVENESS_S, "the eviction notice")
            deadline = victim.notice.deadline_unix
            os.kill(proc.pid, signal.SIGSTOP)   # the requester hangs; its session expires after 2 s
            wait_for(lambda: queue(cluster) == [], max(1.0, deadline - time.time() - 1.0),
                     "the hung requester's entry to go with its session, before the victim's deadline")
            pass_time(max(0.0, deadline - time.time()) + 1.5, "the victim's deadline to pass")
            assert [x.id for x in cluster.leases()] == [victim.id], \
                "the victim was revoked for a requester that is gone"
        finally:
            os.kill(proc.pid, signal.SIGCONT)
            proc.kill()
            proc.wait()
