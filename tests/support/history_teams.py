"""The team rules of the history checker (G11, issue 22): ``TeamRules`` follows ``teams/<team>`` records and every
lease record through the replay of tests/history.check_history and checks, at each revision:

* **limit**: where a lease record of team T is created, T's usage (every live lease record of its agents, VRAM x
  GPUs) is within T's limit. Only grants are held to it: an operator who lowers a limit below what the team
  holds breaks nothing.
* **quota marks** of a lease created with ``over_quota`` (format 3; leases without it, or granted while no team
  is stored, are not checked): ``false`` -> T's usage before the revision plus the lease is within T's quota;
  ``true`` -> T's usage as it stood after T's previous grant (or the last change of the teams), plus what the
  revision grants T, is above the quota, or so is its usage of a GPU model T has a quota for (each GPU record
  to its GPU's model, from the hosts' registrations). A grant counts its team's use from a copy that saw the team's previous
  grant (its ledger serializes them), and the use only falls until the next one: releases since then may make
  a mark ``true`` though the team is within its quota when the grant lands; nothing else can.
* **reclaim notices** (``evictions/<id>`` with ``reclaim``: the requesting team): the victim is of another team
  is preemptible, and is over its team's quota at that revision by the dynamic classification (``teams.in_quota``:
  a team's live leases fill its quota oldest first). Whether the requesting team stays
  within its quota counting the request is not in the notice: not checked. G3's priority rule does not apply.
* **G3 within a team**: with teams stored, a notice for a request by priority (``requester_priority`` set, no
  ``reclaim``) names a lease of the requester's team (the agent before ``/`` in ``requested_by``).

Membership is ``teams.Membership`` over the records at that revision (exact name, longest prefix, ``default``).
"""
from __future__ import annotations

import dataclasses
import json
from collections import defaultdict
from typing import Any, Iterable, Mapping

from coordinator.etcd.store import KV, WatchEvent
from coordinator.policy.team_admission import by_lease, charge_of
from coordinator.policy.teams import Charge, Membership, Team, in_quota
from coordinator.records import InvalidRecord, VramLease
from coordinator.replica.teams import gpu_models

Leases = Mapping[tuple[str, str], Mapping[str, dict[str, Any]]]   # (host, gpu) -> lease id -> record


@dataclasses.dataclass(frozen=True)
class _Stored:
    """A lease record as ``VramLease.from_kv`` reads it."""

    key: bytes
    value: bytes
    mod_revision: int = 0
    etcd_lease: int = 0


def _record(d: dict[str, Any]) -> VramLease:
    return VramLease.from_kv(_Stored(b"", json.dumps(d).encode()))


