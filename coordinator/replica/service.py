"""The coordinator's decisions: sessions, admission (group commit), release, status.

A replica keeps no state that etcd does not have. What it keeps in memory is a cache (which host a
session is on) and the per-host batches of acquires it is deciding right now. Every decision is made
from one consistent snapshot and committed in one transaction that compares what it read.
"""
from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import logging
import time
import uuid
from typing import Any, Awaitable, Callable, Iterable

from coordinator import errors, metrics, clock
from coordinator.aio import cancel_and_wait, log_failure, retry_forever
from coordinator.records import EvictionRecord, HostInventory, QueueEntry, SessionInfo, VramLease, dumps
from coordinator.replica.admitter import AcquireCall, HostAdmitter
from coordinator.config import (MAX_ATTACHED_PIDS, MAX_CLIENT_VERSION_BYTES, MAX_GRACE_S, MAX_PARTITION_BYTES,
                                MAX_PID, MAX_PRIORITY, MAX_REASON_BYTES, MAX_REQUEST_ID_LEN, MAX_SESSION_ID_LEN, MAX_SPEC_BYTES,
                                MAX_TTL_S, MAX_VRAM_MB, MAX_WAIT_S, MIN_TTL_S, CoordinatorConfig, quote)
from coordinator.replica.mirror import Mirror
from coordinator.replica.observed import Observed
from coordinator.keys import (Keys, etcd_lease_from_session_id, last_segment, lease_id_for, session_id_from_etcd_lease,
                              valid_name)
from coordinator.policy.partition import Partition, PartitionError, compute_partition, default_partition, parse_spec
from coordinator.etcd.election import Election
from coordinator.etcd.store import KV, Snapshot, Store, WatchBatch
from coordinator.etcd.ops import (cmp_absent, cmp_exists, cmp_mod_revision, cmp_range_unchanged, op_delete, op_put,
                                  range_req)
from coordinator.policy.host import HostView
from coordinator.replica.view import host_ranges, host_view

log = logging.getLogger(__name__)


def _check_name(field: str, value: str) -> str:
    if not value:
        raise errors.InvalidArgument(f"{field}: is required", field)
    if not valid_name(value):
        raise errors.InvalidArgument(
            f"{field}: {quote(value)} is not a valid name (letters, digits, '.', '_', ':', '@', '-'; at most 128)",
            field)
    return value


def _check_text(field: str, value: str, max_bytes: int) -> str:
    """A free-text field that is stored in etcd: bounded in UTF-8 bytes."""
    size = len(value.encode("utf-8", "surrogatepass"))
    if size > max_bytes:
        raise errors.InvalidArgument(f"{field}: {size} bytes, more than the limit of {max_bytes}", field)
    return value


def check_session_id(session_id: str, field: str = "session.session_id") -> int:
    """The etcd_lease id a session id names (lowercase hex, at most 16 digits)."""
    if not session_id:
        raise errors.InvalidArgument(f"{field}: is required", field)
    if len(session_id) > MAX_SESSION_ID_LEN or any(c not in "0123456789abcdef" for c in session_id):
        raise errors.InvalidArgument(f"{field}: {quote(session_id)} is not a session id", field)
    return etcd_lease_from_session_id(session_id)


def validate_acquire(vram_mb: int, gpu: str, priority: int, request_id: str, wait_s: float) -> None:
    """Every field of an acquire, before anything is read (not even the session)."""
    if vram_mb <= 0:
        raise errors.InvalidArgument(f"vram_mb: must be > 0, got {vram_mb}", "vram_mb")
    if vram_mb > MAX_VRAM_MB:
        raise errors.InvalidArgument(f"vram_mb: {vram_mb} is above the limit of {MAX_VRAM_MB}", "vram_mb")
    if not -MAX_PRIORITY <= priority <= MAX_PRIORITY:
        raise errors.InvalidArgument(f"priority: must be within [-{MAX_PRIORITY}, {MAX_PRIORITY}]", "priority")
    if len(request_id) > MAX_REQUEST_ID_LEN or any(c in request_id for c in "/\0"):
        raise errors.InvalidArgument(
            f"request_id: at most {MAX_REQUEST_ID_LEN} characters, without '/' or NUL", "request_id")
    if not 0 <= wait_s <= MAX_WAIT_S or wait_s != wait_s:
        raise errors.InvalidArgument(f"wait_seconds: must be within [0, {MAX_WAIT_S:g}]", "wait_seconds")
    if gpu and not valid_name(gpu):
        raise errors.InvalidArgument(f"gpu: {quote(gpu)} is neither a GPU index nor a uuid", "gpu")


