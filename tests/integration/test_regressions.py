"""Regression tests for the bugs a review pass found (F1-F13); each failed before its fix.

Faults are injected by wrapping methods of the coordinator's own ``Store`` instance (a slow or failing
etcd call), never by editing the code under test. Every test waits with ``wait_for`` or with gRPC
deadlines, never with a bare sleep as synchronisation.
"""
from __future__ import annotations

import asyncio
import threading
import time
from typing import Any, Callable, Iterator

import grpc
import pytest

from agent_client import AsyncClient, Client, errors
from coordinator import errors as cerrors
from agent_client.api import coordinator_pb2 as pb
from agent_client.api import coordinator_pb2_grpc as pb_grpc
from coordinator.etcd.store import Snapshot, WatchBatch
from coordinator.records import QueueEntry
from tests.harness import Background, Cluster, LoopThread, wait_for
from tests.history import check_store

pytestmark = pytest.mark.integration


# -- helpers ------------------------------------------------------------------------------------

def svc_of(cluster: Cluster, addr: str) -> Any:
    return cluster.coordinators[addr][1]


def queue(cluster: Cluster, host: str = "h1") -> list[QueueEntry]:
    return [QueueEntry.from_kv(kv) for kv in cluster.get_prefix(cluster.keys.queue(host))]


def stub(addr: str) -> pb_grpc.CoordinatorStub:
    return pb_grpc.CoordinatorStub(grpc.insecure_channel(addr))


def acquire_req(agent: str, session_id: str, vram_mb: int, request_id: str, wait: float = 0.0,
                **kw: Any) -> pb.AcquireRequest:
    return pb.AcquireRequest(session=pb.SessionRef(agent=agent, session_id=session_id), vram_mb=vram_mb,
                             request_id=request_id, wait_seconds=wait, **kw)


def _is_put(op: Any, key_part: bytes) -> bool:
    return op.HasField("request_put") and key_part in op.request_put.key


def _is_delete(op: Any, key_part: bytes) -> bool:
    return op.HasField("request_delete_range") and key_part in op.request_delete_range.key


def patch_commit(cluster: Cluster, svc: Any,
                 hook: Callable[[Any, Any, Any], Any]) -> Callable[[], None]:
    """Wrap ``svc.store.commit``: ``await hook(compares, success, orig)`` decides. Returns an undo."""
    store = svc.store
    orig = store.commit

    async def commit(compares: Any, success: Any, failure: Any = ()) -> Any:
        return await hook(list(compares), list(success), lambda: orig(compares, success, failure))

    def install() -> None:
        store.commit = commit

    def undo() -> None:
        store.__dict__.pop("commit", None)

    cluster.lt.loop.call_soon_threadsafe(install)
    wait_for(lambda: store.__dict__.get("commit") is commit, 2, "the patch to be installed")
    return undo




@pytest.fixture
def history_checked(cluster: Cluster) -> Iterator[None]:
    yield
    cluster.lt.run(check_store(cluster.store, cluster.keys)).assert_ok()


# -- F1: an etcd error in a round loses the whole batch ---------------------------------------------

def test_round_error_answers_the_batch_instead_of_hanging(cluster: Cluster) -> None:
    """admitter._run: the batch was already removed from _pending; an exception out of _round (here one
    UNAVAILABLE answer to the commit) answers only _pending, so the batch's futures are never resolved."""
    cluster.start_node("h1", "1x8GiB")
    addr = cluster.start_coordinator()
    svc = svc_of(cluster, addr)
    failed = []

    async def hook(compares: Any, success: Any, commit: Any) -> Any:
        if not failed and any(_is_put(op, b"/leases/") for op in success):
            failed.append(1)
            raise cerrors.Unavailable("etcd unavailable: injected")
        return await commit()

    undo = patch_commit(cluster, svc, hook)
    try:
        with Client(addr, agent="a", host="h1") as a:
            s = stub(addr)
            t0 = time.monotonic()
            try:
                s.Acquire(acquire_req("a", a.session_id, 1000, "r1"), timeout=4)
                outcome = "granted"
            except grpc.RpcError as e:
                outcome = e.code().name
            elapsed = time.monotonic() - t0
            assert failed, "the fault was not injected"
            # Expected: UNAVAILABLE (retryable) at once. Observed: no answer until the caller's deadline.
            assert outcome in ("UNAVAILABLE", "granted") and elapsed < 2, (outcome, elapsed)
    finally:
        undo()


