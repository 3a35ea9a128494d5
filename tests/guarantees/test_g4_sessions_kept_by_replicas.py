"""G4 and G7 with sessions kept alive in the replicas' memory (``replica/liveness.py``, issue 32): the replica a
session's keepalives reach tracks it (taking it over from another), the one that stops hearing from it leaves it
to the one that does, and the sessions of a replica that is gone are adopted: a dead agent's is revoked, a live
agent's kept. Each session's etcd lease has the long ``session_etcd_ttl_s``, so a session that goes before it
went because a replica revoked it. The history checker ends each test."""
from __future__ import annotations

import json
import threading

import grpc
import pytest

from agent_client import Client
from agent_client.api import coordinator_pb2 as pb
from coordinator.etcd.session import EtcdSession
from coordinator.node.fake_hosts import fake_host_names, register_fake_hosts
from tests.support.cluster import Cluster
from tests.support.rpcs import coordinator_stub
from tests.support.waiting import LIVENESS_S, Background, pass_time, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("history_checked")]
TTL = 5


def _open(addr: str, agent: str) -> pb.SessionRef:
    resp = coordinator_stub(addr).OpenSession(pb.OpenSessionRequest(agent=agent, host="h1", ttl_seconds=TTL),
                                              timeout=30)
    return pb.SessionRef(agent=agent, session_id=resp.session_id)


def _keep_alive(addr: str, ref: pb.SessionRef, stop: threading.Event) -> None:
    """KeepAlive messages every TTL/5 to ``addr`` until ``stop``."""
    def requests():  # type: ignore[no-untyped-def]
        while not stop.is_set():
            yield pb.KeepAliveRequest(session=ref)
            stop.wait(TTL / 5)
    call = coordinator_stub(addr).KeepAlive(requests())
    try:
        for _ in call:
            if stop.is_set():
                break
    except grpc.RpcError:
        if not stop.is_set():
            raise
    finally:
        call.cancel()


def _record(cluster: Cluster, ref: pb.SessionRef) -> dict[str, object] | None:
    kvs = cluster.get_prefix(cluster.keys.session(ref.agent, ref.session_id))
    return kvs[0].json() if kvs else None


def _etcd_lease(cluster: Cluster, ref: pb.SessionRef) -> int:
    (kv,) = cluster.get_prefix(cluster.keys.session(ref.agent, ref.session_id))
    return int(kv.etcd_lease)


def test_a_session_kept_alive_through_the_other_replica_is_taken_over_and_left_alone_by_the_first(
        cluster: Cluster) -> None:
    cluster.start_node("h1", "1x16GiB")
    a, b = cluster.start_coordinator(), cluster.start_coordinator()
    ref = _open(a, "mover")
    stop = threading.Event()
    keeper = Background(_keep_alive, b, ref, stop)
    try:
        b_id = cluster.service(b).replica_id
        wait_for(lambda: (_record(cluster, ref) or {}).get("coordinator") == b_id, LIVENESS_S,
                 "replica b to take the session over")
        # The opener hears nothing from it for its TTL: it sees b keeps it, and drops it.
        wait_for(lambda: ref.session_id not in cluster.service(a).liveness.table, LIVENESS_S,
                 "replica a to leave the session to b")
        pass_time(2 * TTL, "two more TTLs of keepalives through b")
        assert _record(cluster, ref) is not None, "a session kept alive through replica b was lost"
    finally:
        stop.set()
        keeper.result()
    etcd_lease = _etcd_lease(cluster, ref)
    wait_for(lambda: _record(cluster, ref) is None, LIVENESS_S, "b to revoke the session once its keepalives stop")
    assert cluster.lt.run(cluster.store.time_to_live(etcd_lease)) < 0


def test_a_stopped_replicas_sessions_are_adopted_the_dead_agents_revoked_the_live_agents_kept(
        cluster: Cluster) -> None:
    cluster.start_node("h1", "1x16GiB")
    a, b = cluster.start_coordinator(), cluster.start_coordinator()
    with Client(f"{a},{b}", agent="alive", host="h1", ttl=TTL) as alive:
        lease = alive.acquire(1024)
        wait_for(lambda: len(cluster.get_prefix(cluster.keys.sessions("alive"))) == 1, LIVENESS_S, "its session")
        dead = _open(a, "dead")      # opened at a, never kept alive again
        etcd_lease = _etcd_lease(cluster, dead)
        cluster.stop_coordinator(a)
        wait_for(lambda: _record(cluster, dead) is None, LIVENESS_S, "replica b to adopt and revoke the dead session")
        assert cluster.lt.run(cluster.store.time_to_live(etcd_lease)) < 0
        pass_time(2 * TTL, "two TTLs of the live agent's keepalives through b")
        assert len(cluster.get_prefix(cluster.keys.sessions("alive"))) == 1, "the live agent's session was lost"
        assert [x.id for x in cluster.leases()] == [lease.id]
        lease.release()