class CoordinatorService:
    """The domain side of the Coordinator gRPC service (the servicer translates messages and errors)."""

    def __init__(self, config: CoordinatorConfig, store: Store | None = None, advertise: str = "") -> None:
        self.config = config
        self.keys = Keys(config.prefix)
        # A read is retried (e.g. across an etcd leader election) for at most one more etcd timeout, so
        # that a call fails within about twice the timeout when etcd has no quorum.
        self.store = store or Store(config.etcd, timeout=config.etcd_timeout_s, retry_for=config.etcd_timeout_s,
                                    security=config.etcd_security())
        self.replica_id = uuid.uuid4().hex[:12]
        self.advertise = advertise
        self._sessions: dict[tuple[str, str], SessionInfo] = {}
        self._admitters: dict[str, HostAdmitter] = {}
        # Eviction notices, from the watch: lease id -> record. Admission counts their leases as leaving.
        self.evictions: dict[str, EvictionRecord] = {}
        # KeepAlive streams this replica serves: session id -> queues of outgoing notices.
        self._streams: dict[str, set[asyncio.Queue[Any]]] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self._background: set[asyncio.Task[None]] = set()   # fire-and-forget clean-ups, kept referenced
        self.watch_ready = asyncio.Event()
        self.mirror = Mirror(self.keys)
        # When this replica first saw each usage report, eviction notice and queue entry: ages and deadlines
        # are measured on our own monotonic clock from then, never against another machine's wall clock.
        self.observed = Observed()
        self.leadership: Any = None
        self._closed = False
        self.on_stop: list[Callable[[], Awaitable[None]]] = []   # e.g. the RPC layer's forwarding channels

    async def start(self, leader_duties: bool = True) -> None:
        from coordinator.replica.leader import Leadership
        await self.store.connect()
        self._tasks.append(log_failure(asyncio.create_task(self._watch()), "watch"))
        await asyncio.wait_for(self.watch_ready.wait(), self.config.etcd_timeout_s * 3)
        if leader_duties:
            self.leadership = Leadership(self)
            self._tasks.append(log_failure(asyncio.create_task(self.leadership.run()), "leadership"))

    async def stop(self) -> None:
        self._closed = True
        for a in self._admitters.values():
            await a.stop()
        for q in [q for qs in self._streams.values() for q in qs]:
            q.put_nowait(errors.Unavailable("coordinator is shutting down; reconnect to another replica"))
        if self.leadership is not None:
            await self.leadership.resign()
        await cancel_and_wait(self._tasks)
        for hook in self.on_stop:
            await hook()
        await self.store.close()

    # -- the replica's watch ---------------------------------------------------------------------
    async def _watch(self) -> None:
        """One watch over the whole prefix: keeps the mirror, wakes the hosts' admitters and delivers
        eviction notices. It never gives up: an error starts it over from a fresh read."""
        def not_ready() -> None:
            self.mirror.ready = False
        await retry_forever("the replica's watch", self._watch_once, on_error=not_ready,
                            stop=lambda: self._closed)

    async def _watch_once(self) -> None:
        snap = await self.store.get_prefix(self.keys.root())
        self.mirror.reset(snap.ranges[0], snap.revision)
        self._observe(snap.ranges[0], reset=True)
        self.evictions = {r.lease_id: r for r in (EvictionRecord.from_kv(kv)
                                                  for kv in self.mirror.items("evictions"))}
        self.watch_ready.set()
        for a in self._admitters.values():
            a.notify()
        for session_id in list(self._streams):
            self._push_pending(session_id)
        async for batch in self.store.watch(self.keys.root(), start_revision=snap.revision + 1):
            if batch.resync:
                self.mirror.ready = False
                return
            self.mirror.apply(batch)
            self._observe([ev.kv for ev in batch.events if ev.kind == "PUT"])
            for ev in batch.events:
                if ev.kind != "PUT":
                    self.observed.forget(ev.kv.key)
            self._on_events(batch)

    _OBSERVED_KINDS = ("usage", "evictions", "queue")

    def _observe(self, kvs: Any, reset: bool = False) -> None:
        """Note when we first saw each usage report and queue entry (by mod_revision) and each eviction
        notice (by create_revision: a rewrite keeps its grace running)."""
        seen: set[bytes] = set()
        for kv in kvs:
            try:
                kind, _ = self.keys.parse(kv.key)
            except ValueError:
                continue
            if kind in self._OBSERVED_KINDS:
                self.observed.saw(kv.key, kv.create_revision if kind == "evictions" else kv.mod_revision)
                seen.add(kv.key)
        if reset:
            self.observed.keep_only(seen)

    def usage_age(self, kv: KV) -> float:
        """Seconds since this replica saw this usage report (``usage/<host>`` at this mod_revision)."""
        return self.observed.age(kv.key, kv.mod_revision)

    def notice_deadline(self, kv: KV, record: EvictionRecord) -> float:
        """The monotonic time at which an eviction notice's grace ends, as this replica measures it: the
        grace (two wall times written by the same process) from when we first saw the notice."""
        grace = max(0.0, record.deadline_unix - record.created_at)
        return self.observed.saw(kv.key, kv.create_revision) + grace

    def _on_events(self, batch: WatchBatch) -> None:
        woken: set[str] = set()
        for ev in batch.events:
            try:
                kind, parts = self.keys.parse(ev.kv.key)
            except ValueError:
                continue
            if kind == "evictions" and parts:
                if ev.kind == "PUT":
                    try:
                        record = EvictionRecord.from_kv(ev.kv)
                    except (ValueError, TypeError, KeyError) as e:
                        log.warning("ignoring a malformed eviction notice %r: %r", ev.kv.key, e)
                        continue
                    self.evictions[record.lease_id] = record
                    self._deliver(record)
                    if self.leadership is not None:
                        self.leadership.deadline_wake.set()
                    woken.add(record.host)
                else:
                    gone = self.evictions.pop(parts[0], None)
                    if gone is not None:
                        woken.add(gone.host)
            elif kind in ("leases", "queue", "partitions", "hosts", "usage", "gpus") and parts:
                woken.add(parts[0])
        for host in woken:
            admitter = self._admitters.get(host)
            if admitter is not None and admitter.has_waiters:
                admitter.notify()

    # -- eviction notices to KeepAlive streams ---------------------------------------------------
    def register_stream(self, session_id: str, queue: asyncio.Queue[Any]) -> None:
        self._streams.setdefault(session_id, set()).add(queue)
        self._push_pending(session_id, only=queue)

    def unregister_stream(self, session_id: str, queue: asyncio.Queue[Any]) -> None:
        qs = self._streams.get(session_id)
        if qs is not None:
            qs.discard(queue)
            if not qs:
                del self._streams[session_id]

    def _deliver(self, record: EvictionRecord, only: asyncio.Queue[Any] | None = None) -> None:
        for q in ([only] if only is not None else self._streams.get(record.session_id, ())):
            q.put_nowait(record)

    def _push_pending(self, session_id: str, only: asyncio.Queue[Any] | None = None) -> None:
        for record in list(self.evictions.values()):
            if record.session_id == session_id:
                self._deliver(record, only)

    # -- sessions ------------------------------------------------------------------------------
    async def open_session(self, agent: str, host: str, ttl_s: int, pid: int, client_version: str) -> tuple[str, int]:
        # Every field first: nothing is read, granted or written for a request that is refused.
        _check_name("agent", agent)
        _check_name("host", host)
        ttl = ttl_s or self.config.session_ttl_s
        if not MIN_TTL_S <= ttl <= MAX_TTL_S:
            raise errors.InvalidArgument(f"ttl_seconds: must be within [{MIN_TTL_S}, {MAX_TTL_S}], got {ttl}",
                                         "ttl_seconds")
        if not 0 <= pid <= MAX_PID:
            raise errors.InvalidArgument(f"pid: must be within [0, {MAX_PID}], got {pid}", "pid")
        _check_text("client_version", client_version, MAX_CLIENT_VERSION_BYTES)
        for _ in range(self.config.commit_attempts):
            snap = await self.store.snapshot([range_req(self.keys.host(host)), range_req(self.keys.partition(host)),
                                              range_req(self.keys.sessions(agent), prefix=True, keys_only=True)])
            host_kvs, part_kvs, own_sessions = snap.ranges
            if len(own_sessions) >= self.config.max_sessions_per_agent:
                raise errors.CapacityError(
                    f"sessions: agent {agent!r} has {len(own_sessions)} open sessions, the most allowed "
                    f"(max_sessions_per_agent); close one first", "sessions")
            if not host_kvs:
                raise errors.NotFound(f"host: no node daemon has registered host {host!r}", "host")
            if part_kvs:
                partition = Partition.from_json(part_kvs[0].json()["partition"])
                if not partition.allows(agent):
                    raise errors.NotOwner(
                        f"agent: {agent!r} is not in the {partition.mode} partition of host {host!r}", "agent")
            etcd_lease = await self.store.grant(ttl)
            session_id = session_id_from_etcd_lease(etcd_lease)
            value = dumps({"agent": agent, "host": host, "pid": pid, "client_version": client_version,
                           "ttl": ttl, "opened_at": clock.wall(), "coordinator": self.replica_id})
            part_rev = part_kvs[0].mod_revision if part_kvs else 0
            written = False
            try:
                # No session of the agent opened since the count: the cap holds under concurrent opens.
                res = await self.store.commit(
                    [cmp_exists(self.keys.host(host)), cmp_mod_revision(self.keys.partition(host), part_rev),
                     cmp_range_unchanged(self.keys.sessions(agent), snap.revision)],
                    [op_put(self.keys.session(agent, session_id), value, etcd_lease)])
                written = res.succeeded
            finally:
                if not written:
                    # Whatever went wrong (a lost compare, an etcd error, a cancelled call), nobody will
                    # ever know this etcd_lease: it goes now rather than living out its TTL.
                    await self._revoke_unused(etcd_lease)
            if written:
                self._sessions[(agent, session_id)] = SessionInfo(agent, session_id, host, etcd_lease)
                return session_id, ttl
        raise errors.Unavailable("open session: too much contention on the host's partition; retry")

    async def _revoke_unused(self, etcd_lease: int) -> None:
        """Revoke an etcd_lease that no key uses, even if the caller is being cancelled."""
        async def revoke() -> None:
            try:
                await self.store.revoke(etcd_lease)
            except errors.GpucoordError as e:
                log.warning("could not revoke the unused etcd_lease %x (it expires with its TTL): %s", etcd_lease, e)
        task = asyncio.get_running_loop().create_task(revoke())
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        await asyncio.shield(task)

    async def agent_hosts(self, agent: str) -> set[str]:
        """The hosts on which ``agent`` has a live session (authorization of an agent's reads)."""
        snap = await self.store.get_prefix(self.keys.sessions(agent))
        return {str(kv.json().get("host", "")) for kv in snap.ranges[0]}

    async def session(self, agent: str, session_id: str) -> SessionInfo:
        """The session's (cached) identity. Liveness is checked by every transaction, not here."""
        _check_name("session.agent", agent)
        etcd_lease = check_session_id(session_id)
        info = self._sessions.get((agent, session_id))
        if info is not None:
            return info
        kv = await self.store.get(self.keys.session(agent, session_id))
        if kv is None:
            raise errors.SessionGone(f"session: no live session {session_id} of agent {agent!r} "
                                     "(unknown or expired)", "session")
        info = SessionInfo(agent, session_id, kv.json()["host"], etcd_lease)
        self._sessions[(agent, session_id)] = info
        return info

    async def keepalive(self, info: SessionInfo) -> int:
        ttl = await self.store.keepalive(info.etcd_lease)
        if ttl <= 0:
            self._sessions.pop((info.agent, info.session_id), None)
            raise errors.SessionGone(f"session: session {info.session_id} of agent {info.agent!r} has expired",
                                     "session")
        return ttl

    async def close_session(self, info: SessionInfo) -> None:
        await self.store.revoke(info.etcd_lease)
        self._sessions.pop((info.agent, info.session_id), None)

    # -- host ownership ------------------------------------------------------------------------
    def live_replicas(self) -> dict[str, str]:
        """replica id -> gRPC address, of the replicas registered under ``coordinators/`` (the mirror)."""
        out: dict[str, str] = {}
        for kv in self.mirror.items("coordinators"):
            try:
                doc = kv.json()
                out[str(doc["replica"])] = str(doc.get("address", ""))
            except (ValueError, KeyError, TypeError):
                continue
        return out

    def owner(self, host: str) -> tuple[str, str] | None:
        """The replica that admits on ``host`` (id, address), by rendezvous hashing over the live replicas;
        None when this replica cannot tell (its mirror is not current, or no replica is registered).
        Ownership is a performance property: every decision is still a compare-and-set, so two replicas
        that disagree for a moment (one joined, one died) stay correct, only slower."""
        if not self.mirror.ready:
            return None
        replicas = self.live_replicas()
        if not replicas:
            return None
        winner = owner_of(host, replicas)
        return winner, replicas[winner]

    # -- acquire -------------------------------------------------------------------------------
    async def acquire(self, info: SessionInfo, vram_mb: int, gpu: str, priority: int, preemptible: bool,
                      request_id: str, wait_s: float) -> VramLease:
        validate_acquire(vram_mb, gpu, priority, request_id, wait_s)
        if self._closed:
            raise errors.Unavailable("coordinator is shutting down; retry on another replica")
        request_id = request_id or uuid.uuid4().hex
        loop = asyncio.get_running_loop()
        call = AcquireCall(info, vram_mb, gpu or None, priority, preemptible, request_id,
                           lease_id_for(info.agent, request_id, info.host), wait_s, loop.create_future())
        admitter = self._admitters.get(info.host)
        if admitter is None:
            admitter = self._admitters[info.host] = HostAdmitter(self, info.host)
        return await admitter.submit(call)

    async def withdraw_evictions(self, entry: QueueEntry) -> None:
        """The request that evicted these leases left without a grant: its notices are withdrawn, so that
        nobody is revoked for a request that no longer needs the room (G3)."""
        requested_by = f"{entry.agent}/{entry.request_id}"
        for victim in entry.victims:
            key = self.keys.eviction(victim)
            kv = self.mirror.get(key)
            if kv is None or EvictionRecord.from_kv(kv).requested_by != requested_by:
                continue
            res = await self.store.commit([cmp_mod_revision(key, kv.mod_revision)], [op_delete(key)])
            if res.succeeded:
                log.info("withdrew the eviction notice of lease %s: its requester left", victim)

    # -- operator: evict and revoke ----------------------------------------------------------------
    async def evict(self, lease_id: str, grace_s: float, reason: str, asked_by: str = "") -> float:
        """Send an eviction notice; the leader revokes the lease at the deadline if it is still held."""
        check_lease_id(lease_id)
        if grace_s < 0 or grace_s != grace_s or grace_s > MAX_GRACE_S:
            raise errors.InvalidArgument(f"grace_seconds: must be within [0, {MAX_GRACE_S:g}]", "grace_seconds")
        _check_text("reason", reason, MAX_REASON_BYTES)
        grace = grace_s or self.config.eviction_grace_s
        for _ in range(self.config.commit_attempts):
            lease = await self.find_lease(lease_id)
            if lease is None:
                raise errors.NotFound(f"lease_id: no live lease {lease_id}", "lease_id")
            now = clock.wall()
            existing = await self.store.get(self.keys.eviction(lease_id))
            if existing is not None:
                record = EvictionRecord.from_kv(existing)
                if record.requested_by == "operator":
                    return float(record.deadline_unix)
                # A request's notice becomes the operator's: it must not be withdrawn if that request
                # gives up, and the operator's grace may bring the deadline forward.
                record = dataclasses.replace(record, requested_by="operator", requester_priority=None,
                                             reason=reason or "operator", asked_by=asked_by,
                                             deadline_unix=min(record.deadline_unix, now + grace))
                res = await self.store.commit(
                    [cmp_mod_revision(existing.key, existing.mod_revision)],
                    [op_put(existing.key, dumps(record.to_json()), existing.etcd_lease)])
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
                [cmp_mod_revision(key, lease.mod_revision), cmp_absent(self.keys.eviction(lease_id))],
                [op_put(self.keys.eviction(lease_id), dumps(record.to_json()), lease.etcd_lease)])
            if res.succeeded:
                metrics.EVICTIONS.labels("notice").inc()
                return record.deadline_unix
        raise errors.Unavailable("evict: too much contention; retry")

    async def revoke(self, lease_id: str, host: str | None = None, notice_revision: int | None = None,
                     fence: Election | None = None) -> bool:
        """Delete a lease now (operator, or the leader at an eviction deadline). False if it was gone.

        With ``notice_revision`` (the leader at a deadline) it happens only while that very notice still
        stands: a notice withdrawn meanwhile (its requester left) saves the lease. With ``fence`` (the
        leader) every write also compares the leader's candidacy, and a deposed leader gets NotOwner.
        """
        check_lease_id(lease_id)
        notice_key = self.keys.eviction(lease_id)
        fenced = fence.fence() if fence is not None else []
        for _ in range(self.config.commit_attempts):
            lease = await self.find_lease(lease_id, host)
            if lease is None:
                if notice_revision is None:
                    await self.store.delete(notice_key)
                else:
                    await self.store.commit([cmp_mod_revision(notice_key, notice_revision), *fenced],
                                            [op_delete(notice_key)])
                return False
            key = self.keys.lease(lease.host, lease.gpu_uuid, lease.id)
            compares = [cmp_mod_revision(key, lease.mod_revision), *fenced]
            if notice_revision is not None:
                compares.append(cmp_mod_revision(notice_key, notice_revision))
            res = await self.store.commit(compares, [op_delete(key), op_delete(notice_key)])
            if res.succeeded:
                metrics.EVICTIONS.labels("revoke").inc()
                return True
            if fence is not None and not await fence.holds():
                raise errors.NotOwner("leader: this replica is no longer the leader", "leader")
            if notice_revision is not None and (await self.store.get(notice_key)) is None:
                return False   # withdrawn: nothing to enforce any more
        raise errors.Unavailable("revoke: too much contention; retry")

    # -- release -------------------------------------------------------------------------------
    async def release(self, info: SessionInfo, lease_id: str) -> bool:
        """Delete the lease if it is the caller's. Idempotent: a lease that is gone answers False."""
        check_lease_id(lease_id)
        for attempt in range(self.config.commit_attempts):
            # First from the mirror (a miss or a lost compare falls back to reading etcd).
            lease = self._mirrored_lease(lease_id, info.host) if attempt == 0 else None
            if lease is not None and lease.session_id != info.session_id:
                lease = None   # only the positive case is trusted from the mirror
            if lease is None:
                lease = await self.find_lease(lease_id, info.host)
            if lease is None:
                return False
            if lease.session_id != info.session_id or lease.agent != info.agent:
                raise errors.NotOwner(f"lease_id: lease {lease_id} belongs to another session", "lease_id")
            key = self.keys.lease(lease.host, lease.gpu_uuid, lease.id)
            res = await self.store.commit([cmp_mod_revision(key, lease.mod_revision)],
                                          [op_delete(key), op_delete(self.keys.eviction(lease.id))])
            if res.succeeded:
                metrics.RELEASES.inc()
                return True
        raise errors.Unavailable("release: too much contention; retry")

    async def attach_processes(self, info: SessionInfo, lease_id: str, pids: list[int], pgid: int) -> bool:
        """Record the processes a lease covers (owner only): a compare-and-set on the lease's key that
        keeps everything else, token included. False when it already recorded exactly these."""
        validate_attach(lease_id, pids, pgid)
        wanted = tuple(sorted(set(pids)))
        for _ in range(self.config.commit_attempts):
            lease = await self.find_lease(lease_id, info.host)
            if lease is None:
                raise errors.NotFound(f"lease_id: no live lease {lease_id}", "lease_id")
            if lease.session_id != info.session_id or lease.agent != info.agent:
                raise errors.NotOwner(f"lease_id: lease {lease_id} belongs to another session", "lease_id")
            if (lease.pids, lease.pgid) == (wanted, pgid):
                return False
            key = self.keys.lease(lease.host, lease.gpu_uuid, lease.id)
            value = dumps(dataclasses.replace(lease, pids=wanted, pgid=pgid).to_json())
            res = await self.store.commit([cmp_mod_revision(key, lease.mod_revision)],
                                          [op_put(key, value, lease.etcd_lease)])
            if res.succeeded:
                return True
        raise errors.Unavailable("attach processes: too much contention; retry")

    def _mirrored_lease(self, lease_id: str, host: str) -> VramLease | None:
        if not self.mirror.ready:
            return None
        return _lease_named(self.mirror.host_items("leases", host), lease_id)

    async def find_lease(self, lease_id: str, host: str | None = None) -> VramLease | None:
        prefix = self.keys.leases(host) if host else self.keys.leases()
        snap = await self.store.get_prefix(prefix)
        return _lease_named(snap.ranges[0], lease_id)

    # -- partitions ----------------------------------------------------------------------------
    async def apply_partition(self, spec_data: dict[str, Any], dry_run: bool, evict: bool) -> tuple[Partition, bool]:
        size = len(dumps(spec_data))
        if size > MAX_SPEC_BYTES:
            raise errors.InvalidArgument(f"spec: {size} bytes of JSON, more than the limit of {MAX_SPEC_BYTES}",
                                         "spec")
        try:
            spec = parse_spec(spec_data)
        except PartitionError as e:
            raise errors.InvalidArgument(str(e), e.field) from e
        _check_name("host", spec.host)
        deadline = time.monotonic() + self.config.eviction_grace_s + 5
        for _ in range(self.config.commit_attempts * 4):
            snap = await self.store.snapshot(host_ranges(self.keys, spec.host))
            view = host_view(self.keys, spec.host, snap, untracked=False)
            if view.inventory is None:
                raise errors.NotFound(f"host: no node daemon has registered host {spec.host!r}", "host")
            try:
                partition = compute_partition(view.inventory, spec)
            except PartitionError as e:
                raise errors.InvalidArgument(str(e), e.field) from e
            conflicts, offenders = partition_conflicts(partition, view)
            if conflicts and (not evict or dry_run):
                raise errors.FailedPrecondition(
                    "partition: live leases would break the new partition: " + "; ".join(conflicts)
                    + ("" if dry_run else " (apply with --evict to send them eviction notices)"), "partition")
            if conflicts:
                # --evict: notices to the offenders; the partition is written once they are gone (released,
                # or revoked by the leader at their deadline), so no revision ever breaks the new caps.
                if time.monotonic() > deadline:
                    raise errors.Unavailable("partition: the evicted leases are still held; retry", "partition")
                for lease in offenders:
                    try:
                        await self.evict(lease.id, 0, f"partition of {spec.host} changes")
                    except errors.NotFound:
                        pass
                await self._host_changed(spec.host, snap.revision, timeout=1.0)
                continue
            if dry_run:
                return partition, False
            part_key = self.keys.partition(spec.host)
            compares = [cmp_mod_revision(part_key, view.partition_kv.mod_revision if view.partition_kv else 0)]
            # Any admission on the host bumps a ledger: comparing them all orders apply against acquires.
            compares += [cmp_mod_revision(self.keys.gpu(spec.host, u), g.ledger.mod_revision)
                         for u, g in view.gpus.items()]
            value = dumps({"partition": partition.to_json()})
            if len(value) > MAX_PARTITION_BYTES:
                raise errors.InvalidArgument(f"partition: the computed partition takes {len(value)} bytes, more "
                                             f"than the limit of {MAX_PARTITION_BYTES}", "partition")
            res = await self.store.commit(compares, [op_put(part_key, value)])
            if res.succeeded:
                return partition, True
        raise errors.Unavailable("partition apply: too much contention; retry")

    async def _host_changed(self, host: str, revision: int, timeout: float) -> None:
        """Wait (at most ``timeout``) for any lease on ``host`` to change after ``revision``."""
        async def watch() -> None:
            async for batch in self.store.watch(self.keys.leases(host), start_revision=revision + 1):
                if batch.events or batch.resync:
                    return
        try:
            await asyncio.wait_for(watch(), timeout)
        except asyncio.TimeoutError:
            pass

    async def get_partition(self, host: str) -> tuple[Partition, bool]:
        _check_name("host", host)
        snap = await self.store.snapshot([range_req(self.keys.host(host)), range_req(self.keys.partition(host))])
        host_kvs, part_kvs = snap.ranges
        if part_kvs:
            return Partition.from_json(part_kvs[0].json()["partition"]), True
        if not host_kvs:
            raise errors.NotFound(f"host: no node daemon has registered host {host!r}", "host")
        return default_partition(HostInventory.from_json(host_kvs[0].json()["inventory"])), False

    # -- status --------------------------------------------------------------------------------
    async def status(self, host: str = "") -> tuple[int, list[HostView], dict[int, int]]:
        """Every host's view at one revision, plus the remaining TTL of each session's etcd_lease."""
        if host:
            _check_name("host", host)
            snap = await self.store.snapshot(host_ranges(self.keys, host))
            views = [host_view(self.keys, host, snap, self.config.untracked_vram, self.usage_age)]
        else:
            # Six whole-prefix ranges in one transaction, whatever the number of hosts (a range per host
            # would pass etcd's limit of operations per transaction).
            kinds = ("hosts", "usage", "partitions", "gpus", "leases", "queue")
            snap = await self.store.snapshot([range_req(self.keys.kind(k), prefix=True)
                                              for k in kinds])
            per_host: dict[str, list[list[KV]]] = {}
            for i, kvs in enumerate(snap.ranges):
                for kv in kvs:
                    h = self.keys.parse(kv.key)[1][0]
                    per_host.setdefault(h, [[] for _ in kinds])[i].append(kv)
            views = [host_view(self.keys, h, Snapshot(snap.revision, tuple(tuple(r) for r in per_host[h])),
                               self.config.untracked_vram, self.usage_age)
                     for h in sorted(per_host)]
        etcd_leases = {lease.etcd_lease for v in views for lease in v.leases.values()}
        ttls = dict(zip(etcd_leases, await asyncio.gather(*(self.store.time_to_live(x) for x in etcd_leases))))
        return snap.revision, views, ttls


