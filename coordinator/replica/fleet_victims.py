"""The victims of a waiting multi-host gang (issue 30 point 4): by priority over host sets (G3,
``policy/fleet.plan_gang_eviction``), only of its own team when teams are stored, else by reclaim (G11,
``policy/fleet_reclaim.py``): the fleet's leases as the teams charge them, the compares that keep a reclaim
decision true until it commits (``policy/reclaim_guard.py``, as for a host's round), and the reclaim notices a
waiting gang may no longer keep."""
from __future__ import annotations

from typing import Collection, Iterable, Mapping

from coordinator import clock
from coordinator.policy.fleet import (
    FleetHost,
    FleetRequest,
    FleetWait,
    plan_gang_eviction,
)
from coordinator.policy.fleet_reclaim import FleetReclaim, plan_gang_reclaim
from coordinator.policy.reclaim_guard import reclaim_guards
from coordinator.policy.team_admission import TeamState, charge_of
from coordinator.policy.teams import Charge, in_quota, stays_in_quota
from coordinator.records import EvictionRecord
from coordinator.replica.call import AcquireCall
from coordinator.replica.context import ReplicaContext
from coordinator.replica.fleet_view import (
    Fleet,
    eviction_inputs,
    gang_notices,
    uuids_of,
)
from coordinator.replica.idle import IdleNow
from coordinator.txn import Compare, Op


def new_victims(ctx: ReplicaContext, fleet: Fleet, hosts: dict[str, FleetHost], c: AcquireCall, req: FleetRequest,
                decision: FleetWait, teams: TeamState | None
                ) -> tuple[dict[str, tuple[str, ...]], tuple[str, ...], list[Compare], list[Op]]:
    """What a gang with no victims still going reserves, and whom it evicts or reclaims for it: (host -> the GPUs
    it reserves there, the victims, the notices' compares and writes)."""
    wanted = {host: uuids_of(hosts[host], idx) for host, idx in decision.reserve}
    team_of = teams.membership.team_of if teams is not None else None
    evicting, idle, grace_s, keys = set(ctx.evictions), IdleNow(ctx), ctx.config.eviction_grace_s, ctx.keys
    inputs = eviction_inputs(fleet, hosts, c.session.agent, evicting, idle, team_of)
    evict = plan_gang_eviction(req, *inputs, c.priority, c.session.agent)
    if evict is not None:
        compares, ops = gang_notices(keys, fleet, c, req, [(h, v.id) for h, v in evict.victims], grace_s)
        return ({host: uuids_of(hosts[host], idx) for host, idx in evict.reserve},
                tuple(v.id for _, v in evict.victims), compares, ops)
    got = gang_reclaim(fleet, inputs[0], teams, c.session.agent, req, evicting, idle, clock.wall()) if teams else None
    if teams is None or got is None:
        return wanted, (), [], []
    reclaim, charges = got
    team = teams.membership.team_of(c.session.agent)
    compares, ops = gang_notices(keys, fleet, c, req, [(fleet.leases[v][0].host, v) for v in reclaim.victims],
                                 grace_s, reclaim=team)
    compares += reclaim_guards(teams, None, keys, team, reclaim.victims, charges,
                               records={lease_id: parts[0] for lease_id, parts in fleet.leases.items() if parts})
    return {host: uuids_of(hosts[host], idx) for host, idx in reclaim.reserve}, reclaim.victims, compares, ops


def fleet_models(fleet: Fleet) -> dict[str, str]:
    return {g.uuid: g.name for v in fleet.views.values() if v.inventory is not None for g in v.inventory.gpus}


def fleet_charges_of(fleet: Fleet, state: TeamState) -> list[Charge]:
    """Every live lease of the snapshot as the teams charge it (a multi-host gang once, over all its hosts)."""
    models = fleet_models(fleet)
    return [charge_of(parts, state.membership, models) for parts in fleet.leases.values() if parts]


def gang_reclaim(fleet: Fleet, hosts: list[FleetHost], state: TeamState, agent: str, req: FleetRequest,
                 evicting: Collection[str], idle: Collection[str], now: float
                 ) -> tuple[FleetReclaim, list[Charge]] | None:
    """What a gang of ``agent`` reclaims (``hosts``: as G3 sees them), with the charges it was chosen from."""
    charges = fleet_charges_of(fleet, state)
    team = state.membership.team_of(agent)
    got = plan_gang_reclaim(req, hosts, team, charges, state.membership, fleet_models(fleet), now,
                            exclude=evicting, idle=idle, fair=state.fair)
    return (got, charges) if got is not None and got.victims else None


def invalid_reclaims(fleet: Fleet, state: TeamState | None, agent: str, charge_mb: int, pending: Iterable[str],
                     notices: Mapping[str, EvictionRecord]) -> set[str]:
    """The pending victims a waiting gang reclaimed that it may no longer keep: each now in its team's quota (an
    older lease of its team ended), or all of them once the gang's team, counting the gang (``charge_mb``), is
    over its own quota."""
    reclaimed = [v for v in pending if v in notices and notices[v].reclaim]
    if not reclaimed or state is None:
        return set()
    charges = fleet_charges_of(fleet, state)
    team = state.membership.team(state.membership.team_of(agent))
    if not stays_in_quota(team, charges, charge_mb):
        return set(reclaimed)
    marks = in_quota(charges, state.membership)
    return {v for v in reclaimed if marks.get(v, False)}
