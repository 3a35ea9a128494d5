"""G6 idempotency: an acquire retried with the same ``request_id`` returns the same lease and never a second
one, whether the retry comes after the answer, together with the first call, or after the first call was
cancelled while its grant was being committed. Another session of the same agent cannot take over a
request_id. A release that failed can be retried.

Every test ends with the history checker (G6 at every revision: never two live leases for one
(agent, request_id)).
"""
from __future__ import annotations

import asyncio
import threading
from typing import Any

import grpc
import pytest

from agent_client import Client, errors
from coordinator import errors as cerrors
from coordinator.replica.call import ORPHAN_GRACE_S
from tests.support.cluster import Cluster, queue
from tests.support.patching import is_delete, is_put, patch_commit, patch_method
from tests.support.rpcs import acquire_req, coordinator_stub
from tests.support.waiting import LIVENESS_S, wait_for

pytestmark = pytest.mark.usefixtures("history_checked")


def test_same_request_id_returns_the_same_lease(cluster: Cluster) -> None:
    cluster.start_node("h1", "1x16GiB")
    addr = cluster.start_coordinator()
    with Client(addr, agent="agent-a", host="h1") as c:
        first = c.acquire(4000, request_id="job-42")
        again = c.acquire(4000, request_id="job-42")
        assert again.id == first.id and again.token == first.token
        assert len(cluster.leases()) == 1


def test_same_request_id_from_another_session_is_refused(cluster: Cluster) -> None:
    cluster.start_node("h1", "1x16GiB")
    addr = cluster.start_coordinator()
    with Client(addr, agent="agent-a", host="h1") as first, Client(addr, agent="agent-a", host="h1") as second:
        lease = first.acquire(1000, request_id="job-7")
        before = cluster.state()
        with pytest.raises(errors.FailedPrecondition, match="request_id"):
            second.acquire(1000, request_id="job-7")
        assert cluster.state() == before and [x.id for x in cluster.leases()] == [lease.id]


def test_two_calls_with_one_request_id_in_one_round_get_one_queue_entry_and_the_same_answer(
        cluster: Cluster) -> None:
    """Two calls with the same request_id that land in one admission round are one request: one queue
    entry, and both calls are answered with the same lease. (Review finding F11: they became two entries
    for one lease id, and the first call was never answered.)"""
    cluster.start_node("h1", "1x8GiB")
    addr = cluster.start_coordinator()
    svc = cluster.service(addr)
    slow = threading.Event()
    release_commit = threading.Event()

    async def hook(compares: Any, success: Any, commit: Any) -> Any:
        if any(is_put(op, b"/leases/") for op in success) and not slow.is_set():
            slow.set()
            await asyncio.get_running_loop().run_in_executor(None, release_commit.wait, 5)
        return await commit()

    with Client(addr, agent="a", host="h1") as a, Client(addr, agent="b", host="h1", ttl=30) as b:
        undo = patch_commit(cluster, svc, hook)
        try:
            s = coordinator_stub(addr)
            # A round in flight (its commit held), so that the two duplicates land in the next batch together.
            blocker = s.Acquire.future(acquire_req("a", a.session_id, 8000, "blocker", preemptible=False),
                                       timeout=10)
            assert slow.wait(LIVENESS_S)
            req = acquire_req("b", b.session_id, 1000, "dup", wait=20)
            first, second = s.Acquire.future(req, timeout=8), s.Acquire.future(req, timeout=8)
            wait_for(lambda: len(svc._admitters["h1"]._pending) == 2, LIVENESS_S, "both duplicates to be pending")
            release_commit.set()
            wait_for(lambda: len(queue(cluster)) >= 1, LIVENESS_S, "the duplicates to be queued")
            blocker.result(5)
            entries = queue(cluster)
            a.release(blocker.result().lease.id)
            outcomes = []
            for call in (first, second):
                try:
                    outcomes.append(call.result().lease.id)
                except grpc.RpcError as e:
                    outcomes.append(e.code().name)
            assert len(entries) == 1 and outcomes[0] == outcomes[1], (len(entries), outcomes)
        finally:
            release_commit.set()
            undo()