def owner_of(host: str, replicas: Iterable[str]) -> str:
    """Rendezvous (highest random weight) hashing: the replica whose hash with the host is highest. When a
    replica joins or leaves, only the hosts it wins or held move."""
    return max(replicas, key=lambda r: hashlib.sha256(f"{host}\0{r}".encode()).digest())


def validate_attach(lease_id: str, pids: list[int], pgid: int) -> None:
    """Every field of AttachProcesses, before anything is read (not even the session)."""
    check_lease_id(lease_id)
    if len(pids) > MAX_ATTACHED_PIDS:
        raise errors.InvalidArgument(f"pids: at most {MAX_ATTACHED_PIDS}, got {len(pids)}", "pids")
    bad = [p for p in pids if not 1 <= p <= MAX_PID]
    if bad:
        raise errors.InvalidArgument(f"pids: {bad[0]} is not a process id (1..{MAX_PID})", "pids")
    if not 0 <= pgid <= MAX_PID:
        raise errors.InvalidArgument(f"pgid: {pgid} is not a process group id (0 for none, or 1..{MAX_PID})",
                                     "pgid")


def check_lease_id(lease_id: str) -> None:
    if not lease_id or not valid_name(lease_id):
        raise errors.InvalidArgument(f"lease_id: {quote(lease_id)} is not a lease id", "lease_id")


