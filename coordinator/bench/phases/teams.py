"""TEAMS: what teams cost admission (issue 22: P1 and P4 may not regress by more than 10 % with teams
configured). P1's serial acquire p50 and P4's acquire+release pairs/s and coordinator CPU per pair (16 agents
on one GPU), with three teams stored against the same without any, in the same run on the same coordinator.

The teams are stored through the operator RPCs (``SetTeam``, ``DeleteTeam``), with quotas and limits far above
what the phase takes, so nothing is refused or waits: the figures are the cost of the teams' accounting. Every
measuring agent is a member of a team with a limit, so each grant takes the limited path: the round reads the
teams' state from the mirror, checks the limit, and its transaction compares the teams and bumps the team's
ledger (``teamledgers/<team>``). A second limited team and an unlimited one have members that take no part,
as on a fleet where other teams exist.

Machine load drifts over a run, so the two sides alternate (none, teams; then teams, none; ...) on the same
agents and hosts: P1 for ``2 * rounds`` rounds of ``n / 2`` acquires, then P4 for ``rounds`` rounds. Each
side's figures pool its rounds: the p50 of all its timed acquires, its pairs over its seconds, its coordinator
CPU over its pairs.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Callable

from agent_client import Client
from coordinator.bench import eventloop, load
from coordinator.bench.report import Figures, Line, line
from coordinator.bench.rig import cpu_seconds, rig
from coordinator.bench.stats import percentile
from coordinator.etcd.store import Store
from coordinator.keys import Keys
from coordinator.records import load_record

P1_HOST, P4_HOST = "teams-p1", "teams-p4"
SERIAL_AGENT = "bench-serial"     # P1's agent; P4's are a0, a1, ... (load.clients)
GIB = 1024
# (name, members, quota MiB, limit MiB or None): the measuring agents are in "bench", which has a limit.
TEAMS = (
    ("bench", ("a*", SERIAL_AGENT), 512 * GIB, 1024 * GIB),
    ("infra", ("infra-*",), 64 * GIB, 128 * GIB),
    ("ops", ("ops-*",), 64 * GIB, None),
)
MEASURED_TEAM = "bench"


def _set_teams(addr: str, on: bool) -> None:
    """Stores the phase's teams (``on``) or deletes them, as an operator does (insecure: the rig has no TLS)."""
    import grpc

    from agent_client.api import coordinator_pb2 as pb
    from agent_client.api import coordinator_pb2_grpc as pb_grpc

    with grpc.insecure_channel(addr) as channel:
        stub = pb_grpc.CoordinatorStub(channel)
        for name, members, quota, limit in TEAMS:
            if on:
                stub.SetTeam(pb.SetTeamRequest(name=name, quota_mb=quota, limit_mb=-1 if limit is None else limit,
                                               members=pb.TeamMembers(patterns=members)), timeout=15)
            else:
                stub.DeleteTeam(pb.DeleteTeamRequest(name=name), timeout=15)


async def _ledger_seq(ep: str, team: str) -> int:
    """How many grant transactions have bumped ``team``'s ledger (0 when it has none)."""
    async with Store([ep]) as s:
        kvs = (await s.get_prefix(Keys().team_ledger(team))).kvs
    seq = load_record(kvs[0].value).get("seq", 0) if kvs else 0
    return seq if isinstance(seq, int) else 0


async def _contended(addr: str, agents: int, seconds: float, pid: int) -> tuple[int, float, float, list[float]]:
    """P4's loop: ``agents`` agents on the one GPU of P4's host; (pairs, wall s, coordinator CPU s, acquires)."""
    clients = await load.clients(addr, agents, [P4_HOST])
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
class _Side:
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


def _order(i: int) -> tuple[str, str]:
    """Which side goes first in round ``i``: none, then teams, then teams first, and so on."""
    return ("none", "teams") if i % 2 == 0 else ("teams", "none")


def phase_teams(n: int, seconds: float, agents: int, rounds: int, out: Figures) -> list[Line]:
    """The TEAMS lines: P1's acquire p50 and P4's pairs/s and CPU per pair, with teams / without."""
    sides = {"none": _Side(), "teams": _Side()}
    with rig() as r:
        coord, addr = r.coordinator()
        r.node(P1_HOST, "8x80GiB")
        r.node(P4_HOST, "1x80GiB")
        bumps = 0

        def measure(side: str, what: Callable[[_Side], None]) -> None:
            nonlocal bumps
            _set_teams(addr, side == "teams")
            before = eventloop.run(_ledger_seq(r.ep, MEASURED_TEAM))
            what(sides[side])
            if side == "teams":
                bumps += eventloop.run(_ledger_seq(r.ep, MEASURED_TEAM)) - before

        # P1 is cheap: twice as many rounds of half as many acquires, so that its sides alternate more often.
        with Client(addr, agent=SERIAL_AGENT, host=P1_HOST) as serial:
            def p1(s: _Side) -> None:
                s.acquires += load.acquire_times(serial, max(10, n // 2), warmup=20)
            for i in range(2 * rounds):
                for side in _order(i):
                    measure(side, p1)

        def p4(s: _Side) -> None:
            pairs, wall, cpu, acq = eventloop.run(_contended(addr, agents, seconds, coord.pid))
            s.pairs += pairs
            s.wall += wall
            s.cpu += cpu
            s.contended += acq
        for i in range(rounds):
            for side in _order(i):
                measure(side, p4)
    fig = {side: s.figures() for side, s in sides.items()}
    out["teams"] = {"teams": [t[0] for t in TEAMS], "agents": agents, "rounds": rounds, "ledger_bumps": bumps,
                    **fig}
    t, b = fig["teams"], fig["none"]
    return [
        line("TEAMS", "acquire p50 (P1), 3 teams stored / none", t["acquire_p50_ms"], "ms", b["acquire_p50_ms"],
             "same agent without teams, same run", "<= 1.1", lambda x: x <= 1.1),
        line("TEAMS", f"pairs/s, {agents} agents on 1 GPU (P4), teams / none", t["pairs_s"], "/s", b["pairs_s"],
             "same agents without teams, same run", ">= 0.9", lambda x: x >= 0.9),
        line("TEAMS", f"coordinator CPU per pair, {agents} agents (P4)", t["coordinator_cpu_ms_per_pair"], "ms",
             b["coordinator_cpu_ms_per_pair"], "same without teams, same run", "<= 1.1", lambda x: x <= 1.1),
    ]
