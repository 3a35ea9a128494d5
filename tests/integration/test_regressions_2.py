"""Second review pass: agent_client, the node daemon, the service, the admitter after its fixes, the leader.

Regression tests: each one failed before its fix (R1-R14; the docstrings say what went wrong). Faults
are injected with real processes (SIGSTOP, SIGKILL) or by wrapping methods of one component's own ``Store``
instance, never by editing the code under test. Tests wait with ``wait_for`` or gRPC deadlines.
"""
from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

import grpc
import pytest

from agent_client import Client, errors
from coordinator import errors as cerrors
from agent_client.api import coordinator_pb2 as pb
from agent_client.api import coordinator_pb2_grpc as pb_grpc
from agent_client.api import node_pb2
from agent_client.api import node_pb2_grpc
from coordinator.etcd.store import WatchBatch
from coordinator.records import QueueEntry
from tests.harness import Background, REPO, Cluster, child_env, spawn_coordinator, wait_for

pytestmark = pytest.mark.integration


# -- helpers ------------------------------------------------------------------------------------

def svc_of(cluster: Cluster, addr: str) -> Any:
    return cluster.coordinators[addr][1]


def stub(addr: str) -> pb_grpc.CoordinatorStub:
    return pb_grpc.CoordinatorStub(grpc.insecure_channel(addr))


def queue(cluster: Cluster, host: str = "h1") -> list[QueueEntry]:
    return [QueueEntry.from_kv(kv) for kv in cluster.get_prefix(cluster.keys.queue(host))]


def session_alive(cluster: Cluster, agent: str, session_id: str) -> bool:
    return bool(cluster.get_prefix(cluster.keys.session(agent, session_id)))


def pass_time(seconds: float, what: str) -> None:
    """Let wall-clock time pass (a TTL, a grace period): the thing under test is what happens meanwhile."""
    until = time.monotonic() + seconds
    wait_for(lambda: time.monotonic() >= until, seconds + 5, what, interval=0.05)


def patch_method(cluster: Cluster, obj: Any, name: str, replacement: Callable[..., Any]) -> Callable[[], None]:
    """Install ``obj.name = replacement`` on the cluster's loop thread; returns an undo."""
    cluster.lt.loop.call_soon_threadsafe(lambda: setattr(obj, name, replacement))
    wait_for(lambda: obj.__dict__.get(name) is replacement, 2, f"the patch of {name}")
    return lambda: obj.__dict__.pop(name, None)




# == agent_client ==================================================================================

# -- R1: a hung replica (SIGSTOP, or a silent network partition) keeps the KeepAlive stream forever ---------

def test_keepalive_fails_over_from_a_hung_replica(cluster: Cluster, tmp_path: Path) -> None:
    """AsyncClient._keepalive reads its stream with no deadline and no gRPC keepalive ping, and checks the
    TTL only once the stream breaks. A replica that stops answering without closing its socket (SIGSTOP, a
    hung event loop, a partition that drops packets) never breaks it: the client neither fails over to the
    healthy replica nor notices that its session expired (``expired`` stays False)."""
    cluster.start_node("h1", "1x8GiB")
    p1, port1 = spawn_coordinator(cluster.endpoints, cluster.prefix, "127.0.0.1:0", str(tmp_path / "c1.log"))
    p2, port2 = spawn_coordinator(cluster.endpoints, cluster.prefix, "127.0.0.1:0", str(tmp_path / "c2.log"))
    c = None
    try:
        c = Client([f"127.0.0.1:{port1}", f"127.0.0.1:{port2}"], agent="a", host="h1", ttl=3).connect()
        lease = c.acquire(1000)
        os.kill(p1.pid, signal.SIGSTOP)          # the replica serving the stream hangs
        pass_time(3 + 2, "the session TTL and more")
        alive = session_alive(cluster, "a", c.session_id)
        held = [x.id for x in cluster.leases()]
        expired = c.expired
        os.kill(p1.pid, signal.SIGCONT)
        # Expected: the client moved to replica 2 and kept its session. Observed: the session and its lease
        # are gone while the client still believes it is alive.
        assert (alive, held) == (True, [lease.id]), f"session alive={alive}, leases={held}, client.expired={expired}"
    finally:
        for p in (p1, p2):
            if p.poll() is None:
                os.kill(p.pid, signal.SIGCONT)
        if c is not None:
            c.close()
        for p in (p1, p2):
            p.terminate()
            p.wait(10)


