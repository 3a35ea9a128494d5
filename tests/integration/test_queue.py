"""The priority queue, promotion, eviction with grace, and shutdown, against a real etcd.

Every test here ends with the history checker over the test's whole etcd history (G1, G3, G5, G6).
"""
from __future__ import annotations

import asyncio
import threading
import time
from typing import Any, Iterator

import grpc
import pytest

from agent_client import AsyncClient, Client, errors
from agent_client.api import coordinator_pb2 as pb
from agent_client.api import coordinator_pb2_grpc as pb_grpc
from coordinator.records import QueueEntry
from tests.harness import Background, Cluster, LoopThread, wait_for
from tests.history import check_store

pytestmark = pytest.mark.integration


@pytest.fixture(autouse=True)
def history_checked(cluster: Cluster) -> Iterator[None]:
    yield
    report = cluster.lt.run(check_store(cluster.store, cluster.keys))
    report.assert_ok()


def queue(cluster: Cluster, host: str = "h1") -> list[QueueEntry]:
    return [QueueEntry.from_kv(kv) for kv in cluster.get_prefix(cluster.keys.queue(host))]




def test_waiter_is_granted_right_after_a_release(cluster: Cluster) -> None:
    cluster.start_node("h1", "1x8GiB")
    addr = cluster.start_coordinator()
    with Client(addr, agent="agent-a", host="h1") as a, Client(addr, agent="agent-b", host="h1") as b:
        first = a.acquire(4000)
        a.acquire(4000)
        with pytest.raises(errors.ResourceExhausted):
            b.acquire(4000)
        waiter = Background(b.acquire, 4000, wait=5)
        wait_for(lambda: len(queue(cluster)) == 1, 5, "the waiter to be queued")
        released_at = time.monotonic()
        first.release()
        lease = waiter.result()
        assert lease.vram_mb == 4000 and lease.token == 3
        assert waiter.finished_at - released_at < 2.0
        assert queue(cluster) == []


def test_wait_that_times_out_leaves_the_queue_first(cluster: Cluster) -> None:
    cluster.start_node("h1", "1x8GiB")
    addr = cluster.start_coordinator()
    with Client(addr, agent="agent-a", host="h1") as a:
        a.acquire(8000, preemptible=False)
        t0 = time.monotonic()
        with pytest.raises(errors.ResourceExhausted, match="after waiting"):
            a.acquire(4000, wait=1)
        assert time.monotonic() - t0 >= 1.0
        assert queue(cluster) == []


def test_two_concurrent_5000_on_8192_exactly_one_granted(cluster: Cluster) -> None:
    cluster.start_node("h1", "1x8GiB")
    addrs = [cluster.start_coordinator(), cluster.start_coordinator()]
    lt = LoopThread()
    try:
        async def both() -> list[Any]:
            clients = [AsyncClient(addrs[i], agent=f"agent-{i}", host="h1") for i in range(2)]
            for c in clients:
                await c.connect()
            out = await asyncio.gather(*(c.acquire(5000) for c in clients), return_exceptions=True)
            for c in clients:
                await c.close()
            return out
        results = lt.run(both())
    finally:
        lt.close()
    granted = [r for r in results if not isinstance(r, BaseException)]
    refused = [r for r in results if isinstance(r, errors.ResourceExhausted)]
    assert len(granted) == 1 and len(refused) == 1, results