def _lease_named(kvs: Any, lease_id: str) -> VramLease | None:
    """The lease with this id among ``leases/<host>/<gpu>/<id>`` keys (ids are unique across hosts)."""
    for kv in kvs:
        if last_segment(kv.key) == lease_id:
            return VramLease.from_kv(kv)
    return None


def partition_conflicts(partition: Partition, view: HostView) -> tuple[list[str], list[VramLease]]:
    """Live leases that the new partition would not admit: readable lines, and the fewest leases (newest
    first) whose removal would make it admit the rest."""
    assert view.inventory is not None
    lines: list[str] = []
    offenders: dict[str, VramLease] = {}
    newest_first = sorted(view.leases.values(), key=lambda x: (-x.created_at, -x.token))
    per_agent_gpu: dict[tuple[str, str], list[VramLease]] = {}
    for lease in newest_first:
        per_agent_gpu.setdefault((lease.agent, lease.gpu_uuid), []).append(lease)
    for (agent, gpu_uuid), held in sorted(per_agent_gpu.items()):
        used = sum(x.vram_mb for x in held)
        caps = partition.gpu_caps(agent, view.inventory)
        if not partition.allows(agent):
            lines.append(f"agent {agent} holds {used} MiB on {gpu_uuid} but is not in the partition")
            offenders.update((x.id, x) for x in held)
        elif gpu_uuid not in caps:
            lines.append(f"agent {agent} holds {used} MiB on {gpu_uuid}, outside its partition")
            offenders.update((x.id, x) for x in held)
        elif used > caps[gpu_uuid]:
            lines.append(f"agent {agent} holds {used} MiB on {gpu_uuid}, above its cap of {caps[gpu_uuid]} MiB")
            for x in held:
                if used <= caps[gpu_uuid]:
                    break
                offenders[x.id] = x
                used -= x.vram_mb
    for gpu in view.gpus.values():
        usable = partition.usable_mb(view.inventory.gpu(gpu.uuid))  # type: ignore[arg-type]
        if gpu.leased_mb > usable:
            lines.append(f"GPU {gpu.uuid} has {gpu.leased_mb} MiB leased, above the new usable {usable} MiB")
            left = gpu.leased_mb - sum(x.vram_mb for x in offenders.values() if x.gpu_uuid == gpu.uuid)
            for x in sorted(gpu.leases, key=lambda x: (-x.created_at, -x.token)):
                if left <= usable:
                    break
                if x.id not in offenders:
                    offenders[x.id] = x
                    left -= x.vram_mb
    return lines, list(offenders.values())