# -- R2: after a coordinator restart, gRPC's reconnect backoff keeps the client away past its TTL ----------

def test_sessions_survive_a_coordinator_outage_shorter_than_their_ttl(cluster: Cluster, tmp_path: Path) -> None:
    """G7: "Clients reconnect and keep their leases as long as the TTL has not passed." The client reuses one
    grpc.aio channel per address with gRPC's default reconnect backoff (1 s, x1.6 per failure, +-20 %
    jitter: attempts about 1, 2.6, 5.2, 9.3 s into the outage). While the channel is in TRANSIENT_FAILURE
    every call fails fast, so the 0.2 s retry loop of _keepalive cannot reach a replica that is back: a
    replica back ~6.5 s into a 10 s TTL is tried again only ~7.4-11 s in, after many sessions have expired.
    One client survives or not by the luck of the jitter (gRPC shares the backoff between channels of one
    process), so this uses 16 agent processes; each survives with p ~ 0.7, all 16 by chance < 1 %."""
    cluster.start_node("h1", "1x16GiB")
    proc, port = spawn_coordinator(cluster.endpoints, cluster.prefix, "127.0.0.1:0", str(tmp_path / "c1.log"))
    addr = f"127.0.0.1:{port}"
    agents = [subprocess.Popen([sys.executable, "-m", "coordinator.cli.demo", "agent", "--coordinator", addr, "--host", "h1",
                                "--agent", f"a{i}", "--vram-mb", "1000", "--ttl", "10"], stdout=subprocess.PIPE,
                               stdin=subprocess.PIPE, stderr=open(tmp_path / f"a{i}.log", "ab"), env=child_env(),
                               cwd=REPO) for i in range(16)]
    try:
        for a in agents:
            assert a.stdout is not None and a.stdout.readline().startswith(b"GRANTED")
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        down_at = time.monotonic()
        pass_time(6.3, "an outage well within the TTL")
        proc, port2 = spawn_coordinator(cluster.endpoints, cluster.prefix, addr, str(tmp_path / "c2.log"))
        assert port2 == port
        back_after = time.monotonic() - down_at
        pass_time(max(0.0, 12.0 - (time.monotonic() - down_at)), "the TTL to pass since the outage began")
        sessions = len(cluster.get_prefix(cluster.keys.sessions()))
        # Expected: every session (and lease) survived an outage of ~6 s out of a 10 s TTL.
        assert sessions == 16 and len(cluster.leases()) == 16, \
            f"{16 - sessions} of 16 sessions lost although the coordinator was back {back_after:.1f}s into a 10s TTL"
    finally:
        for a in agents:
            a.kill()
            a.wait()
        proc.terminate()
        proc.wait(10)


# -- R3: a Client whose connect fails leaks its event-loop thread -----------------------------------------

def test_failed_connect_does_not_leak_the_client_thread(cluster: Cluster) -> None:
    """Client.__init__ starts a loop thread; ``with Client(...)`` calls connect() in __enter__, and when that
    raises, __exit__ never runs and nothing stops the thread (or closes the channel). An agent that retries
    connecting (host not registered yet, partition not applied yet) leaks one thread per attempt."""
    cluster.start_node("h1", "1x8GiB")
    addr = cluster.start_coordinator()

    def leaked() -> list[threading.Thread]:
        return [t for t in threading.enumerate() if t.name == "gpucoord-leaky" and t.is_alive()]
    for _ in range(3):
        with pytest.raises(errors.NotFound):
            with Client(addr, agent="leaky", host="no-such-host"):
                pass
    pass_time(0.5, "the threads to wind down")
    assert leaked() == [], f"{len(leaked())} client loop threads left running after failed connects"


# == coordinator/service.py =========================================================================

# -- R4: status of a fleet reads every host in ONE transaction: > 21 hosts passes etcd's --max-txn-ops -------