def test_waiters_are_served_by_priority_then_fifo(cluster: Cluster) -> None:
    cluster.start_node("h1", "1x8GiB")
    addr = cluster.start_coordinator()
    order: list[str] = []
    with Client(addr, agent="holder", host="h1") as holder:
        blocker = holder.acquire(8192, preemptible=False)
        clients = {name: Client(addr, agent=name, host="h1").connect() for name in ("p1", "p5-first", "p5-second")}
        try:
            waiters = {}
            for name, prio in (("p1", 1), ("p5-first", 5), ("p5-second", 5)):
                def take(name: str = name, prio: int = prio) -> Any:
                    lease = clients[name].acquire(8192, priority=prio, wait=20)
                    order.append(name)
                    return lease
                waiters[name] = Background(take)
                n = len(waiters)
                wait_for(lambda: len(queue(cluster)) == n, 5, f"{name} to be queued")
            # Rank order in etcd already says 5, 5, 1.
            assert [e.agent for e in queue(cluster)] == ["p5-first", "p5-second", "p1"]
            blocker.release()
            for name in ("p5-first", "p5-second", "p1"):
                lease = waiters[name].result()
                wait_for(lambda: len(order) >= 1, 5, "a grant")
                lease.release()
            assert order == ["p5-first", "p5-second", "p1"]
        finally:
            for c in clients.values():
                c.close()


def test_a_later_request_does_not_overtake_waiters(cluster: Cluster) -> None:
    cluster.start_node("h1", "1x8GiB")
    addr = cluster.start_coordinator()
    with Client(addr, agent="a", host="h1") as a, Client(addr, agent="b", host="h1") as b:
        a.acquire(6000, preemptible=False)
        waiter = Background(b.acquire, 4000, priority=3, wait=10)
        wait_for(lambda: len(queue(cluster)) == 1, 5, "b to be queued")
        # 2000 would fit now, but b (priority 3) waits on this GPU: equal or lower priority must queue.
        with pytest.raises(errors.ResourceExhausted, match="overtaking"):
            a.acquire(1000, priority=3)
        # A higher priority request may go first.
        a.acquire(1000, priority=4).release()
        b.close()
        with pytest.raises(errors.GpucoordError):
            waiter.result()


def test_priority_request_evicts_the_low_priority_lease_only(cluster: Cluster) -> None:
    cluster.start_node("h1", "1x8GiB")
    addr = cluster.start_coordinator(eviction_grace_s=10)
    notices: list[Any] = []
    with Client(addr, agent="low", host="h1") as low, Client(addr, agent="peer", host="h1") as peer, \
            Client(addr, agent="high", host="h1") as high:
        victim = low.acquire(4000, priority=1)
        keep = peer.acquire(4000, priority=10)
        released = threading.Event()

        def on_evict(notice: Any) -> None:
            notices.append(notice)
            victim.release()
            released.set()
        victim.on_evict(on_evict)
        lease = high.acquire(4000, priority=10, wait=15)
        # The grant may reach `high` before the victim's thread, back from its release, sets the event.
        wait_for(released.is_set, 10, "the victim's on_evict to finish")
        assert notices[0].lease_id == victim.id
        assert victim.evicting.is_set() and not keep.evicting.is_set()
        assert {x.id for x in cluster.leases()} == {keep.id, lease.id}


def test_victim_that_does_not_release_is_revoked_at_its_deadline(cluster: Cluster) -> None:
    cluster.start_node("h1", "1x8GiB")
    addr = cluster.start_coordinator(eviction_grace_s=1.5)
    with Client(addr, agent="low", host="h1") as low, Client(addr, agent="high", host="h1") as high:
        victim = low.acquire(8000, priority=0)
        t0 = time.monotonic()
        lease = high.acquire(6000, priority=5, wait=15)
        elapsed = time.monotonic() - t0
        assert victim.evicting.is_set() and victim.notice is not None
        assert elapsed >= 1.4, "admitted before the victim's grace period ended"
        assert [x.id for x in cluster.leases()] == [lease.id]
        assert victim.release() is False   # revoked already: releasing is a no-op


