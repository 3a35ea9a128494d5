"""Fair share over time (issue 33 point 3, docs/teams.md "Fair share"): each team's factor from its decayed usage
against its weight. Pure: no I/O."""
from __future__ import annotations

from typing import Iterable, Mapping

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


def borrow_shares(membership: Membership, fair: Mapping[str, float], contenders: Iterable[str]) -> dict[str, float]:
    """Each contender's share of the capacity beyond the quotas (docs/teams.md "Fair share"): its weight times
    its factor, against the same over every team that borrows or waits to borrow, s = w·F / Σ w·F."""
    names = sorted(set(contenders))
    weighted = {n: membership.team(n).weight * fair.get(n, 1.0) for n in names}
    total = sum(weighted.values())
    return {n: (w / total if total > 0 else 1.0 / len(names)) for n, w in weighted.items()}