def test_status_of_more_than_21_hosts(cluster: Cluster) -> None:
    """CoordinatorService.status puts 6 ranges per host into one read-only txn. etcd refuses a txn with more
    than 128 operations (--max-txn-ops default), so GetStatus (and `gpucoord status`) fails for any fleet of
    22 hosts or more; P5 speaks of 1,000."""
    for i in range(22):
        cluster.start_node(f"h{i:02d}", "1x1GiB")
    addr = cluster.start_coordinator()
    resp = stub(addr).GetStatus(pb.GetStatusRequest(), timeout=20)   # observed: INVALID_ARGUMENT
    assert len(resp.hosts) == 22


# == coordinator/node/daemon.py ======================================================================

def _node_stub(daemon: Any) -> node_pb2_grpc.NodeStub:
    return node_pb2_grpc.NodeStub(grpc.insecure_channel(daemon.address))


# -- R5: the node's lease watch dies on one etcd error; CheckToken then answers from a frozen view forever ---

def test_node_lease_watch_survives_an_etcd_error_after_a_resync(cluster: Cluster, monkeypatch: Any) -> None:
    """NodeDaemon._watch_leases has no error handling (the twin of F8 on the coordinator): after a resync
    (compaction), a get_prefix that fails (etcd unreachable longer than Store.retry_for) ends the task, and
    nobody notices. From then on CheckToken answers from a frozen copy: a released lease's token stays
    ``live`` (G5: fencing says yes to a stale token) and new leases are never ``live``; untracked VRAM is
    computed against the frozen lease set too."""
    from coordinator.etcd.store import Store
    leases_prefix = cluster.keys.leases("h1")
    orig_watch, orig_get_prefix = Store.watch, Store.get_prefix
    arm = {"resync": False, "fail": False}

    async def watch(self: Any, key: bytes, **kw: Any) -> Any:
        async for batch in orig_watch(self, key, **kw):
            if arm["resync"] and key == leases_prefix and batch.events:
                arm["resync"], arm["fail"] = False, True
                yield WatchBatch(batch.revision, (), resync=True)   # as after a compaction
                return
            yield batch

    async def get_prefix(self: Any, prefix: bytes) -> Any:
        if arm["fail"] and prefix == leases_prefix and self is daemon.store:
            arm["fail"] = False
            raise cerrors.Unavailable("etcd unavailable: injected (longer than retry_for)")
        return await orig_get_prefix(self, prefix)

    monkeypatch.setattr(Store, "watch", watch)
    monkeypatch.setattr(Store, "get_prefix", get_prefix)
    daemon = cluster.start_node("h1", "1x8GiB")
    addr = cluster.start_coordinator()
    node = _node_stub(daemon)

    def live(lease: Any) -> bool | None:
        req = node_pb2.CheckTokenRequest(gpu_uuid=lease.gpu_uuid, token=lease.token)
        try:
            return bool(node.CheckToken(req, timeout=5).live)
        except grpc.RpcError as e:
            assert e.code() == grpc.StatusCode.UNAVAILABLE   # resynchronising: no answer rather than a stale one
            return None
    with Client(addr, agent="a", host="h1") as a:
        arm["resync"] = True
        first = a.acquire(1000)                 # its event carries the injected resync, then the failure
        wait_for(lambda: not arm["resync"] and not arm["fail"], 5, "the injected resync and failure")
        first.release()
        second = a.acquire(1000)
        # Expected: within moments the node sees the release and the new lease. Observed: never.
        wait_for(lambda: live(first) is False and live(second) is True, 5,
                 "CheckToken to reflect the release of the first lease and the grant of the second")


# -- R6: re-registration after the node's etcd_lease expired is not retried: one error and the host is gone --

def test_node_registers_again_even_if_the_first_attempt_fails(cluster: Cluster) -> None:
    """NodeDaemon's registration loop (once _keepalive_loop) caught errors of keepalive() only. When the etcd_lease has expired it
    grants a new one and publishes hosts/<host> outside any try: one failed write (etcd still flapping after
    an outage) raises out of the loop and ends the task. The daemon process keeps running and serving gRPC,
    but its host never comes back and no agent can be admitted there."""
    daemon = cluster.start_node("h1", "1x8GiB", ttl=3)
    store = daemon.store
    orig_commit = store.commit
    failed: list[int] = []

    async def commit(compares: Any, success: Any, failure: Any = ()) -> Any:
        if not failed and any(op.HasField("request_put") and op.request_put.key == cluster.keys.host("h1")
                              for op in success):
            failed.append(1)
            raise cerrors.Unavailable("etcd unavailable: injected")
        return await orig_commit(compares, success, failure)

    undo = patch_method(cluster, store, "commit", commit)
    try:
        cluster.lt.run(cluster.store.revoke(daemon.etcd_lease))   # as if etcd was unreachable past the TTL
        wait_for(lambda: failed, 10, "the node to try to register again")
        # Expected: a later attempt succeeds and hosts/h1 is back within a few keepalive intervals.
        wait_for(lambda: cluster.get_prefix(cluster.keys.host("h1")), 8, "hosts/h1 to be published again")
    finally:
        undo()


