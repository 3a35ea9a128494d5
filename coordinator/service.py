"""The coordinator's decisions: sessions, admission (group commit), release, status.

A replica keeps no state that etcd does not have. What it keeps in memory is a cache (which host a
session is on) and the per-host batches of acquires it is deciding right now. Every decision is made
from one consistent snapshot and committed in one transaction that compares what it read.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import random
import time
import uuid
from typing import Any, Sequence

from coordinator import errors, metrics
from coordinator.admission import GpuLedger, GpuView, VramLease, best_fit, never_fits
from coordinator.config import MAX_PRIORITY, MAX_REQUEST_ID_LEN, MAX_TTL_S, MAX_VRAM_MB, MAX_WAIT_S, MIN_TTL_S, CoordinatorConfig
from coordinator.keys import Keys, etcd_lease_from_session_id, lease_id_for, session_id_from_etcd_lease, valid_name
from coordinator.models import HostInventory, dumps
from coordinator.partition import Partition, PartitionError, compute_partition, default_partition, parse_spec
from coordinator.store import (KV, Snapshot, Store, cmp_exists, cmp_mod_revision, op_delete, op_put,
                               range_req)

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class SessionInfo:
    agent: str
    session_id: str
    host: str
    etcd_lease: int


@dataclasses.dataclass
class AcquireCall:
    session: SessionInfo
    vram_mb: int
    gpu_ref: str | None
    priority: int
    preemptible: bool
    request_id: str
    lease_id: str
    future: asyncio.Future[VramLease]


def _usage_fresh(usage: dict[str, Any] | None, now: float) -> dict[str, int]:
    """NVML used VRAM per GPU uuid, or {} when the usage is missing or stale (> 3 node intervals old)."""
    if not usage:
        return {}
    interval = float(usage.get("interval_s", 5.0))
    if now - float(usage.get("ts", 0)) > 3 * interval:
        return {}
    return {g["uuid"]: int(g["vram_used_mb"]) for g in usage.get("gpus", ())}


@dataclasses.dataclass
class HostView:
    """A host as one snapshot shows it."""

    host: str
    revision: int
    inventory: HostInventory | None
    host_kv: KV | None
    partition: Partition | None
    partition_kv: KV | None
    gpus: dict[str, GpuView]
    leases: dict[str, VramLease]
    usage: dict[str, Any] | None
    queue: tuple[KV, ...]

    @property
    def alive(self) -> bool:
        return self.host_kv is not None

    def effective_partition(self) -> Partition:
        if self.partition is not None:
            return self.partition
        assert self.inventory is not None
        return default_partition(self.inventory)


def host_ranges(keys: Keys, host: str) -> list[Any]:
    return [
        range_req(keys.host(host)),
        range_req(keys.usage(host)),
        range_req(keys.partition(host)),
        range_req(keys.gpus(host), prefix=True),
        range_req(keys.leases(host), prefix=True),
        range_req(keys.queue(host), prefix=True),
    ]


def host_view(keys: Keys, host: str, snap: Snapshot, untracked: bool, now: float | None = None) -> HostView:
    """Build a HostView from the first six ranges of a snapshot taken with ``host_ranges``."""
    now = time.time() if now is None else now
    host_kvs, usage_kvs, part_kvs, ledger_kvs, lease_kvs, queue_kvs = snap.ranges[:6]
    host_kv = host_kvs[0] if host_kvs else None
    inventory = HostInventory.from_json(host_kv.json()["inventory"]) if host_kv else None
    part_kv = part_kvs[0] if part_kvs else None
    partition = Partition.from_json(part_kv.json()["partition"]) if part_kv else None
    usage = usage_kvs[0].json() if usage_kvs else None
    used = _usage_fresh(usage, now) if untracked else {}
    ledgers = {keys.parse(kv.key)[1][-1]: GpuLedger.from_kv(kv) for kv in ledger_kvs}
    leases = {}
    by_gpu: dict[str, list[VramLease]] = {}
    for kv in lease_kvs:
        lease = VramLease.from_kv(kv)
        leases[lease.id] = lease
        by_gpu.setdefault(lease.gpu_uuid, []).append(lease)
    gpus: dict[str, GpuView] = {}
    if inventory is not None:
        part = partition or default_partition(inventory)
        for g in inventory.gpus:
            gpus[g.uuid] = GpuView(
                uuid=g.uuid, index=g.index, total_mb=g.vram_total_mb, usable_mb=part.usable_mb(g),
                ledger=ledgers.get(g.uuid, GpuLedger(g.vram_total_mb, 0, 0)),
                leases=list(by_gpu.get(g.uuid, ())), nvml_used_mb=used.get(g.uuid))
    return HostView(host, snap.revision, inventory, host_kv, partition, part_kv, gpus, leases, usage, queue_kvs)


def _check_name(field: str, value: str) -> str:
    if not value:
        raise errors.InvalidArgument(f"{field}: is required", field)
    if not valid_name(value):
        raise errors.InvalidArgument(
            f"{field}: {value!r} is not a valid name (letters, digits, '.', '_', ':', '@', '-'; at most 128)", field)
    return value


class CoordinatorService:
    """The domain side of the Coordinator gRPC service (the servicer translates messages and errors)."""

    def __init__(self, config: CoordinatorConfig, store: Store | None = None) -> None:
        self.config = config
        self.keys = Keys(config.prefix)
        self.store = store or Store(config.etcd, timeout=config.etcd_timeout_s)
        self.replica_id = uuid.uuid4().hex[:12]
        self._sessions: dict[tuple[str, str], SessionInfo] = {}
        self._admitters: dict[str, _HostAdmitter] = {}
        self._closed = False

    async def start(self) -> None:
        await self.store.connect()

    async def stop(self) -> None:
        self._closed = True
        for a in self._admitters.values():
            await a.stop()
        await self.store.close()

    # -- sessions ------------------------------------------------------------------------------
    async def open_session(self, agent: str, host: str, ttl_s: int, pid: int, client_version: str) -> tuple[str, int]:
        _check_name("agent", agent)
        _check_name("host", host)
        ttl = ttl_s or self.config.session_ttl_s
        if not MIN_TTL_S <= ttl <= MAX_TTL_S:
            raise errors.InvalidArgument(f"ttl_seconds: must be within [{MIN_TTL_S}, {MAX_TTL_S}], got {ttl}",
                                         "ttl_seconds")
        for _ in range(self.config.commit_attempts):
            snap = await self.store.snapshot([range_req(self.keys.host(host)), range_req(self.keys.partition(host))])
            host_kvs, part_kvs = snap.ranges
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
                           "ttl": ttl, "opened_at": time.time(), "coordinator": self.replica_id})
            part_rev = part_kvs[0].mod_revision if part_kvs else 0
            res = await self.store.commit(
                [cmp_exists(self.keys.host(host)), cmp_mod_revision(self.keys.partition(host), part_rev)],
                [op_put(self.keys.session(agent, session_id), value, etcd_lease)])
            if res.succeeded:
                self._sessions[(agent, session_id)] = SessionInfo(agent, session_id, host, etcd_lease)
                return session_id, ttl
            await self.store.revoke(etcd_lease)
        raise errors.Unavailable("open session: too much contention on the host's partition; retry")

    async def session(self, agent: str, session_id: str) -> SessionInfo:
        """The session's (cached) identity. Liveness is checked by every transaction, not here."""
        _check_name("session.agent", agent)
        if not session_id:
            raise errors.InvalidArgument("session.session_id: is required", "session.session_id")
        info = self._sessions.get((agent, session_id))
        if info is not None:
            return info
        try:
            etcd_lease = etcd_lease_from_session_id(session_id)
        except ValueError:
            raise errors.InvalidArgument(f"session.session_id: {session_id!r} is not a session id",
                                         "session.session_id") from None
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

    # -- acquire -------------------------------------------------------------------------------
    async def acquire(self, info: SessionInfo, vram_mb: int, gpu: str, priority: int, preemptible: bool,
                      request_id: str, wait_s: float) -> VramLease:
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
            raise errors.InvalidArgument(f"wait_seconds: must be within [0, {MAX_WAIT_S}]", "wait_seconds")
        if gpu and not valid_name(gpu):
            raise errors.InvalidArgument(f"gpu: {gpu!r} is neither a GPU index nor a uuid", "gpu")
        request_id = request_id or uuid.uuid4().hex
        loop = asyncio.get_running_loop()
        call = AcquireCall(info, vram_mb, gpu or None, priority, preemptible, request_id,
                           lease_id_for(info.agent, request_id), loop.create_future())
        admitter = self._admitters.get(info.host)
        if admitter is None:
            admitter = self._admitters[info.host] = _HostAdmitter(self, info.host)
        return await admitter.submit(call)

    # -- release -------------------------------------------------------------------------------
    async def release(self, info: SessionInfo, lease_id: str) -> bool:
        """Delete the lease if it is the caller's. Idempotent: a lease that is gone answers False."""
        if not lease_id or not valid_name(lease_id):
            raise errors.InvalidArgument(f"lease_id: {lease_id!r} is not a lease id", "lease_id")
        for _ in range(self.config.commit_attempts):
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

    async def find_lease(self, lease_id: str, host: str | None = None) -> VramLease | None:
        prefix = self.keys.leases(host) if host else self.keys.leases()
        snap = await self.store.get_prefix(prefix)
        for kv in snap.ranges[0]:
            if kv.key.endswith(b"/" + lease_id.encode()):
                return VramLease.from_kv(kv)
        return None

    # -- partitions ----------------------------------------------------------------------------
    async def apply_partition(self, spec_data: dict[str, Any], dry_run: bool, evict: bool) -> tuple[Partition, bool]:
        try:
            spec = parse_spec(spec_data)
        except PartitionError as e:
            raise errors.InvalidArgument(str(e), e.field) from e
        _check_name("host", spec.host)
        if evict:
            raise errors.FailedPrecondition("evict: --evict is not supported yet (it comes with eviction)", "evict")
        for _ in range(self.config.commit_attempts):
            snap = await self.store.snapshot(host_ranges(self.keys, spec.host))
            view = host_view(self.keys, spec.host, snap, untracked=False)
            if view.inventory is None:
                raise errors.NotFound(f"host: no node daemon has registered host {spec.host!r}", "host")
            try:
                partition = compute_partition(view.inventory, spec)
            except PartitionError as e:
                raise errors.InvalidArgument(str(e), e.field) from e
            conflicts = partition_conflicts(partition, view)
            if conflicts:
                raise errors.FailedPrecondition(
                    "partition: live leases would break the new partition: " + "; ".join(conflicts), "partition")
            if dry_run:
                return partition, False
            part_key = self.keys.partition(spec.host)
            compares = [cmp_mod_revision(part_key, view.partition_kv.mod_revision if view.partition_kv else 0)]
            # Any admission on the host bumps a ledger: comparing them all orders apply against acquires.
            compares += [cmp_mod_revision(self.keys.gpu(spec.host, u), g.ledger.mod_revision)
                         for u, g in view.gpus.items()]
            res = await self.store.commit(compares, [op_put(part_key, dumps({"partition": partition.to_json()}))])
            if res.succeeded:
                return partition, True
        raise errors.Unavailable("partition apply: too much contention; retry")

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
            hosts = [host]
        else:
            snap = await self.store.snapshot([range_req(self.keys.hosts(), prefix=True, keys_only=True),
                                              range_req(self.keys.gpus(), prefix=True, keys_only=True),
                                              range_req(self.keys.partitions(), prefix=True, keys_only=True)])
            names = {self.keys.parse(kv.key)[1][0] for r in snap.ranges for kv in r}
            hosts = sorted(names)
        ranges = [r for h in hosts for r in host_ranges(self.keys, h)]
        snap = await self.store.snapshot(ranges)
        views = []
        for i, h in enumerate(hosts):
            sub = Snapshot(snap.revision, snap.ranges[6 * i: 6 * i + 6])
            views.append(host_view(self.keys, h, sub, self.config.untracked_vram))
        etcd_leases = {lease.etcd_lease for v in views for lease in v.leases.values()}
        ttls = dict(zip(etcd_leases, await asyncio.gather(*(self.store.time_to_live(x) for x in etcd_leases))))
        return snap.revision, views, ttls


