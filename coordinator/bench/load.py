"""What agents do to gpucoord during a phase: timed acquires and acquire+release loops, through agent_client."""
from __future__ import annotations

import asyncio
import time
from typing import Awaitable, Callable

from agent_client import AsyncClient, Client


async def time_async(n: int, op: Callable[[], Awaitable[object]]) -> list[float]:
    """Seconds of each of ``n`` awaits of ``op()``, one after the other."""
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        await op()
        out.append(time.perf_counter() - t0)
    return out


def acquire_times(client: Client, n: int, warmup: int) -> list[float]:
    """Seconds of each of ``n`` acquires of a sync client (each released at once, untimed), after
    ``warmup`` untimed acquire+release pairs."""
    for _ in range(warmup):
        client.acquire(16).release()
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        lease = client.acquire(16)
        out.append(time.perf_counter() - t0)
        lease.release()
    return out


async def pairs(clients: list[AsyncClient], seconds: float, vram: int = 16) -> tuple[int, list[float], list[float]]:
    """Every client loops acquire+release for ``seconds``; returns pairs, acquire and release latencies."""
    stop_at = time.perf_counter() + seconds
    acq: list[float] = []
    rel: list[float] = []

    async def loop(c: AsyncClient) -> None:
        while time.perf_counter() < stop_at:
            t0 = time.perf_counter()
            lease = await c.acquire(vram)
            t1 = time.perf_counter()
            await lease.release()
            acq.append(t1 - t0)
            rel.append(time.perf_counter() - t1)
    await asyncio.gather(*(loop(c) for c in clients))
    return len(acq), acq, rel


async def clients(addr: str, agents: int, hosts: list[str], ttl: int | None = None) -> list[AsyncClient]:
    """``agents`` connected clients, agents ``a0``... spread round robin over ``hosts``."""
    cs = [AsyncClient(addr, agent=f"a{i}", host=hosts[i % len(hosts)], ttl=ttl) for i in range(agents)]
    await asyncio.gather(*(c.connect() for c in cs))
    return cs


async def close(clients: list[AsyncClient]) -> None:
    await asyncio.gather(*(c.close() for c in clients), return_exceptions=True)
