"""P1 and P4 measured twice in one run, with and without some condition (teams stored, multi-host gangs in the
fleet), on the same coordinator, agents and hosts: P1's serial acquire p50, and P4's acquire+release pairs/s
and coordinator CPU per pair (agents on one GPU). Machine load drifts over a run, so the two sides alternate
(without, with; then with, without; ...): P1 for ``2 * rounds`` rounds of ``n / 2`` acquires, then P4 for
``rounds`` rounds. Each side's figures pool its rounds: the p50 of all its timed acquires, its pairs over its
seconds, its coordinator CPU over its pairs."""
from __future__ import annotations

import dataclasses
import time
from typing import Callable

from agent_client import Client
from coordinator.bench import eventloop, load
from coordinator.bench.rig import cpu_seconds
from coordinator.bench.stats import percentile

SERIAL_AGENT = "bench-serial"     # P1's agent; P4's are a0, a1, ... (load.clients)


async def _contended(addr: str, host: str, agents: int, seconds: float, pid: int) -> tuple[int, float, float, list[float]]:
    """P4's loop: ``agents`` agents on the one GPU of ``host``; (pairs, wall s, coordinator CPU s, acquires)."""
    clients = await load.clients(addr, agents, [host])
    try:
        await load.pairs(clients, min(1.0, seconds / 4))    # warm up (and the mirror has the teams by then)
        cpu0 = cpu_seconds(pid)
        t0 = time.perf_counter()
        pairs, acq, _ = await load.pairs(clients, seconds)
        wall = time.perf_counter() - t0
        cpu = cpu_seconds(pid) - cpu0
    finally:
        await load.close(clients)
    return pairs, wall, cpu, acq


@dataclasses.dataclass
class Side:
    """One side's measurements, pooled over its rounds."""
    acquires: list[float] = dataclasses.field(default_factory=list)    # P1: serial acquires, s
    contended: list[float] = dataclasses.field(default_factory=list)   # P4: acquires under contention, s
    pairs: int = 0
    wall: float = 0.0
    cpu: float = 0.0

    def figures(self) -> dict[str, float]:
        return {"acquire_p50_ms": percentile(self.acquires, .5) * 1e3,
                "acquire_p99_ms": percentile(self.acquires, .99) * 1e3,
                "pairs_s": self.pairs / self.wall if self.wall else 0.0,
                "contended_acquire_p50_ms": percentile(self.contended, .5) * 1e3,
                "coordinator_cpu_ms_per_pair": self.cpu / max(1, self.pairs) * 1e3}


def _order(i: int) -> tuple[bool, bool]:
    """Which side goes first in round ``i``: without, then with, then with first, and so on."""
    return (False, True) if i % 2 == 0 else (True, False)


def alternate(addr: str, pid: int, p1_host: str, p4_host: str, n: int, seconds: float, agents: int, rounds: int,
              enter: Callable[[bool], None], leave: Callable[[bool], None] = lambda _: None) -> dict[bool, Side]:
    """Both sides' figures (True: with the condition). ``enter(side)`` sets the condition up (or takes it down)
    before each round of that side, ``leave(side)`` after; ``pid``: the coordinator's process."""
    sides = {False: Side(), True: Side()}

    def measure(side: bool, what: Callable[[Side], None]) -> None:
        enter(side)
        try:
            what(sides[side])
        finally:
            leave(side)

    # P1 is cheap: twice as many rounds of half as many acquires, so that its sides alternate more often.
    with Client(addr, agent=SERIAL_AGENT, host=p1_host) as serial:
        def p1(s: Side) -> None:
            s.acquires += load.acquire_times(serial, max(10, n // 2), warmup=20)
        for i in range(2 * rounds):
            for side in _order(i):
                measure(side, p1)

    def p4(s: Side) -> None:
        pairs, wall, cpu, acq = eventloop.run(_contended(addr, p4_host, agents, seconds, pid))
        s.pairs += pairs
        s.wall += wall
        s.cpu += cpu
        s.contended += acq
    for i in range(rounds):
        for side in _order(i):
            measure(side, p4)
    return sides