def partition_conflicts(partition: Partition, view: HostView) -> list[str]:
    """Live leases that the new partition would not admit, as readable lines (empty: none)."""
    assert view.inventory is not None
    out = []
    per_agent_gpu: dict[tuple[str, str], int] = {}
    for lease in view.leases.values():
        per_agent_gpu[(lease.agent, lease.gpu_uuid)] = per_agent_gpu.get((lease.agent, lease.gpu_uuid), 0) + lease.vram_mb
    for (agent, gpu_uuid), used in sorted(per_agent_gpu.items()):
        caps = partition.gpu_caps(agent, view.inventory)
        if not partition.allows(agent):
            out.append(f"agent {agent} holds {used} MiB on {gpu_uuid} but is not in the partition")
        elif gpu_uuid not in caps:
            out.append(f"agent {agent} holds {used} MiB on {gpu_uuid}, outside its partition")
        elif used > caps[gpu_uuid]:
            out.append(f"agent {agent} holds {used} MiB on {gpu_uuid}, above its cap of {caps[gpu_uuid]} MiB")
    for gpu in view.gpus.values():
        if gpu.leased_mb > partition.usable_mb(view.inventory.gpu(gpu.uuid)):  # type: ignore[arg-type]
            out.append(f"GPU {gpu.uuid} has {gpu.leased_mb} MiB leased, above the new usable VRAM")
    return out


