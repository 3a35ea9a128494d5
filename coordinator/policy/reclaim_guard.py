"""What a round that reclaims (G11) compares, so that its decision commits only while it is still true. Pure:
the round's copies in, compares out; no I/O.

A victim of reclaim is over its team's quota because of the leases of its team that are older than it: a
team's leases fill its quota oldest first (``teams.in_quota``), so the victim stays over quota for as long as
enough of its team's older leases live, whatever else is granted (a grant is always newer) or ends (a newer
lease). Its **witness** is the fewest of those older leases whose charges alone keep it over its team's quota
(or its quota of one of the victim's GPU models, counting what each lease holds on GPUs of that model: a
gang's GPUs may differ; whichever takes fewer): the largest first. The round's transaction
compares that each witness lease is still the record it read (its first GPU record's mod_revision: a lease
that ended, by a release, a revoke or its session's expiry, which no transaction of ours sees, fails it), that
no team changed since the teams' copy was read (a quota raised, members moved), and the requesting team's
ledger (a grant of that team elsewhere may take it past its quota: then it may not reclaim). A compare that
fails makes the round decide again from a fresh snapshot. A fleet without teams compares nothing new; a round
that reclaims pays one compare per witness lease, plus two.
"""
from __future__ import annotations

from typing import Callable, Iterable, Mapping, Sequence

from coordinator.keys import Keys
from coordinator.policy.host import HostView
from coordinator.policy.team_admission import TeamState
from coordinator.policy.teams import Charge, Membership
from coordinator.records import VramLease
from coordinator.txn import Compare, ModRevisionIs, NothingWrittenSince


def _largest_past(candidates: Iterable[Charge], room_mb: int,
                  weight: Callable[[Charge], int] = lambda c: c.charge_mb) -> list[Charge] | None:
    """The fewest of ``candidates`` (largest ``weight`` first) whose weights sum to more than ``room_mb``; []
    when ``room_mb`` is below 0; None when even all of them do not."""
    out: list[Charge] = []
    total = 0
    for c in sorted(candidates, key=lambda c: (-weight(c), c.age_order())):
        if total > room_mb:
            break
        out.append(c)
        total += weight(c)
    return out if total > room_mb else None


def quota_witness(victim: Charge, charges: Sequence[Charge], membership: Membership) -> list[Charge] | None:
    """The older leases of ``victim``'s team that keep it over quota (see the module's docstring): [] when it
    is over quota on its own; None when it is in quota (it may not be reclaimed)."""
    team = membership.team(victim.team)
    older = [c for c in charges if c.team == victim.team and c.id != victim.id
             and c.age_order() < victim.age_order()]
    options = [_largest_past(older, team.quota_mb - victim.charge_mb)]
    for model, mb in victim.by_model().items():      # each of its GPUs' models, charged per GPU (a gang's differ)
        model_quota = team.model_quota(model)
        if model_quota is not None:
            def on_model(c: Charge, model: str = model) -> int:
                return c.by_model().get(model, 0)
            options.append(_largest_past([c for c in older if on_model(c)], model_quota - mb, on_model))
    found = [o for o in options if o is not None]
    return min(found, key=len) if found else None


def _records(state: TeamState, view: HostView) -> dict[str, VramLease]:
    """The first GPU record of every lease of the fleet, by id: this host's from the round's snapshot, the
    others' from the teams' copy."""
    here = {g.uuid for g in view.gpus.values()}
    out: dict[str, VramLease] = {}
    for x in state.records():
        if x.gpu_uuid not in here:
            out.setdefault(x.id, x)
    for g in sorted(view.gpus.values(), key=lambda g: g.index):
        for x in g.leases:
            out.setdefault(x.id, x)
    return out


def reclaim_guards(state: TeamState, view: HostView | None, keys: Keys, requester: str, victims: Sequence[str],
                   charges: Sequence[Charge], records: Mapping[str, VramLease] | None = None) -> list[Compare]:
    """The compares of a round that writes reclaim notices to ``victims`` (lease ids) for team ``requester``
    (see the module's docstring). A victim with no witness (in quota: never chosen so) compares nothing more
    than its own record, which the notice's write compares already. ``records``: the first GPU record of each
    lease by id, where the caller has them (a multi-host gang's snapshot of the fleet); else this host's view
    and the teams' copy."""
    by_id = {c.id: c for c in charges}
    witnesses: dict[str, Charge] = {}
    for lease_id in victims:
        victim = by_id.get(lease_id)
        if victim is None:
            continue
        for c in quota_witness(victim, charges, state.membership) or ():
            if c.id not in victims:      # a victim's own record is compared by its notice's write
                witnesses[c.id] = c
    if records is None:
        records = _records(state, view) if witnesses and view is not None else {}
    out: list[Compare] = [NothingWrittenSince(keys.teams(), state.revision),
                          ModRevisionIs(keys.team_ledger(requester), state.ledger(requester)[0])]
    for lease_id in sorted(witnesses):
        x = records.get(lease_id)
        if x is not None:
            out.append(ModRevisionIs(keys.lease(x.host, x.gpu_uuid, x.id), x.mod_revision))
    return out
