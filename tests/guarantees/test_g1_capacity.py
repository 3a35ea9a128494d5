"""50 concurrent clients race on one 16 GiB GPU; the history checker then replays every etcd revision."""
from __future__ import annotations

import asyncio
import random

import pytest

from agent_client import AsyncClient, errors
from tests.harness import Cluster, LoopThread
from tests.history import check_store

pytestmark = pytest.mark.integration

SIZES = (512, 1024, 2048, 3000, 4096, 6000)


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
