"""Processes that die with many sessions, in the nemesis load (issue 32, P6 at scale): a process opens ``SESSIONS``
sessions over the hosts, each takes a lease, keeps them all alive with one ``KeepAliveSessions`` message, and dies:
no keepalive and no close after it. Their sessions expire in one tick of the replica that keeps them (or of the one
that adopts them, if a fault takes that replica), and their keys go in shared transactions
(``replica/ended_together.py``) while the rest of the load and the faults go on. The history checker and the leak
check after the run judge what that left; each call's outcome is recorded."""
from __future__ import annotations

import asyncio
import dataclasses
import time

import grpc

from agent_client.api import coordinator_pb2 as pb
from agent_client.api import coordinator_pb2_grpc as pb_grpc

SESSIONS = 20
EVERY_S = 12.0
VRAM_MB = 256
CALL_S = 5.0
# What a call may answer under the nemesis's faults: anything else is a defect.
EXPECTED = {"OK", "UNAVAILABLE", "DEADLINE_EXCEEDED", "RESOURCE_EXHAUSTED", "FAILED_PRECONDITION", "NOT_FOUND",
            "CANCELLED"}


@dataclasses.dataclass
class MassDeathReport:
    outcomes: list[str] = dataclasses.field(default_factory=list)   # each call's gRPC code name
    died: int = 0            # sessions left to expire

    def unexpected(self) -> list[str]:
        return [x for x in self.outcomes if x not in EXPECTED]


async def die_with_sessions(addresses: list[str], hosts: list[str], duration_s: float, report: MassDeathReport,
                            ttl: int) -> None:
    """A process that dies with ``SESSIONS`` sessions every ``EVERY_S``, until ``duration_s`` has passed."""
    until = time.monotonic() + duration_s
    n = 0
    while time.monotonic() + EVERY_S < until:
        await asyncio.sleep(EVERY_S)
        n += 1
        await _live_and_die(addresses[n % len(addresses)], hosts, n, ttl, report)


async def _call(report: MassDeathReport, call: object) -> object | None:
    try:
        out = await call   # type: ignore[misc]
    except grpc.aio.AioRpcError as e:
        report.outcomes.append(e.code().name)
        return None
    report.outcomes.append("OK")
    return out


async def _live_and_die(addr: str, hosts: list[str], n: int, ttl: int, report: MassDeathReport) -> None:
    async with grpc.aio.insecure_channel(addr) as channel:
        stub = pb_grpc.CoordinatorStub(channel)
        refs = []
        for i in range(SESSIONS):
            agent = f"dies-{n}-{i}"
            opened = await _call(report, stub.OpenSession(pb.OpenSessionRequest(
                agent=agent, host=hosts[i % len(hosts)], ttl_seconds=ttl), timeout=CALL_S))
            if isinstance(opened, pb.OpenSessionResponse):
                refs.append(pb.SessionRef(agent=agent, session_id=opened.session_id))
        await asyncio.gather(*(_call(report, stub.Acquire(pb.AcquireRequest(
            session=ref, vram_mb=VRAM_MB, request_id="r", wait_seconds=1.0), timeout=CALL_S)) for ref in refs))
        if refs:
            stream = stub.KeepAliveSessions(iter([pb.KeepAliveSessionsRequest(seq=1, sessions=refs)]), timeout=CALL_S)
            try:
                async for _ in stream:
                    break
                report.outcomes.append("OK")
            except grpc.aio.AioRpcError as e:
                report.outcomes.append(e.code().name)
            stream.cancel()
        report.died += len(refs)
