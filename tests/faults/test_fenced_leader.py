"""A fenced leader: a leader paused past its election TTL (SIGSTOP) that wakes up after its successor took
over cannot act beside it. Every write made as leader compares the leader's own candidacy
(``Election.fence``), so the deposed leader's revoke at an eviction deadline fails.

Two tests. The first, in process, is the one that fails without the fence: a leader that never learns it
was deposed (it is made deaf to its loss) keeps trying its duties, and etcd refuses every write. The
second is the whole scene with real processes and SIGSTOP; there the resumed leader usually notices its
loss before its deadline timer fires, so it passes even without the fence.

Real coordinator processes. The old leader saw an eviction notice first, so its deadline comes first; it
is stopped before then and resumed after it (while, by its own clock, the deadline has passed), but
before the deadline of its successor, which saw the notice later. The lease must still be there after the
old leader has resumed, and the successor revokes it at its own deadline. From etcd's history: no write
of a leader's (a revoke at a deadline deletes the notice and the lease at one revision) committed between
the old leader's election key going and the successor's deadline.
"""
from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import grpc

from agent_client import Client
from agent_client.api import coordinator_pb2 as pb
from agent_client.api import coordinator_pb2_grpc as pb_grpc
from tests.history import check_history, read_history
from tests.support.cluster import Cluster, revision
from tests.support.patching import deafen
from tests.support.processes import spawn_coordinator, stop_process
from tests.support.waiting import wait_for

GRACE_S = 12.0


def test_a_deposed_leader_that_has_not_noticed_commits_no_leader_write(cluster: Cluster) -> None:
    """The leader's candidacy goes (its etcd_lease is revoked, as if it had expired during a pause) while
    the leader is kept from noticing (its step-down is a no-op), so its duties run on. At the eviction
    deadline it tries to revoke the victim's lease again and again: every try must fail in etcd, and etcd's
    history must show no write of a leader's after the candidacy went."""
    cluster.start_node("h1", "1x16GiB", ttl=30)
    addr = cluster.start_coordinator()
    svc = cluster.service(addr)
    wait_for(lambda: svc.leadership.is_leader, 15, "the replica to lead")
    leadership = svc.leadership
    term = leadership.election
    deaf = deafen(cluster, leadership)
    tries = deaf.tries
    try:
        with Client(addr, agent="victim", host="h1", ttl=60) as victim:
            lease = victim.acquire(4000)
            pb_grpc.CoordinatorStub(grpc.insecure_channel(addr)).EvictLease(
                pb.EvictLeaseRequest(lease_id=lease.id, grace_seconds=2.0, reason="fence"), timeout=10)
            cluster.lt.run(cluster.store.revoke(term.session.etcd_lease))     # deposed, and deaf to it
            gone_at = time.monotonic()
            wait_for(lambda: len([t for t, _ in tries if t > gone_at]) >= 3 or any(out is True for _, out in tries),
                     20, "the deposed leader to try its revoke at the deadline three times")
            print(f"the deposed leader's tries: {[type(out).__name__ for _, out in tries]}")
            assert lease.id in {x.id for x in cluster.leases()}, "a deposed leader revoked a lease"
            assert cluster.get_prefix(cluster.keys.eviction(lease.id)), "a deposed leader deleted a notice"
            checked = revision(cluster)    # later, the victim's session ends and takes its keys with it
    finally:
        deaf.undo()
    events = cluster.lt.run(read_history(cluster.store, cluster.keys.root()))
    gone = [ev.kv.mod_revision for ev in events
            if ev.kind == "DELETE" and ev.kv.key == cluster.keys.candidate(term.candidate_id)]
    assert gone
    leader_writes = [ev for ev in events if gone[0] < ev.kv.mod_revision <= checked and ev.kind == "DELETE"
                     and (ev.kv.key == cluster.keys.eviction(lease.id) or lease.id.encode() in ev.kv.key)]
    assert not leader_writes, leader_writes
    check_history(events, cluster.keys).assert_ok()


def test_a_leader_paused_past_its_ttl_cannot_revoke_beside_its_successor(cluster: Cluster, tmp_path: Path) -> None:
    cluster.start_node("h1", "1x16GiB", ttl=30)
    procs = []
    try:
        old, port_a = spawn_coordinator(cluster.endpoints, cluster.prefix, "127.0.0.1:0", str(tmp_path / "a.log"))
        procs.append(old)
        a = f"127.0.0.1:{port_a}"
        wait_for(lambda: len(cluster.replicas()) == 1, 15, "the first replica (the leader) to register")
        old_id = next(iter(cluster.replicas()))
        with Client(a, agent="victim", host="h1", ttl=60) as victim:
            lease = victim.acquire(4000)
            pb_grpc.CoordinatorStub(grpc.insecure_channel(a)).EvictLease(
                pb.EvictLeaseRequest(lease_id=lease.id, grace_seconds=GRACE_S, reason="fence"), timeout=10)
            noticed = time.monotonic()
            os.kill(old.pid, signal.SIGSTOP)
            # The successor starts (and first sees the notice) well after the old leader did: its deadline
            # comes ~4 s after the old leader's.
            time.sleep(4.0)
            new, port_b = spawn_coordinator(cluster.endpoints, cluster.prefix, "127.0.0.1:0",
                                            str(tmp_path / "b.log"))
            procs.append(new)
            b = f"127.0.0.1:{port_b}"
            wait_for(lambda: pb_grpc.CoordinatorStub(grpc.insecure_channel(b)).GetStatus(
                pb.GetStatusRequest(host="h1"), timeout=5).leader not in ("", old_id), 20,
                "the successor to lead")
            # Resume the old leader after its own deadline (it saw the notice first) ...
            time.sleep(max(0.0, noticed + GRACE_S + 0.3 - time.monotonic()))
            os.kill(old.pid, signal.SIGCONT)
            resumed = time.monotonic()
            # ... and give it time to act on it, before the successor's deadline.
            time.sleep(1.5)
            assert lease.id in {x.id for x in cluster.leases()}, "the deposed leader revoked the lease"
            wait_for(lambda: lease.id not in {x.id for x in cluster.leases()}, 15, "the successor's revoke")
            print(f"revoked {time.monotonic() - resumed:.1f}s after the old leader resumed")
    finally:
        for p in procs:
            stop_process(p)
    events = cluster.lt.run(read_history(cluster.store, cluster.keys.root()))
    gone = [ev.kv.mod_revision for ev in events
            if ev.kind == "DELETE" and ev.kv.key == cluster.keys.candidate(old_id)]
    revoked = [ev.kv.mod_revision for ev in events
               if ev.kind == "DELETE" and ev.kv.key == cluster.keys.eviction(lease.id)]
    assert gone and revoked and revoked[0] > gone[0]
    assert len(revoked) == 1
    check_history(events, cluster.keys).assert_ok()
