"""Commits shared across hosts (``coordinator/etcd/shared_commits.py``) against a real etcd: transactions that
arrive together go as one etcd transaction, each nested with its own compares; each part hears its own answer,
and the outcome is the one some serial order of the parts would give."""
from __future__ import annotations

import asyncio

from coordinator import errors
from coordinator.etcd.shared_commits import IN_FLIGHT, SharedCommits
from coordinator.etcd.store import Store
from coordinator.txn import Absent, ModRevisionIs, Put, Range
from tests.support.cluster import EtcdEndpoint
from tests.support.waiting import LoopThread


def test_parts_that_arrive_together_commit_at_one_revision_and_a_failed_compare_fails_only_its_part(
        etcd: EtcdEndpoint, prefix: str, lt: LoopThread) -> None:
    async def go() -> None:
        async with Store(etcd.endpoints) as s:
            shared = SharedCommits(s, 128, 64)
            taken = (prefix + "taken").encode()
            await s.put(taken, b"")
            keys = [(prefix + f"host{i}/ledger").encode() for i in range(10)]
            # Nine grants on nine hosts, and one whose compare fails (its key exists already).
            results = await asyncio.gather(*(shared.commit([Absent(k)], [Put(k, b"1")]) for k in keys[:9]),
                                           shared.commit([Absent(taken)], [Put(keys[9], b"1")]))
            assert [r.succeeded for r in results] == [True] * 9 + [False]
            assert shared.shared >= 1
            revisions = {r.revision for r in results[:9]}
            stored = await s.snapshot([Range(k) for k in keys])
            written = [r[0] for r in stored.ranges[:9]]
            # Parts that went together share their revision; every part committed is stored at its own.
            assert {kv.mod_revision for kv in written} == revisions and len(revisions) < 9
            assert stored.ranges[9] == ()
    lt.run(go())


def test_a_write_skew_pair_never_both_commits(etcd: EtcdEndpoint, prefix: str, lt: LoopThread) -> None:
    """x + y <= 1: each try reads both, compares both and sets one. Serially only one can win a round;
    etcd evaluates nested compares before any write, so both would win if they shared a transaction."""
    async def go() -> None:
        async with Store(etcd.endpoints) as s:
            shared = SharedCommits(s, 128, 64)
            for round_ in range(20):
                x, y = (prefix + f"{round_}/x").encode(), (prefix + f"{round_}/y").encode()
                await s.commit([], [Put(x, b"0"), Put(y, b"0")])
                snap = await s.snapshot([Range(x), Range(y)])
                revs = [r[0].mod_revision for r in snap.ranges]
                compares = [ModRevisionIs(x, revs[0]), ModRevisionIs(y, revs[1])]
                results = await asyncio.gather(shared.commit(compares, [Put(x, b"1")]),
                                               shared.commit(compares, [Put(y, b"1")]))
                assert sum(r.succeeded for r in results) == 1, results
                after = await s.snapshot([Range(x), Range(y)])
                assert sum(int(r[0].value) for r in after.ranges) == 1
    lt.run(go())


def test_a_part_on_an_expired_etcd_lease_fails_alone(etcd: EtcdEndpoint, prefix: str, lt: LoopThread) -> None:
    """etcd refuses a whole request for a put on an etcd_lease that is gone: the parts are then committed one by
    one, and only that part hears SessionGone."""
    async def go() -> None:
        async with Store(etcd.endpoints) as s:
            shared = SharedCommits(s, 128, 64)
            gone = await s.grant(5)
            await s.revoke(gone)
            keys = [(prefix + f"k{i}").encode() for i in range(4)]
            results = await asyncio.gather(*(shared.commit([], [Put(k, b"1")]) for k in keys[:3]),
                                           shared.commit([], [Put(keys[3], b"1", gone)]), return_exceptions=True)
            assert [type(r).__name__ for r in results[:3]] == ["TxnResult"] * 3
            assert isinstance(results[3], errors.SessionGone), results[3]
            stored = await s.snapshot([Range(k) for k in keys])
            assert [len(r) for r in stored.ranges] == [1, 1, 1, 0]
    lt.run(go())


def test_a_part_cancelled_before_it_was_sent_is_never_committed(etcd: EtcdEndpoint, prefix: str,
                                                                 lt: LoopThread) -> None:
    async def go() -> None:
        async with Store(etcd.endpoints) as s:
            shared = SharedCommits(s, 128, 64)
            shared._in_flight = IN_FLIGHT     # as if two were in flight: the next part waits
            later = asyncio.ensure_future(shared.commit([], [Put((prefix + "later").encode(), b"")]))
            await asyncio.sleep(0)     # the task's first step: its part is queued
            assert shared._pending
            later.cancel()
            await asyncio.gather(later, return_exceptions=True)
            assert later.cancelled() and not shared._pending
            shared._in_flight = 0
            await shared.commit([], [Put((prefix + "next").encode(), b"")])
            assert await s.get((prefix + "later").encode()) is None
            assert await s.get((prefix + "next").encode()) is not None
    lt.run(go())


def test_sharing_off_commits_each_alone(etcd: EtcdEndpoint, prefix: str, lt: LoopThread) -> None:
    async def go() -> None:
        async with Store(etcd.endpoints) as s:
            shared = SharedCommits(s, 128, 1)
            results = await asyncio.gather(*(shared.commit([], [Put((prefix + f"o{i}").encode(), b"")])
                                             for i in range(5)))
            assert len({r.revision for r in results}) == 5 and shared.shared == 0
    lt.run(go())