# -- F2: a queue drain that needs more than etcd's max-txn-ops -----------------------------------------

def test_more_than_64_waiters_are_granted_after_a_release(cluster: Cluster, history_checked: None) -> None:
    """A round grants every waiter that fits, in one transaction: 2 ops per granted queue entry (lease put,
    entry delete). Above etcd's --max-txn-ops (128 by default) etcd answers INVALID_ARGUMENT, the round
    fails, and it fails the same way every 0.2 s: nobody is ever granted."""
    cluster.start_node("h1", "1x8GiB")
    n = 70
    addr = cluster.start_coordinator(max_queue_per_agent=n)   # one agent waits n times
    with Client(addr, agent="holder", host="h1") as holder:
        blocker = holder.acquire(8100, preemptible=False)
        lt = LoopThread()
        try:
            async def waiters() -> list[Any]:
                async with AsyncClient(addr, agent="w", host="h1", ttl=30) as c:
                    out = await asyncio.gather(*(c.acquire(100, wait=12, request_id=f"w{i}") for i in range(n)),
                                               return_exceptions=True)
                    return out
            fut = asyncio.run_coroutine_threadsafe(waiters(), lt.loop)
            wait_for(lambda: len(queue(cluster)) == n, 10, f"{n} waiters to be queued")
            blocker.release()
            # 70 x 100 MiB fit in 8 GiB at once: all should be granted within a few seconds.
            wait_for(lambda: queue(cluster) == [], 5, "the queue to drain after the release")
            results = fut.result(20)
            assert all(not isinstance(r, BaseException) for r in results), \
                {type(r).__name__ for r in results if isinstance(r, BaseException)}
        finally:
            lt.close()


# -- F3: a retry of a queued request with wait 0 never returns -------------------------------------

def test_retry_of_a_queued_request_with_no_wait_answers(cluster: Cluster, history_checked: None) -> None:
    """A retry (same request_id) attaches to the waiting entry; with wait_seconds=0 no timer is armed
    (submit only arms one for wait_s > 0), so _expire never runs for it: the call hangs until an
    unrelated event on the host wakes the admitter."""
    cluster.start_node("h1", "1x8GiB")
    addr = cluster.start_coordinator()
    with Client(addr, agent="a", host="h1") as a, Client(addr, agent="b", host="h1", ttl=30) as b:
        a.acquire(8000, preemptible=False)
        s = stub(addr)
        first = s.Acquire.future(acquire_req("b", b.session_id, 1000, "same", wait=60), timeout=90)
        wait_for(lambda: len(queue(cluster)) == 1, 5, "the first call to be queued")
        try:
            s.Acquire(acquire_req("b", b.session_id, 1000, "same", wait=0), timeout=4)
            outcome = "granted"
        except grpc.RpcError as e:
            outcome = e.code().name
        first.cancel()
        # Expected: RESOURCE_EXHAUSTED (or a grant) right away. Observed: DEADLINE_EXCEEDED after 4 s.
        assert outcome != "DEADLINE_EXCEEDED", outcome
        b.close()


# -- F4: an etcd error while a waiter expires loses the waiter -------------------------------------------

