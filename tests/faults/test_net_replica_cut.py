"""G4 under partitions: a replica cut from etcd while its clients still reach it.

Two coordinator replicas (real processes) on one etcd, each behind its own links (tests/faultlink.py); 8 agents
list both replicas, half of them the cut one first, on two hosts, one owned by each replica. The link between
replica A and etcd is cut silently (packets dropped, connections hanging) for longer than two session TTLs,
then healed. Throughout, and after:

* no agent's session is lost: keepalives move to replica B well before the TTL;
* every call ends with OK, RESOURCE_EXHAUSTED or UNAVAILABLE, and no waiter is answered RESOURCE_EXHAUSTED
  before its wait is over, also those that A held;
* A grants nothing it cannot commit, and answers UNAVAILABLE while cut; B owns A's host while A is cut:
  grants on it go on through B before the heal;
* when healed, A rejoins without a double grant: the history checker over etcd's whole history and the leak
  check end the test; A's log has no traceback.

How soon things happen is printed, not asserted (a loaded machine decides it): how late waiters were
answered (G8's target, bench P7's figure for grants), how soon A said UNAVAILABLE (within the etcd timeout,
2 s here, on a quiet machine), B's first grant on A's host after the cut (the election TTL plus a few
seconds), and how soon A serves again after the heal.
"""
from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Iterator

import grpc
import pytest

from agent_client.api import coordinator_pb2 as pb
from coordinator.replica.service import owner_of
from tests.history import check_history, read_history
from tests.support.cluster import Cluster, wait_no_leaks
from tests.support.etcd3 import ClientFailovers
from tests.support.load import LoadReport, run_load
from tests.support.noise import unhandled_in_log
from tests.support.processes import LinkedReplica
from tests.support.rpcs import acquire_req, coordinator_stub
from tests.support.waiting import LIVENESS_S, wait_for

TTL = 6
CUT_S = 2 * TTL + 1


@pytest.fixture
def replicas(cluster: Cluster, tmp_path: Path) -> Iterator[list[LinkedReplica]]:
    reps: list[LinkedReplica] = []
    try:
        for i in range(2):
            reps.append(LinkedReplica(cluster.endpoints, cluster.prefix, str(tmp_path / f"c{i}.log"),
                                      extra=["--session-ttl", str(TTL)]))
        wait_for(lambda: all(r.registered(cluster) for r in reps), 15, "both replicas to register")
        yield reps
    finally:
        for r in reps:
            r.close()


def hosts_owned(ids: list[str]) -> list[str]:
    """A host name owned by each replica, in order (rendezvous hashing over both ids)."""
    out: list[str] = []
    for want in ids:
        out.append(next(h for h in (f"h{i}" for i in range(100)) if owner_of(h, ids) == want and h not in out))
    return out


def probe(address: str, session_id: str, host: str, n: int) -> tuple[str, float]:
    """One acquire that fits, sent to ``address``: its status code and how long it took. Its deadline is
    generous: the replica's answer, not the caller's patience, decides the code."""
    t0 = time.monotonic()
    try:
        coordinator_stub(address).Acquire(acquire_req("probe", session_id, 1000, f"probe-{n}"), timeout=LIVENESS_S)
        code = "OK"
    except grpc.RpcError as e:
        code = e.code().name
    return code, time.monotonic() - t0


