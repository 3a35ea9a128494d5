"""No caller learns an outcome before the etcd transaction that makes it true has committed.

The replica's Store is wrapped (``CommitGate``): a commit that matches holds until the test lets it go, as
a slow etcd would. For every answer path (a grant, a sweep because the host is gone, a partition change, a
wait that ends, a displacement) the waiter's answer must not arrive while the transaction that removes
its queue entry is held, and when it arrives the entry is gone (for a grant: the lease is there). A
refusal that needs no write is answered at once, even while the round's transaction is held.

"Must not arrive while held" is observed for ``HOLD_S``: the gate stays shut that long first (an answer
sent before the commit reaches the client in milliseconds). The gate is never what makes a correct run
pass: it only keeps a wrong answer visible.
"""
from __future__ import annotations

import asyncio
import json
import threading
from typing import Any, Callable

import grpc
import pytest

from agent_client import Client, errors
from agent_client.api import coordinator_pb2 as pb
from agent_client.api import coordinator_pb2_grpc as pb_grpc
from coordinator.txn import Delete
from tests.support.cluster import Cluster, queue
from tests.support.patching import is_delete, is_put, patch_method
from tests.support.waiting import Background, wait_for

pytestmark = pytest.mark.usefixtures("history_checked")
HOLD_S = 0.5


class CommitGate:
    """Wraps ``svc.store.commit``: a commit whose operations match ``when`` waits for ``release``."""

    def __init__(self, cluster: Cluster, svc: Any, when: Callable[[list[Any]], bool]) -> None:
        self.cluster, self.store, self.when = cluster, svc.store, when
        self.held = 0
        self._lock = threading.Lock()
        self._open: asyncio.Event = cluster.lt.run(self._event())
        orig = self.store.commit

        async def commit(compares: Any, success: Any, failure: Any = (), deadline: float | None = None) -> Any:
            if not self._open.is_set() and self.when(list(success)):
                with self._lock:
                    self.held += 1
                await self._open.wait()
                deadline = None    # the hold stands for a slow commit, not one that timed out
            return await orig(compares, success, failure, deadline)
        self._undo = patch_method(cluster, self.store, "commit", commit)

    @staticmethod
    async def _event() -> asyncio.Event:
        return asyncio.Event()

    def holding(self) -> bool:
        with self._lock:
            return self.held > 0

    def release(self) -> None:
        self.cluster.lt.loop.call_soon_threadsafe(self._open.set)

    def remove(self) -> None:
        self.release()
        self._undo()


def deletes(key: bytes) -> Callable[[list[Any]], bool]:
    return lambda ops: any(isinstance(op, Delete) and op.key == key for op in ops)


def answer_then_look(cluster: Cluster, call: Callable[[], Any], rank: Callable[[], str]) -> Background:
    """Run ``call`` in the background; when it ends, look at once whether the queue entry is still there."""
    def run() -> tuple[Any, bool]:
        try:
            outcome: Any = call()
        except errors.GpucoordError as e:
            outcome = e
        return outcome, rank() in [e.rank for e in queue(cluster)]
    return Background(run)


def check_follows_commit(gate: CommitGate, waiter: Background) -> Any:
    """The answer must not come while the gate holds the transaction; once it comes, the entry is gone."""
    wait_for(gate.holding, 10, "the transaction that removes the entry to be held")
    assert not waiter.done.wait(HOLD_S), f"answered before its transaction committed: {waiter.value}"
    gate.release()
    outcome, entry_still_there = waiter.result(15)
    assert not entry_still_there, f"answered ({outcome!r}) while its queue entry was still in etcd"
    return outcome


def queued_waiter(cluster: Cluster, client: Client, **kw: Any) -> tuple[Background, bytes]:
    before = {e.rank for e in queue(cluster)}
    ranks: list[str] = []
    waiter = answer_then_look(cluster, lambda: client.acquire(4000, **kw), lambda: ranks[0])
    wait_for(lambda: {e.rank for e in queue(cluster)} - before, 10, "the waiter to be queued")
    ranks.extend({e.rank for e in queue(cluster)} - before)
    return waiter, cluster.keys.queue_entry("h1", ranks[0])


def test_a_swept_waiter_is_answered_after_its_entry_is_gone(cluster: Cluster) -> None:
    cluster.start_node("h1", "1x8GiB")
    addr = cluster.start_coordinator()
    with Client(addr, agent="a", host="h1") as a, Client(addr, agent="b", host="h1") as b:
        a.acquire(8000, preemptible=False)
        waiter, key = queued_waiter(cluster, b, wait=30)
        gate = CommitGate(cluster, cluster.service(addr), deletes(key))
        try:
            cluster.stop_node("h1")               # hosts/h1 goes: the waiter can never be granted there
            outcome = check_follows_commit(gate, waiter)
        finally:
            gate.remove()
        assert isinstance(outcome, errors.FailedPrecondition) and "host" in outcome.message, outcome


