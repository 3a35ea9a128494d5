"""GANG: agents looping 2-GPU NVLink gangs on one 8-GPU host, against the same agents taking the same two
GPUs as two single leases in a fixed order (lower index first), in the same run: pairs/s and acquire p50.

A gang is one Acquire (both GPUs granted together in one transaction) and one Release; the baseline is
what an agent does without gangs: two Acquires, each pinned to a GPU of its NVLink pair, in an order every
agent keeps (so two agents never hold one GPU each of a pair waiting for the other), then two Releases.
Each agent asks 16 MiB a GPU, so nothing waits for room: the figures are the cost of the calls.
"""
from __future__ import annotations

import asyncio
import time

from agent_client import AsyncClient
from coordinator.bench import eventloop, load
from coordinator.bench.report import Figures, Line, line
from coordinator.bench.rig import rig
from coordinator.bench.stats import percentile

HOST = "gang"
GPUS = "8x80GiB:nvlink=0-1,2-3,4-5,6-7"
PAIRS = 4


async def _loop(clients: list[AsyncClient], seconds: float, gang: bool, vram: int = 16) -> tuple[int, list[float]]:
    """Every client loops taking two GPUs of one NVLink pair and giving them back, for ``seconds``: as one
    gang, or as two single leases in a fixed order. Returns the pairs done and the acquire latencies (both
    GPUs held)."""
    stop_at = time.perf_counter() + seconds
    acq: list[float] = []

    async def one(i: int, c: AsyncClient) -> None:
        low, high = 2 * (i % PAIRS), 2 * (i % PAIRS) + 1
        while time.perf_counter() < stop_at:
            t0 = time.perf_counter()
            if gang:
                lease = await c.acquire(vram, gpu_count=2, topology="nvlink")
                acq.append(time.perf_counter() - t0)
                await lease.release()
            else:
                first = await c.acquire(vram, gpu=low)
                second = await c.acquire(vram, gpu=high)
                acq.append(time.perf_counter() - t0)
                await second.release()
                await first.release()
    await asyncio.gather(*(one(i, c) for i, c in enumerate(clients)))
    return len(acq), acq


def phase_gang(seconds: float, agents: int, out: Figures) -> list[Line]:
    """The gang line: pairs/s and acquire p50 of 2-GPU NVLink gangs against two single leases a pair."""
    figures: dict[str, dict[str, float]] = {}
    with rig() as r:
        _coord, addr = r.coordinator()
        r.node(HOST, GPUS)

        async def measure(gang: bool) -> dict[str, float]:
            clients = await load.clients(addr, agents, [HOST])
            try:
                await _loop(clients, min(1.0, seconds / 4), gang)     # warm up
                t0 = time.perf_counter()
                pairs, acq = await _loop(clients, seconds, gang)
                wall = time.perf_counter() - t0
            finally:
                await load.close(clients)
            return {"pairs_s": pairs / wall, "acquire_p50_ms": percentile(acq, .5) * 1e3,
                    "acquire_p99_ms": percentile(acq, .99) * 1e3}
        # Each side on fresh sessions with its own warm-up, the baseline first.
        figures["singles"] = eventloop.run(measure(False))
        figures["gang"] = eventloop.run(measure(True))
    out["gang"] = {"agents": agents, "gpus": GPUS, **figures}
    g, s = figures["gang"], figures["singles"]
    return [
        line("GANG", f"pairs/s, {agents} agents, 2-GPU nvlink gangs", g["pairs_s"], "/s", s["pairs_s"],
             "two single leases in a fixed order, same agents", ">= 1", lambda x: x >= 1),
        line("GANG", f"acquire p50, {agents} agents, 2-GPU nvlink gang", g["acquire_p50_ms"], "ms",
             s["acquire_p50_ms"], "both of two single leases, fixed order", "<= 1", lambda x: x <= 1),
    ]
