"""The leader cut from etcd (its clients still reach it): it stops its duties before its election can lapse,
and whatever it still sends once its election key is gone is refused by etcd (the fence), while the successor
enforces the eviction deadline that was pending.

In-process coordinators, each with its etcd connection behind a fault link (tests/faultlink.py). A silent cut
holds the bytes a side sends and delivers them when the link heals, as TCP does across a partition: the old
leader's revokes, sent while it was cut, arrive after its candidacy expired, which is what the fence is for.
"""
from __future__ import annotations

import time

import grpc

from agent_client import Client
from agent_client.api import coordinator_pb2 as pb
from agent_client.api import coordinator_pb2_grpc as pb_grpc
from tests.history import check_history, check_store, read_history
from tests.support.cluster import Cluster, revision, wait_no_leaks
from tests.support.patching import deafen
from tests.support.waiting import pass_time, wait_for

GRACE_S = 8.0


def test_a_leader_cut_from_etcd_stops_its_duties_before_its_election_can_lapse(cluster: Cluster) -> None:
    addr = cluster.start_coordinator(linked=True)
    lead = cluster.service(addr).leadership
    wait_for(lambda: lead.acting, 15, "the replica to lead")
    cluster.etcd_links[addr].cut()
    cut_at = time.monotonic()
    wait_for(lambda: not lead.acting, 10, "the cut leader to stop its duties")
    stopped_at = time.monotonic()
    assert lead.session is not None
    margin = lead.session.expires_by - stopped_at
    print(f"duties stopped {stopped_at - cut_at:.2f}s after the cut, {margin:.2f}s before the election could lapse")
    assert margin > 0.5, f"the duties ran until {-margin:.2f}s before the election could lapse"
    assert not cluster.service(addr).reach.ok
    cluster.etcd_links[addr].heal()
    wait_for(lambda: lead.acting, 15, "the healed replica to lead again")
    assert cluster.service(addr).reach.ok
    cluster.lt.run(check_store(cluster.store, cluster.keys)).assert_ok()


def test_a_leader_cut_from_etcd_commits_nothing_once_its_election_key_is_gone(cluster: Cluster) -> None:
    """The leader (kept deaf to its loss: its step-down is a no-op, so its duties run on) is cut from etcd while
    an eviction deadline is pending. Its revokes at the deadline are held by the link and delivered when it heals,
    after its candidacy expired, and it keeps trying after: etcd refuses every one. The successor, which saw the
    notice later, revokes at its own deadline, and only then is the lease gone."""
    cluster.start_node("h1", "1x16GiB", ttl=30)
    a = cluster.start_coordinator(linked=True)
    old = cluster.service(a).leadership
    wait_for(lambda: old.acting, 15, "the first replica to lead")
    assert old.election is not None
    term = old.election
    deaf = deafen(cluster, old)
    tries = deaf.tries
    try:
        with Client(a, agent="victim", host="h1", ttl=60) as victim:
            lease = victim.acquire(4000)
            pb_grpc.CoordinatorStub(grpc.insecure_channel(a)).EvictLease(
                pb.EvictLeaseRequest(lease_id=lease.id, grace_seconds=GRACE_S, reason="fence"), timeout=10)
            noticed = time.monotonic()
            cluster.etcd_links[a].cut()
            # The successor starts, and sees the notice, ~3 s after the old leader did: its deadline is later.
            pass_time(3.0, "the successor to start after the old leader saw the notice")
            b = cluster.start_coordinator()
            new = cluster.service(b).leadership
            wait_for(lambda: new.acting, 20, "the successor to lead")
            # Heal after the old leader's deadline (its revokes are held meanwhile), before the successor's.
            pass_time(max(0.0, noticed + GRACE_S + 1.0 - time.monotonic()), "the old leader's deadline")
            healed = time.monotonic()
            cluster.etcd_links[a].heal()
            wait_for(lambda: any(t > healed for t, _ in tries), 10, "the old leader to try its revoke after the heal")
            assert lease.id in {x.id for x in cluster.leases()}, "a deposed leader revoked a lease"
            wait_for(lambda: lease.id not in {x.id for x in cluster.leases()}, 15, "the successor's revoke")
            print(f"the old leader's tries from the heal: {[(round(t - healed, 1), type(out).__name__) for t, out in tries]}; "
                  f"the successor revoked {time.monotonic() - healed:.1f}s after it")
            checked = revision(cluster)
    finally:
        deaf.undo()
    events = cluster.lt.run(read_history(cluster.store, cluster.keys.root()))
    gone = [ev.kv.mod_revision for ev in events
            if ev.kind == "DELETE" and ev.kv.key == cluster.keys.candidate(term.candidate_id)]
    revoked = [ev.kv.mod_revision for ev in events
               if ev.kind == "DELETE" and ev.kv.key == cluster.keys.eviction(lease.id) and ev.kv.mod_revision <= checked]
    assert gone and revoked and revoked[0] > gone[0]
    assert len(revoked) == 1
    check_history(events, cluster.keys).assert_ok()
    wait_no_leaks(cluster, 10)


def test_a_replica_whose_last_candidacy_outlived_its_session_stands_again(cluster: Cluster) -> None:
    """A replica gives its session up for lost (no keepalive got through for a TTL) while etcd still holds it:
    a keepalive held by a partition arrived late, or etcd expires leases a moment after the replica counts.
    Its next term must stand anyway (its own old candidacy is in the way, on the old etcd lease), not end the
    replica's leadership loop: the nemesis once saw "background task leadership died: RuntimeError('candidate
    ... already stands')", after which that replica neither led nor knew whether it could reach etcd."""
    addr = cluster.start_coordinator()
    lead = cluster.service(addr).leadership
    wait_for(lambda: lead.acting, 15, "the replica to lead")
    old = lead.session
    assert old is not None

    async def given_up_for_lost() -> None:      # what the session does when no keepalive got through for a TTL
        await old.orphan()
        old.lost = True
    cluster.lt.run(given_up_for_lost())
    wait_for(lambda: lead.session is not old and lead.acting, 15, "the replica to stand again and lead")
    assert lead.session is not None and lead.session.etcd_lease != old.etcd_lease
    assert cluster.lt.run(cluster.store.time_to_live(old.etcd_lease)) < 0, "the old etcd lease was left behind"
    assert [r for r in cluster.replicas()] == [cluster.service(addr).replica_id]
    cluster.lt.run(check_store(cluster.store, cluster.keys)).assert_ok()
