"""Sessions that expire together end in shared etcd transactions (issue 32: P6, 10,000 agents killed at once).

Revoking one etcd lease is one unary call: a replica revokes about 2,000 a second beside the watch that follows
their deletions, so 10,000 sessions expiring in one tick took five seconds after their TTL. When many expire at
once (``TOGETHER_AT_LEAST``), each one's keys (its record, leases, queue entries: every key the mirror holds on
its etcd lease) are deleted instead in a transaction nested in a shared one, with its own compares: each of those
keys unchanged since the mirror read it. A part whose compare fails (another replica took the session over, or
one of its keys was rewritten) is left to the revoke, as is a session with more keys than a part may carry.

A session's keys still go in one revision (its nested transaction is atomic). The mirror had caught up with
the registrations read that decided the expiry; a write that attached a key to the session's etcd lease after
the mirror's read and before the delete committed (a grant compares only that the session record exists) is
not in the delete: the etcd leases of the sessions ended here are revoked right after, in the background, which
deletes such a key, and the etcd lease itself.
"""
from __future__ import annotations

import asyncio
import logging

from coordinator import errors
from coordinator.etcd.types import NestedResult
from coordinator.records import SessionInfo
from coordinator.replica.context import ReplicaContext
from coordinator.txn import Delete, ModRevisionIs, Txn

log = logging.getLogger(__name__)

TOGETHER_AT_LEAST = 16   # fewer sessions due in one tick are revoked one by one (fast enough, and etcd's own way)
IN_FLIGHT = 4            # shared transactions in flight at once


Part = tuple[SessionInfo, Txn]


async def delete_together(ctx: ReplicaContext, due: list[SessionInfo]) -> tuple[list[SessionInfo], list[SessionInfo]]:
    """Delete the keys of the sessions ``due`` in shared transactions, as the mirror holds them: (the sessions whose
    keys went, those left to a revoke: one whose record the mirror does not hold on its etcd lease, too)."""
    keys, max_ops = ctx.keys, ctx.config.etcd_max_txn_ops
    attached = ctx.mirror.on_etcd_leases({info.etcd_lease for info in due})
    left: list[SessionInfo] = []
    batches: list[list[Part]] = [[]]
    widest = 0
    for info in due:
        key = keys.session(info.agent, info.session_id)
        mine = attached.get(info.etcd_lease, [])
        if not any(x.key == key for x in mine) or len(mine) > max_ops // 2:
            left.append(info)
            continue
        # etcd's limit: the parts of a transaction, plus the widest part's operations, within --max-txn-ops.
        if batches[-1] and len(batches[-1]) + 1 + max(widest, len(mine)) > max_ops:
            batches.append([])
            widest = 0
        # Each key as the mirror holds it: one rewritten meanwhile (its etcd lease may be another's now) fails the
        # part, and the revoke, which deletes exactly what is on the etcd lease, ends the session.
        batches[-1].append((info, Txn(tuple(ModRevisionIs(x.key, x.mod_revision) for x in mine),
                                      tuple(Delete(x.key) for x in mine))))
        widest = max(widest, len(mine))
    ended: list[SessionInfo] = []
    gate = asyncio.Semaphore(IN_FLIGHT)

    async def commit(batch: list[Part]) -> None:
        async with gate:
            try:
                res = await ctx.store.commit([], [txn for _, txn in batch])
            except errors.GpucoordError as e:   # outcome unknown included: a revoke of a session gone is a no-op
                log.warning("session expiry: %d sessions' keys could not be deleted together (%s); revoking them",
                            len(batch), e)
                left.extend(info for info, _ in batch)
                return
        for (info, _), part in zip(batch, res.responses):
            (ended if isinstance(part, NestedResult) and part.succeeded else left).append(info)
    await asyncio.gather(*(commit(b) for b in batches if b))
    return ended, left


async def revoke_all(ctx: ReplicaContext, sessions: list[SessionInfo], at_once: int) -> None:
    """Revoke the etcd leases of ``sessions``, ``at_once`` in flight; a failure is logged (the etcd lease's own
    long TTL ends it then)."""
    gate = asyncio.Semaphore(at_once)
    failed: list[BaseException] = []

    async def revoke(info: SessionInfo) -> None:
        async with gate:
            try:
                await ctx.store.revoke(info.etcd_lease)
            except Exception as e:   # noqa: BLE001 - etcd's error, or the store closed: the long TTL ends it
                failed.append(e)
    await asyncio.gather(*(revoke(i) for i in sessions))
    if failed:
        log.warning("session expiry: %d etcd leases of sessions ended together could not be revoked (%s); their "
                    "own TTL ends them", len(failed), failed[0])