def test_expire_error_still_answers_the_waiter_and_removes_its_entry(cluster: Cluster) -> None:
    """_expire deletes the waiter from _waiting *before* its delete commits; if that commit raises, the
    waiter is neither answered nor retried, and its queue entry stays (blocking its GPU) until the leader's
    'overdue' sweep, deadline + 20 s later."""
    cluster.start_node("h1", "1x8GiB")
    addr = cluster.start_coordinator()
    svc = svc_of(cluster, addr)
    failed = []

    async def hook(compares: Any, success: Any, commit: Any) -> Any:
        if not failed and len(success) == 1 and _is_delete(success[0], b"/queue/"):
            failed.append(1)
            raise cerrors.Unavailable("etcd unavailable: injected")
        return await commit()

    with Client(addr, agent="a", host="h1") as a, Client(addr, agent="b", host="h1", ttl=30) as b:
        a.acquire(8000, preemptible=False)
        undo = patch_commit(cluster, svc, hook)
        try:
            s = stub(addr)
            t0 = time.monotonic()
            try:
                s.Acquire(acquire_req("b", b.session_id, 1000, "exp", wait=1), timeout=5)
                outcome = "granted"
            except grpc.RpcError as e:
                outcome = e.code().name
            assert failed, "the fault was not injected"
            assert outcome != "DEADLINE_EXCEEDED", (outcome, time.monotonic() - t0)
            wait_for(lambda: queue(cluster) == [], 3, "the expired waiter's entry to leave the queue")
        finally:
            undo()


# -- F5: a caller that goes away during its round leaves its entry behind ------------------------------

def test_waiter_cancelled_during_its_round_leaves_the_queue(cluster: Cluster) -> None:
    """_settle only records a wait in _waiting when the future is not done; a caller cancelled while the
    round that queues it is in flight gets an entry in etcd that nobody on this replica tracks: it stays
    until deadline + 20 s (leader's overdue sweep) and blocks the GPU for every later request meanwhile."""
    cluster.start_node("h1", "1x8GiB")
    addr = cluster.start_coordinator()
    svc = svc_of(cluster, addr)
    in_commit = threading.Event()

    async def hook(compares: Any, success: Any, commit: Any) -> Any:
        if any(_is_put(op, b"/queue/") for op in success) and not in_commit.is_set():
            in_commit.set()
            await asyncio.sleep(0.5)   # a slow etcd write
        return await commit()

    with Client(addr, agent="a", host="h1") as a, Client(addr, agent="b", host="h1", ttl=30) as b:
        a.acquire(8000, preemptible=False)
        undo = patch_commit(cluster, svc, hook)
        try:
            call = stub(addr).Acquire.future(acquire_req("b", b.session_id, 1000, "gone", wait=60), timeout=90)
            assert in_commit.wait(5)
            call.cancel()
            # The entry may be written (the slow commit) and removed again before a poll would see it.
            # G4: the caller has gone; its entry should go (the normal cancel path takes milliseconds).
            wait_for(lambda: queue(cluster) == [], 5, "the cancelled caller's entry to leave the queue")
        finally:
            undo()
            b.close()


# -- F6: decisions answered from a stale (serializable) read ---------------------------------------------

def _lagging_reads(cluster: Cluster, svc: Any, lag_rev: int) -> Callable[[], None]:
    """Serializable snapshots are served as a follower that is behind at ``lag_rev`` would serve them."""
    store = svc.store
    orig = store.snapshot

    async def snapshot(ranges: Any, serializable: bool = False) -> Snapshot:
        ranges = list(ranges)
        if not serializable:
            return await orig(ranges)
        for r in ranges:
            r.revision = lag_rev
        snap = await orig(ranges)
        return Snapshot(lag_rev, snap.ranges)

    cluster.lt.loop.call_soon_threadsafe(lambda: setattr(store, "snapshot", snapshot))
    wait_for(lambda: store.__dict__.get("snapshot") is snapshot, 2, "the patch")
    return lambda: store.__dict__.pop("snapshot", None)


