"""Reads that cannot crash etcd and have no size limit: a snapshot is Ranges at one revision (never a
read-only transaction), prefix reads come in pages, and ``commit`` refuses a transaction without a write."""
from __future__ import annotations

import logging
from typing import Any, Iterator

import grpc
import pytest

import coordinator.etcd.store as store_module
from agent_client import Client
from agent_client import errors as client_errors
from agent_client.api import coordinator_pb2 as pb
from agent_client.api import coordinator_pb2_grpc as pb_grpc
from coordinator import errors
from coordinator.etcd.process import EtcdCluster
from coordinator.etcd.store import Store
from coordinator.txn import Delete, Exists, Get, Put, Range, Txn
from tests.support.cluster import Cluster, EtcdEndpoint
from tests.support.etcd_calls import read_only, record_etcd_calls
from tests.support.waiting import LIVENESS_S, LoopThread, wait_for

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def own_etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdCluster]:
    # Its own etcd: these tests compact, which would take the history other tests' checkers read.
    with EtcdCluster(1, base_dir=tmp_path_factory.mktemp("reads-etcd")) as cluster:
        yield cluster


def test_a_snapshot_is_ranges_at_one_revision_never_a_transaction(own_etcd: EtcdCluster, lt: LoopThread) -> None:
    calls = record_etcd_calls()

    async def go() -> None:
        async with Store(own_etcd.endpoints, channel=calls.channel) as s:
            await s.put(b"/one/a", b"1")
            for i in range(3):
                await s.put(b"/one/b/%d" % i, b"x")
            calls.calls.clear()
            snap = await s.snapshot([Range(b"/one/a"), Range(b"/one/b/", prefix=True), Range(b"/none")])
            assert [len(r) for r in snap.ranges] == [1, 3, 0]
            assert await s.get(b"/one/a") is not None and len((await s.get_prefix(b"/one/")).kvs) == 4
    lt.run(go())
    assert calls.of("Txn") == [], "a read went out as a transaction"
    ranges = calls.of("Range")
    assert len(ranges) == 5
    # The first range fixes the revision (linearizable, "now"); the others are read at that revision.
    assert ranges[0].revision == 0 and not ranges[0].serializable
    assert len({r.revision for r in ranges[1:3]}) == 1 and ranges[1].revision > 0