def test_non_preemptible_lease_is_never_a_victim(cluster: Cluster) -> None:
    cluster.start_node("h1", "1x8GiB")
    addr = cluster.start_coordinator(eviction_grace_s=1)
    with Client(addr, agent="low", host="h1") as low, Client(addr, agent="high", host="h1") as high:
        held = low.acquire(8000, priority=0, preemptible=False)
        with pytest.raises(errors.ResourceExhausted):
            high.acquire(4000, priority=100)
        with pytest.raises(errors.ResourceExhausted, match="after waiting"):
            high.acquire(4000, priority=100, wait=1.5)
        assert not held.evicting.is_set()
        assert cluster.get_prefix(cluster.keys.evictions()) == []


def test_operator_evict_and_revoke(cluster: Cluster) -> None:
    cluster.start_node("h1", "1x8GiB")
    addr = cluster.start_coordinator()
    stub = pb_grpc.CoordinatorStub(grpc.insecure_channel(addr))
    with Client(addr, agent="a", host="h1") as a:
        one = a.acquire(1000, preemptible=False, priority=99)
        got = threading.Event()
        one.on_evict(lambda n: got.set())
        stub.EvictLease(pb.EvictLeaseRequest(lease_id=one.id, grace_seconds=30, reason="maintenance"), timeout=5)
        assert got.wait(5) and one.notice.requested_by == "operator" and one.notice.reason == "maintenance"
        two = a.acquire(1000)
        assert stub.RevokeLease(pb.RevokeLeaseRequest(lease_id=two.id), timeout=5).revoked
        assert {x.id for x in cluster.leases()} == {one.id}
        with pytest.raises(grpc.RpcError) as info:
            stub.EvictLease(pb.EvictLeaseRequest(lease_id="nope"), timeout=5)
        assert info.value.code() == grpc.StatusCode.NOT_FOUND and "lease_id" in info.value.details()


def test_queue_length_is_bounded(cluster: Cluster) -> None:
    cluster.start_node("h1", "1x8GiB")
    addr = cluster.start_coordinator(max_queue_per_host=2)
    with Client(addr, agent="a", host="h1") as a, Client(addr, agent="b", host="h1") as b:
        a.acquire(8000, preemptible=False)
        waiters = [Background(b.acquire, 1000, wait=20) for _ in range(2)]
        wait_for(lambda: len(queue(cluster)) == 2, 5, "two waiters")
        with pytest.raises(errors.ResourceExhausted, match="queue"):
            b.acquire(1000, wait=5)
        b.close()
        for w in waiters:
            with pytest.raises(errors.GpucoordError):
                w.result()


def test_cancelled_waiter_leaves_the_queue(cluster: Cluster) -> None:
    cluster.start_node("h1", "1x8GiB")
    addr = cluster.start_coordinator()
    with Client(addr, agent="a", host="h1") as a, Client(addr, agent="b", host="h1", ttl=30) as b:
        a.acquire(8000, preemptible=False)
        stub = pb_grpc.CoordinatorStub(grpc.insecure_channel(addr))
        call = stub.Acquire.future(pb.AcquireRequest(
            session=pb.SessionRef(agent="b", session_id=b.session_id), vram_mb=1000, wait_seconds=60,
            request_id="cancel-me"), timeout=120)
        wait_for(lambda: len(queue(cluster)) == 1, 5, "the waiter to be queued")
        call.cancel()
        # The session lives on (TTL 30 s), yet the entry goes as soon as the caller has gone.
        wait_for(lambda: queue(cluster) == [], 5, "the cancelled waiter's entry to go")


