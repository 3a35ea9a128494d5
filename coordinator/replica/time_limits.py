"""Time limits (issue 31, docs/policies.md "Time limits"): the leader's duty that warns a lease before its end.

A lease granted with a time limit records it (``time_limit_s``, with ``time_limit_warning_s``: the warning,
resolved at acquire by ``policy.time_limits.resolve``). Its end is measured on the leader's monotonic clock from
when this replica first saw the lease's key (``ReplicaContext.observed``, fed by the watch at create_revision),
plus the limit: never from the granting replica's wall clock (``created_at``) against ours. At end − warning the
leader sends the holder an operator's eviction notice with the reason ``time-limit`` and a grace of the time
left (``Leases.evict``); the leader's deadline enforcement (``leader.py``) then revokes the lease at the end,
with the kill margin and G3's order for leases bound to processes, exactly as for any notice.

Under clock skew and leader changes: the end can come late, never early (a replica that starts, or a new leader,
sees the lease "now"; the notice's grace is two wall times of the one process that wrote it). A lease
already under an operator's notice (a drain, a revoke, or its own notice sent before a leader change) is
left to that notice; a request's notice (priority eviction) is made the operator's, keeping the earlier
deadline, so that its withdrawal cannot let the lease outlive its limit.
"""
from __future__ import annotations

import asyncio
import logging

from coordinator import clock, errors
from coordinator.policy.time_limits import REASON, Limited, due
from coordinator.records import EvictionRecord, InvalidRecord
from coordinator.replica.context import ReplicaContext
from coordinator.replica.leases import Leases
from coordinator.replica.mirror import TIME_LIMITED
from coordinator.replica.view import lease_of

log = logging.getLogger(__name__)

SWEEP_S = 1.0   # how often the leader looks for new leases with a limit (sooner when a warning is due)
ASKED_BY = "time limit"   # the notices' asked_by


class TimeLimits:
    def __init__(self, ctx: ReplicaContext, leases: Leases) -> None:
        self.ctx, self.leases, self.keys = ctx, leases, ctx.keys

    def limited(self) -> list[Limited]:
        """Every lease with a time limit in this replica's mirror, with its end on our clock (a gang's latest
        part's: never early) and whether an operator's notice stands for it already."""
        by_id: dict[str, Limited] = {}
        for kv in self.ctx.mirror.marked_leases(TIME_LIMITED):   # only format 4 records carry a limit
            try:
                lease = lease_of(kv)
            except InvalidRecord:
                continue   # its host is INVALID until it is rewritten (the admitters report it)
            if not lease.time_limit_s:
                continue
            ends_at = self.ctx.observed.saw(kv.key, kv.create_revision) + lease.time_limit_s
            held = by_id.get(lease.id)
            if held is not None and held.ends_at >= ends_at:
                continue
            by_id[lease.id] = Limited(lease.id, ends_at, lease.time_limit_warning_s, self._noticed(lease.id))
        return list(by_id.values())

    def _noticed(self, lease_id: str) -> bool:
        kv = self.ctx.mirror.get(self.keys.eviction(lease_id))
        if kv is None:
            return False
        try:
            return EvictionRecord.from_kv(kv).requested_by == "operator"
        except InvalidRecord:
            return True   # nothing to convert: the deadline enforcement reports it

    async def sweep(self) -> float | None:
        """Send the notices due now; when the next one is due (None: none known)."""
        todo, next_at = due(self.limited(), clock.monotonic())
        for lease_id, grace in todo:
            try:
                await self.leases.evict(lease_id, grace, REASON, ASKED_BY)
                log.info("lease %s reaches its time limit in %.1f s: eviction notice sent", lease_id, grace)
            except errors.NotFound:
                continue   # released meanwhile
            except errors.GpucoordError as e:
                log.warning("could not send the time-limit notice of lease %s: %s", lease_id, e)
        return next_at

    async def run(self) -> None:
        """The leader's duty, for as long as the term lasts."""
        while True:
            next_at = await self.sweep()
            wait = SWEEP_S if next_at is None else min(SWEEP_S, max(0.0, next_at - clock.monotonic()))
            await asyncio.sleep(max(wait, 0.05))
