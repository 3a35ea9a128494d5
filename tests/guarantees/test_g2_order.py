"""G2 order and the queue: a waiting request is never overtaken on its GPU by a later request of the same or
lower priority; equal priorities are served first come, first served.

* A release wakes the queue: the next waiter is granted at once, not at a polling tick; a wait that ends
  without a grant leaves the queue before its caller is answered.
* Waiters are served by priority, then in arrival order; a later request that would fit now still queues
  behind an earlier waiter of the same or higher priority.
* The queue is bounded, and the bounds per agent and per host never stop a more important request. One
  agent filling its own bound (``max_queue_per_agent``) is refused past it, and another agent's request of
  higher priority still waits and is granted first. A full host queue (``max_queue_per_host``) does not
  refuse an arrival that outranks its lowest waiter: the arrival may evict (G3), and it takes the lowest
  waiter's place; that waiter is answered RESOURCE_EXHAUSTED naming ``queue``, also when another replica
  serves it. An arrival that does not outrank the lowest waiter is refused, naming ``queue``.

Small bounds keep it fast. Every test ends with the history checker (G1, G3, G5, G6 at every revision).
"""
from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from agent_client import Client, errors
from tests.support.cluster import Cluster, queue
from tests.support.waiting import LIVENESS_S, Background, wait_for

pytestmark = pytest.mark.usefixtures("history_checked")


def waiting(cluster: Cluster, request_id: str) -> bool:
    return any(e.request_id == request_id for e in queue(cluster))


def test_an_agent_at_its_queue_bound_does_not_stop_another_agents_request(cluster: Cluster) -> None:
    cluster.start_node("h1", "1x8GiB")
    addr = cluster.start_coordinator(max_queue_per_agent=3, max_queue_per_host=8)
    with Client(addr, agent="holder", host="h1") as holder, Client(addr, agent="greedy", host="h1") as greedy, \
            Client(addr, agent="other", host="h1") as other:
        blocker = holder.acquire(8000, preemptible=False)
        mine = [Background(greedy.acquire, 4000, priority=-10, wait=30, request_id=f"g{i}") for i in range(3)]
        wait_for(lambda: len(queue(cluster)) == 3, 10, "greedy's three waiters")
        with pytest.raises(errors.ResourceExhausted, match="queue") as info:
            greedy.acquire(4000, priority=-10, wait=30, request_id="g3")
        assert "greedy" in info.value.message and "per agent" in info.value.message
        # The host's queue has room (3 of 8): another agent's more important request waits, and is served
        # first when the room appears.
        theirs = Background(other.acquire, 4000, priority=1000, wait=30, request_id="o0")
        wait_for(lambda: waiting(cluster, "o0"), 10, "the other agent's request to wait")
        assert [e.agent for e in queue(cluster)][0] == "other"
        blocker.release()
        lease = theirs.result(15)
        assert lease.vram_mb == 4000
        first = mine[0].result(15)   # the rest of the room goes to greedy's first waiter, in order
        assert first.vram_mb == 4000 and not mine[1].done.is_set()
        greedy.close()
        for w in mine[1:]:
            with pytest.raises(errors.GpucoordError):
                w.result(15)


def test_a_full_host_queue_is_displaced_by_a_higher_priority_arrival_which_may_evict(cluster: Cluster) -> None:
    cluster.start_node("h1", "1x8GiB")
    addr = cluster.start_coordinator(max_queue_per_host=3, max_queue_per_agent=2, eviction_grace_s=30)
    with Client(addr, agent="holder", host="h1") as holder, Client(addr, agent="a", host="h1") as a, \
            Client(addr, agent="b", host="h1") as b, Client(addr, agent="vip", host="h1") as vip:
        # Preemptible, at priority 0: the queued requests (priority <= 0) cannot evict it; vip (100) can.
        held = holder.acquire(8000, priority=0)
        released = threading.Event()

        def give_way(notice: Any) -> None:
            held.release()
            released.set()
        held.on_evict(give_way)
        w_a0 = Background(a.acquire, 4000, priority=0, wait=30, request_id="a0")
        wait_for(lambda: waiting(cluster, "a0"), 10, "a0 to wait")
        w_b0 = Background(b.acquire, 4000, priority=-10, wait=30, request_id="b0")
        wait_for(lambda: waiting(cluster, "b0"), 10, "b0 to wait")
        w_b1 = Background(b.acquire, 4000, priority=-10, wait=30, request_id="b1")
        wait_for(lambda: len(queue(cluster)) == 3, 10, "the host's queue to be full")
        # Not above the lowest waiter (b1: -10, and later): refused, and nothing changes.
        with pytest.raises(errors.ResourceExhausted, match="queue"):
            a.acquire(4000, priority=-10, wait=30, request_id="a1")
        assert [e.request_id for e in queue(cluster)] == ["a0", "b0", "b1"]
        # vip outranks them all: b1 (the lowest) leaves the queue for it, and vip evicts the holder (G3).
        got = Background(vip.acquire, 6000, priority=100, wait=30, request_id="v0")
        with pytest.raises(errors.ResourceExhausted, match="queue") as info:
            w_b1.result(15)
        assert "displaced" in info.value.message
        assert not waiting(cluster, "b1"), "the displaced waiter was answered before its entry left"
        lease = got.result(20)
        assert released.is_set() and lease.vram_mb == 6000 and lease.priority == 100
        assert [e.request_id for e in queue(cluster)] == ["a0", "b0"]
        a.close()
        b.close()
        for w in (w_a0, w_b0):
            with pytest.raises(errors.GpucoordError):
                w.result(15)


