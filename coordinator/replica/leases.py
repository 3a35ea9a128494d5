"""Operations on VRAM leases outside admission: release, eviction notices (and their withdrawal), revocation,
the processes a lease covers, and finding a lease. Each is a compare-and-set on what it read."""
from __future__ import annotations

import dataclasses
import logging
from typing import Any, Awaitable, Callable, Iterable, Sequence

from coordinator import clock, errors, metrics
from coordinator.etcd.election import Election
from coordinator.etcd.types import KV
from coordinator.keys import last_segment
from coordinator.policy.departing import reported_pids, still_reported
from coordinator.records import (
    DepartingRecord,
    EvictionRecord,
    InvalidRecord,
    QueueEntry,
    SessionInfo,
    VramLease,
    check_usage,
    dumps,
    load_record,
)
from coordinator.replica.context import ReplicaContext
from coordinator.txn import Absent, Compare, Delete, ModRevisionIs, Op, Put

# Raises (PERMISSION_DENIED or UNAVAILABLE naming pids) unless the lease's node says its processes are the caller's.
Confirm = Callable[[VramLease], Awaitable[None]]
log = logging.getLogger(__name__)


class Leases:
    def __init__(self, ctx: ReplicaContext) -> None:
        self.ctx = ctx
        self.store, self.keys, self.config, self.mirror = ctx.store, ctx.keys, ctx.config, ctx.mirror

    async def withdraw_evictions(self, entry: QueueEntry) -> None:
        """The request that evicted these leases left without a grant: its notices are withdrawn, so that
        nobody is revoked for a request that no longer needs the room (G3)."""
        requested_by = f"{entry.agent}/{entry.request_id}"
        for victim in entry.victims:
            key = self.keys.eviction(victim)
            kv = self.mirror.get(key)
            if kv is None or EvictionRecord.from_kv(kv).requested_by != requested_by:
                continue
            res = await self.store.commit([ModRevisionIs(key, kv.mod_revision)], [Delete(key)])
            if res.succeeded:
                log.info("withdrew the eviction notice of lease %s: its requester left", victim)

    async def evict(self, lease_id: str, grace_s: float, reason: str, asked_by: str = "", force: bool = False) -> float:
        """Send an eviction notice; the leader revokes the lease at the deadline if it is still held. ``force``:
        an operator's notice standing already takes this one's reason and, if earlier, its deadline (a multi-host
        gang that lost a host goes, whatever notice it had)."""
        grace = grace_s or self.config.eviction_grace_s
        for _ in range(self.config.commit_attempts):
            lease = await self.find_lease(lease_id)
            if lease is None:
                raise errors.NotFound(f"lease_id: no live lease {lease_id}", "lease_id")
            now = clock.wall()
            existing = await self.store.get(self.keys.eviction(lease_id))
            if existing is not None:
                record = EvictionRecord.from_kv(existing)
                if record.requested_by == "operator" and (not force or record.reason == reason):
                    return float(record.deadline_unix)
                # A request's notice becomes the operator's: it must not be withdrawn if that request
                # gives up, and the operator's grace may bring the deadline forward.
                record = dataclasses.replace(record, requested_by="operator", requester_priority=None,
                                             reason=reason or "operator", asked_by=asked_by,
                                             deadline_unix=min(record.deadline_unix, now + grace))
                res = await self.store.commit(
                    [ModRevisionIs(existing.key, existing.mod_revision)],
                    [Put(existing.key, dumps(record.to_json()), existing.etcd_lease)])
                if res.succeeded:
                    return record.deadline_unix
                continue
            record = EvictionRecord(
                lease_id=lease.id, host=lease.host, gpu_uuid=lease.gpu_uuid, agent=lease.agent,
                session_id=lease.session_id, victim_priority=lease.priority, requested_by="operator",
                requester_priority=None, reason=reason or "operator", deadline_unix=now + grace, created_at=now,
                asked_by=asked_by)
            key = self.keys.lease(lease.host, lease.gpu_uuid, lease.id)
            res = await self.store.commit(
                [ModRevisionIs(key, lease.mod_revision), Absent(self.keys.eviction(lease_id))],
                [Put(self.keys.eviction(lease_id), dumps(record.to_json()), lease.etcd_lease)])
            if res.succeeded:
                metrics.EVICTIONS.labels("notice").inc()
                return record.deadline_unix
        raise errors.Unavailable("evict: too much contention; retry")

    async def revoke(self, lease_id: str, host: str | None = None, notice_revision: int | None = None,
                     fence: Election | None = None, *, at_bound: bool = False,
                     decided_on: Sequence[Compare] = (), also: Sequence[Compare] = (),
                     reason: str = "revoke") -> bool:
        """Delete a lease now (the leader at an eviction deadline, or ``revoke_by_operator`` for a lease not
        bound to processes). False if it was gone.

        With ``notice_revision`` (the leader at a deadline) it happens only while that very notice still
        stands: a notice withdrawn meanwhile (its requester left) saves the lease. With ``fence`` (the
        leader) every write also compares the leader's candidacy, and a deposed leader gets NotOwner.
        ``decided_on``: the revoke was decided on these reads (the usage reports that list none of the lease's
        processes, and the records as they were read): it happens only while they all hold, else False (decide
        again).
        ``at_bound``: the kill margin past the deadline has passed; a lease bound to processes that the node
        still reports leaves a forced ``departing/`` record (G3: its VRAM counts as free from now on, and the
        history shows that the bound, not the processes' exit, ended it). ``also``: what else must hold (the
        leader: the requester's queue entry, as it read it, still listing the lease). ``reason``: how the lease
        ended, for ``gpucoord_releases_total`` (``revoke``, ``eviction``, ``reclaim``).
        """
        notice_key = self.keys.eviction(lease_id)
        fenced = fence.fence() if fence is not None else []
        for _ in range(self.config.commit_attempts):
            lease = await self.find_lease(lease_id, host)
            if lease is None:
                if notice_revision is None:
                    await self.store.delete(notice_key)
                else:
                    await self.store.commit([ModRevisionIs(notice_key, notice_revision), *fenced],
                                            [Delete(notice_key)])
                return False
            key = self.keys.lease(lease.host, lease.gpu_uuid, lease.id)
            others = await self._other_parts(lease, False)
            compares = [ModRevisionIs(key, lease.mod_revision), *fenced, *also,
                        *(ModRevisionIs(kv.key, kv.mod_revision) for kv in others)]
            ops: list[Op] = [Delete(key), Delete(notice_key), *(Delete(kv.key) for kv in others)]
            if notice_revision is not None:
                compares.append(ModRevisionIs(notice_key, notice_revision))
            compares += decided_on
            forced = False
            all_parts = [lease, *(VramLease.from_kv(kv) for kv in others)]
            if at_bound and any(p.pids or p.pgid for p in all_parts):
                notice = _notice(await self.store.get(notice_key))
                usage_kvs = {h: await self.store.get(self.keys.usage(h)) for h in sorted({p.host for p in all_parts})}
                listed = [p for p in all_parts if _listed(usage_kvs[p.host], [p])]
                if notice is not None and listed:
                    compares += [ModRevisionIs(self.keys.usage(h), kv.mod_revision)
                                 for h, kv in usage_kvs.items() if kv is not None]
                    for part in listed:   # a gang: every GPU whose report still lists its processes
                        record = self._departing(part, notice, bound_in_s=0.0)
                        ops.append(Put(self.keys.departing(part.host, part.gpu_uuid, part.id),
                                       dumps(record.to_json())))
                    forced = True
            res = await self.store.commit(list(dict.fromkeys(compares)), ops)   # (decided_on repeats some)
            if res.succeeded:
                metrics.EVICTIONS.labels("revoke").inc()
                metrics.RELEASES.labels(reason).inc()
                if forced:
                    metrics.EVICTIONS.labels("margin").inc()
                    log.warning("lease %s of %s revoked at the kill margin while the node still reports its "
                                "processes on GPU %s: its VRAM counts as free now", lease.id, lease.agent,
                                lease.gpu_uuid)
                return True
            if fence is not None and not await fence.holds():
                raise errors.NotOwner("leader: this replica is no longer the leader", "leader")
            if notice_revision is not None and (await self.store.get(notice_key)) is None:
                return False   # withdrawn: nothing to enforce any more
            if decided_on:
                return False   # what it was decided on changed (a new usage report): the caller decides again
        raise errors.Unavailable("revoke: too much contention; retry")

    async def revoke_by_operator(self, lease_id: str, asked_by: str = "") -> tuple[bool, bool]:
        """An operator's revoke: (revoked, processes). A lease not bound to processes is deleted at once. One
        bound to processes gets a revoke notice: its holder (``gpucoord run``) SIGKILLs them at once and
        releases it once they are gone, and the leader revokes it when the node reports none of them, or at
        the kill margin (G3: its VRAM counts as free only then). (False, False) if it was gone."""
        for _ in range(self.config.commit_attempts):
            lease = await self.find_lease(lease_id)
            if lease is None:
                await self.store.delete(self.keys.eviction(lease_id))
                return False, False
            if not (lease.pids or lease.pgid):
                return await self.revoke(lease_id, lease.host), False
            key = self.keys.lease(lease.host, lease.gpu_uuid, lease.id)
            notice_key = self.keys.eviction(lease_id)
            now = clock.wall()
            existing = await self.store.get(notice_key)
            if existing is not None:
                record = EvictionRecord.from_kv(existing)
                if record.revoke:
                    return True, True
                record = dataclasses.replace(record, requested_by="operator", requester_priority=None,
                                             reason="revoked by an operator", asked_by=asked_by, revoke=True,
                                             deadline_unix=min(record.deadline_unix, now))
                res = await self.store.commit([ModRevisionIs(notice_key, existing.mod_revision)],
                                              [Put(notice_key, dumps(record.to_json()), existing.etcd_lease)])
            else:
                record = EvictionRecord(
                    lease_id=lease.id, host=lease.host, gpu_uuid=lease.gpu_uuid, agent=lease.agent,
                    session_id=lease.session_id, victim_priority=lease.priority, requested_by="operator",
                    requester_priority=None, reason="revoked by an operator", deadline_unix=now, created_at=now,
                    asked_by=asked_by, revoke=True)
                res = await self.store.commit([ModRevisionIs(key, lease.mod_revision), Absent(notice_key)],
                                              [Put(notice_key, dumps(record.to_json()), lease.etcd_lease)])
            if res.succeeded:
                metrics.EVICTIONS.labels("notice").inc()
                return True, True
        raise errors.Unavailable("revoke: too much contention; retry")

    def _departing(self, lease: VramLease, notice: EvictionRecord, bound_in_s: float) -> DepartingRecord:
        """The ``departing/`` record of ``lease``, ended under ``notice``; the bound comes ``bound_in_s`` from
        now (0 or less: it has passed, the record is forced)."""
        now = clock.wall()
        return DepartingRecord(
            lease_id=lease.id, host=lease.host, gpu_uuid=lease.gpu_uuid, agent=lease.agent, vram_mb=lease.vram_mb,
            pids=lease.pids, pgid=lease.pgid, requested_by=notice.requested_by, reason=notice.reason,
            created_at=now, bound_unix=now + max(0.0, bound_in_s), forced=bound_in_s <= 0, revoke=notice.revoke)

    async def release(self, info: SessionInfo, lease_id: str) -> bool:
        """Delete the lease if it is the caller's. Idempotent: a lease that is gone answers False.

        A lease bound to processes, released under an eviction notice while the node's report still lists
        some of its processes on the GPU, leaves a ``departing/`` record in the same transaction: its VRAM
        counts as held until the node lists none of them, or the kill margin past the notice's deadline has
        passed (G3). The transaction compares the notice it read (or its absence) and the report.
        """
        for attempt in range(self.config.commit_attempts):
            # First from the mirror (a miss or a lost compare falls back to reading etcd).
            from_mirror = attempt == 0 and self.mirror.ready
            lease = self._mirrored_lease(lease_id, info.host) if from_mirror else None
            if lease is not None and lease.session_id != info.session_id:
                lease = None   # only the positive case is trusted from the mirror
            if lease is None:
                # A multi-host gang may hold no GPU on the session's own host: then it is found on any host.
                lease = await self.find_lease(lease_id, info.host) or await self.find_lease(lease_id)
                from_mirror = False
            if lease is None:
                return False
            if lease.session_id != info.session_id or lease.agent != info.agent:
                raise errors.NotOwner(f"lease_id: lease {lease_id} belongs to another session", "lease_id")
            key = self.keys.lease(lease.host, lease.gpu_uuid, lease.id)
            notice_key = self.keys.eviction(lease.id)
            notice_kv = await self._read(notice_key, from_mirror)
            others = await self._other_parts(lease, from_mirror)   # a gang goes whole, in this transaction
            compares: list[Compare] = [
                ModRevisionIs(key, lease.mod_revision),
                ModRevisionIs(notice_key, notice_kv.mod_revision) if notice_kv else Absent(notice_key),
                *(ModRevisionIs(kv.key, kv.mod_revision) for kv in others)]
            ops: list[Op] = [Delete(key), Delete(notice_key), *(Delete(kv.key) for kv in others)]
            # (A malformed notice is set aside: it is deleted with the lease, as if there were none.)
            notice = _notice(notice_kv)
            all_parts = [lease, *(VramLease.from_kv(kv) for kv in others)]
            if notice_kv is not None and notice is not None and any(p.pids or p.pgid for p in all_parts):
                # Each host's report for its own part (a multi-host gang's parts run on several hosts).
                usage_kvs = {h: await self._read(self.keys.usage(h), from_mirror)
                             for h in sorted({p.host for p in all_parts})}
                listed = [p for p in all_parts if _listed(usage_kvs[p.host], [p])]
                usage_compares: list[Compare] = [
                    ModRevisionIs(self.keys.usage(h), kv.mod_revision) if kv is not None else Absent(self.keys.usage(h))
                    for h, kv in usage_kvs.items()]
                if listed:
                    bound = (self.ctx.notice_deadline(notice_kv, notice) + self.config.eviction_kill_margin_s
                             - clock.monotonic())
                    res = await self.store.commit(
                        [*compares, *usage_compares],
                        [*ops, *(Put(self.keys.departing(part.host, part.gpu_uuid, part.id),
                                     dumps(self._departing(part, notice, bound).to_json()))
                                 for part in listed)])
                    if res.succeeded:
                        metrics.RELEASES.labels("release").inc()
                        log.info("lease %s released under its eviction notice while the nodes still report its "
                                 "processes %s: its VRAM stays held until they are gone (at most %.1f s)", lease.id,
                                 sorted({pid for part in listed for pid in reported_pids(
                                     usage_report(usage_kvs[part.host]), part.gpu_uuid, part.id,  # type: ignore[arg-type]
                                     part.pids)}), max(0.0, bound))
                        return True
                    continue
                # The reports list none of them: they must still say so when the lease goes.
                compares += usage_compares
            if (await self.ctx.commits.commit(compares, ops)).succeeded:
                metrics.RELEASES.labels("release").inc()
                return True
        raise errors.Unavailable("release: too much contention; retry")

    async def _other_parts(self, lease: VramLease, from_mirror: bool, hosts: Sequence[str] | None = None) -> list[KV]:
        """The records of a gang's other GPUs, on every host of a multi-host gang (none for a single-GPU lease):
        release, revoke and expiry take the whole gang in one transaction, comparing each. ``hosts``: only the
        records of these hosts."""
        out = []
        for host, uuids in lease.parts:
            if hosts is not None and host not in hosts:
                continue
            for uuid_ in uuids:
                if (host, uuid_) != (lease.host, lease.gpu_uuid):
                    kv = await self._read(self.keys.lease(host, uuid_, lease.id), from_mirror)
                    if kv is not None:
                        out.append(kv)
        return out

    async def _read(self, key: bytes, from_mirror: bool) -> KV | None:
        """A key from the mirror (``from_mirror``: the caller's compares validate it) or from etcd."""
        return self.mirror.get(key) if from_mirror else await self.store.get(key)

    async def attach_processes(self, info: SessionInfo, lease_id: str, pids: list[int], pgid: int,
                               confirm: Confirm | None = None) -> bool:
        """Record the processes a lease covers (owner only): a compare-and-set on the lease's key that
        keeps everything else, token included. False when it already recorded exactly these. ``confirm``
        (once the lease is known to be the caller's, before anything is written) raises unless the node of
        the host says every process is the caller's."""
        wanted = tuple(sorted(set(pids)))
        confirmed = confirm is None or (not wanted and not pgid)
        for _ in range(self.config.commit_attempts):
            lease = await self.find_lease(lease_id, info.host)
            if lease is None:
                raise errors.NotFound(f"lease_id: no live lease {lease_id}", "lease_id")
            joined = bool(lease.hosts) and lease.session_id != info.session_id
            if lease.agent != info.agent or (lease.session_id != info.session_id and not joined):
                raise errors.NotOwner(f"lease_id: lease {lease_id} belongs to another session", "lease_id")
            if (lease.pids, lease.pgid) == (wanted, pgid):
                return False
            if not confirmed:
                assert confirm is not None
                await confirm(lease)
                confirmed = True
            # A gang: every GPU's record names the processes, in one transaction.
            # A multi-host gang: the records of the caller's host only (each host's part runs its own processes,
            # bound by ``run --join`` through a session of the same agent on that host).
            only = [info.host] if lease.hosts else None
            parts = [lease, *(VramLease.from_kv(kv) for kv in await self._other_parts(lease, False, only))]
            res = await self.store.commit(
                [ModRevisionIs(self.keys.lease(x.host, x.gpu_uuid, x.id), x.mod_revision) for x in parts],
                [Put(self.keys.lease(x.host, x.gpu_uuid, x.id),
                     dumps(dataclasses.replace(x, pids=wanted, pgid=pgid).to_json()), x.etcd_lease) for x in parts])
            if res.succeeded:
                return True
        raise errors.Unavailable("attach processes: too much contention; retry")

    def _mirrored_lease(self, lease_id: str, host: str) -> VramLease | None:
        if not self.mirror.ready:
            return None
        kv = self.mirror.lease(lease_id)
        if kv is None:
            return None
        lease = VramLease.from_kv(kv)
        return lease if lease.host == host or lease.hosts else None

    async def find_lease(self, lease_id: str, host: str | None = None) -> VramLease | None:
        prefix = self.keys.leases(host) if host else self.keys.leases()
        snap = await self.store.get_prefix(prefix)
        return _lease_named(snap.kvs, lease_id)