# -- R8: an operator's eviction is folded into a requester's notice, and withdrawn with it -------------------

def test_operator_eviction_is_not_withdrawn_with_a_requesters_notice(cluster: Cluster) -> None:
    """service.evict returns early when evictions/<lease_id> exists, whoever wrote it: the operator's grace
    is ignored (the requester's deadline is answered) and no record of the operator's request is kept. When
    the waiting request then gives up, withdraw_evictions deletes the notice (requested_by is the
    requester): the lease the operator asked to evict is never revoked, and the operator was told it would
    be. (`partition apply --evict` goes through the same evict() and loses its notices the same way.)"""
    cluster.start_node("h1", "1x8GiB")
    addr = cluster.start_coordinator(eviction_grace_s=30)
    with Client(addr, agent="low", host="h1") as low, Client(addr, agent="high", host="h1") as high:
        victim = low.acquire(8000, priority=0)
        waiter = Background(high.acquire, 6000, priority=5, wait=2)
        wait_for(lambda: victim.evicting.is_set(), 5, "the requester's eviction notice")
        t0 = time.time()
        resp = stub(addr).EvictLease(pb.EvictLeaseRequest(lease_id=victim.id, grace_seconds=1, reason="drain"),
                                     timeout=10)
        asked_deadline = resp.deadline_unix
        try:
            waiter.result(10)                   # granted once the operator's 1 s deadline revoked the victim
        except errors.ResourceExhausted:
            pass                                # or it gave up first (its own notice is then withdrawn)
        notices = cluster.get_prefix(cluster.keys.evictions())
        held = victim.id in [x.id for x in cluster.leases()]
        # Expected: the operator's eviction stands (a notice remains, or the lease is already revoked).
        assert notices or not held, (
            f"the operator's eviction was withdrawn with the requester's notice: no notice, lease still held "
            f"(EvictLease had answered a deadline {asked_deadline - t0:.0f}s away for a 1 s grace)")


# -- R9: `partition apply --evict` gives up after 15 s whatever the grace; its notices still revoke ----------

def test_partition_apply_evict_from_the_cli_outlasts_the_grace_period(cluster: Cluster, tmp_path: Path) -> None:
    """cli.cmd_partition calls ApplyPartition with a fixed timeout of 15 s, but with --evict the server
    waits for the offenders: up to the eviction grace (eviction_grace_s, 10 s by default, operator-set)
    plus the leader's revoke. With a grace above ~14 s the CLI always fails with DEADLINE_EXCEEDED; the
    server's handler is cancelled, so the partition is never written, yet the notices it sent stand and the
    leader revokes the offenders at their deadline: leases are lost for a partition that was not applied."""
    cluster.start_node("h1", "2x8GiB")
    addr = cluster.start_coordinator(eviction_grace_s=16)
    spec = tmp_path / "p.toml"
    spec.write_text('host = "h1"\nmode = "auto-split"\nagents = ["a", "b"]\n')
    with Client(addr, agent="a", host="h1", ttl=30) as a:
        on_gpu1 = a.acquire(2000, gpu=1)       # auto-split gives GPU 1 to b: a must leave it
        proc = subprocess.run([sys.executable, "-m", "coordinator.cli", "partition", "--coordinator", addr, "apply",
                               str(spec), "--evict"], capture_output=True, text=True, env=child_env(), cwd=REPO,
                              timeout=120)
        applied = bool(cluster.get_prefix(cluster.keys.partition("h1")))
        wait_for(lambda: on_gpu1.id not in [x.id for x in cluster.leases()] or applied, 10, "the deadline to pass")
        revoked = on_gpu1.id not in [x.id for x in cluster.leases()]
        applied = bool(cluster.get_prefix(cluster.keys.partition("h1")))
        # Expected: the CLI waits for the evictions and the partition is applied (or nothing is evicted).
        assert proc.returncode == 0 and applied, \
            f"cli rc={proc.returncode} ({proc.stderr.strip()[-120:]}); partition applied={applied}; offender revoked={revoked}"


