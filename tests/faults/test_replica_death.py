"""G7 (and G3) with coordinators as real processes, killed: the leader dies with an eviction deadline
pending; a waiter keeps its place when the replica serving it, or the one that forwarded it, dies; a
replica is killed (or stopped) and restarted on its address, within its clients' TTL. Every test ends with the history checker."""
from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import pytest

from agent_client import Client
from coordinator.cli.common import fetch_status
from coordinator.records import QueueEntry
from tests.faultlink import FaultLink
from tests.history import check_store
from tests.support.cluster import Cluster
from tests.support.processes import replica_processes, spawn_agent, spawn_coordinator
from tests.support.waiting import LIVENESS_S, pass_time, wait_for


@pytest.fixture
def replicas(cluster: Cluster, tmp_path: Path) -> Iterator[dict[str, Any]]:
    """Two coordinator processes; maps replica id -> (process, address). The history checker runs at the end."""
    with replica_processes(cluster, tmp_path, extra=["--grace", "3"]) as by_id:
        yield by_id
    cluster.lt.run(check_store(cluster.store, cluster.keys)).assert_ok()


def _leader(addr: str) -> str:
    return str(fetch_status(addr).get("leader", ""))


def test_new_leader_enforces_a_pending_eviction_deadline(cluster: Cluster, replicas: dict[str, Any]) -> None:
    cluster.start_node("h1", "1x8GiB")
    addrs = [addr for _, addr in replicas.values()]
    leader_id = wait_for(lambda: _leader(addrs[0]), 10, "a leader")
    leader_proc, leader_addr = replicas[leader_id]
    (follower_addr,) = [a for a in addrs if a != leader_addr]
    with Client(follower_addr, agent="low", host="h1") as low, Client(follower_addr, agent="high", host="h1") as high:
        victim = low.acquire(8000, priority=0)          # it will ignore its notice
        result: dict[str, Any] = {}

        def take() -> None:
            result["lease"] = high.acquire(6000, priority=5, wait=2 * LIVENESS_S)   # far past the deadline
        t = threading.Thread(target=take, daemon=True)
        t.start()
        wait_for(lambda: victim.evicting.is_set(), LIVENESS_S, "the eviction notice")
        deadline = victim.notice.deadline_unix
        os.kill(leader_proc.pid, signal.SIGKILL)       # the leader dies with the deadline pending
        leader_proc.wait()
        t.join(2 * LIVENESS_S + 10)
        assert "lease" in result, "the waiter was never granted: the deadline was lost"
        granted_at = time.time()
        assert granted_at >= deadline - 0.1
        assert [x.id for x in cluster.leases()] == [result["lease"].id]
        assert wait_for(lambda: _leader(follower_addr), 10, "a new leader") != leader_id


def _waiter_keeps_its_place_when(cluster: Cluster, replicas: dict[str, Any], kill: str) -> None:
    """A waiter whose call reaches the host's owner through the other replica (forwarded), and ``kill`` says
    which of the two dies: "owner" (the one whose id the queue entry names) or "forwarder". The client
    retries through the survivor with the same request_id, keeps its rank, and is granted once the room is
    freed."""
    cluster.start_node("h1", "1x8GiB")
    addrs = [addr for _, addr in replicas.values()]
    with Client(addrs, agent="holder", host="h1") as holder:
        held = holder.acquire(8000, preemptible=False)
        owner_addr = wait_for(lambda: holder._async._owner, LIVENESS_S, "the owner's address")
        (forwarder_addr,) = [a for a in addrs if a != owner_addr]
        by_addr = {addr: (rid, proc) for rid, (proc, addr) in replicas.items()}
        with Client([forwarder_addr, owner_addr], agent="waiter", host="h1", ttl=10) as waiter:
            result: dict[str, Any] = {}

            def take() -> None:
                result["lease"] = waiter.acquire(4000, wait=2 * LIVENESS_S, request_id="survivor")
            t = threading.Thread(target=take, daemon=True)
            t.start()
            entries = lambda: [QueueEntry.from_kv(kv) for kv in cluster.get_prefix(cluster.keys.queue("h1"))]
            queued = wait_for(lambda: entries(), LIVENESS_S, "the waiter to be queued")
            rank, served_by = queued[0].rank, queued[0].replica
            assert served_by == by_addr[owner_addr][0], "the owner serves the forwarded waiter"
            victim = by_addr[owner_addr if kill == "owner" else forwarder_addr][1]
            os.kill(victim.pid, signal.SIGKILL)
            victim.wait()
            if kill == "owner":
                # The client retries through the survivor, which takes the entry over (its id in it).
                now = wait_for(lambda: [e for e in entries() if e.replica != served_by], LIVENESS_S,
                               "the retry to attach")
            else:
                # The owner keeps the forwarded waiter's entry for the client's retry, past the grace of a
                # caller that went away (2 s).
                deadline = time.monotonic() + 3.0
                while time.monotonic() < deadline:
                    assert entries(), "the entry of a forwarded waiter left with its forwarder"
                    time.sleep(0.1)
                now = entries()
            assert now[0].rank == rank
            held.release()
            t.join(LIVENESS_S)
            assert result["lease"].vram_mb == 4000
            assert not waiter.expired


def test_a_waiter_keeps_its_place_when_the_replica_serving_it_dies(cluster: Cluster,
                                                                  replicas: dict[str, Any]) -> None:
    _waiter_keeps_its_place_when(cluster, replicas, kill="owner")


