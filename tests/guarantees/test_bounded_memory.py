"""A replica's memory is bounded by what is live, not by what it has seen: per-host admitters retire when
idle, and a session's cached identity goes when the session is closed or expires.

Counts structures (``CoordinatorService.tracked``), never RSS."""
from __future__ import annotations

import asyncio
from typing import Any, Awaitable, Callable, TypeVar

import pytest

from coordinator import errors
from coordinator.node.fake_hosts import fake_host_names, register_fake_hosts
from coordinator.replica.service import CoordinatorService
from tests.support.cluster import Cluster
from tests.support.waiting import wait_for

pytestmark = pytest.mark.integration
T = TypeVar("T")

HOSTS = 200
SESSIONS = 20_000
ACQUIRE_EVERY = 10      # every tenth session also acquires and releases (2,000 admissions over 200 hosts)
CONCURRENCY = 64


async def _churn(svc: CoordinatorService, hosts: list[str], count: int, acquire_every: int, offset: int) -> None:
    sem = asyncio.Semaphore(CONCURRENCY)

    async def one(i: int) -> None:
        async with sem:
            agent, host = f"agent-{i % 997}", hosts[i % len(hosts)]
            session_id, _ = await _again(lambda: svc.open_session(agent, host, 10, 0, "test"))
            info = await svc.session(agent, session_id)
            if i % acquire_every == 0:
                # A request id: an acquire answered UNAVAILABLE is asked again and gets the same lease (G6).
                lease = (await _again(lambda: svc.acquire(info, 16, "", 0, True, f"churn-{i}", 0.0)))[0]
                assert await _release(svc, info, lease.id)
            if i % 2:
                await _again(lambda: svc.close_session(info))
            else:   # its holder "died": the etcd_lease ends behind the replica's back (as at expiry)
                await _again(lambda: svc.store.revoke(info.etcd_lease))
    await asyncio.gather(*(one(offset + i) for i in range(count)))


async def _again(call: Callable[[], Awaitable[T]]) -> T:
    """``call()``, made again while it is answered UNAVAILABLE (etcd slow for a starved replica: G8's documented
    answer on a loaded machine, safe to retry for these calls: opening a session leaves nothing when it fails,
    an acquire carries its request id, closing and revoking are idempotent)."""
    while True:
        try:
            return await call()
        except errors.Unavailable:
            await asyncio.sleep(0.1)


async def _release(svc: CoordinatorService, info: Any, lease_id: str) -> bool:
    """Release, again while the answer is OutcomeUnknown: a starved replica (a loaded machine) may not see
    etcd settle a release in time, and a release is idempotent (G8's documented answers)."""
    retried = False
    while True:
        try:
            released = await svc.release(info, lease_id)
            return released or retried   # the retry may find it released by the first try
        except errors.OutcomeUnknown:
            retried = True
            await asyncio.sleep(0.1)


def _subset(have: dict[str, int], want: dict[str, int]) -> bool:
    return all(have.get(k) == v for k, v in want.items())


def test_churn_of_sessions_and_hosts_leaves_nothing_behind(cluster: Cluster) -> None:
    addr = cluster.start_coordinator()
    svc: CoordinatorService = cluster.coordinators[addr][1]
    svc.admitter_idle_s = 0.0      # retire at once when idle (production: 30 s)
    hosts = fake_host_names("mem", HOSTS)
    registration = cluster.lt.run(register_fake_hosts(cluster.store, cluster.keys, "mem", HOSTS, "1x16GiB"))
    try:
        wait_for(lambda: svc.mirror.get(cluster.keys.usage(hosts[-1])) is not None, 10, "the hosts in the mirror")
        # One admission per host first: each GPU's ledger is durable (bounded by the hosts, not the sessions).
        cluster.lt.run(_churn(svc, hosts, HOSTS, 1, 0), timeout=120)
        settled = {"admitters": 0, "sessions": 0, "streams": 0, "evictions": 0, "background": 0,
                   "mirror_buckets": HOSTS, "mirror_lease_index": 0}   # a bucket per host: its GPU ledger
        wait_for(lambda: _subset(svc.tracked(), settled), 15, "the warm-up's admitters and sessions dropped")
        start = svc.tracked()
        cluster.lt.run(_churn(svc, hosts, SESSIONS, ACQUIRE_EVERY, HOSTS), timeout=600)
        try:
            # Back to their starting count or below: a leak grows a count; a key the test does not own (the
            # replica's own registration or election key, renewed under a loaded machine) may go meanwhile.
            wait_for(lambda: all(n <= start[k] for k, n in svc.tracked().items()), 15,
                     "tracked structures back to their starting count")
        finally:
            print("start", start, "end", svc.tracked())
    finally:
        cluster.lt.run(registration.close())
