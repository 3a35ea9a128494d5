"""G7 restarts: stopping coordinator replicas, or etcd failing under them, loses no lease, queue entry or
partition; clients reconnect (to the same address or another replica) and keep their leases while the TTL
lasts.

In-process replicas here (stopped cleanly, or an etcd error injected into one); killed and restarted
processes are in tests/faults/. Every test ends with the history checker.
"""
from __future__ import annotations

from typing import Any

import grpc
import pytest

from agent_client import Client
from coordinator import errors as cerrors
from coordinator.etcd.store import WatchBatch
from tests.support.cluster import Cluster, queue, session_alive
from tests.support.rpcs import acquire_req, coordinator_stub
from tests.support.waiting import LIVENESS_S, Background, pass_time, wait_for

pytestmark = pytest.mark.usefixtures("history_checked")


def test_client_fails_over_to_another_replica(cluster: Cluster) -> None:
    cluster.start_node("h1", "1x16GiB")
    a = cluster.start_coordinator()
    b = cluster.start_coordinator()
    with Client([a, b], agent="agent-a", host="h1", ttl=6) as c:
        lease = c.acquire(1000)
        cluster.stop_coordinator(a)
        other = c.acquire(1000)
        assert other.gpu_uuid == lease.gpu_uuid
        # Kept alive through b for longer than the TTL: the session survives.
        pass_time(8, "a TTL and more")
        assert session_alive(cluster, "agent-a", c.session_id) and len(cluster.leases()) == 2


def test_shutdown_answers_waiters_unavailable_and_keeps_their_entries(cluster: Cluster) -> None:
    cluster.start_node("h1", "1x8GiB")
    addrs = {cluster.start_coordinator(), cluster.start_coordinator()}
    # The waiter talks to the replica that owns h1 (one that forwards would cancel its forwarded call
    # when it stops, and the owner would then dequeue it as a caller gone).
    first = cluster.owner("h1", 2)
    second, = addrs - {first}
    with Client([first, second], agent="a", host="h1") as a, Client(first, agent="b", host="h1", ttl=30) as b:
        held = a.acquire(8000, preemptible=False)
        request = acquire_req("b", b.session_id, 1000, "survivor", wait=60)
        call = coordinator_stub(first).Acquire.future(request, timeout=120)
        wait_for(lambda: len(queue(cluster)) == 1, LIVENESS_S, "the waiter to be queued")
        rank = queue(cluster)[0].rank
        cluster.stop_coordinator(first)
        with pytest.raises(grpc.RpcError) as info:
            call.result(timeout=10)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        assert [e.rank for e in queue(cluster)] == [rank]
        # The caller retries through another replica with the same request_id: same place, then granted.
        retry = coordinator_stub(second).Acquire.future(request, timeout=120)
        wait_for(lambda: queue(cluster) and queue(cluster)[0].replica != "", LIVENESS_S, "the retry to attach")
        a.release(held.id)
        assert retry.result(timeout=10).lease.vram_mb == 1000


def test_an_acquire_that_reaches_a_stopping_replica_is_answered_unavailable(cluster: Cluster) -> None:
    """Between the service's stop and the gRPC server's, an acquire is answered UNAVAILABLE at once, so
    that the client fails over to another replica. (Review finding F9: it was queued for an admitter that
    had stopped, and never answered.)"""
    cluster.start_node("h1", "1x8GiB")
    addr = cluster.start_coordinator()
    server, svc = cluster.coordinators[addr]
    with Client(addr, agent="a", host="h1", ttl=30) as a:
        a.acquire(100).release()               # the admitter of h1 exists
        sid = a.session_id
        cluster.lt.run(svc.stop())             # the window between svc.stop() and server.stop()
        try:
            coordinator_stub(addr).Acquire(acquire_req("a", sid, 100, "late"), timeout=3)
            outcome = "granted"
        except grpc.RpcError as e:
            outcome = e.code().name
        cluster.coordinators.pop(addr)
        cluster.lt.run(server.stop(grace=0.2))
        a.orphan()
        assert outcome == "UNAVAILABLE", outcome


def test_the_replicas_watch_survives_an_etcd_error_during_a_resync(cluster: Cluster, monkeypatch: Any) -> None:
    """After a compaction the replica re-reads the whole state; when that read fails (etcd out of reach
    longer than the Store retries), the replica's watch carries on: a release still wakes the waiter
    within milliseconds, and no service task has died. (Review finding F8: the watch task ended on the
    error, unnoticed: the replica never woke waiters, delivered notices or, as leader, enforced deadlines.)"""
    from coordinator.etcd.store import Store
    cluster.start_node("h1", "1x8GiB")
    orig_watch, orig_snapshot = Store.watch, Store.snapshot
    arm = {"resync": False, "fail": False}
    root = cluster.keys.root()

    async def watch(self: Any, key: bytes, **kw: Any) -> Any:
        async for batch in orig_watch(self, key, **kw):
            if arm["resync"] and key == root and self is not cluster.store:
                arm["resync"] = False
                arm["fail"] = True
                yield WatchBatch(batch.revision, (), resync=True)   # as after a compaction
                return
            yield batch

    async def snapshot(self: Any, ranges: Any, **kw: Any) -> Any:
        ranges = list(ranges)
        if arm["fail"] and ranges[0].key == root:    # the read of the whole state (``mirrored_ranges``)
            arm["fail"] = False
            raise cerrors.Unavailable("etcd unavailable: injected (longer than retry_for)")
        return await orig_snapshot(self, ranges, **kw)

    monkeypatch.setattr(Store, "watch", watch)
    monkeypatch.setattr(Store, "snapshot", snapshot)
    addr = cluster.start_coordinator()
    svc = cluster.service(addr)
    with Client(addr, agent="a", host="h1") as a, Client(addr, agent="b", host="h1") as b:
        held = a.acquire(8000, preemptible=False)
        arm["resync"] = True
        a.acquire(100).release()               # any event: the injected resync follows it
        wait_for(lambda: not arm["resync"] and not arm["fail"], LIVENESS_S, "the injected resync and failure")
        waiter = Background(b.acquire, 4000, wait=6)
        wait_for(lambda: len(queue(cluster)) == 1, LIVENESS_S, "b to be queued")
        held.release()
        lease = waiter.result(10)
        assert lease.vram_mb == 4000
        assert not any(t.done() for t in svc._tasks), "a service task has died"
