"""MULTIHOST: agents looping 2-host x 4-GPU exclusive gangs over 8 hosts, against the same agents taking one
4-GPU exclusive gang on each of two hosts in a fixed host order (host A, then host B), in the same run:
pairs/s and acquire p50.

A multi-host gang is one Acquire (both hosts' parts granted together in one transaction, the hosts chosen
by the replica that receives it) and one Release; the baseline is what an agent does without them: a
session on each of its two hosts, a 4-GPU gang on host A and then one on host B (an order every agent
keeps), then both released, B first. Each agent's hosts are its own pair, and the hosts have 8 GPUs each
(64 in all, at most 32 taken at once), so nothing waits for room on either side: the figures are the cost
of the calls. The hosts are simulated by one process (``gpucoord node --fake-hosts``).

Then what multi-host gangs cost everyone else (issue 30: P1 and P4 within 10 % of the run without them): P1's
serial acquire p50 and P4's pairs/s and coordinator CPU per pair on two hosts of their own, with a 3-host gang
held and a 7-host gang waiting (reserving seven simulated hosts; the watch wakes it on every change P4 makes)
against the same without either, alternating in the same run (``phases/sides.py``).
"""
from __future__ import annotations

import asyncio
import time
from typing import Any

import grpc

from agent_client import AsyncClient, Client
from agent_client.api import coordinator_pb2 as pb
from agent_client.api import coordinator_pb2_grpc as pb_grpc
from coordinator.bench import eventloop, load
from coordinator.bench.phases.sides import alternate
from coordinator.bench.report import Figures, Line, line
from coordinator.bench.rig import rig
from coordinator.bench.stats import percentile
from coordinator.etcd.store import Store
from coordinator.keys import Keys
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


def phase_multihost(seconds: float, agents: int, out: Figures, n: int = 100, p4_agents: int = 16,
                    rounds: int = 3) -> list[Line]:
    """The MULTIHOST lines: pairs/s and acquire p50 of 2-host x 4-GPU exclusive gangs against one 4-GPU gang
    per host taken in a fixed host order, same agents, same run; then P1 and P4 with multi-host gangs present
    against without."""
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
        coord = _coord
        r.node(P1_HOST, "4x80GiB")     # (fewer GPUs than a part of the gangs: never one of their hosts)
        r.node(P4_HOST, "1x80GiB")
        present = _Present(addr, r.ep, names)
        sides = alternate(addr, coord.pid, P1_HOST, P4_HOST, n, seconds, p4_agents, rounds, present.enter,
                          present.leave)
    cost = {"none": sides[False].figures(), "gangs": sides[True].figures()}
    out["multihost"] = {"agents": agents, "hosts": HOSTS, "gpus": GPUS, "gpus_per_host": PER_HOST, **figures,
                        "p1_p4": cost}
    m, p = figures["multihost"], figures["per_host"]
    g, b = cost["gangs"], cost["none"]
    return [
        line("MULTIHOST", f"pairs/s, {agents} agents, 2-host x {PER_HOST}-GPU gangs", m["pairs_s"], "/s",
             p["pairs_s"], "a gang per host, host A then B, same agents", ">= 1", lambda x: x >= 1),
        line("MULTIHOST", f"acquire p50, {agents} agents, 2-host x {PER_HOST}-GPU gang", m["acquire_p50_ms"], "ms",
             p["acquire_p50_ms"], "both of a gang per host, host A then B", "<= 1", lambda x: x <= 1),
        line("MULTIHOST", "acquire p50 (P1), multi-host gangs held and waiting / none", g["acquire_p50_ms"], "ms",
             b["acquire_p50_ms"], "same agent without them, same run", "<= 1.1", lambda x: x <= 1.1),
        line("MULTIHOST", f"pairs/s, {p4_agents} agents on 1 GPU (P4), gangs / none", g["pairs_s"], "/s",
             b["pairs_s"], "same agents without them, same run", ">= 0.9", lambda x: x >= 0.9),
        line("MULTIHOST", f"coordinator CPU per pair, {p4_agents} agents (P4)", g["coordinator_cpu_ms_per_pair"],
             "ms", b["coordinator_cpu_ms_per_pair"], "same without them, same run", "<= 1.1", lambda x: x <= 1.1),
    ]


P1_HOST, P4_HOST = "mh-p1", "mh-p4"


class _Present:
    """The multi-host gangs of the measured side: a 3-host gang held, and a 7-host gang waiting that reserves
    seven whole hosts (of the eight simulated ones, three held: it cannot fit, and evicts nobody at its priority;
    seven hosts of 8 GPUs are as many as one etcd transaction can grant). P1's and P4's hosts have too few GPUs
    to be any part's."""

    def __init__(self, addr: str, ep: str, names: list[str]) -> None:
        self.addr, self.ep, self.names = addr, ep, names
        self._clients: list[Client] = []
        self._leases: list[Any] = []
        self._calls: list[Any] = []
        self._channels: list[grpc.Channel] = []
        self._rounds = 0

    def enter(self, on: bool) -> None:
        if not on:
            return
        holder = Client(self.addr, agent="mh-hold", host=self.names[0])
        waiter = Client(self.addr, agent="mh-wait", host=self.names[1]).connect()   # (its session id)
        self._clients += [holder, waiter]
        self._leases.append(holder.acquire(exclusive=True, gpu_count=8, hosts=3))
        channel = grpc.insecure_channel(self.addr)
        self._channels.append(channel)
        self._rounds += 1
        waiting = pb_grpc.CoordinatorStub(channel).Acquire.future(pb.AcquireRequest(
            session=pb.SessionRef(agent="mh-wait", session_id=waiter.session_id), request_id=f"mh-wait-{self._rounds}",
            hosts=len(self.names) - 1, gpu_count=8, exclusive=True, wait_seconds=600.0))
        self._calls.append(waiting)
        eventloop.run(_until_waiting(self.ep, waiting))

    def leave(self, on: bool) -> None:
        for call in self._calls:
            call.cancel()
        for lease in self._leases:
            lease.release()
        for x in [*self._channels, *self._clients]:
            x.close()
        self._clients, self._leases, self._calls, self._channels = [], [], [], []


async def _until_waiting(ep: str, waiting: Any) -> None:
    """Until the waiting gang's entry is in etcd (at most a minute)."""
    async with Store([ep]) as s:
        for _ in range(600):
            if (await s.get_prefix(Keys().gang_queue())).kvs:
                return
            if waiting.done():
                raise RuntimeError(f"the multi-host gang meant to wait was answered: {waiting.exception()!r}")
            await asyncio.sleep(0.1)
    raise RuntimeError("the waiting multi-host gang never wrote its entry")