# -- R10: a requester that dies while it waits leaves its eviction notices: the victims are revoked for nobody --

def test_notices_of_a_requester_whose_session_expired_are_withdrawn(cluster: Cluster, tmp_path: Path) -> None:
    """withdraw_evictions runs only where a replica deletes the queue entry itself (_expire, the leader's
    sweep). A waiter that hangs (SIGSTOP past its TTL, a partitioned host) loses its entry with its session:
    etcd deletes it, the serving replica's _decide answers the gone caller, and nobody withdraws the notices.
    At the deadline the leader revokes the victims for a request that no longer exists (README: "If it gives
    up first (its wait ends, its caller leaves), its notices are withdrawn and the victims are not revoked")."""
    cluster.start_node("h1", "1x8GiB")
    addr = cluster.start_coordinator(eviction_grace_s=6)
    with Client(addr, agent="low", host="h1", ttl=30) as low:
        victim = low.acquire(8000, priority=0)
        proc = subprocess.Popen([sys.executable, "-m", "coordinator.cli.demo", "agent", "--coordinator", addr, "--host", "h1",
                                 "--agent", "high", "--vram-mb", "6000", "--ttl", "2", "--wait", "60",
                                 "--priority", "5"], stdout=subprocess.PIPE, stdin=subprocess.PIPE,
                                stderr=open(tmp_path / "high.log", "ab"), env=child_env(), cwd=REPO)
        try:
            wait_for(lambda: victim.evicting.is_set(), 10, "the eviction notice")
            deadline = victim.notice.deadline_unix
            os.kill(proc.pid, signal.SIGSTOP)   # the requester hangs; its session expires after 2 s
            wait_for(lambda: queue(cluster) == [], 5, "the hung requester's entry to go with its session")
            pass_time(max(0.0, deadline - time.time()) + 1.5, "the victim's deadline to pass")
            # Expected: the notice was withdrawn and the victim kept its lease. Observed: revoked.
            assert [x.id for x in cluster.leases()] == [victim.id], "the victim was revoked for a requester that is gone"
        finally:
            os.kill(proc.pid, signal.SIGCONT)
            proc.kill()
            proc.wait()


# == coordinator/leader.py ===========================================================================

# -- R11: the leader's revoke at a deadline does not check that the notice still exists --------------------

def test_leader_does_not_revoke_a_lease_whose_notice_was_withdrawn(cluster: Cluster) -> None:
    """Leadership._enforce_deadlines picks due records from the replica's cached ``evictions`` and calls
    service.revoke, whose transaction compares only the lease's mod_revision. A notice withdrawn (or the
    lease released and taken again under the same id) between that pick and the revoke's commit does not stop
    it. Here the revoke's read is slowed (a slow etcd), and the requester gives up meanwhile: its notice is
    withdrawn, yet the victim is revoked. The revoke transaction should compare the notice too
    (cmp_mod_revision(evictions/<id>, record.mod_revision))."""
    cluster.start_node("h1", "1x8GiB")
    addr = cluster.start_coordinator(eviction_grace_s=1)
    svc = svc_of(cluster, addr)
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
            assert entered.wait(10), "the leader did not act on the deadline"
            with pytest.raises(errors.ResourceExhausted):
                waiter.result(10)
            wait_for(lambda: cluster.get_prefix(cluster.keys.evictions()) == [], 5, "the notice to be withdrawn")
            gate.set()
            assert finished.wait(10), "the leader's revoke did not finish"
            assert [x.id for x in cluster.leases()] == [victim.id], "revoked after its notice was withdrawn"
    finally:
        gate.set()
        undo()


# == coordinator/admitter.py =========================================================================

# -- R7: a round whose guards alone exceed the compare budget defers everything, forever -------------------

