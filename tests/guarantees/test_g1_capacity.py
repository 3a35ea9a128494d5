"""G1 capacity: at every etcd revision, on every GPU, the sum of live VRAM leases <= usable VRAM, and every
agent's leases on a GPU <= its partition's cap there (the caps: test_partitions.py).

Acquire and release through agent_client, best-fit placement, refusals, and races of concurrent clients
(50 of them on one GPU, through one or two replicas). Every test ends with the history checker, which
checks G1 at every revision of the test's etcd history.
"""
from __future__ import annotations

import asyncio
import random
from typing import Any

import pytest

from agent_client import AsyncClient, Client, errors
from tests.history import check_store
from tests.support.cluster import Cluster
from tests.support.waiting import LoopThread

pytestmark = pytest.mark.usefixtures("history_checked")

SIZES = (512, 1024, 2048, 3000, 4096, 6000)


def test_acquire_release_roundtrip(cluster: Cluster) -> None:
    cluster.start_node("h1", "2x16GiB")
    addr = cluster.start_coordinator()
    with Client(addr, agent="agent-a", host="h1") as c:
        with c.acquire(vram_mb=4096) as lease:
            assert lease.vram_mb == 4096 and lease.token == 1 and lease.gpu_uuid.startswith("GPU-sim-h1-")
            (stored,) = cluster.leases()
            assert stored.id == lease.id and stored.session_id == c.session_id
        assert cluster.leases() == []
        assert c.release(lease.id) is False  # idempotent


def test_best_fit_places_on_the_fullest_gpu_that_fits(cluster: Cluster) -> None:
    cluster.start_node("h1", "3x16GiB")
    addr = cluster.start_coordinator()
    with Client(addr, agent="agent-a", host="h1") as c:
        a = c.acquire(10_000, gpu=1)
        b = c.acquire(4_000, gpu=2)
        # Free: GPU 0 16384, GPU 1 6384, GPU 2 12384. 5000 fits everywhere; best fit leaves the least: GPU 1.
        x = c.acquire(5_000)
        assert x.gpu_index == 1
        # Free: GPU 0 16384, GPU 1 1384, GPU 2 12384. 6000 fits on 0 and 2: GPU 2.
        y = c.acquire(6_000)
        assert y.gpu_index == 2
        for lease in (a, b, x, y):
            lease.release()


def test_refused_when_full_and_invalid_when_it_can_never_fit(cluster: Cluster) -> None:
    cluster.start_node("h1", "1x8GiB")
    addr = cluster.start_coordinator()
    with Client(addr, agent="agent-a", host="h1") as c:
        c.acquire(4000)
        c.acquire(4000)
        with pytest.raises(errors.ResourceExhausted, match="vram_mb"):
            c.acquire(4000)
        with pytest.raises(errors.InvalidArgument, match="vram_mb"):
            c.acquire(9000)


def test_two_concurrent_5000_on_8192_exactly_one_granted(cluster: Cluster) -> None:
    cluster.start_node("h1", "1x8GiB")
    addrs = [cluster.start_coordinator(), cluster.start_coordinator()]
    lt = LoopThread()
    try:
        async def both() -> list[Any]:
            clients = [AsyncClient(addrs[i], agent=f"agent-{i}", host="h1") for i in range(2)]
            for c in clients:
                await c.connect()
            out = await asyncio.gather(*(c.acquire(5000) for c in clients), return_exceptions=True)
            for c in clients:
                await c.close()
            return out
        results = lt.run(both())
    finally:
        lt.close()
    granted = [r for r in results if not isinstance(r, BaseException)]
    refused = [r for r in results if isinstance(r, errors.ResourceExhausted)]
    assert len(granted) == 1 and len(refused) == 1, results


async def _agent(addr: str, n: int, rounds: int, seed: int, stats: dict[str, int]) -> None:
    rng = random.Random(seed)
    async with AsyncClient(addr, agent=f"agent-{n}", host="h1", ttl=10) as c:
        for _ in range(rounds):
            try:
                lease = await c.acquire(rng.choice(SIZES))
            except errors.ResourceExhausted:
                stats["refused"] += 1
                continue
            stats["granted"] += 1
            # Hold it across a few scheduling rounds so that grants overlap.
            for _ in range(rng.randint(0, 3)):
                await asyncio.sleep(0)
            await lease.release()


@pytest.mark.parametrize("replicas", [1, 2])
def test_50_clients_never_overcommit(cluster: Cluster, replicas: int) -> None:
    """50 concurrent clients race on one 16 GiB GPU; the history checker then replays every etcd revision."""
    cluster.start_node("h1", "1x16GiB")
    addrs = [cluster.start_coordinator() for _ in range(replicas)]
    stats = {"granted": 0, "refused": 0}
    clients = LoopThread()
    try:
        async def race() -> None:
            await asyncio.gather(*(_agent(addrs[i % replicas], i, 8, i, stats) for i in range(50)))
        clients.run(race(), timeout=240)
    finally:
        clients.close()
    assert stats["granted"] > 50 and stats["refused"] > 0, stats
    assert cluster.leases() == []
    report = cluster.lt.run(check_store(cluster.store, cluster.keys))
    report.assert_ok()
    assert report.leases_created == stats["granted"]
    # The GPU really was contended: some revision had it (nearly) full.
    assert max(report.max_used.values()) > 16384 - max(SIZES)
