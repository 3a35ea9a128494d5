"""Admission is linearizable (docs/guarantees.md "Guarantees"): an answer reflects every write acknowledged before the
request. A refusal, a wait or an unknown session is decided from a linearizable read, never from a
serializable one that a lagging etcd member may serve.

A lagging member is simulated by wrapping the replica's own Store: its serializable snapshots are served
at an older revision. A waiter on the host makes the round read a snapshot rather than decide from the
replica's mirror.
"""
from __future__ import annotations

from typing import Any, Callable

from agent_client import Client
from coordinator.etcd.store import Snapshot
from tests.support.cluster import Cluster, queue
from tests.support.patching import patch_method
from tests.support.waiting import LIVENESS_S, Background, wait_for


def _lagging_reads(cluster: Cluster, svc: Any, lag_rev: int) -> Callable[[], None]:
    """Serializable snapshots are served as a follower that is behind at ``lag_rev`` would serve them."""
    store = svc.store
    orig = store.snapshot

    async def snapshot(ranges: Any, serializable: bool = False, deadline: float | None = None) -> Snapshot:
        ranges = list(ranges)
        if not serializable:
            return await orig(ranges, deadline=deadline)
        return Snapshot(lag_rev, tuple([await store.read_at(r, lag_rev) for r in ranges]))
    return patch_method(cluster, store, "snapshot", snapshot)


def _waiter_on_gpu1(cluster: Cluster, addr: str) -> tuple[Client, Client, Background]:
    """A waiter on GPU 1 of h1: with a waiter on the host, a round reads a snapshot (no mirror)."""
    holder = Client(addr, agent="holder", host="h1").connect()
    holder.acquire(8000, gpu=1, preemptible=False)
    w = Client(addr, agent="w", host="h1", ttl=30).connect()
    waiter = Background(w.acquire, 4000, gpu=1, wait=30)
    wait_for(lambda: len(queue(cluster)) == 1, LIVENESS_S, "the waiter to be queued")
    return holder, w, waiter


def test_the_first_acquire_of_a_new_session_is_granted_on_a_lagging_member(cluster: Cluster) -> None:
    """A session opened (acknowledged) just before is known to its first acquire, even when the round's
    first read comes from a member that has not applied it yet. (Review finding F6: the session, missing
    from a serializable read, was answered "no live session", which the client takes for expiry.)"""
    cluster.start_node("h1", "2x8GiB")
    addr = cluster.start_coordinator()
    holder, w, _ = _waiter_on_gpu1(cluster, addr)
    lag_rev = cluster.lt.run(cluster.store.get_prefix(cluster.keys.root())).revision
    try:
        with Client(addr, agent="a", host="h1") as a:
            undo = _lagging_reads(cluster, cluster.service(addr), lag_rev)
            try:
                lease = a.acquire(1000, gpu=0)
                assert lease.vram_mb == 1000
            finally:
                undo()
    finally:
        w.close()
        holder.close()


def test_an_acquire_right_after_the_callers_own_release_sees_the_release(cluster: Cluster) -> None:
    """Read-your-writes: a client releases (acknowledged), then acquires the same room at once, and is
    granted, even on a member whose serializable reads have not seen the release. (Review finding F6: it
    was refused RESOURCE_EXHAUSTED.)"""
    cluster.start_node("h1", "2x8GiB")
    addr = cluster.start_coordinator()
    holder, w, _ = _waiter_on_gpu1(cluster, addr)
    try:
        with Client(addr, agent="a", host="h1") as a:
            first = a.acquire(8000, gpu=0)
            lag_rev = cluster.lt.run(cluster.store.get_prefix(cluster.keys.root())).revision
            first.release()
            undo = _lagging_reads(cluster, cluster.service(addr), lag_rev)
            try:
                lease = a.acquire(8000, gpu=0)
                assert lease.vram_mb == 8000
            finally:
                undo()
    finally:
        w.close()
        holder.close()
