"""Which phases a bench command runs, and how big: the full sizes of the targets, or ``--quick``."""
from __future__ import annotations

import dataclasses
from typing import Callable

from coordinator.bench import eventloop
from coordinator.bench.phases.contended import phase_contended
from coordinator.bench.phases.gang import phase_gang
from coordinator.bench.phases.idle_reclaim import phase_idle_and_reclaim
from coordinator.bench.phases.latency import phase_latency
from coordinator.bench.phases.multihost import phase_multihost
from coordinator.bench.phases.notice import phase_p7
from coordinator.bench.phases.scale import phase_p5
from coordinator.bench.phases.teams import phase_teams
from coordinator.bench.phases.throughput import phase_p3
from coordinator.bench.report import Figures, Line


@dataclasses.dataclass(frozen=True)
class Sizes:
    n: int = 300                 # timed acquires for latency figures
    seconds: float = 8.0         # throughput windows
    levels: tuple[int, ...] = (1, 4, 16)
    p3_agents: int = 64
    p3_hosts: int = 16
    replicas: tuple[int, ...] = (1, 2, 3)
    p5_hosts: int = 1000
    p5_leases: int = 10_000
    idle_sessions: int = 1000
    reporting_hosts: int = 1000  # P8 again with this many hosts rewriting their usage reports (as daemons do)
    idle_s: float = 20.0
    ttl: int = 10
    samples: int = 5
    p7_n: int = 100
    gang_agents: int = 8
    multihost_agents: int = 4    # MULTIHOST: agents looping 2-host x 4-GPU gangs over 8 hosts
    teams_rounds: int = 3        # TEAMS: rounds of (no teams, teams), alternating which goes first


QUICK = Sizes(n=20, seconds=1.0, levels=(1, 16), p3_agents=16, p3_hosts=4, p5_hosts=20, p5_leases=40,
              idle_sessions=20, reporting_hosts=20, idle_s=1.0, ttl=2, samples=1, p7_n=5, teams_rounds=1)


PHASES = ("latency", "contended", "p3", "p5", "reclaim", "p7", "gang", "multihost", "teams")


def run(what: str, sizes: Sizes, out: Figures, profile: str = "",
        emit: Callable[[Line], None] = lambda _l: None) -> list[Line]:
    """Runs the phases ``what`` names (``all``, an alias, or one phase), in order; each line is emitted as
    soon as its phase ends. The figures behind the lines are added to ``out``."""
    lines: list[Line] = []
    phases: dict[str, Callable[[], list[Line]]] = {
        "latency": lambda: phase_latency(sizes.n, out),
        "contended": lambda: phase_contended(sizes.seconds, sizes.levels, out, profile),
        "p3": lambda: phase_p3(sizes.seconds, sizes.p3_agents, sizes.p3_hosts, sizes.replicas, out),
        "p5": lambda: phase_p5(sizes.n, sizes.p5_hosts, sizes.p5_leases, out),
        "reclaim": lambda: phase_idle_and_reclaim(sizes.idle_sessions, sizes.idle_s, sizes.ttl, sizes.samples, out,
                                                  sizes.reporting_hosts),
        "p7": lambda: phase_p7(sizes.p7_n, out),
        "gang": lambda: phase_gang(sizes.seconds, sizes.gang_agents, out),
        "multihost": lambda: phase_multihost(sizes.seconds, sizes.multihost_agents, out, sizes.n, sizes.levels[-1],
                                             sizes.teams_rounds),
        "teams": lambda: phase_teams(sizes.n, sizes.seconds, sizes.levels[-1], sizes.teams_rounds, out),
    }
    wanted = {"all": PHASES, "acquire": ("latency",), "p7": ("p7",), "p4": ("contended",)}.get(what, (what,))
    with eventloop.one_loop():
        for name in wanted:
            for line in phases[name]():
                lines.append(line)
                emit(line)
    return lines
