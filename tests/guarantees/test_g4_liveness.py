"""G4 liveness: a lease whose session stops keeping alive is gone within TTL + 1 s; a waiter whose caller
has gone leaves the queue; a host whose node daemon is gone gets no new admissions.

In-process here (a session closed, a call cancelled, a node daemon stopped); the same with killed
processes is in tests/faults/test_agent_death.py. Every test ends with the history checker.
"""
from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest

from agent_client import Client, errors
from tests.support.cluster import Cluster, queue
from tests.support.patching import is_put, patch_commit
from tests.support.rpcs import acquire_req, coordinator_stub
from tests.support.waiting import LIVENESS_S, Background, pass_time, wait_for

pytestmark = pytest.mark.usefixtures("history_checked")


def test_session_close_releases_everything(cluster: Cluster) -> None:
    cluster.start_node("h1", "1x16GiB")
    addr = cluster.start_coordinator()
    c = Client(addr, agent="agent-a", host="h1").connect()
    c.acquire(1000)
    c.acquire(2000)
    assert len(cluster.leases()) == 2
    c.close()
    assert cluster.leases() == []
    assert cluster.get_prefix(cluster.keys.sessions()) == []


def test_connecting_again_keeps_the_first_sessions_leases_alive(cluster: Cluster) -> None:
    """``connect()`` on a connected client opens no second session: ``with Client(...).connect() as c``
    keeps the one session alive past its TTL, with its leases. (Review finding R13: the second connect
    opened a new session and kept only that one alive; the first one's leases vanished after the TTL while
    the client reported nothing.)"""
    cluster.start_node("h1", "1x8GiB")
    addr = cluster.start_coordinator()
    c = Client(addr, agent="a", host="h1", ttl=2).connect()
    try:
        lease = c.acquire(1000)
        with c:                                 # __enter__ connects again
            pass_time(2 + 1.5, "the TTL of the first session")
            assert lease.id in [x.id for x in cluster.leases()], \
                f"the lease of the first session expired (client.expired={c.expired})"
    finally:
        c.close()


def test_cancelled_waiter_leaves_the_queue(cluster: Cluster) -> None:
    cluster.start_node("h1", "1x8GiB")
    addr = cluster.start_coordinator()
    with Client(addr, agent="a", host="h1") as a, Client(addr, agent="b", host="h1", ttl=30) as b:
        a.acquire(8000, preemptible=False)
        call = coordinator_stub(addr).Acquire.future(acquire_req("b", b.session_id, 1000, "cancel-me", wait=60),
                                                     timeout=120)
        wait_for(lambda: len(queue(cluster)) == 1, LIVENESS_S, "the waiter to be queued")
        call.cancel()
        # The session lives on (TTL 30 s), yet the entry goes as soon as the caller has gone.
        wait_for(lambda: queue(cluster) == [], LIVENESS_S, "the cancelled waiter's entry to go")


def test_a_waiter_whose_caller_leaves_during_the_round_that_queues_it_leaves_the_queue(cluster: Cluster) -> None:
    """A caller cancelled while the round that queues it is being committed is still tracked by the
    replica: its queue entry, once written, goes at once, as for any caller that has gone. (Review finding
    F5: such an entry stayed, untracked, until the leader's overdue sweep, and blocked the GPU meanwhile.)"""
    cluster.start_node("h1", "1x8GiB")
    addr = cluster.start_coordinator()
    in_commit = threading.Event()

    async def hook(compares: Any, success: Any, commit: Any) -> Any:
        if any(is_put(op, b"/queue/") for op in success) and not in_commit.is_set():
            in_commit.set()
            await asyncio.sleep(0.5)   # a slow etcd write
        return await commit()

    with Client(addr, agent="a", host="h1") as a, Client(addr, agent="b", host="h1", ttl=30) as b:
        a.acquire(8000, preemptible=False)
        undo = patch_commit(cluster, cluster.service(addr), hook)
        try:
            call = coordinator_stub(addr).Acquire.future(acquire_req("b", b.session_id, 1000, "gone", wait=60),
                                                         timeout=90)
            assert in_commit.wait(LIVENESS_S)
            call.cancel()
            # The entry may be written (the slow commit) and removed again before a poll would see it.
            wait_for(lambda: queue(cluster) == [], LIVENESS_S, "the cancelled caller's entry to leave the queue")
        finally:
            undo()
            b.close()


