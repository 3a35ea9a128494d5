"""G3 eviction: a request of priority P evicts only preemptible leases of priority < P, only when that makes
it fit, and is admitted only after its victims are gone. Each victim gets a notice and a grace period; the
leader revokes it the kill margin after its deadline, unless its notice was withdrawn (the requester gave up)
meanwhile. (Victims bound to processes: tests/run/test_eviction_order.py.)

Every test ends with the history checker (G3 at every revision: every notice names a preemptible lease of
lower priority, and a request with victims is admitted only once they are all gone).
"""
from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import grpc
import pytest

from agent_client import Client, errors
from agent_client.api import coordinator_pb2 as pb
from tests.support.cluster import Cluster
from tests.support.patching import patch_method
from tests.support.rpcs import coordinator_stub
from tests.support.waiting import LIVENESS_S, Background, wait_for

pytestmark = pytest.mark.usefixtures("history_checked")


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


def test_victim_that_does_not_release_is_revoked_at_its_deadline_plus_the_kill_margin(cluster: Cluster) -> None:
    """A cooperative holder (no processes attached) that ignores its notice is revoked the kill margin after
    its deadline, not before."""
    cluster.start_node("h1", "1x8GiB")
    addr = cluster.start_coordinator(eviction_grace_s=1.5, eviction_kill_margin_s=1.0)
    with Client(addr, agent="low", host="h1") as low, Client(addr, agent="high", host="h1") as high:
        victim = low.acquire(8000, priority=0)
        t0 = time.monotonic()
        lease = high.acquire(6000, priority=5, wait=15)
        elapsed = time.monotonic() - t0
        assert victim.evicting.is_set() and victim.notice is not None
        assert elapsed >= 2.4, "admitted before the victim's grace period and the kill margin ended"
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
    stub = coordinator_stub(addr)
    with Client(addr, agent="a", host="h1") as a:
        one = a.acquire(1000, preemptible=False, priority=99)
        got = threading.Event()
        one.on_evict(lambda n: got.set())
        stub.EvictLease(pb.EvictLeaseRequest(lease_id=one.id, grace_seconds=30, reason="maintenance"), timeout=5)
        assert got.wait(LIVENESS_S) and one.notice.requested_by == "operator" and one.notice.reason == "maintenance"
        two = a.acquire(1000)
        assert stub.RevokeLease(pb.RevokeLeaseRequest(lease_id=two.id), timeout=5).revoked
        assert {x.id for x in cluster.leases()} == {one.id}
        with pytest.raises(grpc.RpcError) as info:
            stub.EvictLease(pb.EvictLeaseRequest(lease_id="nope"), timeout=5)
        assert info.value.code() == grpc.StatusCode.NOT_FOUND and "lease_id" in info.value.details()


def test_notices_are_withdrawn_when_the_requester_gives_up(cluster: Cluster) -> None:
    cluster.start_node("h1", "1x8GiB")
    addr = cluster.start_coordinator(eviction_grace_s=30)
    with Client(addr, agent="low", host="h1") as low, Client(addr, agent="high", host="h1") as high:
        victim = low.acquire(8000, priority=0)
        withdrawn = threading.Event()
        victim.on_withdrawn(lambda notice: withdrawn.set())
        with pytest.raises(errors.ResourceExhausted, match="after waiting"):
            high.acquire(6000, priority=5, wait=1)
        # The requester left: nobody needs the room any more, so the victim is not revoked, and its client
        # hears that its notice is withdrawn (``evicting`` is cleared again; within the 30 s grace).
        wait_for(lambda: cluster.get_prefix(cluster.keys.evictions()) == [], 25, "the notice to be withdrawn")
        wait_for(withdrawn.is_set, 25, "the victim to hear its notice withdrawn")
        assert not victim.evicting.is_set()
        assert [x.id for x in cluster.leases()] == [victim.id]


def test_a_release_on_another_host_does_not_cancel_an_eviction(cluster: Cluster) -> None:
    """An eviction notice is keyed by the victim's lease id, and lease ids are host-qualified: agent a's
    lease with request_id "weights" on h2 has another id than its namesake on h1, so releasing it on h2
    leaves the notice of the h1 victim alone, the leader revokes the victim at its deadline, and the
    high-priority waiter on h1 is granted. (Review finding F7: the notices of two hosts collided.)"""
    cluster.start_node("h1", "1x8GiB")
    cluster.start_node("h2", "1x8GiB")
    addr = cluster.start_coordinator(eviction_grace_s=1.5)
    with Client(addr, agent="a", host="h1") as a1, Client(addr, agent="a", host="h2") as a2, \
            Client(addr, agent="high", host="h1") as high:
        victim = a1.acquire(8000, priority=0, request_id="weights")
        other = a2.acquire(1000, priority=0, request_id="weights")
        assert victim.id != other.id          # lease ids are host-qualified: the notices cannot collide
        waiter = Background(high.acquire, 6000, priority=5, wait=8)
        wait_for(lambda: victim.evicting.is_set(), LIVENESS_S, "the eviction notice on h1")
        other.release()                        # on h2: must leave the h1 notice alone
        lease = waiter.result(12)
        assert lease.vram_mb == 6000