def test_pages_of_a_prefix_read_are_all_at_the_first_pages_revision(own_etcd: EtcdCluster, lt: LoopThread,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(store_module, "PAGE_KEYS", 7)
    monkeypatch.setattr(store_module, "PAGE_KEYS_MAX", 7)
    calls = record_etcd_calls()
    prefix = b"/paged/"
    written: dict[bytes, int] = {}

    async def go() -> None:
        async with Store(own_etcd.endpoints, channel=calls.channel) as s, Store(own_etcd.endpoints) as writer:
            for i in range(50):
                written[prefix + b"%03d" % i] = await s.put(prefix + b"%03d" % i, b"v")
            n = 50

            async def write_between_pages(name: str, req: Any) -> None:
                # Every page after the first: another key lands under the prefix, before and after it.
                nonlocal n
                if name == "Range" and req.revision:
                    for key in (prefix + b"%03d" % n, prefix + b"!%03d" % n):
                        written[key] = await writer.put(key, b"late")
                    n += 1
            calls.before = write_between_pages
            snap = await s.get_prefix(prefix)
            calls.before = None
            got = [kv.key for kv in snap.kvs]
            assert got == sorted(k for k, rev in written.items() if rev <= snap.revision)
            assert len(got) == 50 and len(written) > 50, "writes between pages must not show in the read"
    lt.run(go())
    assert len(calls.of("Range")) >= 50 // 7 + 1


def test_the_pages_of_a_long_read_double_up_to_the_largest_page(own_etcd: EtcdCluster, lt: LoopThread,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """etcd counts every key left in the range for each page: a read of 200,000 keys in pages of 1,024 cost it
    seconds. Pages grow from ``PAGE_KEYS`` to ``PAGE_KEYS_MAX``, and the read still returns every key once."""
    monkeypatch.setattr(store_module, "PAGE_KEYS", 4)
    monkeypatch.setattr(store_module, "PAGE_KEYS_MAX", 16)
    calls = record_etcd_calls()
    prefix = b"/growing/"

    async def go() -> None:
        async with Store(own_etcd.endpoints, channel=calls.channel) as s:
            for i in range(60):
                await s.put(prefix + b"%03d" % i, b"v")
            snap = await s.get_prefix(prefix)
            assert [kv.key for kv in snap.kvs] == [prefix + b"%03d" % i for i in range(60)]
            await s.delete(prefix, prefix=True)
    lt.run(go())
    assert [r.limit for r in calls.of("Range") if r.range_end] == [4, 8, 16, 16, 16]


def test_a_page_larger_than_grpcs_message_limit_is_read_in_smaller_pages(own_etcd: EtcdCluster,
                                                                          lt: LoopThread) -> None:
    # Five 1.2 MB values: 6 MB under one prefix, more than gRPC's 4 MiB per response (issue 12 saw a replica
    # fail to start on "Received message larger than max (14339783 vs. 4194304)").
    big = b"x" * 1_200_000

    async def go() -> None:
        async with Store(own_etcd.endpoints) as s:
            for i in range(5):
                await s.put(b"/big/%d" % i, big)
            snap = await s.snapshot([Range(b"/big/", prefix=True), Range(b"/big/", prefix=True, keys_only=True)])
            assert [len(r) for r in snap.ranges] == [5, 5]
            assert all(kv.value == big for kv in snap.ranges[0])
            await s.delete(b"/big/", prefix=True)
    lt.run(go())


def test_a_snapshot_whose_revision_is_compacted_meanwhile_is_read_again(own_etcd: EtcdCluster,
                                                                          lt: LoopThread) -> None:
    calls = record_etcd_calls()

    async def go() -> None:
        async with Store(own_etcd.endpoints, channel=calls.channel) as s, Store(own_etcd.endpoints) as other:
            await s.put(b"/cmp/a", b"1")
            compacted: list[int] = []

            async def compact_once(name: str, req: Any) -> None:
                if name == "Range" and req.revision and not compacted:
                    rev = await other.put(b"/cmp/a", b"2")      # history moves on, then is compacted
                    await other.compact(rev)
                    compacted.append(rev)
            calls.before = compact_once
            snap = await s.snapshot([Range(b"/cmp/a"), Range(b"/cmp/", prefix=True)])
            calls.before = None
            assert compacted and snap.revision >= compacted[0]
            assert [kv.value for kv in snap.ranges[0]] == [kv.value for kv in snap.ranges[1]] == [b"2"]
    lt.run(go())


def test_commit_refuses_a_transaction_without_a_write(lt: LoopThread) -> None:
    async def go() -> None:
        s = Store(["127.0.0.1:1"], timeout=0.2, retry_for=0)   # nothing listens: a refusal sends nothing
        await s.connect()
        try:
            nested_read = Txn((), (Get(b"k"),))
            for compares, success, failure in [([Exists(b"k")], [], []), ([], [Get(b"k")], []),
                                               ([Exists(b"k")], [Get(b"k")], [Get(b"j")]),
                                               ([], [nested_read], [])]:
                with pytest.raises(ValueError, match="read-only"):
                    await s.commit(compares, success, failure)
            # A write in either branch makes it a write transaction: it is sent (and fails here, no etcd).
            for success, failure in [([Put(b"k", b"v")], []), ([Get(b"k")], [Delete(b"k")])]:
                with pytest.raises((errors.Unavailable, errors.Timeout)):
                    await s.commit([Exists(b"k")], success, failure)
        finally:
            await s.close()
    lt.run(go())


def test_no_read_only_transaction_leaves_a_working_coordinator(etcd: EtcdEndpoint, prefix: str) -> None:
    """The audit of every etcd call: a coordinator, a node daemon and an agent at work send Ranges for every
    read, and only transactions that write."""
    calls = record_etcd_calls()
    cluster = Cluster(etcd.endpoints, prefix, etcd_channel=calls.channel)
    try:
        cluster.start_node("h1", "1x8GiB")
        addr = cluster.start_coordinator()
        with Client(addr, agent="agent-a", host="h1") as c, Client(addr, agent="agent-b", host="h1") as d:
            lease = c.acquire(6000, priority=1)
            with pytest.raises(client_errors.ResourceExhausted):
                d.acquire(4000, priority=1)
            stub = pb_grpc.CoordinatorStub(grpc.insecure_channel(addr))
            assert stub.GetStatus(pb.GetStatusRequest(), timeout=10).hosts
            assert stub.GetPartition(pb.GetPartitionRequest(host="h1"), timeout=10)
            lease.release()
            d.acquire(4000).release()
    finally:
        cluster.close()
    txns = calls.of("Txn")
    assert txns and calls.of("Range")
    assert not [t for t in txns if read_only(t)], "a read-only transaction was sent"


def test_the_server_version_is_read_and_a_crashing_one_is_warned_about(own_etcd: EtcdCluster, lt: LoopThread,
                                                                        caplog: pytest.LogCaptureFixture) -> None:
    async def go() -> dict[str, str]:
        async with Store([*own_etcd.endpoints, "127.0.0.1:1"], timeout=1) as s:
            return await s.check_server_version()
    with caplog.at_level(logging.INFO, logger="coordinator.etcd.store"):
        versions = lt.run(go())
    assert versions == {own_etcd.endpoints[0]: "3.5.1", "127.0.0.1:1": ""}
    (warning,) = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert "3.5.1" in warning.getMessage() and "etcd-io/etcd#14110" in warning.getMessage()
    assert own_etcd.endpoints[0] in warning.getMessage()


def test_a_multi_host_gang_that_fits_is_granted_from_the_mirror_without_reading_the_fleet(etcd: EtcdEndpoint,
                                                                                          prefix: str) -> None:
    """A new multi-host gang that fits is decided from the replica's watch-fed mirror (``fleet_view.mirror_fleet``):
    no Range of the fleet (``gangqueue/`` is read only by a fleet snapshot) on the way to its grant; one that must
    wait is decided again from etcd (a stale copy never reserves)."""
    calls = record_etcd_calls()
    cluster = Cluster(etcd.endpoints, prefix, etcd_channel=calls.channel)
    gang_queue = cluster.keys.gang_queue()

    def fleet_reads() -> int:
        return sum(1 for r in calls.of("Range") if r.key == gang_queue)
    try:
        for host in ("h1", "h2", "h3"):
            cluster.start_node(host, "2x8GiB")
        addr = cluster.start_coordinator()
        mirror = cluster.service(addr).ctx.mirror

        def released() -> None:   # the replica's mirror has seen the release (else it would rightly read etcd)
            wait_for(lambda: not mirror.all_host_items("leases"), LIVENESS_S, "the release in the mirror")
        with Client(addr, agent="agent-a", host="h1") as c:
            c.acquire(0, exclusive=True, gpu_count=2, hosts=2).release()   # (the mirror is ready once one ran)
            released()
            before = fleet_reads()
            for _ in range(3):
                c.acquire(0, exclusive=True, gpu_count=2, hosts=2).release()
                released()
            from_mirror = fleet_reads() - before
            held = c.acquire(0, exclusive=True, gpu_count=2, hosts=3)
            with pytest.raises(client_errors.ResourceExhausted):
                c.acquire(0, exclusive=True, gpu_count=1, hosts=2, wait=0.5)
            from_etcd = fleet_reads() - before - from_mirror
            held.release()
    finally:
        cluster.close()
    assert from_mirror == 0, f"{from_mirror} fleet snapshots read for three gangs that fit"
    assert from_etcd >= 1, "a gang that had to wait was never decided from etcd"


def test_a_waiting_multi_host_gang_reads_no_fleet_snapshot_while_other_hosts_churn(etcd: EtcdEndpoint,
                                                                                    prefix: str) -> None:
    """A waiting gang is woken by every change of any host; decided from the mirror, a wait that writes nothing
    is settled there: fifty grants and releases on a third host cost it no read of the fleet from etcd."""
    calls = record_etcd_calls()
    cluster = Cluster(etcd.endpoints, prefix, etcd_channel=calls.channel)
    gang_queue = cluster.keys.gang_queue()
    try:
        for host, gpus in (("h1", "2x8GiB"), ("h2", "2x8GiB"), ("h3", "1x8GiB")):   # h3 never holds a part
            cluster.start_node(host, gpus)
        addr = cluster.start_coordinator()
        stub = pb_grpc.CoordinatorStub(grpc.insecure_channel(addr))
        with Client(addr, agent="holder", host="h1") as holder, Client(addr, agent="big", host="h2") as big, \
                Client(addr, agent="churn", host="h3") as churn:
            held = holder.acquire(1024, gpu=0)
            waiting = stub.Acquire.future(pb.AcquireRequest(
                session=pb.SessionRef(agent="big", session_id=big.session_id), request_id="g", hosts=2,
                gpu_count=2, exclusive=True, wait_seconds=120.0))
            wait_for(lambda: len(cluster.get_prefix(gang_queue)) == 1 and len(cluster.get_prefix(
                cluster.keys.queue())) == 2, LIVENESS_S, "the gang waits, reserving h1 and h2")
            churn.acquire(512).release()     # (the first settles what the entry's writing left behind)
            before = sum(1 for r in calls.of("Range") if r.key == gang_queue)
            for _ in range(50):
                churn.acquire(512).release()
            reads = sum(1 for r in calls.of("Range") if r.key == gang_queue) - before
            held.release()
            assert waiting.result(timeout=LIVENESS_S).lease.id
    finally:
        cluster.close()
    assert reads <= 2, f"the waiting gang read the fleet from etcd {reads} times over 50 grants elsewhere"


def test_a_replicas_mirror_is_loaded_without_the_usage_records(etcd: EtcdEndpoint, prefix: str) -> None:
    """The mirror keeps no usage record or rollup (``accounting/``): a week of records in a busy fleet is hundreds
    of thousands of keys, which a replica read at each start and watch reset only to drop them. Its first read
    covers every other key under the prefix, and the watch still carries the accounting kinds to the leader."""
    calls = record_etcd_calls()
    cluster = Cluster(etcd.endpoints, prefix, etcd_channel=calls.channel)
    accounting = cluster.keys.kind("accounting")
    try:
        cluster.start_node("h1", "1x8GiB")
        addr = cluster.start_coordinator()
        with Client(addr, agent="agent-a", host="h1") as c:
            c.acquire(1000).release()     # a usage record is written
            wait_for(lambda: cluster.get_prefix(cluster.keys.usage_record("")) != [], 30, "a usage record")
            c.acquire(1000).release()     # admitted from the mirror, which holds h1 and the session
    finally:
        cluster.close()
    root = cluster.keys.root()
    # The first page of each read with values (the test's own cluster reads the prefix's keys once, at its start).
    spans = [(r.key, r.range_end) for r in calls.of("Range") if r.range_end and r.key.startswith(root)
             and not r.revision and not r.keys_only]
    assert spans, "the replica's first read of its mirror"
    assert not [s for s in spans if s[0] <= accounting < s[1]], "a read of the whole prefix took the accounting"
    loaded = [s for s in spans if s[0] == root]
    assert loaded and all(s[1] == accounting for s in loaded)
