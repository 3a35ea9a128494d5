"""Fair share over time (issue 33 point 3, docs/teams.md "Fair share"): each team's factor from its decayed usage
against its weight. Pure: no I/O."""
from __future__ import annotations

from typing import Mapping

from coordinator.policy.teams import Membership


def fair_factors(decayed_s: Mapping[str, float], membership: Membership) -> dict[str, float]:
    """Each team's fair-share factor over time (docs/teams.md "Fair share"), from its decayed usage (GPU-seconds,
    ``accounting.decayed_gpu_seconds``): F = 2^(-(U / ΣU) / (w / Σw)) over the teams with usage or a record,
    Slurm's classic factor. 1 for every team when no team has usage (a half-life of 0: weight alone decides);
    lower the larger a team's share of the recent usage against its share of the weights; never 0 (a floor of
    2^-60)."""
    names = set(decayed_s) | set(membership.teams)
    used = {n: max(0.0, float(decayed_s.get(n, 0.0))) for n in names}
    total = sum(used.values())
    if not names or total <= 0:
        return {n: 1.0 for n in names}
    weights = {n: membership.team(n).weight for n in names}
    wsum = sum(weights.values())
    return {n: 2.0 ** -min(60.0, (used[n] / total) / (weights[n] / wsum)) for n in names}