def test_a_waiter_keeps_its_place_when_the_replica_that_forwarded_it_dies(cluster: Cluster,
                                                                         replicas: dict[str, Any]) -> None:
    _waiter_keeps_its_place_when(cluster, replicas, kill="forwarder")


@pytest.mark.usefixtures("history_checked")
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_coordinator_restart_keeps_the_lease_and_the_client_goes_on(cluster: Cluster, tmp_path: Path,
                                                                    sig: int) -> None:
    cluster.start_node("h1", "1x16GiB")
    proc, port = spawn_coordinator(cluster.endpoints, cluster.prefix, "127.0.0.1:0", str(tmp_path / "c1.log"))
    addr = f"127.0.0.1:{port}"
    c = Client(addr, agent="agent-a", host="h1", ttl=10).connect()
    try:
        lease = c.acquire(6000)
        os.kill(proc.pid, sig)
        proc.wait()
        # A new replica on the same address (as a supervisor would restart it).
        proc, port2 = spawn_coordinator(cluster.endpoints, cluster.prefix, addr, str(tmp_path / "c2.log"))
        assert port2 == port
        (stored,) = cluster.leases()
        assert stored.id == lease.id
        # The client keeps its session through the new replica and goes on working.
        second = c.acquire(2000)
        assert second.token == lease.token + 1
        assert not c.expired
        lease.release()
        second.release()
        assert cluster.leases() == []
    finally:
        c.close()
        proc.terminate()
        proc.wait()


# A session kept through the outage must have had time left when its replica was back: enough for the client's
# reconnect (its backoff is at most 1 s) and one keepalive. What a slow restart spent of a session's TTL is the
# machine's speed, not a defect: such a session is counted and printed, not asserted on.
KEEP_MARGIN_S = 2


@pytest.mark.usefixtures("history_checked")
def test_sessions_survive_a_coordinator_outage_shorter_than_their_ttl(cluster: Cluster, tmp_path: Path) -> None:
    """16 agent processes keep their sessions and leases (TTL 10 s) through a coordinator killed and
    restarted on its address, the agents cut from it for 6.3 s (from just after it refreshed their
    etcd_leases): the client reconnects as soon as the replica is back. Each session is judged by what its etcd_lease had left when the
    new replica served (etcd's own LeaseTimeToLive, read then): one with KEEP_MARGIN_S or more must be kept.
    (Review finding R2: gRPC's default reconnect backoff, 1 s x 1.6 per failure, kept a client away until
    ~7.4-11 s into the outage, past many TTLs; each survived with p ~ 0.7, all 16 by chance < 1 %. Before this
    test judged each session by its time left, a loaded machine that took long to restart the replica failed
    it: the sessions had expired before the replica was back.)"""
    cluster.start_node("h1", "1x16GiB")
    proc, port = spawn_coordinator(cluster.endpoints, cluster.prefix, "127.0.0.1:0", str(tmp_path / "c1.log"))
    addr = f"127.0.0.1:{port}"
    # The agents reach the replica over a link that is down (connections reset, as to a dead host) for the
    # whole outage: the new process starts on the same address meanwhile, so that how long a loaded machine
    # takes to start it does not lengthen the outage the clients see (unless it takes longer than the outage).
    link = FaultLink(addr, "agents to the replica")
    agents = [spawn_agent(link.endpoint, "h1", f"a{i}", 1000, 10, log_path=str(tmp_path / f"a{i}.log"),
                          read_answer=False)[0]
              for i in range(16)]
    try:
        for a in agents:
            assert a.stdout is not None and a.stdout.readline().startswith(b"GRANTED")
        sessions = {kv.key: kv.etcd_lease for kv in cluster.get_prefix(cluster.keys.sessions())}
        assert len(sessions) == 16
        # Killed just after a refresh: the outage then leaves every session about TTL - 6.3 s.
        some = next(iter(sessions.values()))
        wait_for(lambda: cluster.lt.run(cluster.store.time_to_live(some)) >= 9, LIVENESS_S, "a fresh refresh")
        link.cut(loud=True)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        down_at = time.monotonic()
        proc, port2 = spawn_coordinator(cluster.endpoints, cluster.prefix, addr, str(tmp_path / "c2.log"))
        assert port2 == port
        pass_time(max(0.0, 6.3 - (time.monotonic() - down_at)), "an outage well within the TTL")
        left = {key: cluster.lt.run(cluster.store.time_to_live(etcd_lease)) for key, etcd_lease in sessions.items()}
        link.heal()
        back_after = time.monotonic() - down_at
        pass_time(max(0.0, 12.0 - (time.monotonic() - down_at)), "the TTL to pass since the outage began")
        kept = {kv.key for kv in cluster.get_prefix(cluster.keys.sessions())}
        judged = {key for key, ttl in left.items() if ttl >= KEEP_MARGIN_S}
        print(f"replica back {back_after:.1f}s into the outage; time left then (s): {sorted(left.values())}; "
              f"{len(judged)} sessions had >= {KEEP_MARGIN_S}s left, {len(kept)} of 16 kept")
        lost = sorted(k.decode() for k in judged - kept)
        assert not lost, f"sessions lost although each had >= {KEEP_MARGIN_S}s of its TTL left when the replica " \
                         f"was back {back_after:.1f}s into the outage: {lost}"
        # Every kept session keeps its lease (and no lease outlives its session: the history checker).
        assert len(cluster.leases()) == len(kept)
    finally:
        for a in agents:
            a.kill()
            a.wait()
        proc.terminate()
        proc.wait(10)
        link.close()
