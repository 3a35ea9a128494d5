"""An operator in the nemesis load (issue 31): cordons, drains and uncordons the load's hosts at random through
random replicas while the agents run, so that the history checker's cordon rule (no grant on a host while its
``cordons/<host>`` key exists) is checked under every fault. Every call's outcome is recorded; at the end every
host is uncordoned (retried until a replica answers)."""
from __future__ import annotations

import asyncio
import dataclasses
import random
from typing import Any, Callable

import grpc

from agent_client.api import coordinator_pb2 as pb
from tests.support.rpcs import coordinator_stub

# What an operator's call may end with under faults: done, or the replica could not answer in time.
DOCUMENTED = {"OK", "UNAVAILABLE", "DEADLINE_EXCEEDED"}


@dataclasses.dataclass
class CordonReport:
    calls: list[tuple[str, str, str]] = dataclasses.field(default_factory=list)   # (action, host, outcome)

    def undocumented(self) -> list[tuple[str, str, str]]:
        return [c for c in self.calls if c[2] not in DOCUMENTED]

    def done(self, action: str) -> int:
        return sum(1 for a, _, o in self.calls if a == action and o == "OK")


async def _call(report: CordonReport, action: str, host: str, fn: Callable[[], Any]) -> bool:
    try:
        await asyncio.to_thread(fn)
        outcome = "OK"
    except grpc.RpcError as e:
        outcome = e.code().name
    report.calls.append((action, host, outcome))
    return outcome == "OK"


async def run_cordons(addrs: list[str], hosts: list[str], duration: float, seed: int,
                      report: CordonReport | None = None) -> CordonReport:
    report = report if report is not None else CordonReport()
    rng = random.Random(seed ^ 0x31)
    stubs = [coordinator_stub(a) for a in addrs]
    loop = asyncio.get_running_loop()
    end = loop.time() + duration

    def cordon(stub: Any, host: str, drain: bool) -> Callable[[], Any]:
        return lambda: stub.CordonHost(pb.CordonHostRequest(host=host, reason="nemesis", drain=drain,
                                                            grace_seconds=1.0), timeout=10)

    def uncordon(stub: Any, host: str) -> Callable[[], Any]:
        return lambda: stub.UncordonHost(pb.UncordonHostRequest(host=host), timeout=10)

    try:
        while loop.time() < end:
            await asyncio.sleep(rng.uniform(1.0, 3.0))      # the operator's pace, as the fault scheduler's
            host, drain = rng.choice(hosts), rng.random() < 0.3
            await _call(report, "drain" if drain else "cordon", host, cordon(rng.choice(stubs), host, drain))
            await asyncio.sleep(rng.uniform(0.5, 2.0))
            await _call(report, "uncordon", host, uncordon(rng.choice(stubs), host))
    finally:
        for host in hosts:       # the load must not end with a host held out of service
            until = loop.time() + 60
            while not await _call(report, "uncordon", host, uncordon(rng.choice(stubs), host)):
                if loop.time() > until:
                    raise AssertionError(f"no replica uncordoned {host} within 60 s")
                await asyncio.sleep(0.5)
    return report