def _waiter_on_gpu1(cluster: Cluster, addr: str) -> tuple[Client, Client, Background]:
    """A waiter on GPU 1 of h1: with a waiter on the host, _round reads a snapshot (no mirror)."""
    holder = Client(addr, agent="holder", host="h1").connect()
    holder.acquire(8000, gpu=1, preemptible=False)
    w = Client(addr, agent="w", host="h1", ttl=30).connect()
    waiter = Background(w.acquire, 4000, gpu=1, wait=30)
    wait_for(lambda: len(queue(cluster)) == 1, 5, "the waiter to be queued")
    return holder, w, waiter


def test_first_acquire_of_a_new_session_on_a_lagging_member(cluster: Cluster) -> None:
    """_round's first read is serializable, and a session missing from it is answered SessionGone at once
    (no compare validates a refusal). With 3 members, a follower that has not applied OpenSession yet
    makes the very first acquire of a new session fail with NOT_FOUND, which the client treats as expiry."""
    cluster.start_node("h1", "2x8GiB")
    addr = cluster.start_coordinator()
    svc = svc_of(cluster, addr)
    holder, w, _ = _waiter_on_gpu1(cluster, addr)
    lag_rev = cluster.lt.run(cluster.store.get_prefix(cluster.keys.root())).revision
    try:
        with Client(addr, agent="a", host="h1") as a:
            undo = _lagging_reads(cluster, svc, lag_rev)
            try:
                lease = a.acquire(1000, gpu=0)   # observed: SessionExpired ("session: no live session ...")
                assert lease.vram_mb == 1000
            finally:
                undo()
    finally:
        w.close()
        holder.close()


def test_acquire_right_after_own_release_on_a_lagging_member(cluster: Cluster) -> None:
    """Read-your-writes: a client releases (acknowledged), then acquires the same room without waiting.
    A serializable read that has not seen the release refuses with RESOURCE_EXHAUSTED."""
    cluster.start_node("h1", "2x8GiB")
    addr = cluster.start_coordinator()
    svc = svc_of(cluster, addr)
    holder, w, _ = _waiter_on_gpu1(cluster, addr)
    try:
        with Client(addr, agent="a", host="h1") as a:
            first = a.acquire(8000, gpu=0)
            lag_rev = cluster.lt.run(cluster.store.get_prefix(cluster.keys.root())).revision
            first.release()
            undo = _lagging_reads(cluster, svc, lag_rev)
            try:
                lease = a.acquire(8000, gpu=0)   # observed: ResourceExhausted
                assert lease.vram_mb == 8000
            finally:
                undo()
    finally:
        w.close()
        holder.close()


# -- F7: evictions/<lease_id> is not host-qualified ----------------------------------------------------

def test_release_on_one_host_does_not_cancel_an_eviction_on_another(cluster: Cluster) -> None:
    """lease_id = hash(agent, request_id) is unique per host only, but evictions/<lease_id> is global.
    Releasing agent a's lease on h2 deletes the eviction notice of a's lease with the same request_id on
    h1, so the leader never revokes the h1 victim and the high-priority waiter on h1 starves."""
    cluster.start_node("h1", "1x8GiB")
    cluster.start_node("h2", "1x8GiB")
    addr = cluster.start_coordinator(eviction_grace_s=1.5)
    with Client(addr, agent="a", host="h1") as a1, Client(addr, agent="a", host="h2") as a2, \
            Client(addr, agent="high", host="h1") as high:
        victim = a1.acquire(8000, priority=0, request_id="weights")
        other = a2.acquire(1000, priority=0, request_id="weights")
        assert victim.id != other.id          # lease ids are host-qualified: the notices cannot collide
        waiter = Background(high.acquire, 6000, priority=5, wait=8)
        wait_for(lambda: victim.evicting.is_set(), 5, "the eviction notice on h1")
        other.release()                        # on h2: deletes evictions/<id>, the h1 notice too
        lease = waiter.result(12)              # observed: ResourceExhausted after 8 s, victim never revoked
        assert lease.vram_mb == 6000


# -- F8: the replica's watch task dies on an error and nobody notices ---------------------------------