def test_a_waiter_shut_out_by_a_new_partition_is_answered_after_its_entry_is_gone(cluster: Cluster) -> None:
    cluster.start_node("h1", "1x8GiB")
    addr = cluster.start_coordinator()
    with Client(addr, agent="a", host="h1") as a, Client(addr, agent="b", host="h1") as b:
        a.acquire(8000, preemptible=False)
        waiter, key = queued_waiter(cluster, b, wait=30)
        gate = CommitGate(cluster, cluster.service(addr), deletes(key))
        try:
            stub = pb_grpc.CoordinatorStub(grpc.insecure_channel(addr))
            spec = {"host": "h1", "mode": "auto-split", "agents": ["a"]}   # b is not in it any more
            assert stub.ApplyPartition(pb.ApplyPartitionRequest(spec_json=json.dumps(spec)), timeout=10).applied
            outcome = check_follows_commit(gate, waiter)
        finally:
            gate.remove()
        assert isinstance(outcome, errors.FailedPrecondition) and "partition" in outcome.message, outcome


def test_a_wait_that_ends_is_answered_after_its_entry_is_gone(cluster: Cluster) -> None:
    cluster.start_node("h1", "1x8GiB")
    addr = cluster.start_coordinator()
    with Client(addr, agent="a", host="h1") as a, Client(addr, agent="b", host="h1") as b:
        a.acquire(8000, preemptible=False)
        gate = CommitGate(cluster, cluster.service(addr), lambda ops: any(
            is_delete(op, b"/queue/") for op in ops))
        try:
            waiter, _ = queued_waiter(cluster, b, wait=1.5)
            outcome = check_follows_commit(gate, waiter)
        finally:
            gate.remove()
        assert isinstance(outcome, errors.ResourceExhausted) and "after waiting" in outcome.message, outcome


def test_a_displaced_waiter_is_answered_after_its_entry_is_gone(cluster: Cluster) -> None:
    cluster.start_node("h1", "1x8GiB")
    addr = cluster.start_coordinator(max_queue_per_host=1)
    with Client(addr, agent="a", host="h1") as a, Client(addr, agent="b", host="h1") as b:
        a.acquire(8000, preemptible=False)
        waiter, key = queued_waiter(cluster, b, wait=30, priority=1)
        gate = CommitGate(cluster, cluster.service(addr), deletes(key))
        try:
            vip = Background(a.acquire, 4000, priority=5, wait=1)
            outcome = check_follows_commit(gate, waiter)
        finally:
            gate.remove()
        assert isinstance(outcome, errors.ResourceExhausted) and "queue" in outcome.message, outcome
        with pytest.raises(errors.ResourceExhausted, match="after waiting"):
            vip.result(15)


def test_a_grant_is_answered_after_its_lease_is_written(cluster: Cluster) -> None:
    cluster.start_node("h1", "1x8GiB")
    addr = cluster.start_coordinator()
    with Client(addr, agent="a", host="h1") as a, Client(addr, agent="b", host="h1") as b:
        held = a.acquire(8000, preemptible=False)
        waiter, key = queued_waiter(cluster, b, wait=30)
        gate = CommitGate(cluster, cluster.service(addr), deletes(key))
        try:
            held.release()
            lease = check_follows_commit(gate, waiter)
        finally:
            gate.remove()
        assert lease.vram_mb == 4000 and [x.id for x in cluster.leases()] == [lease.id]


def test_a_refusal_that_needs_no_write_is_answered_while_the_rounds_transaction_is_held(cluster: Cluster) -> None:
    cluster.start_node("h1", "1x8GiB")
    addr = cluster.start_coordinator()
    with Client(addr, agent="a", host="h1") as a, Client(addr, agent="b", host="h1") as b, \
            Client(addr, agent="c", host="h1") as c:
        a.acquire(8000, preemptible=False)
        puts_queue = [0]

        def queues(ops: list[Any]) -> bool:
            if any(is_put(op, b"/queue/") for op in ops):
                puts_queue[0] += 1
                return True
            return False
        gate = CommitGate(cluster, cluster.service(addr), queues)
        try:
            first = Background(b.acquire, 4000, wait=30, request_id="first")   # its round's commit is held
            wait_for(gate.holding, 10, "the first round's commit to be held")
            # Both arrive while the first round is held, so the next round decides them together: one
            # waits (a queue entry to write: held again), the other is refused (nothing to write).
            second = Background(c.acquire, 4000, wait=30, request_id="second")
            refused = Background(c.acquire, 4000, request_id="refused")
            wait_for(lambda: len(cluster.service(addr)._admitters["h1"]._pending) == 2, 10,
                     "both calls to reach the admitter")
            cluster.lt.loop.call_soon_threadsafe(gate._open.set)
            cluster.lt.loop.call_soon_threadsafe(gate._open.clear)
            wait_for(lambda: puts_queue[0] >= 2, 10, "the second round's commit to be held")
            with pytest.raises(errors.ResourceExhausted, match="does not fit now"):
                refused.result(10)      # answered at once, while the second round's commit is still held
            assert not second.done.is_set()
        finally:
            gate.remove()
        wait_for(lambda: len(queue(cluster)) == 2, 10, "both waiters to be queued")
        b.close()
        c.close()
        for w in (first, second):
            with pytest.raises(errors.GpucoordError):
                w.result(15)
