"""P7: from a release to the waiter's grant, and from a higher-priority request to the victim's eviction
notice, p99."""
from __future__ import annotations

import asyncio
import time

from agent_client import AsyncClient, EvictionNotice
from coordinator.bench import eventloop
from coordinator.bench.report import Figures, Line, line
from coordinator.bench.rig import rig
from coordinator.bench.stats import percentile
from coordinator.etcd.store import Store
from coordinator.keys import Keys


def phase_p7(n: int, out: Figures) -> list[Line]:
    with rig() as r:
        _coord, addr = r.coordinator("--grace", "30")
        r.node("bench", "1x16GiB")

        async def run() -> tuple[list[float], list[float]]:
            async with Store([r.ep]) as store, AsyncClient(addr, agent="holder", host="bench") as holder, \
                    AsyncClient(addr, agent="waiter", host="bench") as waiter:
                queue_prefix = Keys().queue("bench")

                async def queued() -> None:
                    while not (await store.get_prefix(queue_prefix)).kvs:  # noqa: ASYNC110 - polls etcd for the queue entry, with the phase's deadline
                        await asyncio.sleep(0.001)
                promote, notice = [], []
                for _ in range(n):
                    held = await holder.acquire(16384, preemptible=False)
                    task = asyncio.create_task(waiter.acquire(16384, wait=10))
                    await asyncio.wait_for(queued(), 10)
                    t0 = time.perf_counter()
                    await held.release()
                    lease = await task
                    promote.append(time.perf_counter() - t0)
                    await lease.release()
                for _ in range(n):
                    victim = await holder.acquire(16384, priority=0)
                    got = asyncio.Event()
                    stamp: list[float] = []

                    def on_evict(_notice: EvictionNotice) -> None:
                        stamp.append(time.perf_counter())  # noqa: B023 - this iteration's stamp list, awaited before the next
                        got.set()  # noqa: B023 - this iteration's event, awaited before the next
                    victim.on_evict(on_evict)
                    t0 = time.perf_counter()
                    task = asyncio.create_task(waiter.acquire(8192, priority=10, wait=10))
                    await asyncio.wait_for(got.wait(), 10)
                    notice.append(stamp[0] - t0)
                    await victim.release()
                    await (await task).release()
                return promote, notice
        promote, notice = eventloop.run(run())
    promote_ms = (percentile(promote, .5) * 1e3, percentile(promote, .99) * 1e3)
    notice_ms = (percentile(notice, .5) * 1e3, percentile(notice, .99) * 1e3)
    out["p7"] = {"release_to_grant_p50_ms": promote_ms[0], "release_to_grant_p99_ms": promote_ms[1],
                 "eviction_notice_p50_ms": notice_ms[0], "eviction_notice_p99_ms": notice_ms[1]}
    return [
        line("P7", "eviction notice p99", notice_ms[1], "ms", None, f"p50 {notice_ms[0]:.1f} ms",
             "<= 50 ms", lambda x: x <= 50),
        line("P7", "release -> grant p99", promote_ms[1], "ms", None, f"p50 {promote_ms[0]:.1f} ms",
             "<= 50 ms", lambda x: x <= 50),
    ]
