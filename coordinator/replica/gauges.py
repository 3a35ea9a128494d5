"""The fleet gauges from the replica's mirror: ``gpucoord_leases{host}``, ``gpucoord_vram_bytes{host,gpu,kind}``
and ``gpucoord_team_vram_bytes{team,kind}``, updated after the watch applies a batch, never by a read.

A host's series are computed again only when one of its keys changed (``Mirror.host_stamp``), and when only its
usage report changed, at most every ``USAGE_EVERY_S``; a host whose records are all gone loses its series. The
team series are computed again from the kept host views when a lease, a queue entry or a team changed. At most
one update every ``MIN_INTERVAL_S``: a busy fleet costs one pass over the changed hosts per interval, an idle one
nothing.
"""
from __future__ import annotations

import asyncio
import logging
import time

from prometheus_client import Gauge

from coordinator import metrics
from coordinator.aio import Pacer
from coordinator.etcd.types import KV
from coordinator.keys import last_segment
from coordinator.policy.host import HostView
from coordinator.policy.teams import DEFAULT_TEAM, Membership, Usage, usage_by_team
from coordinator.record_fields import without_ts
from coordinator.replica.context import ReplicaContext
from coordinator.replica.teams import charges_from_views, read_teams
from coordinator.replica.view import host_view

log = logging.getLogger(__name__)

MIN_INTERVAL_S = 0.5
_REGISTERED = ("hosts", "usage", "partitions")   # the flat kinds, one key per host, that give a host its series
# Host views computed between two pauses at most (about 5 ms of work at 8 GPUs a host), and fewer when they take
# longer than ``aio.SLICE_S`` (hosts with many leases); each pause at least as long as the slice before it, so that
# calls get half of the loop or more (``aio.Pacer``).
HOSTS_AT_ONCE = 16
# A host whose usage report alone changed (its daemon rewrites it every few seconds) has its series computed again
# at most this often (about a scrape interval): 1,000 hosts' reports every 5 s made the gauges recompute 200 host
# views a second, and took a replica from 3.8 % to 12 % of a core. Any other change of the host is followed at once.
USAGE_EVERY_S = 15.0


