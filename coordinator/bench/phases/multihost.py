"""MULTIHOST: agents looping 2-host x 4-GPU exclusive gangs over 8 hosts, against the same agents taking one
4-GPU exclusive gang on each of two hosts in a fixed host order (host A, then host B), in the same run:
pairs/s and acquire p50.

A multi-host gang is one Acquire (both hosts' parts granted together in one transaction, the hosts chosen
by the replica that receives it) and one Release; the baseline is what an agent does without them: a
session on each of its two hosts, a 4-GPU gang on host A and then one on host B (an order every agent
keeps), then both released, B first. Each agent's hosts are its own pair, and the hosts have 8 GPUs each
(64 in all, at most 32 taken at once), so nothing waits for room on either side: the figures are the cost
of the calls. The hosts are simulated by one process (``gpucoord node --fake-hosts``).
"""
from __future__ import annotations

import asyncio
import time

from agent_client import AsyncClient
from coordinator.bench import eventloop, load
from coordinator.bench.report import Figures, Line, line
from coordinator.bench.rig import rig
from coordinator.bench.stats import percentile
from coordinator.node.fake_hosts import fake_host_names

HOSTS = 8
GPUS = "8x80GiB"
PER_HOST = 4
# A gang of the multi-host side waits (rather than fails) should a replica's view of the fleet lag a
# release: the figures then count the wait, as an agent would meet it.
WAIT_S = 30.0


async def _loop(a_side: list[AsyncClient], b_side: list[AsyncClient], seconds: float,
                multi: bool) -> tuple[int, list[float]]:
    """Every agent loops taking 4 whole GPUs on each of two hosts and giving them back, for ``seconds``: as
    one multi-host gang (through its session on host A), or as a gang on its host A and then one on its
    host B. Returns the pairs done and the acquire latencies (both hosts' GPUs held)."""
    stop_at = time.perf_counter() + seconds
    acq: list[float] = []

    async def one(on_a: AsyncClient, on_b: AsyncClient) -> None:
        while time.perf_counter() < stop_at:
            t0 = time.perf_counter()
            if multi:
                lease = await on_a.acquire(gpu_count=PER_HOST, exclusive=True, hosts=2, wait=WAIT_S)
                acq.append(time.perf_counter() - t0)
                await lease.release()
            else:
                first = await on_a.acquire(gpu_count=PER_HOST, exclusive=True)
                second = await on_b.acquire(gpu_count=PER_HOST, exclusive=True)
                acq.append(time.perf_counter() - t0)
                await second.release()
                await first.release()
    await asyncio.gather(*(one(a, b) for a, b in zip(a_side, b_side)))
    return len(acq), acq


def phase_multihost(seconds: float, agents: int, out: Figures) -> list[Line]:
    """The MULTIHOST line: pairs/s and acquire p50 of 2-host x 4-GPU exclusive gangs against one 4-GPU gang
    per host taken in a fixed host order, same agents, same run."""
    figures: dict[str, dict[str, float]] = {}
    with rig() as r:
        _coord, addr = r.coordinator()
        r.node("mh", GPUS, fake_hosts=HOSTS)
        names = fake_host_names("mh", HOSTS)
        # Agent i's host A is names[2i], its host B names[2i + 1] (round robin over the pairs when there are
        # more agents than pairs).
        hosts_a, hosts_b = names[0::2], names[1::2]

        async def measure(multi: bool) -> dict[str, float]:
            a_side = await load.clients(addr, agents, hosts_a)
            b_side = await load.clients(addr, agents, hosts_b)
            try:
                await _loop(a_side, b_side, min(1.0, seconds / 4), multi)     # warm up
                t0 = time.perf_counter()
                pairs, acq = await _loop(a_side, b_side, seconds, multi)
                wall = time.perf_counter() - t0
            finally:
                await load.close(a_side + b_side)
            return {"pairs_s": pairs / wall, "acquire_p50_ms": percentile(acq, .5) * 1e3,
                    "acquire_p99_ms": percentile(acq, .99) * 1e3}
        # Each side on fresh sessions with its own warm-up, the baseline first (as GANG).
        figures["per_host"] = eventloop.run(measure(False))
        figures["multihost"] = eventloop.run(measure(True))
    out["multihost"] = {"agents": agents, "hosts": HOSTS, "gpus": GPUS, "gpus_per_host": PER_HOST, **figures}
    m, p = figures["multihost"], figures["per_host"]
    return [
        line("MULTIHOST", f"pairs/s, {agents} agents, 2-host x {PER_HOST}-GPU gangs", m["pairs_s"], "/s",
             p["pairs_s"], "a gang per host, host A then B, same agents", ">= 1", lambda x: x >= 1),
        line("MULTIHOST", f"acquire p50, {agents} agents, 2-host x {PER_HOST}-GPU gang", m["acquire_p50_ms"], "ms",
             p["acquire_p50_ms"], "both of a gang per host, host A then B", "<= 1", lambda x: x <= 1),
    ]
