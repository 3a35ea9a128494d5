"""A load of agents (``run_load``/``LoadReport``) and a flood of calls by one identity (``flood``)."""
from __future__ import annotations

import asyncio
import dataclasses
import random
import time
from typing import Collection, Mapping, Sequence

import grpc

from agent_client import AsyncClient, errors
from agent_client.api import coordinator_pb2 as pb
from agent_client.api import coordinator_pb2_grpc as pb_grpc

# Agents doing random acquire/release cycles, each call's outcome and timing recorded: used by the replica
# tests (throughput with one and two replicas, waits answered on time) and the nemesis run (every call must
# end with a documented status; part of its agents ask for 2-GPU gangs). Agents are ``AsyncClient``s on one
# event loop.

# What a call may end with, and stay within the contract: a grant, or one of these documented statuses.
DOCUMENTED = {"ok", "ResourceExhausted", "Unavailable", "DeadlineExceeded", "SessionExpired", "FailedPrecondition"}


@dataclasses.dataclass
class LoadCall:
    agent: str
    wait_s: float
    elapsed_s: float
    outcome: str          # "ok" or the agent_client error class name
    host: str = ""
    ended_at: float = 0.0     # time.monotonic() when it was answered
    lease_id: str = ""        # the lease granted ("ok")
    gpu_count: int = 1        # a gang's GPUs
    exclusive: bool = False   # whole GPUs
    time_limit: float = 0.0   # the time limit it asked
    hosts: int = 1            # a multi-host gang's hosts (gpu_count on each)

    @property
    def late_s(self) -> float:
        """How long after its wait the call was answered (calls with a wait only)."""
        return self.elapsed_s - self.wait_s


