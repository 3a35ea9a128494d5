"""G7: the agent client leaves a hung replica (SIGSTOP) for the next address, for an acquire in flight, for one
that waits in the queue, and for the keepalive stream of its session; the retry keeps its request_id, so it
gets the same lease, and the session lives on. Coordinators are real child processes; every test ends with
SIGCONT, cleanup by PID and the history checker.

How soon the client moves on (one attempt deadline, 3 s, and a retry; within two health checks for a
waiter) is printed, not asserted: the calls get deadlines far beyond it, so that only a client that never
leaves the hung replica fails them (it would be answered DEADLINE_EXCEEDED, or not at all), whatever the
machine's load."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Iterator

import pytest

from agent_client import Client
from coordinator.cli.common import fetch_status
from coordinator.records import QueueEntry
from tests.history import check_store
from tests.support.cluster import Cluster, session_alive
from tests.support.etcd3 import ClientFailovers
from tests.support.processes import spawn_coordinator
from tests.support.waiting import LIVENESS_S, Background, pass_time, wait_for


class Replica:
    def __init__(self, proc: subprocess.Popen[bytes], addr: str) -> None:
        self.proc, self.addr, self.id = proc, addr, ""
        self.stopped = False

    def stop(self) -> None:
        os.kill(self.proc.pid, signal.SIGSTOP)
        self.stopped = True

    def resume(self) -> None:
        if self.stopped and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGCONT)
        self.stopped = False


@pytest.fixture
def replicas(cluster: Cluster, tmp_path: Path) -> Iterator[list[Replica]]:
    """Two coordinator processes, with their replica ids."""
    reps = []
    try:
        for i in range(2):
            proc, port = spawn_coordinator(cluster.endpoints, cluster.prefix, "127.0.0.1:0", str(tmp_path / f"c{i}.log"))
            reps.append(Replica(proc, f"127.0.0.1:{port}"))

        def registered() -> bool:
            for kv in cluster.get_prefix(cluster.keys.coordinators()):
                info = json.loads(kv.value)
                for r in reps:
                    if info["address"] == r.addr:
                        r.id = info["replica"]
            return all(r.id for r in reps)
        wait_for(registered, 10, "both replicas to register")
        yield reps
    finally:
        for r in reps:
            r.resume()
        for r in reps:
            if r.proc.poll() is None:
                r.proc.terminate()
                r.proc.wait(10)
    cluster.lt.run(check_store(cluster.store, cluster.keys)).assert_ok()


def test_acquire_sent_to_a_hung_replica_is_answered_through_the_next(cluster: Cluster, replicas: list[Replica]) -> None:
    cluster.start_node("h1", "1x8GiB")
    first, second = replicas
    # The call's own deadline is far beyond one attempt deadline (3 s) and a retry: before, the client stayed
    # on the hung replica until it gave up with DEADLINE_EXCEEDED, after the whole rpc_timeout.
    with ClientFailovers() as failovers, \
            Client([first.addr, second.addr], agent="a", host="h1", rpc_timeout=LIVENESS_S) as c:
        first.stop()        # the replica the client talks to hangs, its socket still open
        t0 = time.monotonic()
        lease = c.acquire(1000, request_id="through-the-next")
        print(f"answered through the next replica after {time.monotonic() - t0:.1f}s; the client moved on "
              f"{dict(failovers.counts)}")
        assert failovers.counts, "the call was answered without leaving the hung replica"
        again = c.acquire(1000, request_id="through-the-next")
        assert (again.id, again.token) == (lease.id, lease.token)
        assert [x.id for x in cluster.leases()] == [lease.id]
        first.resume()
        fetch_status(first.addr)            # it serves again, having seen the cancelled call
        assert [x.id for x in cluster.leases()] == [lease.id]
        lease.release()


def test_waiting_acquire_leaves_a_replica_that_hangs_mid_call(cluster: Cluster, replicas: list[Replica]) -> None:
    cluster.start_node("h1", "1x8GiB")
    # The waiter's replica must be the one that owns h1 (host ownership): another would forward it there.
    from coordinator.replica.service import owner_of
    owner = owner_of("h1", [r.id for r in replicas])
    first, second = sorted(replicas, key=lambda r: r.id != owner)
    entries = lambda: [QueueEntry.from_kv(kv) for kv in cluster.get_prefix(cluster.keys.queue("h1"))]
    with Client(second.addr, agent="holder", host="h1") as holder, \
            Client([first.addr, second.addr], agent="waiter", host="h1") as waiter:
        held = holder.acquire(8000, preemptible=False)
        # A wait far longer than the test waits for the grant: a client that stayed on the stopped replica
        # would not be answered before the test gives up.
        call = Background(waiter.acquire, 4000, wait=10 * LIVENESS_S, request_id="mid-call")
        wait_for(lambda: len(entries()) == 1, 10, "the waiter to be queued")
        assert entries()[0].replica == first.id
        first.stop()        # mid-call: it holds the waiting request
        stopped_at = time.monotonic()
        held.release()      # through the other replica: the room is there now
        lease = call.result(timeout=LIVENESS_S)
        assert first.stopped and first.proc.poll() is None
        # Found hung within two health checks (2 x 3 s) on a quiet machine, then granted through the other
        # replica; without failover it would wait on the stopped replica for its whole wait.
        print(f"granted {call.finished_at - stopped_at:.1f}s after the replica hung")
        assert lease.vram_mb == 4000
        again = waiter.acquire(4000, request_id="mid-call")
        assert (again.id, again.token) == (lease.id, lease.token)
        first.resume()
        fetch_status(first.addr)
        assert [x.id for x in cluster.leases()] == [lease.id]
        assert not waiter.expired
        lease.release()


def test_the_keepalive_stream_leaves_a_hung_replica(cluster: Cluster, replicas: list[Replica]) -> None:
    """A replica that stops answering without closing its socket (SIGSTOP, a hung event loop, a partition
    that drops packets) does not hold the client's session hostage: the keepalive moves to the next
    replica within the TTL, and the session and its lease live on. (Review finding R1: the KeepAlive stream
    was read with no deadline and no gRPC ping, so the session expired while the client, its ``expired``
    still False, believed it alive.)"""
    cluster.start_node("h1", "1x8GiB")
    first, second = replicas
    # The keepalive gives up on a quiet stream after a quarter of the TTL at most: a TTL of 10 s leaves a
    # loaded machine seconds to get a refresh through the other replica (the defect lost it at any TTL).
    with Client([first.addr, second.addr], agent="a", host="h1", ttl=10) as c:
        lease = c.acquire(1000)
        first.stop()                            # the replica serving the stream hangs
        pass_time(10 + 2, "the session TTL and more")
        alive = session_alive(cluster, "a", c.session_id)
        held = [x.id for x in cluster.leases()]
        first.resume()
        assert (alive, held) == (True, [lease.id]), \
            f"session alive={alive}, leases={held}, client.expired={c.expired}"


def test_the_keepalive_follows_the_calls_away_from_a_hung_replica(cluster: Cluster, replicas: list[Replica]) -> None:
    """The keepalive stream and the calls share the client's place in its list of replicas. When a call has
    already left a hung replica for the next one, the keepalive must go there too when its own stream to the
    hung replica goes quiet, not step on past it (back to the hung one, with two replicas) and lose a whole
    watchdog period there: with a short TTL that lost the session (the nemesis lost one so, seed 42)."""
    from coordinator.replica.service import owner_of
    first, second = replicas
    host = next(h for h in (f"h{i}" for i in range(100)) if owner_of(h, [first.id, second.id]) == second.id)
    cluster.start_node(host, "1x8GiB")
    with Client([first.addr, second.addr], agent="a", host=host, ttl=4, attempt_timeout=1.0) as c:
        first.stop()                            # it serves the keepalive stream
        lease = c.acquire(1000)                 # leaves it for the other replica, after one attempt
        pass_time(4 + 2, "the session TTL and more")
        alive = session_alive(cluster, "a", c.session_id)
        first.resume()
        assert (alive, c.expired) == (True, False), f"session alive={alive}, client.expired={c.expired}"
        lease.release()