def test_a_session_a_previous_release_replica_keeps_alive_is_not_revoked_while_it_does(cluster: Cluster) -> None:
    """During a rolling upgrade a replica of the previous release keeps a session alive by refreshing its etcd
    lease, and never takes it over: the replica that tracks it sees the refreshes and leaves it be; once they
    stop, it revokes the session."""
    cluster.start_node("h1", "1x16GiB")
    a = cluster.start_coordinator()
    old = cluster.lt.run(EtcdSession(cluster.store, 5, "an old replica").open())
    cluster.lt.run(cluster.store.put(cluster.keys.coordinator("old-release"),
                                     json.dumps({"replica": "old-release", "address": ""}).encode(), old.etcd_lease))
    try:
        ref = _open(a, "upgraded")
        etcd_lease = _etcd_lease(cluster, ref)
        stop = threading.Event()

        def refresh() -> None:      # what the old replica does on each of the agent's keepalives
            while not stop.is_set():
                assert cluster.lt.run(cluster.store.keepalive(etcd_lease)) > 0
                stop.wait(TTL / 5)
        refresher = Background(refresh)
        try:
            pass_time(3 * TTL, "three TTLs of refreshes by the old replica only")
            assert _record(cluster, ref) is not None, "a session an old replica kept alive was revoked"
        finally:
            stop.set()
            refresher.result()
        wait_for(lambda: _record(cluster, ref) is None, LIVENESS_S, "the session to be revoked once nobody refreshes it")
        assert cluster.lt.run(cluster.store.time_to_live(etcd_lease)) < 0
    finally:
        cluster.lt.run(old.close())


def test_a_session_revoked_behind_its_replicas_back_is_gone_at_the_next_keepalive(cluster: Cluster) -> None:
    """The replica keeps the session in memory, but answers no keepalive of a session whose record its mirror
    no longer holds: the agent hears NOT_FOUND at once, as when etcd said the session's etcd lease was gone."""
    cluster.start_node("h1", "1x16GiB")
    a = cluster.start_coordinator()
    ref = _open(a, "revoked")
    cluster.lt.run(cluster.store.revoke(_etcd_lease(cluster, ref)))
    svc = cluster.service(a)
    wait_for(lambda: svc.mirror.get(cluster.keys.session(ref.agent, ref.session_id)) is None, LIVENESS_S,
             "the replica's mirror to see the session go")
    with pytest.raises(grpc.RpcError) as refused:
        for _ in coordinator_stub(a).KeepAlive(iter([pb.KeepAliveRequest(session=ref)]), timeout=30):
            pass
    assert refused.value.code() == grpc.StatusCode.NOT_FOUND, refused.value


def test_an_agent_that_comes_back_to_its_first_replica_keeps_its_session(cluster: Cluster) -> None:
    """The agent's keepalives go to b (b takes the session over), then back to a within the TTL: a must take it
    over again, not only note the keepalive in its memory, or b revokes the session at its deadline."""
    cluster.start_node("h1", "1x16GiB")
    a, b = cluster.start_coordinator(), cluster.start_coordinator()
    ref = _open(a, "returner")
    a_id, b_id = cluster.service(a).replica_id, cluster.service(b).replica_id
    away = threading.Event()
    at_b = Background(_keep_alive, b, ref, away)
    try:
        wait_for(lambda: (_record(cluster, ref) or {}).get("coordinator") == b_id, LIVENESS_S, "b to take it over")
    finally:
        away.set()
        at_b.result()
    back = threading.Event()
    at_a = Background(_keep_alive, a, ref, back)
    try:
        wait_for(lambda: (_record(cluster, ref) or {}).get("coordinator") == a_id, LIVENESS_S, "a to take it back")
        pass_time(2 * TTL, "two TTLs of keepalives through a")
        assert _record(cluster, ref) is not None, "the session was revoked while its agent kept it alive through a"
    finally:
        back.set()
        at_a.result()


def test_a_dead_agents_session_expires_while_the_last_writes_to_etcd_are_another_applications(
        cluster: Cluster) -> None:
    """etcd shared with another application: its writes move etcd's revision past every event of the prefix, and
    in a quiet fleet no event of the prefix comes to carry the replica's mirror there. Expiry does not wait for
    one: it reads what it needs from etcd (``Liveness.expire``)."""
    addr = cluster.start_coordinator()
    # Hosts without a node daemon: nothing under the prefix is written again by itself.
    registration = cluster.lt.run(register_fake_hosts(cluster.store, cluster.keys, "quiet", 1, "1x16GiB"))
    other = f"/other-application-of-{cluster.prefix.strip('/')}/counter".encode()
    stop = threading.Event()

    def other_application() -> None:
        n = 0
        while not stop.is_set():
            n += 1
            cluster.lt.run(cluster.store.put(other, str(n).encode()))
            stop.wait(0.2)
    writer = Background(other_application)
    try:
        resp = coordinator_stub(addr).OpenSession(pb.OpenSessionRequest(
            agent="gone", host=fake_host_names("quiet", 1)[0], ttl_seconds=TTL), timeout=30)
        ref = pb.SessionRef(agent="gone", session_id=resp.session_id)
        # No keepalive: the agent died at once. Its session goes after its TTL, not with its long etcd lease.
        wait_for(lambda: _record(cluster, ref) is None, LIVENESS_S, "the dead agent's session to expire")
    finally:
        stop.set()
        writer.result()
        cluster.lt.run(cluster.store.delete(other))
        cluster.lt.run(registration.close())
