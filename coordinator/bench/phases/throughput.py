"""P3: acquire+release pairs/s of many agents over simulated hosts, with 1, 2, 3... replicas, against raw
compare-and-put txns/s of as many writers."""
from __future__ import annotations

import asyncio
import subprocess
import time

from agent_client import AsyncClient
from coordinator.bench import baselines, eventloop, load
from coordinator.bench.report import Figures, Line, line
from coordinator.bench.rig import cpu_seconds, rig
from coordinator.node.fake_hosts import fake_host_names


def phase_p3(seconds: float, agents: int, hosts: int, replicas: tuple[int, ...], out: Figures) -> list[Line]:
    """P3 with 1, 2, 3... replicas: replicas join one by one, and the agents are spread over them (each host
    is admitted by its owning replica; the others forward)."""
    results: dict[int, tuple[float, float]] = {}
    with rig() as r:
        r.node("p3", "8x80GiB", fake_hosts=hosts)
        names = fake_host_names("p3", hosts)
        coords: list[tuple[subprocess.Popen[bytes], str]] = []
        for count in replicas:
            while len(coords) < count:
                coords.append(r.coordinator())
            time.sleep(0.5 if len(coords) > 1 else 0)   # the newcomer's registration reaches every mirror

            async def ours() -> tuple[float, float]:
                clients = [AsyncClient(coords[i % len(coords)][1], agent=f"a{i}", host=names[i % len(names)])
                           for i in range(agents)]
                await asyncio.gather(*(c.connect() for c in clients))
                await load.pairs(clients, min(1.0, seconds / 4))
                cpu0 = sum(cpu_seconds(p.pid) for p, _ in coords)
                t0 = time.perf_counter()
                pairs, _, _ = await load.pairs(clients, seconds)
                wall = time.perf_counter() - t0
                cpu = sum(cpu_seconds(p.pid) for p, _ in coords) - cpu0
                await load.close(clients)
                return pairs / wall, cpu / max(1, pairs)
            results[count] = eventloop.run(ours())

        base = eventloop.run(baselines.cas_rate(r.ep, agents, seconds))
    out["p3"] = {"raw_cas_txn_s": base, "agents": agents, "hosts": hosts,
                 "by_replicas": {str(n): {"pairs_s": rate, "coordinators_cpu_ms_per_pair": cpu * 1e3}
                                 for n, (rate, cpu) in results.items()}}
    return [line("P3", f"pairs/s, {agents} agents, {hosts} hosts x 8 GPUs, {n} replica{'s' if n > 1 else ''}",
                 rate, "/s", base, f"raw compare-and-put txn/s, {agents} writers", ">= 0.5", lambda x: x >= 0.5)
            for n, (rate, _cpu) in results.items()]
