"""The fleet gauges from the replica's mirror: ``gpucoord_leases{host}``, ``gpucoord_vram_bytes{host,gpu,kind}``
and ``gpucoord_team_vram_bytes{team,kind}``, updated after the watch applies a batch, never by a read.

A host's series are computed again only when one of its keys changed (``Mirror.host_stamp``); a host whose records are all gone loses its series. The team series are computed again from the
kept host views when a lease, a queue entry or a team changed. At most one update every ``MIN_INTERVAL_S``:
a busy fleet costs one pass over the changed hosts per interval, an idle one nothing.
"""
from __future__ import annotations

import asyncio
import logging

from prometheus_client import Gauge

from coordinator import metrics
from coordinator.policy.host import HostView
from coordinator.policy.teams import DEFAULT_TEAM, Membership, Usage, usage_by_team
from coordinator.replica.context import ReplicaContext
from coordinator.replica.teams import charges_from_views, read_teams
from coordinator.replica.view import host_view

log = logging.getLogger(__name__)

MIN_INTERVAL_S = 0.5
HOSTS_AT_ONCE = 64      # host views computed between two pauses (about 20 ms of work at 8 GPUs a host)
PAUSE_S = 0.005         # each pause: calls get the loop between two slices of a pass over a large fleet


class MirrorGauges:
    def __init__(self, ctx: ReplicaContext) -> None:
        self.ctx = ctx
        self._stamps: dict[str, int] = {}   # host -> its mirror stamp when its series were computed
        self._views: dict[str, HostView] = {}
        self._teams_at = -1

    def _hosts(self) -> set[str]:
        keys, mirror = self.ctx.keys, self.ctx.mirror
        hosts = set(mirror.lease_stamps())
        for kind in ("hosts", "usage", "partitions"):
            for kv in mirror.items(kind):
                try:
                    hosts.add(keys.parse(kv.key)[1][0])
                except (ValueError, IndexError):
                    continue
        return hosts

    async def update(self) -> None:
        """Bring every gauge to what the mirror says now. It yields to the event loop every ``HOSTS_AT_ONCE``
        hosts computed, for ``PAUSE_S``: a replica's first pass over 10,000 hosts took seconds, and held its start
        (and every call) for all of them."""
        ctx = self.ctx
        hosts = self._hosts()
        changed = 0
        for host in set(self._stamps) - hosts:
            self._forget(host)
            changed += 1
        for host in hosts:
            stamp = ctx.mirror.host_stamp(host)
            if self._stamps.get(host) == stamp:
                continue
            changed += 1
            if changed % HOSTS_AT_ONCE == 0:
                await asyncio.sleep(PAUSE_S)
                stamp = ctx.mirror.host_stamp(host)    # the mirror may have moved meanwhile
                if not stamp:
                    continue     # every key of the host went meanwhile: the next pass forgets it
            self._stamps[host] = stamp
            view = host_view(ctx.keys, host, ctx.mirror.host_snapshot(host), ctx.config.untracked_vram,
                             ctx.usage_age)
            old = self._views.get(host)
            self._views[host] = view
            for uuid in (set(old.gpus) - set(view.gpus)) if old is not None else ():
                for kind in ("leased", "free"):
                    _remove(metrics.VRAM, host, uuid, kind)
                _remove(metrics.GPU_UTILIZATION, host, uuid)
            metrics.LEASES.labels(host).set(len(view.leases))
            reported = {str(x.get("uuid")): x for x in (view.usage or {}).get("gpus", ())}
            for g in view.gpus.values():
                metrics.VRAM.labels(host, g.uuid, "leased").set(g.leased_mb * metrics.MIB)
                metrics.VRAM.labels(host, g.uuid, "free").set(g.free_mb * metrics.MIB)
                pct = reported.get(g.uuid, {}).get("utilization_pct", -1)
                metrics.GPU_UTILIZATION.labels(host, g.uuid).set(-1 if view.usage_stale or not isinstance(pct, int)
                                                                 else pct)
        teams_at = ctx.mirror.generation("teams")
        if changed or teams_at != self._teams_at:
            self._teams_at = teams_at
            self._update_teams()

    def _forget(self, host: str) -> None:
        self._stamps.pop(host, None)
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
            seen = mirror.revision
            if mirror.ready:
                try:
                    await self.update()
                except Exception:
                    log.exception("updating the fleet gauges failed; retrying at the next change")
            await asyncio.sleep(MIN_INTERVAL_S)
            while mirror.revision == seen or not mirror.ready:
                await mirror.caught_up(max(seen, mirror.revision) + 1, timeout=60.0)
                if not mirror.ready:
                    await asyncio.sleep(MIN_INTERVAL_S)


def _remove(gauge: Gauge, *labels: str) -> None:
    try:
        gauge.remove(*labels)
    except KeyError:
        pass


__all__ = ["MirrorGauges"]