@dataclasses.dataclass
class LoadReport:
    calls: list[LoadCall] = dataclasses.field(default_factory=list)
    releases: int = 0
    open_failures: list[str] = dataclasses.field(default_factory=list)
    expired: list[str] = dataclasses.field(default_factory=list)    # agents whose session was lost

    @property
    def granted(self) -> int:
        return sum(1 for c in self.calls if c.outcome == "ok")

    def outcomes(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for c in self.calls:
            out[c.outcome] = out.get(c.outcome, 0) + 1
        return out

    def waits(self) -> list[LoadCall]:
        """Calls with a wait that ended by the coordinator's answer (a grant or RESOURCE_EXHAUSTED)."""
        return [c for c in self.calls if c.wait_s > 0 and c.outcome in ("ok", "ResourceExhausted")]

    def max_late_s(self) -> float:
        return max((c.late_s for c in self.waits()), default=0.0)

    def answered_early(self, slack_s: float = 0.05) -> list[LoadCall]:
        """Waiters answered RESOURCE_EXHAUSTED before their wait was over, as the client counts it (from
        sending the call; the coordinator counts from its arrival, later): never, at any speed. ``slack_s``: a
        timer may fire a millisecond early (uvloop rounds to milliseconds)."""
        return [c for c in self.waits() if c.outcome == "ResourceExhausted" and c.late_s < -slack_s]

    def undocumented(self) -> list[LoadCall]:
        return [c for c in self.calls if c.outcome not in DOCUMENTED]


async def agent_loop(client: AsyncClient, report: LoadReport, until: float, rng: random.Random,
                     sizes: Sequence[int], waits: Sequence[float], hold_s: float,
                     low_priority: Collection[int] = (), gang: bool = False, base_priority: int = 0,
                     time_limit: float = 0.0, hold_past_limit: float = 0.0, hosts: int = 1) -> None:
    """Acquire/release cycles until ``until``; with ``gang``, each acquire is a 2-GPU gang: ``vram`` on each
    GPU, or one time in four two whole GPUs (``exclusive``, at priority -1, so that it waits behind the
    others instead of holding the queue's head). With ``time_limit``, each lease asks it and is held up to twice
    as long, so that about half of them are revoked at their limit (the release then finds them gone); with
    ``hold_past_limit`` too, one lease in four is held that long past its limit (only the revoke ends it in time:
    the history checker's time-limit rule sees one that outlives it). With ``hosts`` of 2 or more, each acquire is
    a multi-host gang of one GPU on each of ``hosts`` hosts (``vram``, or one time in four a whole GPU, at priority
    -1), always with a wait (the longest of ``waits``)."""
    while time.monotonic() < until:
        vram, wait = rng.choice(sizes), rng.choice(waits)
        gpu_count, exclusive = (2, rng.random() < 0.25) if gang else (1, False)
        if hosts > 1:
            gpu_count, exclusive, wait = 1, rng.random() < 0.25, max(waits)
        priority = base_priority + (-1 if vram in low_priority or exclusive else 0)
        t0 = time.monotonic()
        try:
            lease = await client.acquire(0 if exclusive else vram, wait=wait, priority=priority,
                                         gpu_count=gpu_count, exclusive=exclusive, time_limit=time_limit, hosts=hosts)
        except errors.GpucoordError as e:
            report.calls.append(LoadCall(client.agent, wait, time.monotonic() - t0, type(e).__name__, client.host,
                                         time.monotonic(), gpu_count=gpu_count, exclusive=exclusive,
                                         time_limit=time_limit, hosts=hosts))
            if isinstance(e, errors.SessionExpired):
                return
            if not isinstance(e, errors.ResourceExhausted):
                await asyncio.sleep(0.05)    # a fault: do not spin while it lasts
            continue
        report.calls.append(LoadCall(client.agent, wait, time.monotonic() - t0, "ok", client.host, time.monotonic(),
                                     lease.id, gpu_count, exclusive, time_limit, hosts))
        if time_limit and hold_past_limit and rng.random() < 0.25:
            await asyncio.sleep(time_limit + hold_past_limit)
        else:
            await asyncio.sleep(rng.uniform(0, 2 * time_limit if time_limit else hold_s))
        try:
            await lease.release()
            report.releases += 1
        except errors.GpucoordError:
            pass   # the lease goes with the session, or was evicted


async def run_load(addresses: Sequence[Sequence[str]], host: str | Sequence[str], duration_s: float, seed: int,
                   sizes: Sequence[int] = (2000, 4000, 6000), waits: Sequence[float] = (0.0, 0.5, 2.0),
                   hold_s: float = 0.02, agent_prefix: str = "agent", ttl: int = 10,
                   report: LoadReport | None = None, low_priority: Collection[int] = (),
                   gang_every: int = 0, priorities: Mapping[str, int] | None = None,
                   time_limits: Mapping[str, float] | None = None, hold_past_limit: float = 0.0,
                   multi_host: Collection[int] = ()) -> LoadReport:
    """One agent per entry of ``addresses`` (the replicas that agent talks to), each on ``host`` (or the
    hosts in turn), for ``duration_s`` seconds. Sessions are closed at the end. Requests of the sizes in
    ``low_priority`` ask with priority -1 (they wait behind the others instead of blocking them). With
    ``gang_every`` N, every Nth agent (``0``, ``N``...) asks for 2-GPU gangs (its hosts need 2 GPUs).
    ``priorities``: a base priority by agent name (0 for the others); ``time_limits``: a time limit by agent name
    (time limits, issue 31: see ``agent_loop``, as for ``hold_past_limit``); ``multi_host``: the indexes of the
    agents that ask for 2-host gangs instead (issue 30: see ``agent_loop``; the fleet needs two hosts)."""
    report = report or LoadReport()
    hosts = [host] if isinstance(host, str) else list(host)
    rng = random.Random(seed)
    clients = [AsyncClient(list(addrs), agent=f"{agent_prefix}-{i}", host=hosts[i % len(hosts)], ttl=ttl)
               for i, addrs in enumerate(addresses)]
    connected: list[AsyncClient] = []
    for c in clients:
        try:
            await c.connect()
            connected.append(c)
        except errors.GpucoordError as e:
            report.open_failures.append(f"{c.agent}: {e!r}")
    until = time.monotonic() + duration_s
    try:
        await asyncio.gather(*(agent_loop(c, report, until, random.Random(rng.random()), sizes, waits, hold_s,
                                          low_priority, gang=bool(gang_every) and clients.index(c) % gang_every == 0,
                                          base_priority=(priorities or {}).get(c.agent, 0),
                                          time_limit=(time_limits or {}).get(c.agent, 0.0),
                                          hold_past_limit=hold_past_limit,
                                          hosts=2 if clients.index(c) in multi_host else 1)
                               for c in connected))
    finally:
        for c in connected:
            if c.expired:
                report.expired.append(c.agent)
            try:
                await c.close()
            except errors.GpucoordError:
                pass
    return report


# -- a flood of calls by one identity (fair service) ----------------------------------------------------------

def flood(addr: str, ca: str, cert: str, key: str, agent: str, host: str, kind: str, count: int,
          concurrency: int = 32, seconds: float = 3600.0) -> dict[str, int]:
    """``count`` calls of ``kind`` by ``agent`` (its certificate), ``concurrency`` at a time, as fast as the
    coordinator answers, for at most ``seconds``: ``status`` (GetStatus of ``host``, where it holds a
    session), ``acquire`` (requests that never fit), ``open`` (OpenSession). Returns how many ended with each
    status code. Run it in a process of its own (``python -c``), so that its work is not the test's."""
    from coordinator.security.tls import TlsFiles, channel_credentials

    async def run() -> dict[str, int]:
        codes: dict[str, int] = {}
        creds = channel_credentials(TlsFiles(ca, cert, key))
        async with grpc.aio.secure_channel(addr, creds) as ch:
            stub = pb_grpc.CoordinatorStub(ch)
            sid = (await stub.OpenSession(pb.OpenSessionRequest(agent=agent, host=host, ttl_seconds=60),
                                          timeout=30)).session_id
            ref = pb.SessionRef(agent=agent, session_id=sid)
            calls = {"status": lambda: stub.GetStatus(pb.GetStatusRequest(host=host), timeout=30),
                     "acquire": lambda: stub.Acquire(pb.AcquireRequest(session=ref, vram_mb=1 << 29), timeout=30),
                     "open": lambda: stub.OpenSession(pb.OpenSessionRequest(agent=agent, host=host, ttl_seconds=5),
                                                      timeout=30)}
            left = count
            until = time.monotonic() + seconds

            async def worker() -> None:
                nonlocal left
                while left > 0 and time.monotonic() < until:
                    left -= 1
                    try:
                        await calls[kind]()
                        code = "OK"
                    except grpc.aio.AioRpcError as e:
                        code = e.code().name
                    codes[code] = codes.get(code, 0) + 1
            await asyncio.gather(*(worker() for _ in range(concurrency)))
        return codes
    return asyncio.run(run())