def test_shutdown_answers_waiters_unavailable_and_keeps_their_entries(cluster: Cluster) -> None:
    cluster.start_node("h1", "1x8GiB")
    addrs = {cluster.start_coordinator(), cluster.start_coordinator()}
    # The waiter talks to the replica that owns h1 (one that forwards would cancel its forwarded call
    # when it stops, and the owner would then dequeue it as a caller gone).
    first = cluster.owner("h1", 2)
    second, = addrs - {first}
    with Client([first, second], agent="a", host="h1") as a, Client(first, agent="b", host="h1", ttl=30) as b:
        held = a.acquire(8000, preemptible=False)
        stub = pb_grpc.CoordinatorStub(grpc.insecure_channel(first))
        request = pb.AcquireRequest(session=pb.SessionRef(agent="b", session_id=b.session_id), vram_mb=1000,
                                    wait_seconds=60, request_id="survivor")
        call = stub.Acquire.future(request, timeout=120)
        wait_for(lambda: len(queue(cluster)) == 1, 5, "the waiter to be queued")
        rank = queue(cluster)[0].rank
        cluster.stop_coordinator(first)
        with pytest.raises(grpc.RpcError) as info:
            call.result(timeout=10)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        assert [e.rank for e in queue(cluster)] == [rank]
        # The caller retries through another replica with the same request_id: same place, then granted.
        retry = pb_grpc.CoordinatorStub(grpc.insecure_channel(second)).Acquire.future(request, timeout=120)
        wait_for(lambda: queue(cluster) and queue(cluster)[0].replica != "", 5, "the retry to attach")
        a.release(held.id)
        assert retry.result(timeout=10).lease.vram_mb == 1000


def test_killed_waiter_leaves_the_queue_within_its_ttl(cluster: Cluster, tmp_path: Any) -> None:
    import os
    import signal

    from tests.harness import spawn_agent
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


def test_waiters_of_a_host_that_is_gone_are_swept(cluster: Cluster) -> None:
    cluster.start_node("h1", "1x8GiB")
    addr = cluster.start_coordinator()
    with Client(addr, agent="a", host="h1") as a, Client(addr, agent="b", host="h1") as b:
        a.acquire(8000, preemptible=False)
        waiter = Background(b.acquire, 4000, wait=30)
        wait_for(lambda: len(queue(cluster)) == 1, 5, "b to be queued")
        cluster.stop_node("h1")               # the node daemon goes: hosts/h1 is gone
        with pytest.raises(errors.FailedPrecondition, match="queue|host"):
            waiter.result(timeout=10)
        assert queue(cluster) == []


def test_partition_apply_with_evict_waits_for_the_offenders(cluster: Cluster) -> None:
    import json as _json
    cluster.start_node("h1", "2x8GiB")
    addr = cluster.start_coordinator(eviction_grace_s=1)
    stub = pb_grpc.CoordinatorStub(grpc.insecure_channel(addr))
    spec = {"host": "h1", "mode": "auto-split", "agents": ["a", "b"]}
    with Client(addr, agent="a", host="h1") as a:
        on_gpu1 = a.acquire(2000, gpu=1)     # auto-split gives GPU 1 to b: a must leave it
        keep = a.acquire(2000, gpu=0)
        with pytest.raises(grpc.RpcError) as info:
            stub.ApplyPartition(pb.ApplyPartitionRequest(spec_json=_json.dumps(spec)), timeout=10)
        assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "--evict" in info.value.details()
        resp = stub.ApplyPartition(pb.ApplyPartitionRequest(spec_json=_json.dumps(spec), evict=True), timeout=30)
        assert resp.applied
        assert on_gpu1.evicting.is_set() and not keep.evicting.is_set()
        assert [x.id for x in cluster.leases()] == [keep.id]


def test_notices_are_withdrawn_when_the_requester_gives_up(cluster: Cluster) -> None:
    cluster.start_node("h1", "1x8GiB")
    addr = cluster.start_coordinator(eviction_grace_s=30)
    with Client(addr, agent="low", host="h1") as low, Client(addr, agent="high", host="h1") as high:
        victim = low.acquire(8000, priority=0)
        with pytest.raises(errors.ResourceExhausted, match="after waiting"):
            high.acquire(6000, priority=5, wait=1)
        assert victim.evicting.is_set()
        # The requester left: nobody needs the room any more, so the victim is not revoked.
        wait_for(lambda: cluster.get_prefix(cluster.keys.evictions()) == [], 5, "the notice to be withdrawn")
        assert [x.id for x in cluster.leases()] == [victim.id]
