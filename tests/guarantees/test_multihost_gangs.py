"""Multi-host gangs end to end (issue 30, G12), against a real etcd, coordinators and node daemons with simulated
GPUs: one lease over GPUs on several hosts, granted in one transaction, whole or absent at every revision (the
history checker), placed by host labels, waiting with a reservation that later requests respect (G2 across
hosts), released whole, and notified and released whole when one of its hosts is lost."""
from __future__ import annotations

import threading
import time

import grpc
import pytest

from agent_client import Client, errors
from agent_client.api import coordinator_pb2 as pb
from tests.support.cluster import Cluster, events_since, revision
from tests.support.rpcs import coordinator_stub, expect_refused
from tests.support.waiting import LIVENESS_S, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("history_checked")]


def gang(c: Client, agent: str, request_id: str, hosts: int = 2, gpus: int = 4, wait: float = 0.0,
         **kw: object) -> pb.AcquireRequest:
    return pb.AcquireRequest(session=pb.SessionRef(agent=agent, session_id=c.session_id), request_id=request_id,
                             hosts=hosts, gpu_count=gpus, exclusive=True, wait_seconds=wait, **kw)  # type: ignore[arg-type]


def parts(cluster: Cluster, lease_id: str) -> list[tuple[str, str]]:
    out = []
    for kv in cluster.get_prefix(cluster.keys.leases()):
        _, p = cluster.keys.parse(kv.key)
        if p[2] == lease_id:
            out.append((p[0], p[1]))
    return sorted(out)


def racks(cluster: Cluster) -> None:
    for host, rack in (("a", "r1"), ("b", "r1"), ("c", "r2")):
        cluster.start_node(host, "4x16GiB", labels=(("rack", rack),))


def test_same_rack_gets_the_two_hosts_of_one_rack_in_one_transaction_and_three_are_refused_naming_same(
        cluster: Cluster) -> None:
    racks(cluster)
    addr = cluster.start_coordinator()
    stub = coordinator_stub(addr)
    with Client(addr, agent="agent-a", host="c") as c:
        before = revision(cluster)
        got = stub.Acquire(gang(c, "agent-a", "g1", same="rack"))
        lease_id = got.lease.id
        assert sorted({h for h, _ in parts(cluster, lease_id)}) == ["a", "b"]
        assert len(parts(cluster, lease_id)) == 8
        # One transaction wrote all eight records and their ledgers.
        assert len({rev for kind, rev in _lease_puts(cluster, before, lease_id)}) == 1
        expect_refused(cluster, lambda: stub.Acquire(gang(c, "agent-a", "g2", hosts=3, same="rack")),
                       grpc.StatusCode.FAILED_PRECONDITION, "same")
        assert stub.Release(pb.ReleaseRequest(session=pb.SessionRef(agent="agent-a", session_id=c.session_id),
                                              lease_id=lease_id)).released
        assert parts(cluster, lease_id) == []


def _lease_puts(cluster: Cluster, before: int, lease_id: str) -> list[tuple[str, int]]:
    return [(kind, rev) for kind, key, rev in events_since(cluster, before)
            if kind == "PUT" and key.decode().endswith("/" + lease_id)]


def test_a_waiting_gang_reserves_its_hosts_and_a_later_single_gpu_request_is_not_granted_on_them(
        cluster: Cluster) -> None:
    for host in ("a", "b"):
        cluster.start_node(host, "2x16GiB")
    addr = cluster.start_coordinator()
    stub = coordinator_stub(addr)
    with Client(addr, agent="agent-a", host="a") as holder, Client(addr, agent="agent-b", host="a") as g, \
            Client(addr, agent="agent-c", host="b") as later:
        held = holder.acquire(vram_mb=1024, gpu="0")
        answers: list[object] = []
        t = threading.Thread(target=lambda: answers.append(stub.Acquire(gang(g, "agent-b", "big", gpus=2, wait=30.0))))
        t.start()
        wait_for(lambda: len(cluster.get_prefix(cluster.keys.gang_queue())) == 1, LIVENESS_S, "the gang waits")
        wait_for(lambda: len(cluster.get_prefix(cluster.keys.queue("b"))) == 1, LIVENESS_S, "b is reserved")
        # A request ranked after the gang is not granted on host b's reserved GPUs, though they are free.
        with pytest.raises(errors.ResourceExhausted):
            later.acquire(vram_mb=1024, wait=0)
        held.release()
        t.join(LIVENESS_S)
        assert answers, "the gang was granted once host a's GPU was free"
        lease = answers[0].lease  # type: ignore[attr-defined]
        assert sorted({h for h, _ in parts(cluster, lease.id)}) == ["a", "b"]
        assert cluster.get_prefix(cluster.keys.gang_queue()) == []
        assert cluster.get_prefix(cluster.keys.queue()) == []