def test_a_grant_whose_caller_left_during_its_commit_is_given_back(cluster: Cluster) -> None:
    """A lease committed under the session of a caller that has gone meanwhile (cancelled, or its deadline
    passed) is known to nobody: the replica gives it back rather than leave the VRAM taken for as long as
    the session lives. (Review finding F5, on the grant side.)"""
    cluster.start_node("h1", "1x8GiB")
    addr = cluster.start_coordinator()
    in_commit = threading.Event()
    committed = threading.Event()

    async def hook(compares: Any, success: Any, commit: Any) -> Any:
        if any(is_put(op, b"/leases/") for op in success) and not in_commit.is_set():
            in_commit.set()
            await asyncio.sleep(0.5)   # a slow etcd write
            res = await commit()
            committed.set()
            return res
        return await commit()

    with Client(addr, agent="b", host="h1", ttl=30) as b:
        undo = patch_commit(cluster, cluster.service(addr), hook)
        try:
            call = coordinator_stub(addr).Acquire.future(acquire_req("b", b.session_id, 1000, "gone"), timeout=30)
            assert in_commit.wait(LIVENESS_S)
            call.cancel()
            wait_for(lambda: call.done(), LIVENESS_S, "the cancel")
            assert committed.wait(LIVENESS_S)              # granted after the caller left
            wait_for(lambda: cluster.leases() == [], LIVENESS_S, "the orphaned lease to go")
        finally:
            undo()


@pytest.mark.parametrize("mode", ["etcd", "registry"])
def test_no_admission_on_a_host_whose_node_is_gone(cluster: Cluster, mode: str) -> None:
    addr = cluster.start_coordinator()
    cluster.start_node("h1", "1x16GiB", via=[addr] if mode == "registry" else None)
    with Client(addr, agent="agent-a", host="h1") as c:
        c.acquire(1000)
        cluster.stop_node("h1")
        with pytest.raises(errors.FailedPrecondition, match="host"):
            c.acquire(1000)


def test_no_admission_on_a_host_whose_node_died_in_the_registry_mode(cluster: Cluster) -> None:
    """A node daemon that dies sends no more heartbeats: the coordinator stops refreshing its registration,
    which expires within its TTL, and its host takes no more admissions."""
    addr = cluster.start_coordinator()
    cluster.start_node("h1", "1x16GiB", ttl=3, via=[addr])
    with Client(addr, agent="agent-a", host="h1") as c:
        c.acquire(1000)
        cluster.stop_node("h1", revoke=False)     # gone without a word
        wait_for(lambda: cluster.get_prefix(cluster.keys.host("h1")) == [], 3 + 2, "the registration to expire")
        with pytest.raises(errors.FailedPrecondition, match="host"):
            c.acquire(1000)


@pytest.mark.parametrize("mode", ["etcd", "registry"])
def test_waiters_of_a_host_that_is_gone_are_swept(cluster: Cluster, mode: str) -> None:
    addr = cluster.start_coordinator()
    cluster.start_node("h1", "1x8GiB", via=[addr] if mode == "registry" else None)
    with Client(addr, agent="a", host="h1") as a, Client(addr, agent="b", host="h1") as b:
        a.acquire(8000, preemptible=False)
        waiter = Background(b.acquire, 4000, wait=30)
        wait_for(lambda: len(queue(cluster)) == 1, LIVENESS_S, "b to be queued")
        cluster.stop_node("h1")               # the node daemon goes: hosts/h1 is gone
        with pytest.raises(errors.FailedPrecondition, match="queue|host"):
            waiter.result(timeout=10)
        assert queue(cluster) == []
