"""An idle holder in the nemesis load (issue 31, docs/policies.md "Idle GPUs"): an agent that holds a lease on a GPU the
node reports at 0 % until it gets a notice (or for at most ``HOLD_S``), releases it and asks again, while the
replicas run with idle eviction on, so that the history checker's idle rule (no ``idle`` notice unless the usage
reports over the window show the lease's GPUs known and below the threshold) is checked under every fault. Every
call's outcome and every notice's reason are recorded."""
from __future__ import annotations

import asyncio
import dataclasses
import time

from agent_client import AsyncClient, errors
from tests.support.load import DOCUMENTED

HOLD_S = 15.0
IDLE_GPU = 0   # the GPU the nemesis's procs file reports at 0 % on the first host


@dataclasses.dataclass
class IdleReport:
    outcomes: list[str] = dataclasses.field(default_factory=list)   # each acquire's: ok or the error's name
    notices: list[str] = dataclasses.field(default_factory=list)    # the reason of each notice the holder got

    def undocumented(self) -> list[str]:
        return [x for x in self.outcomes if x not in DOCUMENTED]


async def hold_idle(addresses: list[str], host: str, duration_s: float, report: IdleReport, ttl: int) -> None:
    """Hold an idle lease on ``host``'s GPU ``IDLE_GPU`` over and over until ``duration_s`` has passed."""
    client = AsyncClient(addresses, agent="idler", host=host, ttl=ttl)
    until = time.monotonic() + duration_s
    try:
        await client.connect()
    except errors.GpucoordError as e:
        report.outcomes.append(type(e).__name__)
        return
    try:
        while time.monotonic() < until:
            try:
                lease = await client.acquire(1000, gpu=IDLE_GPU, wait=2.0)
            except errors.GpucoordError as e:
                report.outcomes.append(type(e).__name__)
                if isinstance(e, errors.SessionExpired):
                    return
                await asyncio.sleep(0.2)   # a fault: do not spin while it lasts
                continue
            report.outcomes.append("ok")
            end = min(until, time.monotonic() + HOLD_S)
            await asyncio.to_thread(lease.evicting.wait, max(0.0, end - time.monotonic()))   # (a threading.Event)
            if lease.evicting.is_set() and lease.notice is not None:
                report.notices.append(lease.notice.reason)
            try:
                await lease.release()
            except errors.GpucoordError:
                pass   # revoked meanwhile, or its session went
    finally:
        try:
            await client.close()
        except errors.GpucoordError:
            pass