def test_a_retry_claims_the_lease_its_cancelled_first_call_was_granted(cluster: Cluster) -> None:
    """A caller that goes away while its grant is being committed, and retries with the same request_id,
    gets that lease, and keeps it: the retry claims it, so the give-back that the replica schedules for a
    lease nobody knows (ORPHAN_GRACE_S after the commit) leaves it alone. The test waits until that
    give-back has run before it looks. (Review finding R12: the retry was answered with the lease, then the
    give-back deleted it: a lease that no longer existed, whose VRAM went to others.)"""
    cluster.start_node("h1", "1x8GiB")
    addr = cluster.start_coordinator()
    svc = cluster.service(addr)
    in_commit, release_commit = threading.Event(), threading.Event()
    gave_back = threading.Event()

    async def hook(compares: Any, success: Any, commit: Any) -> Any:
        if not in_commit.is_set() and any(is_put(op, b"/leases/") for op in success):
            in_commit.set()
            await asyncio.get_running_loop().run_in_executor(None, release_commit.wait, 10)   # a slow etcd write
        return await commit()

    with Client(addr, agent="b", host="h1", ttl=30) as b:
        undo = patch_commit(cluster, svc, hook)
        undo_give_back = None
        try:
            s = coordinator_stub(addr)
            req = acquire_req("b", b.session_id, 1000, "x")
            first = s.Acquire.future(req, timeout=30)
            assert in_commit.wait(LIVENESS_S)
            admitter = svc._admitters["h1"]
            orig_give_back = admitter._give_back

            async def give_back(lease: Any) -> None:
                try:
                    await orig_give_back(lease)
                finally:
                    gave_back.set()
            undo_give_back = patch_method(cluster, admitter, "_give_back", give_back)
            first.cancel()                      # the caller gives up (a client-side deadline, a cancelled task)
            wait_for(lambda: first.done(), LIVENESS_S, "the cancel")
            retry = s.Acquire.future(req, timeout=10)   # ... and retries with the same request_id
            wait_for(lambda: len(admitter._pending) == 1, LIVENESS_S, "the retry to be pending")
            release_commit.set()
            lease = retry.result().lease
            # The give-back of the cancelled call runs ORPHAN_GRACE_S after the commit, claimed or not.
            wait_for(gave_back.is_set, ORPHAN_GRACE_S + 10, "the give-back of the cancelled call to run")
            assert lease.id in [x.id for x in cluster.leases()], "the retry was answered with a lease that is gone"
        finally:
            release_commit.set()
            if undo_give_back is not None:
                undo_give_back()
            undo()


def test_a_release_that_failed_can_be_retried(cluster: Cluster) -> None:
    """A release whose RPC failed (etcd unavailable) leaves the lease known to the client, so that a
    second ``release()`` asks again and releases it. (Review finding F12: the client forgot the lease
    before the RPC, and the second release answered False without asking.)"""
    cluster.start_node("h1", "1x8GiB")
    addr = cluster.start_coordinator()
    failing = threading.Event()
    failing.set()

    async def hook(compares: Any, success: Any, commit: Any) -> Any:
        if failing.is_set() and any(is_delete(op, b"/leases/") for op in success):
            raise cerrors.Unavailable("etcd unavailable: injected")
        return await commit()

    with Client(addr, agent="a", host="h1", retry_for=0.3) as a:
        lease = a.acquire(1000)
        undo = patch_commit(cluster, cluster.service(addr), hook)
        try:
            with pytest.raises(errors.Unavailable):
                lease.release()
            failing.clear()
            lease.release()
            assert cluster.leases() == [], "the second release() did not release"
        finally:
            undo()