def status_json(revision: int, views: list[HostView], ttls: dict[int, int]) -> dict[str, Any]:
    """The operator's view, as plain JSON (``gpucoord status --json``)."""
    hosts = []
    for v in views:
        inv = v.inventory
        part = v.partition or (default_partition(inv) if inv else None)
        # The node's attribution of each GPU's processes to leases (over-use, orphans), as last reported.
        reported = {str(g.get("uuid")): g for g in (v.usage or {}).get("gpus", ())}
        gpus = []
        for g in sorted(v.gpus.values(), key=lambda g: g.index):
            gpus.append({"index": g.index, "uuid": g.uuid, "total_mb": g.total_mb, "usable_mb": g.usable_mb,
                         "leased_mb": g.leased_mb, "used_mb": -1 if g.nvml_used_mb is None else g.nvml_used_mb,
                         "untracked_mb": g.untracked_mb, "free_mb": g.free_mb, "seq": g.seq,
                         "name": next((x.name for x in inv.gpus if x.uuid == g.uuid), "") if inv else "",
                         "processes": list(reported.get(g.uuid, {}).get("processes", ())),
                         "lease_use": list(reported.get(g.uuid, {}).get("leases", ()))})
        leases = [{**lease.to_json(), "ttl_remaining": ttls.get(lease.etcd_lease, -1)}
                  for lease in sorted(v.leases.values(), key=lambda x: (x.gpu_index, x.token))]
        agents = []
        if part is not None and inv is not None:
            for alloc in part.allocations:
                used = [lease for lease in v.leases.values() if lease.agent == alloc.agent]
                agents.append({"agent": alloc.agent, "allocation": alloc.to_json(),
                               "leased_mb": sum(x.vram_mb for x in used), "leases": len(used)})
        queue = [json.loads(kv.value) | {"rank": last_segment(v_key)}
                 for kv in v.queue for v_key in [kv.key]]
        hosts.append({
            "host": v.host, "alive": v.alive, "address": json.loads(v.host_kv.value).get("address", "") if v.host_kv else "",
            "simulated": bool(inv.simulated) if inv else False, "usage_age_s": round(v.usage_age_s, 1),
            "usage_stale": v.usage_stale,
            "cpu_count": inv.cpu_count if inv else 0, "mem_bytes": inv.mem_bytes if inv else 0,
            "disk_bytes": inv.disk_bytes if inv else 0, "partition_mode": part.mode if part else "shared",
            "partition_explicit": v.partition is not None, "gpus": gpus, "agents": agents, "leases": leases,
            "queue": queue})
    return {"revision": revision, "hosts": hosts}