class MirrorGauges:
    def __init__(self, ctx: ReplicaContext) -> None:
        self.ctx = ctx
        # host -> its mirror stamp and shape stamp when its series were computed, and when that was
        self._computed: dict[str, tuple[int, int, float]] = {}
        self._views: dict[str, HostView] = {}
        # host -> the value this replica last set of each of its series, by (gpu uuid or "", kind): a host computed
        # again touches only the series whose value moved (a usage report's rewrite mostly moves none of them).
        self._set: dict[str, dict[tuple[str, str], float]] = {}
        # host -> its usage report's content (less its ``ts``) when its series were computed, as a hash
        self._reports: dict[str, int | None] = {}
        self._teams_at = -1
        self._mark = -1                   # the mirror's host log as of the last pass (-1: none yet, look at all)
        self._deferred: set[str] = set()  # hosts whose usage report alone changed, left for a later pass
        self._registered: set[str] = set()
        self._registered_at: tuple[int, ...] = ()

    def _registered_hosts(self) -> set[str]:
        """The hosts with a registration, a usage report or a partition, found again only when a key of one of those
        kinds came or went: a pass over a quiet fleet of 10,000 hosts parsed 30,000 keys every time a lease changed
        anywhere, and every time a usage report did. (With the hosts with leases: those that get series.)"""
        mirror = self.ctx.mirror
        generations = tuple(mirror.keys_generation(kind) for kind in _REGISTERED)
        if generations != self._registered_at:
            self._registered_at = generations
            self._registered = {last_segment(kv.key) for kind in _REGISTERED for kv in mirror.items(kind)}
        return self._registered

    async def update(self) -> bool:
        """Bring every gauge to what the mirror says now. It yields to the event loop after ``HOSTS_AT_ONCE``
        hosts computed or ``aio.SLICE_S`` of work, whichever comes first, for as long as that work took
        (``aio.PAUSE_S`` at least): a replica's first pass over 10,000 hosts and 100,000 leases is seconds of work, which held its
        start and every call behind it (in slices of 64 hosts, 60 ms each, its first acquire waited 3.6 s)."""
        ctx = self.ctx
        # Only the hosts whose keys changed since the last pass, and those deferred then (a pass over every host of
        # a fleet twice a second was most of what 10,000 quiet hosts cost); all of them after a reset.
        mark, moved = ctx.mirror.hosts_changed_since(self._mark)
        registered, with_leases = self._registered_hosts(), ctx.mirror.lease_stamps()
        todo = (registered | with_leases.keys() | self._computed.keys()) if moved is None else moved | self._deferred
        changed, deferred = 0, set[str]()
        pacer = Pacer(every=HOSTS_AT_ONCE)
        now = time.monotonic()
        for host in todo:
            if host not in registered and host not in with_leases:
                if host in self._computed:   # every key of the host that gives it series is gone
                    self._forget(host)
                    changed += 1
                continue
            stamp = ctx.mirror.host_stamp(host)
            computed, shape, at = self._computed.get(host, (-1, -1, 0.0))
            if computed == stamp:
                continue
            if shape == ctx.mirror.shape_stamp(host):    # only its usage report changed
                if self._same_report(host):
                    self._computed[host] = (stamp, shape, at)   # its daemon's rewrite: every series as it is
                    continue
                if now - at < USAGE_EVERY_S:
                    deferred.add(host)   # not long ago: later (its stamp still differs)
                    continue
            changed += 1
            if await pacer.step():
                stamp = ctx.mirror.host_stamp(host)    # the mirror may have moved meanwhile
                if not stamp:
                    continue     # every key of the host went meanwhile: the next pass forgets it
            self._computed[host] = (stamp, ctx.mirror.shape_stamp(host), time.monotonic())
            view = host_view(ctx.keys, host, ctx.mirror.host_snapshot(host), ctx.config.untracked_vram,
                             ctx.usage_age)
            old = self._views.get(host)
            self._views[host] = view
            self._reports[host] = _content(ctx.mirror.flat(ctx.keys.usage(host)))
            last = self._set.setdefault(host, {})
            for uuid in (set(old.gpus) - set(view.gpus)) if old is not None else ():
                for kind in ("leased", "free"):
                    _remove(metrics.VRAM, host, uuid, kind)
                    last.pop((uuid, kind), None)
                _remove(metrics.GPU_UTILIZATION, host, uuid)
                last.pop((uuid, "utilization"), None)
            _set(last, ("", "leases"), metrics.LEASES, (host,), len(view.leases))
            reported = {str(x.get("uuid")): x for x in (view.usage or {}).get("gpus", ())}
            for g in view.gpus.values():
                _set(last, (g.uuid, "leased"), metrics.VRAM, (host, g.uuid, "leased"), g.leased_mb * metrics.MIB)
                _set(last, (g.uuid, "free"), metrics.VRAM, (host, g.uuid, "free"), g.free_mb * metrics.MIB)
                pct = reported.get(g.uuid, {}).get("utilization_pct", -1)
                _set(last, (g.uuid, "utilization"), metrics.GPU_UTILIZATION, (host, g.uuid),
                     -1 if view.usage_stale or not isinstance(pct, int) else pct)
        self._mark, self._deferred = mark, deferred
        teams_at = ctx.mirror.generation("teams")
        if changed or teams_at != self._teams_at:
            self._teams_at = teams_at
            self._update_teams()
        return bool(deferred)

    def _same_report(self, host: str) -> bool:
        """Whether the host's usage report says what it said when its series were computed, while it was fresh:
        then they are what computing them again would give (a fresh report's series depend on its content alone)."""
        view = self._views.get(host)
        return (view is not None and not view.usage_stale and host in self._reports
                and self._reports[host] == _content(self.ctx.mirror.flat(self.ctx.keys.usage(host))))

    def _forget(self, host: str) -> None:
        self._computed.pop(host, None)
        self._set.pop(host, None)
        self._reports.pop(host, None)
        view = self._views.pop(host, None)
        _remove(metrics.LEASES, host)
        for uuid in view.gpus if view is not None else ():
            for kind in ("leased", "free"):
                _remove(metrics.VRAM, host, uuid, kind)
            _remove(metrics.GPU_UTILIZATION, host, uuid)

    def _update_teams(self) -> None:
        teams, _ = read_teams(self.ctx.mirror.items("teams"))
        metrics.TEAM_VRAM.clear()   # a deleted team leaves no series behind
        if not teams:
            return
        membership = Membership(teams.values())
        charges, waiting = charges_from_views(self._views.values(), membership)
        usage = usage_by_team(charges, membership, waiting)
        for name in sorted(set(usage) | set(teams) | {DEFAULT_TEAM}):
            team, use = membership.team(name), usage.get(name, Usage())
            kinds = {"quota": team.quota_mb, "used": use.used_mb, "borrowed": use.borrowed_mb,
                     "waiting": use.waiting_mb} | ({"limit": team.limit_mb} if team.limit_mb is not None else {})
            for kind, mb in kinds.items():
                metrics.TEAM_VRAM.labels(name, kind).set(mb * metrics.MIB)

    async def run(self) -> None:
        """Update after each change of the mirror, at most every ``MIN_INTERVAL_S`` (a rate bound)."""
        mirror = self.ctx.mirror
        while True:
            seen, deferred = mirror.revision, False
            if mirror.ready:
                try:
                    deferred = await self.update()
                except Exception:
                    log.exception("updating the fleet gauges failed; retrying at the next change")
            await asyncio.sleep(MIN_INTERVAL_S)
            while mirror.revision == seen or not mirror.ready:
                moved = await mirror.caught_up(max(seen, mirror.revision) + 1,
                                               timeout=USAGE_EVERY_S if deferred else 60.0)
                if not mirror.ready:
                    await asyncio.sleep(MIN_INTERVAL_S)
                elif deferred and not moved:
                    break    # a host whose usage report alone changed waited its turn: now


def _set(last: dict[tuple[str, str], float], series: tuple[str, str], gauge: Gauge, labels: tuple[str, ...],
         value: float) -> None:
    """Set ``gauge{labels}`` to ``value`` unless this replica set it so last (``last[series]``): ``labels()``
    and ``set()`` are most of a host's cost otherwise, at 24 series a host of 8 GPUs."""
    if last.get(series) != value:
        last[series] = value
        gauge.labels(*labels).set(value)


def _remove(gauge: Gauge, *labels: str) -> None:
    try:
        gauge.remove(*labels)
    except KeyError:
        pass


def _content(kv: KV | None) -> int | None:
    """A usage report's content less its ``ts``, as a hash (a gauge is no admission decision: a collision of 64-bit
    hashes would keep a host's series until its next change)."""
    return None if kv is None else hash(without_ts(kv.value))


__all__ = ["MirrorGauges"]