def test_a_priority_9_gang_evicts_the_minimal_victims_across_hosts_and_is_granted_once_they_are_gone(
        cluster: Cluster) -> None:
    for host in ("a", "b", "c"):
        cluster.start_node(host, "2x16GiB")
    addr = cluster.start_coordinator(eviction_grace_s=1.0)
    stub = coordinator_stub(addr)
    with Client(addr, agent="low", host="a") as la, Client(addr, agent="low", host="b") as lb, \
            Client(addr, agent="mid", host="c") as mc, Client(addr, agent="big", host="a") as big:
        a0 = la.acquire(vram_mb=1024, gpu="0", priority=1)
        b0 = lb.acquire(vram_mb=1024, gpu="0", priority=1)
        b1 = lb.acquire(vram_mb=1024, gpu="1", priority=2)
        c0 = mc.acquire(vram_mb=1024, gpu="0", priority=5)
        answers: list[object] = []
        t = threading.Thread(target=lambda: answers.append(stub.Acquire(gang(big, "big", "g", gpus=2, wait=30.0,
                                                                              priority=9))))
        t.start()
        # Hosts a and b: the highest victim priority there is 2, on c it would be 5. a has one victim, b two.
        wait_for(lambda: a0.evicting.is_set() and b0.evicting.is_set() and b1.evicting.is_set(), LIVENESS_S,
                 "the victims on a and b get their notices")
        assert not c0.evicting.is_set()
        assert parts(cluster, a0.id) and not answers, "the gang is not granted before its victims are gone"
        for lease in (a0, b0, b1):
            lease.release()
        t.join(LIVENESS_S)
        assert answers, "granted once its victims were gone"
        lease = answers[0].lease  # type: ignore[attr-defined]
        assert sorted({h for h, _ in parts(cluster, lease.id)}) == ["a", "b"]
        assert parts(cluster, c0.id), "the priority-5 lease on c was never a victim"


def test_a_waiting_gang_retried_through_another_replica_keeps_its_place_and_is_granted_there(
        cluster: Cluster) -> None:
    for host in ("a", "b"):
        cluster.start_node(host, "2x16GiB")
    first, second = cluster.start_coordinator(), cluster.start_coordinator()
    with Client(second, agent="holder", host="a") as holder, Client(second, agent="big", host="b") as g:
        held = holder.acquire(vram_mb=1024, gpu="0")
        errs: list[BaseException] = []

        def ask(addr: str, out: list[object]) -> None:
            try:
                out.append(coordinator_stub(addr).Acquire(gang(g, "big", "r", gpus=2, wait=30.0)))
            except grpc.RpcError as e:
                errs.append(e)
        t1 = threading.Thread(target=ask, args=(first, []))
        t1.start()
        wait_for(lambda: len(cluster.get_prefix(cluster.keys.queue())) == 2, LIVENESS_S, "the gang reserves a and b")
        before = sorted(kv.key for kv in cluster.get_prefix(cluster.keys.gang_queue())) + \
            sorted(kv.key for kv in cluster.get_prefix(cluster.keys.queue()))
        cluster.stop_coordinator(first)
        t1.join(LIVENESS_S)
        answers: list[object] = []
        t2 = threading.Thread(target=ask, args=(second, answers))
        t2.start()
        owner = cluster.service(second).replica_id
        wait_for(lambda: all(owner.encode() in kv.value for kv in cluster.get_prefix(cluster.keys.gang_queue())),
                 LIVENESS_S, "the second replica serves the entry")
        after = sorted(kv.key for kv in cluster.get_prefix(cluster.keys.gang_queue())) + \
            sorted(kv.key for kv in cluster.get_prefix(cluster.keys.queue()))
        assert after == before, "the retry keeps the gang's rank: its entry and reservations keep their keys"
        held.release()
        t2.join(LIVENESS_S)
        assert answers, errs
        assert sorted({h for h, _ in parts(cluster, answers[0].lease.id)}) == ["a", "b"]  # type: ignore[attr-defined]


def test_a_request_that_ends_before_the_gangs_earliest_start_backfills_its_reserved_gpus_and_others_wait(
        cluster: Cluster) -> None:
    for host in ("a", "b"):
        cluster.start_node(host, "1x16GiB")
    addr = cluster.start_coordinator()
    stub = coordinator_stub(addr)
    with Client(addr, agent="holder", host="b") as holder, Client(addr, agent="big", host="a") as g, \
            Client(addr, agent="small", host="a") as small:
        held = holder.acquire(vram_mb=16 * 1024, time_limit=600)   # host b is busy for 10 minutes at most
        answers: list[object] = []
        t = threading.Thread(target=lambda: answers.append(stub.Acquire(gang(g, "big", "g", gpus=1, wait=30.0))))
        t.start()
        wait_for(lambda: [kv for kv in cluster.get_prefix(cluster.keys.queue("a")) if b'"start_after":0.0' not in kv.value],
                 LIVENESS_S, "the gang reserves host a with a known earliest start")
        # status shows the reservation's earliest start: b's lease ends by its time limit (plus the margin).
        entry, = stub.GetStatus(pb.GetStatusRequest(host="a")).hosts[0].queue
        assert entry.hosts == 2 and list(entry.reserve) and entry.start_after_unix > time.time() + 500
        # Host a's GPU is free but reserved: a request without a time limit waits its turn ...
        with pytest.raises(errors.ResourceExhausted):
            small.acquire(vram_mb=1024, wait=0)
        # ... one that is gone well before the gang can start is backfilled there.
        backfill = small.acquire(vram_mb=1024, time_limit=60)
        assert backfill.host == "a"
        # One that would still run at the gang's start is not.
        with pytest.raises(errors.ResourceExhausted):
            small.acquire(vram_mb=1024, time_limit=3600, wait=0)
        backfill.release()
        held.release()
        t.join(LIVENESS_S)
        assert answers, "the gang is granted once host b is free"