class _HostAdmitter:
    """Group commit for one host: concurrent acquires are decided from one snapshot, committed in one txn.

    Compare-and-set then only settles the rare conflicts between replicas; within this replica the
    acquires of a host never fight each other.
    """

    def __init__(self, svc: CoordinatorService, host: str) -> None:
        self.svc = svc
        self.host = host
        self._pending: list[AcquireCall] = []
        self._wake = asyncio.Event()
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        self._task.cancel()
        try:
            await self._task
        except (asyncio.CancelledError, Exception):
            pass
        for c in self._pending:
            if not c.future.done():
                c.future.set_exception(errors.Unavailable("coordinator is shutting down; retry"))

    async def submit(self, call: AcquireCall) -> VramLease:
        self._pending.append(call)
        self._wake.set()
        return await call.future

    async def _run(self) -> None:
        cfg = self.svc.config
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._pending:
                batch = [c for c in self._pending[: cfg.batch_max] if not c.future.done()]
                del self._pending[: cfg.batch_max]
                if not batch:
                    continue
                metrics.BATCH_SIZE.observe(len(batch))
                try:
                    await self._admit(batch)
                except errors.GpucoordError as e:
                    metrics.ETCD_ERRORS.labels(type(e).__name__).inc()
                    for c in batch:
                        if not c.future.done():
                            c.future.set_exception(e)
                except Exception as e:  # never let one batch kill the host's admitter
                    log.exception("admission of a batch on %s failed", self.host)
                    for c in batch:
                        if not c.future.done():
                            c.future.set_exception(errors.Unavailable(f"internal error: {e!r}"))

    async def _admit(self, batch: list[AcquireCall]) -> None:
        svc, keys = self.svc, self.svc.keys
        for attempt in range(svc.config.commit_attempts):
            batch = [c for c in batch if not c.future.done()]
            if not batch:
                return
            sessions = list({c.session.session_id: c.session for c in batch}.values())
            # The first read may be served locally (serializable): every grant it leads to is validated by
            # the commit's compares. A retry reads linearizably, so a lagging member cannot starve us.
            snap = await svc.store.snapshot(
                host_ranges(keys, self.host) + [range_req(keys.session(s.agent, s.session_id)) for s in sessions],
                serializable=attempt == 0)
            view = host_view(keys, self.host, snap, svc.config.untracked_vram)
            live = {s.session_id for s, r in zip(sessions, snap.ranges[6:]) if r}
            grants: list[tuple[AcquireCall, VramLease]] = []
            for c in batch:
                try:
                    lease, new = self._decide(c, view, live)
                except errors.GpucoordError as e:
                    metrics.REFUSALS.labels(type(e).__name__).inc()
                    c.future.set_exception(e)
                    continue
                if new:
                    grants.append((c, lease))
                else:
                    c.future.set_result(lease)
            if not grants:
                return
            compares, ops = self._transaction(view, grants)
            try:
                res = await svc.store.commit(compares, ops)
            except (errors.SessionGone, errors.OutcomeUnknown):
                # A session expired under us, or we do not know whether it applied: the lease ids are
                # deterministic, so reading again settles it either way.
                res = None
            if res is not None and res.succeeded:
                for c, lease in grants:
                    metrics.ADMISSIONS.labels(self.host).inc()
                    if not c.future.done():
                        c.future.set_result(dataclasses.replace(lease, mod_revision=res.revision))
                return
            metrics.CONFLICTS.inc()
            batch = [c for c, _ in grants]
            await asyncio.sleep(random.uniform(0, min(0.05, 0.001 * 2 ** attempt)))
        raise errors.Unavailable(f"acquire: admission on host {self.host} lost {svc.config.commit_attempts} "
                                 "compare-and-set rounds in a row; retry")

    def _decide(self, c: AcquireCall, view: HostView, live: set[str]) -> tuple[VramLease, bool]:
        """Admit ``c`` into ``view`` (mutating it) or raise why not. Returns (lease, is_new)."""
        agent = c.session.agent
        if c.session.session_id not in live:
            raise errors.SessionGone(f"session: no live session {c.session.session_id} of agent {agent!r} "
                                     "(unknown or expired)", "session")
        existing = view.leases.get(c.lease_id)
        if existing is not None:
            if existing.agent != agent:
                raise errors.NotOwner("request_id: names a lease of another agent", "request_id")
            return existing, False
        if view.inventory is None or not view.alive:
            raise errors.FailedPrecondition(
                f"host: the node daemon of host {self.host!r} is gone; no new admissions there", "host")
        partition = view.effective_partition()
        if not partition.allows(agent):
            raise errors.NotOwner(f"agent: {agent!r} is not in the partition of host {self.host!r}", "agent")
        mine = sum(1 for lease in view.leases.values() if lease.agent == agent)
        if mine >= self.svc.config.max_leases_per_agent:
            raise errors.CapacityError(
                f"agent: {agent!r} already holds {mine} leases on {self.host!r} (limit "
                f"{self.svc.config.max_leases_per_agent})", "agent")
        caps = partition.gpu_caps(agent, view.inventory)
        candidates = list(view.gpus.values())
        if c.gpu_ref is not None:
            info = view.inventory.gpu(c.gpu_ref)
            if info is None:
                raise errors.NotFound(f"gpu: host {self.host!r} has no GPU {c.gpu_ref!r}", "gpu")
            if info.uuid not in caps:
                raise errors.NotOwner(f"gpu: GPU {c.gpu_ref} of host {self.host!r} is outside the partition of "
                                      f"agent {agent!r}", "gpu")
            candidates = [view.gpus[info.uuid]]
        reason = never_fits(c.vram_mb, candidates, caps)
        if reason is not None:
            if "cap" in reason or reason == "no GPU is allowed":
                raise errors.FailedPrecondition(reason, "vram_mb")
            raise errors.InvalidArgument(reason, "vram_mb")
        placement = best_fit(c.vram_mb, agent, candidates, caps)
        if placement.gpu is None:
            raise errors.CapacityError(placement.reason, "vram_mb")
        gpu = placement.gpu
        gpu.seq += 1
        lease = VramLease(
            id=c.lease_id, host=self.host, gpu_uuid=gpu.uuid, gpu_index=gpu.index, agent=agent,
            session_id=c.session.session_id, vram_mb=c.vram_mb, priority=c.priority, preemptible=c.preemptible,
            request_id=c.request_id, token=gpu.seq, created_at=time.time(), etcd_lease=c.session.etcd_lease)
        gpu.leases.append(lease)
        view.leases[lease.id] = lease
        return lease, True

    def _transaction(self, view: HostView, grants: Sequence[tuple[AcquireCall, VramLease]]) -> tuple[list[Any], list[Any]]:
        """Compares: every ledger of the host, the partition, the host, each session.

        Every admission on the host bumps a ledger, so comparing all of them (one compare per GPU, not per
        grant) proves that nothing was admitted on the host since the snapshot: no lease id can have been
        taken meanwhile on another GPU (G6), and the batch stays far below etcd's 128 operations per txn.
        """
        keys = self.svc.keys
        compares = [cmp_exists(keys.host(self.host)),
                    cmp_mod_revision(keys.partition(self.host),
                                     view.partition_kv.mod_revision if view.partition_kv else 0)]
        compares += [cmp_mod_revision(keys.gpu(self.host, u), g.ledger.mod_revision)
                     for u, g in sorted(view.gpus.items())]
        ops = []
        for uuid_ in sorted({lease.gpu_uuid for _, lease in grants}):
            gpu = view.gpus[uuid_]
            ops.append(op_put(keys.gpu(self.host, uuid_), dumps({"capacity_mb": gpu.total_mb, "seq": gpu.seq})))
        for c in {c.session.session_id: c for c, _ in grants}.values():
            compares.append(cmp_exists(keys.session(c.session.agent, c.session.session_id)))
        for c, lease in grants:
            ops.append(op_put(keys.lease(self.host, lease.gpu_uuid, lease.id), dumps(lease.to_json()),
                              c.session.etcd_lease))
        return compares, ops