def test_a_batch_of_many_sessions_on_a_many_gpu_host_is_answered(cluster: Cluster) -> None:
    """_decide reserves guard_compares = 3 + len(gpus) + (distinct sessions in the batch) before the first
    item. When that alone is over TXN_COMPARES_BUDGET (120), fits_budget fails at n = 0: every call is
    deferred, plan.ops is empty, _settle puts them back in front of _pending and notifies, and _run decides
    the same batch again: a livelock (one etcd read per turn) in which no caller is ever answered. With the
    default batch_max (64) it takes a host with 64 GPUs (the --fake-gpus limit) and >= 54 sessions in one
    round; with batch_max >= 118 (no upper bound is validated) one GPU is enough."""
    cluster.start_node("h1", "64x1GiB")
    addr = cluster.start_coordinator()
    svc = svc_of(cluster, addr)
    s = stub(addr)
    n = 60
    sids = [s.OpenSession(pb.OpenSessionRequest(agent=f"a{i}", host="h1", ttl_seconds=60), timeout=10).session_id
            for i in range(n + 1)]
    hold, held = threading.Event(), threading.Event()
    orig_commit = svc.store.commit

    async def commit(compares: Any, success: Any, failure: Any = ()) -> Any:
        if not held.is_set():
            held.set()
            await asyncio.get_running_loop().run_in_executor(None, hold.wait, 10)
        return await orig_commit(compares, success, failure)

    undo = patch_method(cluster, svc.store, "commit", commit)
    try:
        def req(i: int) -> pb.AcquireRequest:
            return pb.AcquireRequest(session=pb.SessionRef(agent=f"a{i}", session_id=sids[i]), vram_mb=100,
                                     request_id=f"r{i}")
        first = s.Acquire.future(req(n), timeout=20)       # a round in flight, so the others form one batch
        assert held.wait(5)
        calls = [s.Acquire.future(req(i), timeout=10) for i in range(n)]
        wait_for(lambda: len(svc._admitters["h1"]._pending) == n, 5, f"{n} calls to be pending")
        hold.set()
        first.result()
        outcomes = []
        for call in calls:
            try:
                outcomes.append(call.result().lease.vram_mb)
            except grpc.RpcError as e:
                outcomes.append(e.code().name)
        # 60 x 100 MiB fit easily: all should be granted at once. Observed: DEADLINE_EXCEEDED for all.
        assert outcomes == [100] * n, sorted(set(map(str, outcomes)))
    finally:
        hold.set()
        undo()


# -- R12: a grant given back for a cancelled caller is handed to that caller's retry, then deleted -----------

def test_retry_of_a_cancelled_grant_gets_a_lease_that_stays(cluster: Cluster) -> None:
    """_settle gives back (deletes, compare on the commit's revision) a lease whose caller went away while
    its round committed, in a task that only starts once _run awaits again. A retry of the same request_id
    (G6: the client's own retry, or the user's after a client-side deadline) that is already pending is
    decided next, from a snapshot that is sent before the give-back's delete: it finds the lease,
    is answered with it ("existing"), and then the give-back deletes it. The caller holds a lease that no
    longer exists in etcd: its VRAM is admitted to others (G1 in practice) and its fencing token is dead."""
    cluster.start_node("h1", "1x8GiB")
    addr = cluster.start_coordinator()
    svc = svc_of(cluster, addr)
    in_commit, release_commit = threading.Event(), threading.Event()
    orig_commit = svc.store.commit

    async def commit(compares: Any, success: Any, failure: Any = ()) -> Any:
        if not in_commit.is_set() and any(op.HasField("request_put") and b"/leases/" in op.request_put.key
                                          for op in success):
            in_commit.set()
            await asyncio.get_running_loop().run_in_executor(None, release_commit.wait, 10)   # a slow etcd write
        return await orig_commit(compares, success, failure)

    with Client(addr, agent="b", host="h1", ttl=30) as b:
        undo = patch_method(cluster, svc.store, "commit", commit)
        try:
            s = stub(addr)
            req = pb.AcquireRequest(session=pb.SessionRef(agent="b", session_id=b.session_id), vram_mb=1000,
                                    request_id="x")
            first = s.Acquire.future(req, timeout=30)
            assert in_commit.wait(5)
            first.cancel()                      # the caller gives up (a client-side deadline, a cancelled task)
            wait_for(lambda: first.done(), 5, "the cancel")
            retry = s.Acquire.future(req, timeout=10)   # ... and retries with the same request_id
            wait_for(lambda: len(svc._admitters["h1"]._pending) == 1, 5, "the retry to be pending")
            release_commit.set()
            lease = retry.result().lease
            pass_time(1.0, "the give-back of the cancelled call to run")
            # Expected: the lease the retry was answered with is held. Observed: it was deleted after the answer.
            assert lease.id in [x.id for x in cluster.leases()], "the retry was answered with a lease that is gone"
        finally:
            release_commit.set()
            undo()


