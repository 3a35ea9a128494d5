"""G2 and the fair queue: bounds per agent and per host never stop a more important request.

* One agent filling its own bound (``max_queue_per_agent``) is refused past it, and another agent's request
  of higher priority still waits and is granted first.
* A full host queue (``max_queue_per_host``) does not refuse an arrival that outranks its lowest waiter: the
  arrival may evict (G3), and it takes the lowest waiter's place; that waiter is answered
  RESOURCE_EXHAUSTED naming ``queue``, also when another replica serves it. An arrival that does not
  outrank the lowest waiter is refused, naming ``queue``.

Small bounds keep it fast. Every test ends with the history checker (G1, G3, G5, G6 at every revision).
"""
from __future__ import annotations

import threading
from typing import Any, Iterator

import pytest

from agent_client import Client, errors
from coordinator.records import QueueEntry
from tests.harness import Background, Cluster, wait_for
from tests.history import check_store

pytestmark = pytest.mark.integration


@pytest.fixture(autouse=True)
def history_checked(cluster: Cluster) -> Iterator[None]:
    yield
    report = cluster.lt.run(check_store(cluster.store, cluster.keys))
    report.assert_ok()


def queue(cluster: Cluster, host: str = "h1") -> list[QueueEntry]:
    return [QueueEntry.from_kv(kv) for kv in cluster.get_prefix(cluster.keys.queue(host))]


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
