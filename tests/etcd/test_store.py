"""The store contract (``coordinator.etcd.store``) against real etcd processes: snapshots, compare-and-set,
the shared keepalive stream, watches that resume after a disconnect or a compaction, and error
translation."""
from __future__ import annotations

import asyncio
import gc
import logging
from typing import Any

import pytest

from coordinator import errors
from coordinator.etcd.process import EtcdCluster
from coordinator.etcd.store import Store
from coordinator.txn import ModRevisionIs, Put, Range
from tests.faultlink import FaultLink
from tests.support.cluster import EtcdEndpoint
from tests.support.waiting import LoopThread, wait_for


def test_snapshot_reads_every_range_at_one_revision(etcd: EtcdEndpoint, prefix: str, lt: LoopThread) -> None:
    async def go() -> None:
        async with Store(etcd.endpoints) as s:
            a, b = (prefix + "a").encode(), (prefix + "b/").encode()
            await s.put(a, b"1")
            for i in range(3):
                await s.put(b + str(i).encode(), b"x")
            snap = await s.snapshot([Range(a), Range(b, prefix=True), Range(b"nope")])
            assert [len(r) for r in snap.ranges] == [1, 3, 0]
            assert snap.revision >= max(kv.mod_revision for r in snap.ranges for kv in r)
            # Compare-and-set: wins once on the revision it read, loses after that.
            rev = snap.ranges[0][0].mod_revision
            assert (await s.commit([ModRevisionIs(a, rev)], [Put(a, b"2")])).succeeded
            assert not (await s.commit([ModRevisionIs(a, rev)], [Put(a, b"3")])).succeeded
            assert (await s.get(a)).value == b"2"  # type: ignore[union-attr]
    lt.run(go())


def test_several_endpoints_may_be_names(etcd: EtcdEndpoint, prefix: str, lt: LoopThread) -> None:
    """A list of endpoints with a name in it (docker-compose.yml gives etcd-0:2379,etcd-1:2379,...): gRPC's
    ``ipv4:`` list takes addresses only, so the store resolves the names itself."""
    port = etcd.endpoints[0].rsplit(":", 1)[1]

    async def go() -> None:
        async with Store([f"localhost:{port}", etcd.endpoints[0]]) as s:
            await s.put((prefix + "named").encode(), b"1")
            assert (await s.get((prefix + "named").encode())).value == b"1"  # type: ignore[union-attr]
    lt.run(go())


def test_one_keepalive_stream_serves_many_etcd_leases(etcd: EtcdEndpoint, lt: LoopThread) -> None:
    async def go() -> None:
        async with Store(etcd.endpoints) as s:
            ids = [await s.grant(5) for _ in range(20)]
            ttls = await asyncio.gather(*(s.keepalive(i) for i in ids for _ in range(3)))
            assert all(t == 5 for t in ttls)
            ka = s._keepalive
            assert ka is not None and ka._task is not None and not ka._task.done()
            task = ka._task
            await asyncio.gather(*(s.keepalive(i) for i in ids))
            assert ka._task is task, "a refresh opened a second stream"
            await s.revoke(ids[0])
            assert await s.keepalive(ids[0]) == 0
            with pytest.raises(errors.SessionGone):
                await s.commit([], [Put(b"/store-test/x", b"1", ids[0])])
    lt.run(go())


def test_a_keepalive_stream_that_breaks_leaves_no_task_waiting_behind(etcd: EtcdEndpoint,
                                                                     caplog: pytest.LogCaptureFixture) -> None:
    """The link to etcd is reset under the shared keepalive stream again and again: each broken stream's request
    generator ends with it. (It waited on its queue until collected, and asyncio logged a task destroyed while
    pending and an aclose() of a running generator: the "never retrieved" lines of a replica cut from etcd.)"""
    link = FaultLink(etcd.endpoints)

    async def go() -> None:
        async with Store(link.endpoints, timeout=1.0) as s:
            etcd_lease = await s.grant(30)
            for _ in range(5):
                assert await s.keepalive(etcd_lease) > 0
                await asyncio.to_thread(link.cut, True)
                with pytest.raises(errors.GpucoordError):
                    await s.keepalive(etcd_lease, timeout=0.5)
                await asyncio.to_thread(link.heal)
            assert await s.keepalive(etcd_lease) > 0
            for _ in range(3):
                gc.collect()
                await asyncio.sleep(0.05)
            await s.revoke(etcd_lease)
    caplog.set_level(logging.ERROR, logger="asyncio")
    try:
        asyncio.run(go())
    finally:
        link.close()
    left = [r.getMessage() for r in caplog.records if r.name == "asyncio"]
    assert not left, left


def test_watch_resumes_after_etcd_restarts(tmp_path: Any, lt: LoopThread) -> None:
    cluster = EtcdCluster(1, base_dir=tmp_path).start()
    member = cluster.members[0]
    try:
        async def go() -> None:
            async with Store(cluster.endpoints, timeout=2, retry_for=20) as s:
                seen: list[bytes] = []
                got = asyncio.Event()

                async def consume() -> None:
                    async for batch in s.watch(b"/w/", start_revision=1):
                        seen.extend(ev.kv.key for ev in batch.events)
                        if b"/w/after" in seen:
                            got.set()
                            return
                task = asyncio.create_task(consume())
                await s.put(b"/w/before", b"1")
                member.kill()                                  # the watch's stream breaks
                await asyncio.get_running_loop().run_in_executor(None, member.start, cluster.members[0].name
                                                                 + "=" + member.peer_url)
                await asyncio.get_running_loop().run_in_executor(None, _wait_healthy, member)
                await s.put(b"/w/after", b"2")                 # Store retries reads, not this write: etcd is up
                await asyncio.wait_for(got.wait(), 20)
                await task
                assert seen == [b"/w/before", b"/w/after"], "an event was lost or repeated"
        lt.run(go(), timeout=90)
    finally:
        cluster.stop()


def _wait_healthy(member: Any) -> None:
    wait_for(member.healthy, 20, "etcd to come back")


def test_watch_reports_a_compaction_as_resync(tmp_path: Any, lt: LoopThread) -> None:
    # Its own etcd: compacting the shared one would take the history that other tests' checkers read.
    with EtcdCluster(1, base_dir=tmp_path) as cluster:
        async def go() -> None:
            async with Store(cluster.endpoints) as s:
                key = b"/c"
                first = await s.put(key, b"1")
                last = await s.put(key, b"2")
                await s._client.compact(last)
                async for batch in s.watch(key, prefix=False, start_revision=first):
                    assert not batch.events, "history below the compaction was delivered"
                    if batch.resync:
                        break
        lt.run(go())


def test_unreachable_etcd_is_unavailable(lt: LoopThread) -> None:
    from coordinator.etcd.process import free_port

    async def go() -> None:
        s = Store([f"127.0.0.1:{free_port()}"], timeout=0.5, retry_for=1)
        await s.connect()
        try:
            with pytest.raises((errors.Unavailable, errors.Timeout)):
                await s.snapshot([Range(b"/x")])
        finally:
            await s.close()
    lt.run(go())
