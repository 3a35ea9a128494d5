"""Partial failure of a multi-host gang has one rule, the whole gang (issue 30, G12): the leader's duty that
notices a granted multi-host gang one of whose hosts is lost (its node daemon's registration ``hosts/<host>`` is
gone) and sends its holder one eviction notice for the whole gang, reason ``host-lost``, naming the host
(``Leases.evict``: an operator's notice, with the configured grace). The leader's deadline enforcement
(``leader.py``) then revokes it at the deadline in one transaction over every host (``Leases._other_parts``),
with G3's order for the parts bound to processes. No revision shows part of the gang.

The same duty sweeps ``gangqueue/`` as the leader's queue sweep sweeps ``queue/``: an entry whose replica died and
whose wait is over (nobody retried it through another replica), or long past its wait (a safety net), is removed
comparing its mod_revision (its reservations, entries of ``queue/<host>/``, go by the queue sweep's own rule).

A host that comes back before the deadline does not save the gang: the notice stands (its processes there were
cut off from the others). Leases of one host are not touched: they live on with their holder's session.
"""
from __future__ import annotations

import asyncio
import logging

from coordinator import clock, errors
from coordinator.etcd.election import Election
from coordinator.etcd.removals import Removal, remove_entries
from coordinator.records import EvictionRecord, InvalidRecord, QueueEntry
from coordinator.replica.context import ReplicaContext
from coordinator.replica.leases import Leases
from coordinator.replica.mirror import MULTI_HOST
from coordinator.replica.view import lease_of
from coordinator.txn import Range

log = logging.getLogger(__name__)

SWEEP_S = 0.25   # how often the leader looks for multi-host gangs on a lost host
REASON = "host-lost"


class HostLoss:
    def __init__(self, ctx: ReplicaContext, leases: Leases, sweep_grace_s: float, overdue_s: float) -> None:
        self.ctx, self.leases, self.keys = ctx, leases, ctx.keys
        self.sweep_grace_s, self.overdue_s = sweep_grace_s, overdue_s   # the leader's queue sweep's rule

    def stranded(self) -> dict[str, str]:
        """Multi-host gangs with a part on a host whose registration is gone and no host-lost notice yet:
        lease id -> the first lost host (by rank)."""
        mirror = self.ctx.mirror
        if not mirror.ready:
            return {}
        out: dict[str, str] = {}
        for kv in mirror.marked_leases(MULTI_HOST):   # only multi-host records carry parts
            try:
                lease = lease_of(kv)
            except InvalidRecord:
                continue
            if lease.id in out or self._noticed(lease.id):
                continue
            lost = [h for h, _ in lease.parts if mirror.get(self.keys.host(h)) is None]
            if lost:
                out[lease.id] = lost[0]
        return out

    def _noticed(self, lease_id: str) -> bool:
        kv = self.ctx.mirror.get(self.keys.eviction(lease_id))
        if kv is None:
            return False
        try:
            return EvictionRecord.from_kv(kv).reason == REASON
        except InvalidRecord:
            return True

    async def sweep(self) -> None:
        for lease_id, host in self.stranded().items():
            try:
                await self.leases.evict(lease_id, self.ctx.config.eviction_grace_s, REASON, f"host {host} lost",
                                        force=True)
                log.warning("multi-host gang %s lost host %s: the whole gang goes (notice sent)", lease_id, host)
            except errors.NotFound:
                continue
            except errors.GpucoordError as e:
                log.warning("could not send the host-lost notice of lease %s: %s", lease_id, e)

    async def sweep_waiting(self, term: Election) -> None:
        """Remove the ``gangqueue/`` entries nobody else will (see the module's docstring)."""
        keys = self.keys
        snap = await self.ctx.store.snapshot([Range(keys.gang_queue(), prefix=True),
                                              Range(keys.coordinators(), prefix=True, keys_only=True)])
        replicas = {keys.parse(kv.key)[1][0] for kv in snap.ranges[1]}
        now = clock.monotonic()
        removals = []
        for kv in snap.ranges[0]:
            try:
                entry = QueueEntry.from_kv(kv)
            except InvalidRecord:
                continue
            waited = self.ctx.observed.age(kv.key, kv.mod_revision, now) - entry.wait_s
            if (waited > self.sweep_grace_s and entry.replica not in replicas) or waited > self.overdue_s:
                removals.append(Removal(kv.key, kv.mod_revision, ()))
        if removals:
            await remove_entries(self.ctx.store, removals, common=term.fence())

    async def run(self, term: Election) -> None:
        """The leader's duty, for as long as the term lasts."""
        swept_at = 0.0
        while True:
            await self.sweep()
            if clock.monotonic() - swept_at >= 1.0:
                swept_at = clock.monotonic()
                try:
                    await self.sweep_waiting(term)
                except errors.GpucoordError as e:
                    log.warning("multi-host gang queue sweep failed: %s", e)
            await asyncio.sleep(SWEEP_S)
