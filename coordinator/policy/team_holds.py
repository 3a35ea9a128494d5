"""What holds a request back for its team in a host's round (``planner.py``, "G2 with teams"): its team's limit
(G11, ``over_team_limit``), or its team's fair share of the idle capacity while other teams wait to borrow on the
same host (issue 33 point 3, docs/teams.md "Fair share", ``over_share``). Pure: reads the round's items and plan."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from coordinator.policy.admission import GpuView
from coordinator.policy.decide import Grant, Item, Request, Waits
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
    state, charged = rnd.ctx.teams, _charged(it.req, decision)
    if state is None or charged is None:
        return None
    return team_limit(state, rnd.view, it.agent, charged[1], rnd.team_used)


def _charged(req: Request, decision: object) -> tuple[list[GpuView], int] | None:
    """The GPUs a decision is about and what it charges the team: a new grant's GPUs and its charge, or, for a
    request that does not fit yet, its candidates and the least it could be charged on them; None otherwise."""
    if isinstance(decision, Grant) and decision.existing is None:
        gpus = list(decision.gang or ((decision.gpu,) if decision.gpu is not None else ()))
        return gpus, grant_charge_mb(gpus, req.vram_mb, req.exclusive)
    if isinstance(decision, Waits):
        return list(decision.candidates), least_charge_mb(decision.candidates, req.vram_mb, req.gpu_count,
                                                          req.exclusive)
    return None


def over_share(rnd: Round[Any], it: Item[Any], decision: object) -> str | None:
    """Why ``it`` waits for its team's fair share of the idle capacity (``team_admission.share_refusal``), or
    None: a new grant, or for a request that does not fit yet the least it could be charged, would take its team
    past its share while a request of another team waits here that could take that room. A waiter counts while
    it is queued (or a new call with a wait), not granted, answered, leaving or held for its team or a cordon in
    this round, its own team's limit allows it, and its GPUs' need fits the GPUs in question (its VRAM per GPU
    on one of them, or as many whole GPUs as the host has): one that could not be granted holds nobody back."""
    state, charged = rnd.ctx.teams, _charged(it.req, decision)
    if state is None or state.borrowable_mb is None or charged is None or not charged[0]:
        return None
    gpus, charge = charged
    members, plan, host_gpus = state.membership, rnd.out, list(rnd.view.gpus.values())
    out = {x.id for x in plan.new_leases} | set(plan.team_waits) | set(plan.cordon_waits)
    answered = {id(c) for c, _ in plan.refusals} | {id(c) for c, _ in plan.failures}
    room = max(g.usable_mb for g in gpus)
    waiting: dict[str, int] = {}
    for x in rnd.items:
        if x is it or x.req.lease_id in out or (x.call is not None and id(x.call) in answered):
            continue
        if x.rank in rnd.displaced or rnd._leaving(x) or (x.entry is not None and x.entry.multi_host):
            continue
        if x.entry is None and (x.call is None or x.call.deadline <= rnd.now):
            continue
        if (x.req.exclusive and x.req.gpu_count > len(host_gpus)) or (not x.req.exclusive and x.req.vram_mb > room):
            continue    # it could not take this room
        least = least_charge_mb(host_gpus, x.req.vram_mb, x.req.gpu_count, x.req.exclusive)
        if team_limit(state, rnd.view, x.agent, least, rnd.team_used) is not None:
            continue    # its own team's limit holds it back
        team = members.team_of(x.agent)
        waiting[team] = min(waiting.get(team, least), least)
    if not waiting:
        return None
    return share_refusal(state, members.team_of(it.agent), rnd.team_used, charge, waiting)