# -- R13: connect() on a connected client opens a second session and silently orphans the first --------------

def test_connect_twice_keeps_the_first_sessions_leases(cluster: Cluster) -> None:
    """AsyncClient.connect() does not check that it is connected already: it opens a new session, overwrites
    session_id and starts a second keepalive task; both tasks send _ref(), i.e. the NEW id, so the first
    session is kept alive by nobody and its leases vanish after the TTL while the client reports nothing
    (expired stays False). ``with Client(...).connect() as c:`` is enough to hit it."""
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


# -- R14: NVML is called on the node's event loop: a slow NVML call stalls keepalives and the gRPC server ----

def test_slow_nvml_call_does_not_stall_the_node(cluster: Cluster) -> None:
    """NodeDaemon._publish_usage calls source.usage() (blocking NVML calls) directly on the event loop. NVML
    calls are known to block for seconds (a GPU in a bad state, driver without persistence mode). While one
    blocks, nothing else runs: the etcd_lease keepalive, the lease watch, CheckToken and GetInventory. With a
    stall longer than the node's TTL, hosts/<host> expires and the host takes no admissions although the
    daemon is alive. The scan should run in a thread (run_in_executor / asyncio.to_thread)."""
    from coordinator.node.daemon import NodeDaemon
    from coordinator.rpc.node_server import create_node_server
    from coordinator.node.inventory import MIB, NvmlGpuSource
    from coordinator.etcd.store import Store
    from tests.harness import LoopThread
    from tests.unit.test_inventory import FakeDevice, FakeNvml

    stall = threading.Event()

    class SlowNvml(FakeNvml):
        def nvmlDeviceGetMemoryInfo(self, handle: Any) -> Any:
            if stall.is_set():
                stall.clear()
                time.sleep(4.5)                 # one NVML call that hangs for a while
            return super().nvmlDeviceGetMemoryInfo(handle)

    source = NvmlGpuSource(SlowNvml([FakeDevice("GPU-slow-0", "Sick GPU", 8192 * MIB)]))
    lt = LoopThread()                           # its own loop, so that the stall only stops the node

    async def start() -> tuple[Any, Any]:
        store = Store(cluster.endpoints)
        await store.connect()
        daemon = NodeDaemon(store, cluster.keys, "h1", "127.0.0.1:0", source, "/", 3, scan_interval_s=0.2)
        server, port = await create_node_server(daemon, "127.0.0.1:0")
        daemon.address = f"127.0.0.1:{port}"
        await daemon.start()
        return daemon, server
    daemon, server = lt.run(start())
    try:
        node = _node_stub(daemon)
        node.GetInventory(node_pb2.GetInventoryRequest(), timeout=5)
        stall.set()
        wait_for(lambda: not stall.is_set(), 5, "the scan to reach the slow call")
        t0 = time.monotonic()
        try:
            node.GetInventory(node_pb2.GetInventoryRequest(), timeout=1)
            answered = "answered"
        except grpc.RpcError as e:
            answered = e.code().name
        # Expected: the node answers, and its host stays registered through the stall.
        gone: dict[str, float] = {}

        def gone_or_window_over() -> bool:
            if not cluster.get_prefix(cluster.keys.host("h1")):
                gone["at"] = time.monotonic() - t0
                return True
            return time.monotonic() - t0 >= 5
        wait_for(gone_or_window_over, 10, "hosts/h1 to go, or the stall window to end")
        gone_at = gone.get("at")
        assert answered == "answered" and gone_at is None, \
            f"during a 4.5 s NVML call: GetInventory {answered}; hosts/h1 gone after {gone_at}"
    finally:
        async def stop() -> None:
            await server.stop(grace=0.2)
            await daemon.stop()
            await daemon.store.close()
        lt.run(stop())
        lt.close()
