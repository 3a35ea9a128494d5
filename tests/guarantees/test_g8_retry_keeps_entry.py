"""G8 with a retry through the same replica: a client that leaves an attempt (it hung: the replica missed its
health checks on a starved machine) and sends the same request again to the same replica (its only address, or
the owner the other replica forwards to) is never answered before the wait it asked for ends.

The first attempt's call is gone, so the replica's expiry removes its queue entry, comparing the revision it
knows; the retry joins that same entry in a round. The removal must not take the entry from under the live retry:
the next round would answer the retry at once, "removed from the queue without a grant (displaced by a request
of higher priority)", seconds before its wait ends (seen once in four runs of ``test_g8_expiry.py``'s two-replica
test with a CPU hog on each core, 0.72 s early). Here the expiry's removal is held in the replica's own commit
(``patch_commit``) until the retry waits in the queue, which forces that order at any speed of the machine.
"""
from __future__ import annotations

import asyncio
import threading
import time
from typing import Any, Awaitable, Callable

import grpc
import pytest

from agent_client import Client
from agent_client.api import coordinator_pb2 as pb
from coordinator.keys import lease_id_for
from coordinator.txn import Put
from tests.support.cluster import Cluster
from tests.support.patching import is_delete, patch_commit
from tests.support.rpcs import acquire_req, coordinator_stub
from tests.support.waiting import LIVENESS_S, wait_for

pytestmark = pytest.mark.usefixtures("history_checked")

WAIT_S = 15.0          # the wait, from the first attempt's sending
EARLY_SLACK_S = 0.05   # a timer may fire a millisecond early (see test_g8_expiry.py)


def test_a_retry_through_the_same_replica_is_not_answered_before_its_wait_ends(cluster: Cluster) -> None:
    cluster.start_node("h1", "1x8GiB")
    addr = cluster.start_coordinator()
    svc = cluster.coordinators[addr][1]
    lease_id = lease_id_for("a", "r", "h1")
    queue = cluster.keys.queue("h1")
    entered = threading.Event()
    release = asyncio.Event()    # used on the cluster's loop only (set there with call_soon_threadsafe)

    async def hold_the_removal(compares: Any, success: Any, commit: Callable[[], Awaitable[Any]]) -> Any:
        # The expiry's removal (deletes of queue entries, nothing put) waits until the retry waits.
        if not release.is_set() and any(is_delete(op, queue) for op in success) and \
                not any(isinstance(op, Put) for op in success):
            entered.set()
            await release.wait()
        return await commit()

    with Client(addr, agent="holder", host="h1") as holder:
        held = holder.acquire(8000, preemptible=False)
        stub = coordinator_stub(addr)
        sid = stub.OpenSession(pb.OpenSessionRequest(agent="a", host="h1", ttl_seconds=60), timeout=10).session_id
        # As the client does: the wait is over at ``until``, and the retry asks for what is left of it.
        until = time.monotonic() + WAIT_S
        first = stub.Acquire.future(acquire_req("a", sid, 1000, "r", wait=WAIT_S), timeout=WAIT_S + 30)
        wait_for(lambda: lease_id in getattr(svc._admitters.get("h1"), "_waiting", {}), 30,
                 "the first attempt to wait in the queue")
        admitter = svc._admitters["h1"]
        first_call = admitter._waiting[lease_id]
        undo = patch_commit(cluster, svc, hold_the_removal)
        try:
            first.cancel()     # the client leaves the attempt: the expiry removes its entry (held)
            wait_for(entered.is_set, 30, "the expiry to remove the first attempt's entry")
            second = stub.Acquire.future(acquire_req("a", sid, 1000, "r", wait=max(0.0, until - time.monotonic())),
                                         timeout=WAIT_S + 30)
            answered: list[float] = []
            second.add_done_callback(lambda _: answered.append(time.monotonic()))
            wait_for(lambda: admitter._waiting.get(lease_id) not in (None, first_call) or second.done(), 30,
                     "the retry to join the queue")
        finally:
            cluster.lt.loop.call_soon_threadsafe(release.set)
            undo()
        with pytest.raises(grpc.RpcError) as info:
            second.result()
        wait_for(lambda: answered, LIVENESS_S, "the retry's answer to be recorded")
        assert answered[0] >= until - EARLY_SLACK_S, (
            f"the retry was answered {until - answered[0]:.2f} s before its wait ended: "
            f"{info.value.code().name}: {info.value.details()}")
        # Its wait over: RESOURCE_EXHAUSTED, or UNAVAILABLE when a starved replica could not settle it soon after.
        code, details = info.value.code(), info.value.details() or ""
        assert (code == grpc.StatusCode.RESOURCE_EXHAUSTED and "after waiting" in details) or \
            code == grpc.StatusCode.UNAVAILABLE, (code, details)
        wait_for(lambda: not cluster.get_prefix(queue), 30, "the retry's queue entry to be gone")
        assert [x.id for x in cluster.leases()] == [held.id]