def test_an_operators_eviction_stands_when_a_requester_that_evicted_the_same_lease_gives_up(
        cluster: Cluster) -> None:
    """An operator's EvictLease on a lease that already has a requester's notice is kept as the operator's
    own: its shorter grace is honoured, and when the requester then gives up (its notices are withdrawn)
    the operator's eviction still stands, so the lease is revoked (or a notice remains). The same holds for
    ``partition apply --evict``, which evicts the same way. (Review finding R8: the operator's eviction was
    folded into the requester's notice and withdrawn with it.)"""
    cluster.start_node("h1", "1x8GiB")
    addr = cluster.start_coordinator(eviction_grace_s=30)
    with Client(addr, agent="low", host="h1") as low, Client(addr, agent="high", host="h1") as high:
        victim = low.acquire(8000, priority=0)
        waiter = Background(high.acquire, 6000, priority=5, wait=2)
        wait_for(lambda: victim.evicting.is_set(), LIVENESS_S, "the requester's eviction notice")
        t0 = time.time()
        resp = coordinator_stub(addr).EvictLease(
            pb.EvictLeaseRequest(lease_id=victim.id, grace_seconds=1, reason="drain"), timeout=10)
        asked_deadline = resp.deadline_unix
        try:
            waiter.result(10)                   # granted once the operator's 1 s deadline revoked the victim
        except errors.ResourceExhausted:
            pass                                # or it gave up first (its own notice is then withdrawn)
        notices = cluster.get_prefix(cluster.keys.evictions())
        held = victim.id in [x.id for x in cluster.leases()]
        assert notices or not held, (
            f"the operator's eviction was withdrawn with the requester's notice: no notice, lease still held "
            f"(EvictLease had answered a deadline {asked_deadline - t0:.0f}s away for a 1 s grace)")


def test_the_leader_does_not_revoke_a_victim_whose_notice_was_withdrawn_meanwhile(cluster: Cluster) -> None:
    """The leader's revoke at a deadline compares the notice it acted on inside its transaction: a notice
    withdrawn between the leader's pick of the due record and the revoke's commit (here the revoke is
    slowed, as by a slow etcd, and the requester gives up meanwhile) stops the revoke, and the victim keeps
    its lease. (Review finding R11: the revoke compared only the lease.)"""
    cluster.start_node("h1", "1x8GiB")
    # No kill margin: the revoke comes at the deadline itself, well within the requester's wait.
    addr = cluster.start_coordinator(eviction_grace_s=1, eviction_kill_margin_s=0)
    svc = cluster.service(addr)
    wait_for(lambda: svc.leadership.is_leader, 10, "the replica to lead")
    gate, entered, finished = threading.Event(), threading.Event(), threading.Event()
    orig_revoke = svc.leases.revoke

    async def slow_revoke(lease_id: str, host: str | None = None, **kw: Any) -> bool:
        entered.set()
        await asyncio.get_running_loop().run_in_executor(None, gate.wait, 15)
        try:
            return bool(await orig_revoke(lease_id, host, **kw))
        finally:
            finished.set()

    undo = patch_method(cluster, svc.leases, "revoke", slow_revoke)
    try:
        with Client(addr, agent="low", host="h1") as low, Client(addr, agent="high", host="h1") as high:
            victim = low.acquire(8000, priority=0)
            waiter = Background(high.acquire, 6000, priority=5, wait=3)
            assert entered.wait(LIVENESS_S), "the leader did not act on the deadline"
            with pytest.raises(errors.ResourceExhausted):
                waiter.result(10)
            wait_for(lambda: cluster.get_prefix(cluster.keys.evictions()) == [], LIVENESS_S, "the notice to be withdrawn")
            gate.set()
            assert finished.wait(LIVENESS_S), "the leader's revoke did not finish"
            assert [x.id for x in cluster.leases()] == [victim.id], "revoked after its notice was withdrawn"
    finally:
        gate.set()
        undo()