def test_a_replica_cut_from_etcd_hands_its_clients_to_the_other(cluster: Cluster,
                                                                replicas: list[LinkedReplica]) -> None:
    a, b = replicas
    host_a, host_b = hosts_owned([a.id, b.id])
    # An idle host that the cut replica owns, with room: an acquire there that it decided from its mirror
    # would fit, but it cannot commit it.
    idle = next(h for h in (f"idle{i}" for i in range(100)) if owner_of(h, [a.id, b.id]) == a.id)
    for h in (host_a, host_b, idle):
        cluster.start_node(h, "1x16GiB", ttl=30)
    cut_at: list[float] = []
    probe_session = coordinator_stub(b.address).OpenSession(
        pb.OpenSessionRequest(agent="probe", host=idle, ttl_seconds=60), timeout=10).session_id
    # Once through the replica while it is well: it knows the session from then on.
    assert probe(a.address, probe_session, idle, 0)[0] == "OK"
    probes: list[tuple[str, float]] = []

    async def scenario() -> LoadReport:
        report = LoadReport()
        load = asyncio.create_task(run_load([[a.address, b.address], [b.address, a.address]] * 4,
                                            [host_a, host_a, host_b, host_b], 4 + CUT_S + 6, seed=17,
                                            report=report, ttl=TTL, agent_prefix="cut",
                                            sizes=(4000, 6000, 8000), hold_s=0.1))
        await asyncio.sleep(4)
        cut_at.append(time.monotonic())
        await asyncio.to_thread(a.etcd_link.cut)
        # Before the replica knows it is cut (its round times out on etcd), and after.
        await asyncio.sleep(0.3)
        probes.append(await asyncio.to_thread(probe, a.address, probe_session, idle, 1))
        await asyncio.sleep(2 * TTL - 0.3 - probes[-1][1])
        probes.append(await asyncio.to_thread(probe, a.address, probe_session, idle, 2))
        await asyncio.sleep(max(0.0, cut_at[0] + CUT_S - time.monotonic()))
        await asyncio.to_thread(a.etcd_link.heal)
        # Healed, it serves again: an acquire through it is granted once it has refreshed its etcd lease.
        healed = time.monotonic()
        while (await asyncio.to_thread(probe, a.address, probe_session, idle, 3))[0] != "OK":
            assert time.monotonic() < healed + LIVENESS_S, "the healed replica does not serve"
            await asyncio.sleep(0.2)
        probes.append(("OK", time.monotonic() - healed))
        await load
        return report

    with ClientFailovers() as failovers:
        report = asyncio.run(scenario())
    cut = cut_at[0]
    # A call made after the cut and granted before the heal was granted by B: A can commit nothing meanwhile.
    on_a_host = [c for c in report.calls
                 if c.host == host_a and c.outcome == "ok" and c.ended_at - c.elapsed_s > cut]
    first = min((c.ended_at for c in on_a_host), default=float("inf")) - cut
    print(f"outcomes {report.outcomes()}; expired {report.expired}; max late {report.max_late_s():.2f}s; "
          f"first grant on {host_a} (owned by the cut replica) {first:.2f}s after the cut; the clients moved on "
          f"{dict(failovers.counts)}")
    print(f"acquires sent to the cut replica (code, seconds; the last: granted that long after the heal): {probes}")
    coordinator_stub(b.address).CloseSession(pb.CloseSessionRequest(
        session=pb.SessionRef(agent="probe", session_id=probe_session)), timeout=10)
    # It grants nothing it cannot commit, and says so (within the etcd timeout, 2 s at this TTL, on a quiet
    # machine: the probes' times are printed above).
    assert [code for code, _ in probes] == ["UNAVAILABLE", "UNAVAILABLE", "OK"], probes
    assert not report.open_failures, report.open_failures
    assert not report.expired, f"sessions lost: {report.expired}"
    bad = [c for c in report.calls if c.outcome not in ("ok", "ResourceExhausted", "Unavailable")]
    assert not bad, bad[:5]
    assert not report.answered_early(), report.answered_early()[:3]
    # B owns A's host while A is cut (from the election TTL, 5 s, plus a few seconds on a quiet machine): a
    # grant on it before the heal, CUT_S after the cut. A grant only after the heal could be A's own.
    assert first < CUT_S, f"no grant on {host_a} through the other replica until {first:.1f}s after the cut"

    wait_no_leaks(cluster, LIVENESS_S)
    events = cluster.lt.run(read_history(cluster.store, cluster.keys.root()), timeout=120)
    check_history(events, cluster.keys).assert_ok()
    # Every grant a client was told of was committed: the cut replica granted nothing it could not commit.
    created = {ev.kv.key.rsplit(b"/", 1)[-1].decode() for ev in events
               if ev.kind == "PUT" and cluster.keys.parse(ev.kv.key)[0] == "leases"}
    told = {c.lease_id for c in report.calls if c.outcome == "ok"}
    assert told <= created, f"{len(told - created)} grants never committed: {sorted(told - created)[:3]}"
    failed_over = {k.split()[1] for k in failovers.counts if k.split()[0] in ("Acquire", "Release", "KeepAlive")}
    assert failed_over <= {"UNAVAILABLE", "DEADLINE_EXCEEDED", "no"}, failovers.counts
    for r in replicas:
        bad = unhandled_in_log(r.log())
        assert not bad, f"{r.log_path}:\n{bad}"