def test_a_waiter_displaced_through_another_replica_is_told_queue(cluster: Cluster) -> None:
    cluster.start_node("h1", "1x8GiB")
    first = cluster.start_coordinator(max_queue_per_host=1)
    second = cluster.start_coordinator(max_queue_per_host=1)
    with Client(first, agent="holder", host="h1") as holder, Client(first, agent="low", host="h1") as low, \
            Client(second, agent="high", host="h1") as high:
        holder.acquire(8000, preemptible=False)
        w = Background(low.acquire, 4000, priority=1, wait=30, request_id="low0")
        wait_for(lambda: waiting(cluster, "low0"), 10, "the low waiter on the first replica")
        h = Background(high.acquire, 4000, priority=2, wait=2, request_id="high0")
        # The first replica learns that its waiter's entry vanished without a lease: the host is alive and
        # the request could still fit, so the answer is RESOURCE_EXHAUSTED about the queue, not
        # FAILED_PRECONDITION.
        with pytest.raises(errors.ResourceExhausted, match="queue"):
            w.result(15)
        assert [e.request_id for e in queue(cluster)] == ["high0"]
        with pytest.raises(errors.ResourceExhausted, match="after waiting"):
            h.result(15)
        assert queue(cluster) == []


def test_waiter_is_granted_right_after_a_release(cluster: Cluster) -> None:
    cluster.start_node("h1", "1x8GiB")
    addr = cluster.start_coordinator()
    with Client(addr, agent="agent-a", host="h1") as a, Client(addr, agent="agent-b", host="h1") as b:
        first = a.acquire(4000)
        a.acquire(4000)
        with pytest.raises(errors.ResourceExhausted):
            b.acquire(4000)
        # A wait far longer than a release takes on a loaded machine: the release, not the wait's end, decides.
        waiter = Background(b.acquire, 4000, wait=60)
        wait_for(lambda: len(queue(cluster)) == 1, 30, "the waiter to be queued")
        released_at = time.monotonic()
        first.release()
        lease = waiter.result(timeout=70)
        assert lease.vram_mb == 4000 and lease.token == 3
        print(f"granted {waiter.finished_at - released_at:.3f} s after the release")
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
                wait_for(lambda: len(queue(cluster)) == n, LIVENESS_S, f"{name} to be queued")  # noqa: B023 - polled within this iteration
            # Rank order in etcd already says 5, 5, 1.
            assert [e.agent for e in queue(cluster)] == ["p5-first", "p5-second", "p1"]
            blocker.release()
            for name in ("p5-first", "p5-second", "p1"):
                lease = waiters[name].result()
                wait_for(lambda: len(order) >= 1, LIVENESS_S, "a grant")
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
        wait_for(lambda: len(queue(cluster)) == 1, LIVENESS_S, "b to be queued")
        # 2000 would fit now, but b (priority 3) waits on this GPU: equal or lower priority must queue.
        with pytest.raises(errors.ResourceExhausted, match="overtaking"):
            a.acquire(1000, priority=3)
        # A higher priority request may go first.
        a.acquire(1000, priority=4).release()
        b.close()
        with pytest.raises(errors.GpucoordError):
            waiter.result()


def test_queue_length_is_bounded(cluster: Cluster) -> None:
    cluster.start_node("h1", "1x8GiB")
    addr = cluster.start_coordinator(max_queue_per_host=2)
    with Client(addr, agent="a", host="h1") as a, Client(addr, agent="b", host="h1") as b:
        a.acquire(8000, preemptible=False)
        waiters = [Background(b.acquire, 1000, wait=20) for _ in range(2)]
        wait_for(lambda: len(queue(cluster)) == 2, LIVENESS_S, "two waiters")
        with pytest.raises(errors.ResourceExhausted, match="queue"):
            b.acquire(1000, wait=5)
        b.close()
        for w in waiters:
            with pytest.raises(errors.GpucoordError):
                w.result()