def usage_report(kv: KV) -> dict[str, Any] | None:
    """A node's ``usage/<host>`` report, checked; None when it is malformed (its host is INVALID)."""
    return usage_doc(kv.value)


def usage_doc(value: bytes) -> dict[str, Any] | None:
    """``usage_report`` of a report's stored bytes."""
    try:
        return check_usage(load_record(value, "usage"))
    except InvalidRecord:
        return None


def reported(usage_kv: KV, lease: VramLease) -> bool:
    """Whether the report may still list some of the lease's processes on its GPU: a malformed report
    counts as listing them (fail closed: the VRAM stays held until a report says otherwise, or the bound)."""
    doc = usage_report(usage_kv)
    return doc is None or still_reported(doc, lease.gpu_uuid, lease.id, lease.pids)


def _listed(usage_kv: KV | None, parts: Sequence[VramLease]) -> list[VramLease]:
    """The records of a lease (a gang: one per GPU) whose GPU the report may still list the lease's processes
    on. Each GPU counts on its own: a gang's processes often run one per GPU (a tensor-parallel rank on each),
    so a process listed on the gang's second GPU only holds that GPU."""
    return [] if usage_kv is None else [p for p in parts if reported(usage_kv, p)]


def _notice(kv: KV | None) -> EvictionRecord | None:
    """The notice stored in ``kv``; None when there is none, or it is malformed (then it is set aside)."""
    try:
        return EvictionRecord.from_kv(kv) if kv is not None else None
    except InvalidRecord:
        return None


def _lease_named(kvs: Iterable[KV], lease_id: str) -> VramLease | None:
    """The lease with this id among ``leases/<host>/<gpu>/<id>`` keys (ids are unique across hosts)."""
    for kv in kvs:
        if last_segment(kv.key) == lease_id:
            return VramLease.from_kv(kv)
    return None
