"""The idle judgment of every lease, kept between passes (``replica/idle.py`` asks each ``SAMPLE_S``).

Judging each lease again at every pass cost a replica about 8 % of a core with 10,000 leases and idle reclaim on
(1 % with it off), so about a whole core at a fleet's 100,000. Yet what a judgment is made of rarely moves: a
lease's first sighting never does, and a GPU's stretch below a threshold starts again only when its history gains
a change point (``UtilizationHistory`` keeps only moves across the thresholds in use). So, per host, what its
leases' judgments need is kept until the host's leases change (the mirror's lease stamp), a GPU of the host gains
a point (``UtilizationHistory.moved_since``) or a policy changes (the fleet's, or any team's). A pass then only
compares each kept start with the clock: ``idle_since`` is the latest of the lease's first sighting and each of
its GPUs' last move below the threshold, and the lease is idle once its window has passed since then. The same
judgment as ``policy.idle.judge`` of every lease (``tests/unit/test_idle_judged.py`` checks them against it).

A multi-host gang's parts are kept per host and joined at each pass: the lease is below the threshold only if each
part is, since the latest of them.
"""
from __future__ import annotations

from typing import Hashable

from coordinator.policy.idle import (
    IdlePolicy,
    LeaseIdle,
    UtilizationHistory,
    below_since,
)
from coordinator.policy.teams import Membership
from coordinator.records import InvalidRecord
from coordinator.replica.mirror import Mirror
from coordinator.replica.observed import Observed
from coordinator.replica.view import lease_of

Part = tuple[str, float | None, float, IdlePolicy, str]
"""One lease's part on one host: its id, since when all its GPUs there have been below the threshold (None: one
is not), its latest first sighting there, its policy and its team."""

Judged = dict[str, tuple[LeaseIdle, str]]
"""lease id -> (its idle judgment, its team)."""


class IdleJudgments:
    """What each host's leases' judgments need, kept between passes (see the module's docstring)."""

    def __init__(self) -> None:
        self._hosts: dict[str, tuple[int, list[Part], list[Part], list[str]]] = {}   # stamp, one-host, multi, GPUs
        self._host_of: dict[str, set[str]] = {}   # GPU uuid -> the hosts kept that have a lease on it
        self._policies: Hashable = None
        self._mark = 0

    def clear(self) -> None:
        self._hosts.clear()
        self._host_of.clear()
        self._policies = None

    def judge(self, mirror: Mirror, observed: Observed, history: UtilizationHistory, fleet: IdlePolicy,
              membership: Membership, by_team: dict[str, IdlePolicy], policies: Hashable, now: float,
              idle_only: bool = False) -> Judged:
        """Every lease's judgment at ``now`` (``idle_only``: the idle leases' alone). ``policies`` is a value that
        changes whenever the fleet's or a team's policy, or a team's members, do."""
        if policies != self._policies:
            self.clear()
            self._policies = policies
        self._mark, moved = history.moved_since(self._mark)
        stamps = mirror.lease_stamps()
        for host in [h for h in self._hosts if h not in stamps]:
            self._forget(host)
        moved_hosts = set(stamps) if moved is None else {h for u in moved for h in self._host_of.get(u, ())}
        for host, stamp in stamps.items():
            kept = self._hosts.get(host)
            if kept is None or kept[0] != stamp or host in moved_hosts:
                self._build(host, stamp, mirror, observed, history, fleet, membership, by_team)
        out: Judged = {}
        multi: dict[str, Part] = {}
        for _, one_host, parts, _ in self._hosts.values():
            for part in one_host:
                _judge(out, part, now, idle_only)
            for part in parts:
                joined = multi.get(part[0])
                multi[part[0]] = part if joined is None else _join(joined, part)
        for part in multi.values():
            _judge(out, part, now, idle_only)
        return out

    def _forget(self, host: str) -> None:
        for uuid in self._hosts.pop(host)[3]:
            hosts = self._host_of.get(uuid)
            if hosts is not None:
                hosts.discard(host)
                if not hosts:
                    del self._host_of[uuid]

    def _build(self, host: str, stamp: int, mirror: Mirror, observed: Observed, history: UtilizationHistory,
               fleet: IdlePolicy, membership: Membership, by_team: dict[str, IdlePolicy]) -> None:
        if host in self._hosts:
            self._forget(host)
        by_id: dict[str, Part] = {}
        multi: set[str] = set()
        uuids = []
        for kv in mirror.host_items("leases", host):
            try:
                lease = lease_of(kv)
            except InvalidRecord:
                continue
            uuids.append(lease.gpu_uuid)
            team = membership.team_of(lease.agent)
            policy = by_team.get(team, fleet)
            since = below_since(history.points(lease.gpu_uuid), policy.below_pct) if policy.on else None
            part = (lease.id, since, observed.saw(kv.key, kv.create_revision), policy, team)
            held = by_id.get(lease.id)
            by_id[lease.id] = part if held is None else _join(held, part)
            if lease.hosts:
                multi.add(lease.id)
        for uuid in uuids:
            self._host_of.setdefault(uuid, set()).add(host)
        self._hosts[host] = (stamp, [p for x, p in by_id.items() if x not in multi],
                             [p for x, p in by_id.items() if x in multi], uuids)


def _join(a: Part, b: Part) -> Part:
    """Two parts of one lease (a gang's GPUs): below since the later of both, if both are; first seen at the later."""
    since = None if a[1] is None or b[1] is None else max(a[1], b[1])
    return a[0], since, max(a[2], b[2]), a[3], a[4]


def _judge(out: Judged, part: Part, now: float, idle_only: bool) -> None:
    lease_id, since, seen, policy, team = part
    if since is not None:
        since = max(since, seen)
        if now - since >= policy.after_s:
            out[lease_id] = (LeaseIdle(lease_id, since, True, policy.action), team)
            return
    if not idle_only:
        out[lease_id] = (LeaseIdle(lease_id, since, False, policy.action if policy.on else ""), team)