def client_pid() -> int:
    return os.getpid()


def status_json(revision: int, views: list[HostView], ttls: dict[int, int]) -> dict[str, Any]:
    """The operator's view, as plain JSON (``gpucoord status --json``)."""
    now = time.time()
    hosts = []
    for v in views:
        inv = v.inventory
        part = v.partition or (default_partition(inv) if inv else None)
        usage_age = now - float(v.usage["ts"]) if v.usage else -1.0
        gpus = []
        for g in sorted(v.gpus.values(), key=lambda g: g.index):
            gpus.append({"index": g.index, "uuid": g.uuid, "total_mb": g.total_mb, "usable_mb": g.usable_mb,
                         "leased_mb": g.leased_mb, "used_mb": -1 if g.nvml_used_mb is None else g.nvml_used_mb,
                         "untracked_mb": g.untracked_mb, "free_mb": g.free_mb, "seq": g.seq,
                         "name": next((x.name for x in inv.gpus if x.uuid == g.uuid), "") if inv else ""})
        leases = [{**lease.to_json(), "ttl_remaining": ttls.get(lease.etcd_lease, -1)}
                  for lease in sorted(v.leases.values(), key=lambda x: (x.gpu_index, x.token))]
        agents = []
        if part is not None and inv is not None:
            for alloc in part.allocations:
                used = [lease for lease in v.leases.values() if lease.agent == alloc.agent]
                agents.append({"agent": alloc.agent, "allocation": alloc.to_json(),
                               "leased_mb": sum(x.vram_mb for x in used), "leases": len(used)})
        queue = [json.loads(kv.value) | {"rank": v_key.decode().rsplit("/", 1)[-1]}
                 for kv in v.queue for v_key in [kv.key]]
        hosts.append({
            "host": v.host, "alive": v.alive, "address": v.host_kv.json().get("address", "") if v.host_kv else "",
            "simulated": bool(inv.simulated) if inv else False, "usage_age_s": round(usage_age, 1),
            "cpu_count": inv.cpu_count if inv else 0, "mem_bytes": inv.mem_bytes if inv else 0,
            "disk_bytes": inv.disk_bytes if inv else 0, "partition_mode": part.mode if part else "shared",
            "partition_explicit": v.partition is not None, "gpus": gpus, "agents": agents, "leases": leases,
            "queue": queue})
    return {"revision": revision, "hosts": hosts}