def test_watch_task_survives_an_etcd_error_during_resync(cluster: Cluster, monkeypatch: Any) -> None:
    """CoordinatorService._watch has no error handling: after a compaction resync, a get_prefix that fails
    (etcd down longer than retry_for) ends the task; its exception is only retrieved at stop(). The replica
    then never wakes waiters on a release, never delivers notices, and as leader never enforces deadlines."""
    from coordinator.etcd.store import Store
    cluster.start_node("h1", "1x8GiB")
    orig_watch, orig_get_prefix = Store.watch, Store.get_prefix
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

    async def get_prefix(self: Any, prefix: bytes) -> Any:
        if arm["fail"] and prefix == root:
            arm["fail"] = False
            raise cerrors.Unavailable("etcd unavailable: injected (longer than retry_for)")
        return await orig_get_prefix(self, prefix)

    monkeypatch.setattr(Store, "watch", watch)
    monkeypatch.setattr(Store, "get_prefix", get_prefix)
    addr = cluster.start_coordinator()
    svc = svc_of(cluster, addr)
    with Client(addr, agent="a", host="h1") as a, Client(addr, agent="b", host="h1") as b:
        held = a.acquire(8000, preemptible=False)
        arm["resync"] = True
        a.acquire(100).release()               # any event: the injected resync follows it
        wait_for(lambda: not arm["resync"] and not arm["fail"], 5, "the injected resync and failure")
        waiter = Background(b.acquire, 4000, wait=6)
        wait_for(lambda: len(queue(cluster)) == 1, 5, "b to be queued")
        held.release()
        # Expected: granted within milliseconds of the release. Observed: ResourceExhausted after 6 s.
        lease = waiter.result(10)
        assert lease.vram_mb == 4000
        assert not any(t.done() for t in svc._tasks), "a service task has died"


# -- F9: a replica that is stopping accepts acquires that never answer -------------------------------

def test_acquire_while_the_service_stops_is_answered_unavailable(cluster: Cluster) -> None:
    """serve() stops the service before the gRPC server: in between, an acquire for a host whose admitter
    was stopped is appended to its _pending and never answered (the admitter task is gone)."""
    cluster.start_node("h1", "1x8GiB")
    addr = cluster.start_coordinator()
    server, svc = cluster.coordinators[addr]
    with Client(addr, agent="a", host="h1", ttl=30) as a:
        a.acquire(100).release()               # the admitter of h1 exists
        sid = a.session_id
        cluster.lt.run(svc.stop())             # the window between svc.stop() and server.stop()
        try:
            stub(addr).Acquire(acquire_req("a", sid, 100, "late"), timeout=3)
            outcome = "granted"
        except grpc.RpcError as e:
            outcome = e.code().name
        cluster.coordinators.pop(addr)
        cluster.lt.run(server.stop(grace=0.2))
        a.orphan()
        # Expected: UNAVAILABLE at once (the client then fails over). Observed: DEADLINE_EXCEEDED.
        assert outcome == "UNAVAILABLE", outcome


# -- F5b: a caller that goes away during the round that grants it leaves a lease nobody holds ------------

def test_caller_cancelled_during_its_grant_leaves_no_lease(cluster: Cluster) -> None:
    """Same root cause as F5 on the grant side: the lease is committed under the caller's session, the
    caller has gone (cancelled, or its deadline passed), and nobody ever learns the lease id: the VRAM stays
    taken for as long as the session lives."""
    cluster.start_node("h1", "1x8GiB")
    addr = cluster.start_coordinator()
    svc = svc_of(cluster, addr)
    in_commit = threading.Event()
    committed = threading.Event()

    async def hook(compares: Any, success: Any, commit: Any) -> Any:
        if any(_is_put(op, b"/leases/") for op in success) and not in_commit.is_set():
            in_commit.set()
            await asyncio.sleep(0.5)   # a slow etcd write
            res = await commit()
            committed.set()
            return res
        return await commit()

    with Client(addr, agent="b", host="h1", ttl=30) as b:
        undo = patch_commit(cluster, svc, hook)
        try:
            call = stub(addr).Acquire.future(acquire_req("b", b.session_id, 1000, "gone"), timeout=30)
            assert in_commit.wait(5)
            call.cancel()
            wait_for(lambda: call.done(), 5, "the cancel")
            assert committed.wait(5)              # granted after the caller left
            # Expected: no lease held for a caller that never got an answer (or it is released at once).
            wait_for(lambda: cluster.leases() == [], 3, "the orphaned lease to go")
        finally:
            undo()


