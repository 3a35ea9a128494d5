"""Why each request of a host's queue waits, for the status (docs/policies.md "Why a request waits"): the scene that
``policy.waiting.explain`` reads, built from the status's snapshot of the host (``HostView``, one revision),
the eviction notices read with it and the teams' state of this replica's mirror.

A lease's known end is when it is gone at the latest: the earlier of its time limit's end (``created_at`` +
``time_limit_s``, the granting replica's wall clock; the leader measures it from when it saw the lease, a few
milliseconds later) and its eviction notice's deadline, plus the kill margin (``eviction_kill_margin_s``):
the leader revokes a holder that has not released by then (``leader._deadline``). A holder that releases at
its notice, or whose processes the node reports gone after the deadline, frees the GPU sooner: the estimate is
then late, never early for that reason.
"""
from __future__ import annotations

from typing import Mapping

from coordinator.policy.cordon import cordon_reason
from coordinator.policy.host import HostView
from coordinator.policy.team_admission import TeamState, least_charge_mb, team_limit
from coordinator.policy.waiting import WaitReason, WaitScene, candidates, explain
from coordinator.records import EvictionRecord


def lease_ends(view: HostView, notices: Mapping[str, EvictionRecord], margin_s: float) -> dict[str, float]:
    """The known end (unix seconds) of every lease of the host that has one; ``margin_s``: the kill margin."""
    out: dict[str, float] = {}
    for lease in view.leases.values():
        ends = []
        if lease.time_limit_s:
            ends.append(lease.created_at + lease.time_limit_s)
        notice = notices.get(lease.id)
        if notice is not None:
            ends.append(notice.deadline_unix)
        if ends:
            out[lease.id] = min(ends) + margin_s
    return out


def scene_of(view: HostView, notices: Mapping[str, EvictionRecord], teams: TeamState | None,
             now: float, margin_s: float) -> WaitScene:
    """The host's queue and what it waits for, as the status's snapshot shows it."""
    caps: dict[str, dict[str, int]] = {}
    if view.inventory is not None:
        partition = view.effective_partition()
        for e in view.entries:
            if e.agent not in caps:
                caps[e.agent] = partition.gpu_caps(e.agent, view.inventory) if partition.allows(e.agent) else {}
    gpus = [view.gpus[u] for u in sorted(view.gpus, key=lambda u: view.gpus[u].index)]
    team: dict[str, str] = {}
    if teams is not None:
        for e in view.entries:
            mine = candidates(e, gpus, caps.get(e.agent, {}))
            reason = team_limit(teams, view, e.agent, least_charge_mb(mine or gpus, e.vram_mb, e.gpu_count,
                                                                      e.exclusive))
            if reason is not None:
                team[e.lease_id] = reason
    cordon = cordon_reason(view.host, view.cordon) if view.cordon is not None else None
    return WaitScene(view.host, gpus, list(view.entries), caps, lease_ends(view, notices, margin_s), now, team, cordon)


def host_waits(view: HostView, notices: Mapping[str, EvictionRecord], teams: TeamState | None,
               now: float, margin_s: float) -> dict[str, WaitReason]:
    """Why each entry of the host's queue waits, by rank ({} for a host whose node is gone: nothing waits
    there for long, the planner answers its waiters)."""
    if view.inventory is None or not view.entries:
        return {}
    return {w.rank: w for w in explain(scene_of(view, notices, teams, now, margin_s))}
