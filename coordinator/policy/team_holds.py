"""What holds a request back for its team in a host's round (``planner.py``, "G2 with teams"): its team's limit
(G11, ``over_team_limit``), or its team's fair share of the idle capacity while other teams wait to borrow on the
same host (issue 33 point 3, docs/teams.md "Fair share", ``over_share``). Pure: reads the round's items and plan."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from coordinator.policy.decide import Grant, Item, Waits
from coordinator.policy.team_admission import (
    grant_charge_mb,
    least_charge_mb,
    share_refusal,
    team_limit,
)

if TYPE_CHECKING:
    from coordinator.policy.writes import Round


def over_team_limit(rnd: Round[Any], it: Item[Any], decision: object) -> str | None:
    """Why this request waits for its team (G11; charged VRAM x GPUs), or None: a new grant would take its
    team above its limit, or, for a request that does not fit yet, even the least it could be charged
    would (``least_charge_mb``)."""
    state, req = rnd.ctx.teams, it.req
    if state is None:
        return None
    if isinstance(decision, Grant) and decision.existing is None:
        gpus = decision.gang or ((decision.gpu,) if decision.gpu is not None else ())
        charge = grant_charge_mb(gpus, req.vram_mb, req.exclusive)
    elif isinstance(decision, Waits):
        charge = least_charge_mb(decision.candidates, req.vram_mb, req.gpu_count, req.exclusive)
    else:
        return None
    return team_limit(state, rnd.view, req.agent, charge, rnd.team_used)


def over_share(rnd: Round[Any], it: Item[Any], decision: object) -> str | None:
    """Why ``it``'s new grant waits for its team's fair share, or None: the teams of the host's other waiters
    (each with the least its request would be charged) contend with it for the capacity beyond the quotas.
    A waiter counts while it is queued, or a new call with a wait, and not granted or answered in this round."""
    state = rnd.ctx.teams
    if state is None or state.borrowable_mb is None or not isinstance(decision, Grant) or decision.existing:
        return None
    members = state.membership
    gone = {x.id for x in rnd.out.new_leases} | {id(c) for c, _ in rnd.out.refusals}
    waiting: dict[str, int] = {}
    gpus = list(rnd.view.gpus.values())
    for x in rnd.items:
        if x is it or x.req.lease_id in gone or (x.call is not None and id(x.call) in gone):
            continue
        if x.entry is None and (x.call is None or x.call.deadline <= rnd.now):
            continue
        least = least_charge_mb(gpus, x.req.vram_mb, x.req.gpu_count, x.req.exclusive)
        team = members.team_of(x.agent)
        waiting[team] = min(waiting.get(team, least), least)
    if not waiting:
        return None
    granted = decision.gang or ((decision.gpu,) if decision.gpu is not None else ())
    return share_refusal(state, members.team_of(it.agent), rnd.team_used,
                         grant_charge_mb(granted, it.req.vram_mb, it.req.exclusive), waiting)