# -- F11: two calls with one request_id in one round ---------------------------------------------------

def test_two_concurrent_calls_with_one_request_id_both_answer(cluster: Cluster) -> None:
    """Two calls with the same request_id in one batch both become new queue entries (two entries, one
    lease_id) and _settle keeps only the last in _waiting: the first call is never answered."""
    cluster.start_node("h1", "1x8GiB")
    addr = cluster.start_coordinator()
    svc = svc_of(cluster, addr)
    slow = threading.Event()
    release_commit = threading.Event()

    async def hook(compares: Any, success: Any, commit: Any) -> Any:
        if any(_is_put(op, b"/leases/") for op in success) and not slow.is_set():
            slow.set()
            await asyncio.get_running_loop().run_in_executor(None, release_commit.wait, 5)
        return await commit()

    with Client(addr, agent="a", host="h1") as a, Client(addr, agent="b", host="h1", ttl=30) as b:
        undo = patch_commit(cluster, svc, hook)
        try:
            s = stub(addr)
            # A round in flight (its commit held), so that the two duplicates land in the next batch together.
            blocker = s.Acquire.future(acquire_req("a", a.session_id, 8000, "blocker", preemptible=False),
                                       timeout=10)
            assert slow.wait(5)
            req = acquire_req("b", b.session_id, 1000, "dup", wait=20)
            first, second = s.Acquire.future(req, timeout=8), s.Acquire.future(req, timeout=8)
            wait_for(lambda: len(svc._admitters["h1"]._pending) == 2, 5, "both duplicates to be pending")
            release_commit.set()
            wait_for(lambda: len(queue(cluster)) >= 1, 5, "the duplicates to be queued")
            blocker.result(5)
            entries = queue(cluster)
            # Observed: two entries for one lease_id; then the first call is never answered.
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


# -- F12: a failed release cannot be retried -----------------------------------------------------------

def test_release_that_failed_can_be_retried(cluster: Cluster) -> None:
    """AsyncLease.release sets released=True (and AsyncClient.release forgets the lease) before the RPC;
    when the RPC fails, a second release() answers False without asking: the lease stays held."""
    cluster.start_node("h1", "1x8GiB")
    addr = cluster.start_coordinator()
    svc = svc_of(cluster, addr)
    failing = threading.Event()
    failing.set()

    async def hook(compares: Any, success: Any, commit: Any) -> Any:
        if failing.is_set() and any(_is_delete(op, b"/leases/") for op in success):
            raise cerrors.Unavailable("etcd unavailable: injected")
        return await commit()

    with Client(addr, agent="a", host="h1", retry_for=0.3) as a:
        lease = a.acquire(1000)
        undo = patch_commit(cluster, svc, hook)
        try:
            with pytest.raises(errors.Unavailable):
                lease.release()
            failing.clear()
            lease.release()
            assert cluster.leases() == [], "the second release() did not release"
        finally:
            undo()


# -- F13: bad input that leaks as INTERNAL ---------------------------------------------------------------

def test_deeply_nested_partition_spec_is_invalid_argument(cluster: Cluster) -> None:
    """ApplyPartition catches ValueError around json.loads, but deep nesting raises RecursionError."""
    cluster.start_node("h1", "1x8GiB")
    addr = cluster.start_coordinator()
    with pytest.raises(grpc.RpcError) as info:
        stub(addr).ApplyPartition(pb.ApplyPartitionRequest(spec_json="[" * 100_000), timeout=10)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (info.value.code(), info.value.details())
