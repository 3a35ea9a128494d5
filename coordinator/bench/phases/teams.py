"""TEAMS: what teams cost admission (issue 22: P1 and P4 may not regress by more than 10 % with teams
configured). P1's serial acquire p50 and P4's acquire+release pairs/s and coordinator CPU per pair (16 agents
on one GPU), with three teams stored against the same without any, in the same run on the same coordinator.

The teams are stored through the operator RPCs (``SetTeam``, ``DeleteTeam``), with quotas and limits far above
what the phase takes, so nothing is refused or waits: the figures are the cost of the teams' accounting. Every
measuring agent is a member of a team with a limit, so each grant takes the limited path: the round reads the
teams' state from the mirror, checks the limit, and its transaction compares the teams and bumps the team's
ledger (``teamledgers/<team>``). A second limited team and an unlimited one have members that take no part,
as on a fleet where other teams exist.

The two sides alternate on the same agents and hosts (``phases/sides.py``).
"""
from __future__ import annotations

from coordinator.bench import eventloop
from coordinator.bench.phases.sides import SERIAL_AGENT, alternate
from coordinator.bench.report import Figures, Line, line
from coordinator.bench.rig import rig
from coordinator.etcd.store import Store
from coordinator.keys import Keys
from coordinator.records import load_record

P1_HOST, P4_HOST = "teams-p1", "teams-p4"
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


def phase_teams(n: int, seconds: float, agents: int, rounds: int, out: Figures) -> list[Line]:
    """The TEAMS lines: P1's acquire p50 and P4's pairs/s and CPU per pair, with teams / without."""
    bumps = 0
    with rig() as r:
        coord, addr = r.coordinator()
        r.node(P1_HOST, "8x80GiB")
        r.node(P4_HOST, "1x80GiB")
        before = 0

        def enter(on: bool) -> None:
            nonlocal before
            _set_teams(addr, on)
            before = eventloop.run(_ledger_seq(r.ep, MEASURED_TEAM))

        def leave(on: bool) -> None:
            nonlocal bumps
            if on:
                bumps += eventloop.run(_ledger_seq(r.ep, MEASURED_TEAM)) - before
        measured = alternate(addr, coord.pid, P1_HOST, P4_HOST, n, seconds, agents, rounds, enter, leave)
    sides = {"none": measured[False], "teams": measured[True]}
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