class TeamRules:
    def __init__(self) -> None:
        self.teams: dict[str, Team] = {}
        self.membership = Membership(())
        self.hosts: dict[bytes, KV] = {}            # host registrations: GPU models, for quotas per model
        self.agent_mb: dict[str, int] = defaultdict(int)   # agent -> MiB of its live lease records
        self.since_grant: dict[str, int] = {}       # team -> its usage after its last grant or the last team change
        self.since_grant_models: dict[str, dict[str, int]] = {}   # the same, per GPU model (quotas per model)
        self._changed = False
        self._created: list[dict[str, Any]] = []
        self._deleted: list[dict[str, Any]] = []
        self._notices: list[dict[str, Any]] = []

    # -- fed by the replay, event by event -------------------------------------------------------------
    def event(self, kind: str, parts: list[str], ev: WatchEvent) -> None:
        if kind == "teams" and parts:
            self._changed = True
            if ev.kind == "PUT":
                try:
                    self.teams[parts[-1]] = Team.from_kv(ev.kv)
                except InvalidRecord:       # the coordinator reads past a malformed record the same way
                    self.teams.pop(parts[-1], None)
            else:
                self.teams.pop(parts[-1], None)
            self.membership = Membership(self.teams.values())
        elif kind == "hosts" and parts:
            if ev.kind == "PUT":
                self.hosts[ev.kv.key] = ev.kv
            else:
                self.hosts.pop(ev.kv.key, None)

    def created(self, lease: dict[str, Any]) -> None:
        self.agent_mb[lease["agent"]] += int(lease["vram_mb"])
        self._created.append(lease)

    def deleted(self, lease: dict[str, Any]) -> None:
        self.agent_mb[lease["agent"]] -= int(lease["vram_mb"])
        self._deleted.append(lease)

    def notice(self, rec: dict[str, Any]) -> None:
        self._notices.append(rec)

    # -- at the end of each revision -----------------------------------------------------------------------
    def usage(self) -> dict[str, int]:
        used: dict[str, int] = defaultdict(int)
        for agent, mb in self.agent_mb.items():
            if mb:
                used[self.membership.team_of(agent)] += mb
        return used

    def check(self, rev: int, leases: Leases) -> list[str]:
        """The violations at revision ``rev`` (``leases``: every live lease record after it)."""
        created, deleted, notices, changed = self._created, self._deleted, self._notices, self._changed
        self._created, self._deleted, self._notices, self._changed = [], [], [], False
        if not self.teams:
            return self._reclaims(rev, notices, leases)   # a reclaim without teams is still checked
        after = self.usage()
        by_model = any(t.quota_by_model for t in self.teams.values())
        models_after = self._model_usage(leases) if by_model and (changed or created) else {}
        if changed:
            self.since_grant = dict(after)
            self.since_grant_models = dict(models_after)
        if not created and not notices:
            return []
        team_of = self.membership.team_of
        before: dict[str, int] = defaultdict(int, after)
        for x in created:
            before[team_of(x["agent"])] -= int(x["vram_mb"])
        for x in deleted:
            before[team_of(x["agent"])] += int(x["vram_mb"])
        granted: dict[str, int] = defaultdict(int)
        for x in created:
            granted[team_of(x["agent"])] += int(x["vram_mb"])
        out: list[str] = []
        for lease_id, parts in _by_id(created).items():
            team = self.membership.team(team_of(parts[0]["agent"]))
            charge = sum(int(x["vram_mb"]) for x in parts)
            used = after[team.name]
            if team.limit_mb is not None and used > team.limit_mb:
                out.append(f"rev {rev}: G11 team {team.name!r} holds {used} MiB once lease {lease_id} is granted, "
                           f"above its limit of {team.limit_mb} MiB")
            mark = parts[0].get("over_quota")
            if mark is False and before[team.name] + charge > team.quota_mb:
                out.append(f"rev {rev}: G11 lease {lease_id} marked in quota, but team {team.name!r} held "
                           f"{before[team.name]} MiB + {charge} MiB > its quota of {team.quota_mb} MiB")
            peak = self.since_grant.get(team.name, 0)
            if mark is True and peak + granted[team.name] <= team.quota_mb and not self._over_model_quota(
                    team, created):
                out.append(f"rev {rev}: G11 lease {lease_id} marked over quota, but team {team.name!r} held at most "
                           f"{peak} MiB since its last grant, + {granted[team.name]} MiB granted <= its quota of "
                           f"{team.quota_mb} MiB")
        for name in granted:
            self.since_grant[name] = after[name]
            if by_model:
                self.since_grant_models[name] = models_after.get(name, {})
        return out + self._reclaims(rev, notices, leases) + self._within_team(rev, notices, leases)

    def _reclaims(self, rev: int, notices: list[dict[str, Any]], leases: Leases) -> list[str]:
        reclaims = [rec for rec in notices if rec.get("reclaim")]
        if not reclaims:
            return []
        marks = in_quota(self._charges(leases), self.membership)
        out = []
        for rec in reclaims:
            victim = leases.get((rec["host"], rec["gpu_uuid"]), {}).get(rec["lease_id"])
            if victim is None:
                continue    # G3 reports a notice to a lease that is not live
            team = self.membership.team_of(victim["agent"])
            if not victim["preemptible"]:
                out.append(f"rev {rev}: G11 non-preemptible lease {victim['id']} reclaimed for team {rec['reclaim']!r}")
            if team == rec["reclaim"]:
                out.append(f"rev {rev}: G11 team {team!r} reclaims its own lease {victim['id']}")
            if marks.get(victim["id"]):
                out.append(f"rev {rev}: G11 in-quota lease {victim['id']} of team {team!r} reclaimed for team "
                           f"{rec['reclaim']!r}")
        return out

    def _within_team(self, rev: int, notices: list[dict[str, Any]], leases: Leases) -> list[str]:
        out = []
        for rec in notices:
            if rec.get("reclaim") or rec.get("requester_priority") is None:
                continue
            victim = leases.get((rec["host"], rec["gpu_uuid"]), {}).get(rec["lease_id"])
            if victim is None:
                continue
            mine = self.membership.team_of(str(rec["requested_by"]).split("/", 1)[0])
            theirs = self.membership.team_of(victim["agent"])
            if mine != theirs:
                out.append(f"rev {rev}: G3 lease {victim['id']} of team {theirs!r} evicted by priority for "
                           f"{rec['requested_by']} of team {mine!r}")
        return out

    def _model_usage(self, leases: Leases) -> dict[str, dict[str, int]]:
        """Team -> GPU model -> what its live leases hold on GPUs of that model (each GPU to its own model)."""
        out: dict[str, dict[str, int]] = {}
        for c in self._charges(leases):
            mine = out.setdefault(c.team, {})
            for model, mb in c.by_model().items():
                mine[model] = mine.get(model, 0) + mb
        return out

    def _over_model_quota(self, team: Team, created: list[dict[str, Any]]) -> bool:
        """Whether the team's use of some GPU model it has a quota for, as it stood after its previous grant,
        plus what this revision grants it on that model, passes that quota (a mark ``true`` for it is right)."""
        if not team.quota_by_model:
            return False
        models = gpu_models(self.hosts.values())
        granted: dict[str, int] = defaultdict(int)
        for x in created:
            if self.membership.team_of(x["agent"]) == team.name:
                granted[models.get(x["gpu_uuid"], "")] += int(x["vram_mb"])
        peak = self.since_grant_models.get(team.name, {})
        return any(peak.get(m, 0) + mb > q for m, mb in granted.items()
                   if (q := team.model_quota(m)) is not None)

    def _charges(self, leases: Leases) -> list[Charge]:
        """Every live lease as the teams see it, the way admission builds them (``team_admission.charge_of``)."""
        models = gpu_models(self.hosts.values()) if any(t.quota_by_model for t in self.teams.values()) else {}
        records = [_record(x) for (host, _), live in sorted(leases.items()) for x in live.values()]
        records.sort(key=lambda x: (x.host, x.gpu_index))
        return [charge_of(parts, self.membership, models) for parts in by_lease(records)]


def _by_id(records: Iterable[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = {}
    for x in records:
        out.setdefault(x["id"], []).append(x)
    return out
