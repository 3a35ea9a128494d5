"""The node daemon: one per host. Publishes the host's inventory and live VRAM usage under its own
etcd_lease, and serves the gRPC ``Node`` service (inventory, fencing-token checks).

This class is the etcd-direct mode (``gpucoord node --etcd``, kept for a rolling upgrade): the daemon holds
etcd credentials and writes its keys itself. ``coordinator.node.remote.RemoteNodeDaemon`` is the registry
mode (``gpucoord node --coordinator``): the same daemon, whose registration, usage and watches go through
a coordinator's ``Registry`` service, with no etcd credentials at all.

When the daemon dies its etcd_lease expires and ``hosts/<host>`` disappears: the coordinators then admit
nothing more on that host.

A host has one daemon. ``hosts/<host>`` is written only by a transaction that compares it is absent or
already on this daemon's etcd_lease, and ``usage/<host>`` only while ``hosts/<host>`` is on it, so a second
daemon never overwrites the first: at start it fails with :class:`HostTaken`, naming the live one (a
registration left by a dead daemon is waited out instead). A daemon watches its own key and registers
again at once when it disappears. One that finds its host taken
by another daemon later (its own etcd_lease expired while etcd was out of reach, and another daemon
registered meanwhile) keeps serving, logs an error naming the owner every keepalive round, and takes the
host back as soon as the owner's registration goes away.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import time
from typing import Any

from coordinator import __version__, clock, errors, metrics
from coordinator.aio import cancel_and_wait, first_of, retry_forever, spawn
from coordinator.etcd.contract import KeyFeed
from coordinator.etcd.session import EtcdSession
from coordinator.etcd.store import Store
from coordinator.etcd.types import KV
from coordinator.keys import Keys
from coordinator.node.enforce import Enforcer, usage_doc
from coordinator.node.inventory import GpuSource, NvmlScanError, read_inventory
from coordinator.node.registration import (
    HostTaken,
    publish_host,
    wait_host_free,
    write_usage,
)
from coordinator.records import GpuUsage, HostInventory, InvalidRecord, VramLease, dumps
from coordinator.txn import Range

log = logging.getLogger(__name__)

MAX_LISTED = 64
"""Entries of each list written to ``usage/<host>`` per GPU (processes, leases, a lease's pids)."""

MAX_DISK_PATH = 256
"""Characters of ``--disk-path``, which is stored in ``hosts/<host>``."""

FAST_SCAN_S = 0.25
FAST_SCAN_FOR_S = 60.0
"""When a lease that covered processes ends, the node scans at once, then every FAST_SCAN_S for
FAST_SCAN_FOR_S, and publishes at once whenever a process leaves a GPU: a request may be waiting for that
VRAM (G3)."""


def quote_prefix(value: object, limit: int = 32) -> str:   # limits.QUOTE_CHARS: a refusal quotes <= 32
    """A value for an error message: at most a short prefix of it, quoted."""
    text = str(value)
    return repr(text[:limit]) + ("..." if len(text) > limit else "")


class NodeDaemon:
    """Publishes ``hosts/<host>`` and ``usage/<host>``; keeps a watch-fed view of the host's VRAM leases."""

    def __init__(self, store: Store | None, keys: Keys, host: str, address: str, source: GpuSource, disk_path: str = "/",
                 ttl_s: int = 10, scan_interval_s: float = 1.0, heartbeat_s: float = 5.0,
                 overrides: dict[str, Any] | None = None, enforcer: Enforcer | None = None) -> None:
        self._store, self.keys, self.host, self.address = store, keys, host, address
        # Where the watch of the host's leases and of revoked certificates reads: etcd itself here; the
        # coordinator's stream for a daemon in the registry mode (coordinator.node.remote).
        self.feed: KeyFeed | None = store
        self.source, self.disk_path = source, disk_path
        self.ttl_s, self.scan_interval_s, self.heartbeat_s = ttl_s, scan_interval_s, heartbeat_s
        self.overrides = overrides or {}   # simulated hosts: cpu_count, core_ids, mem_bytes, disk_bytes
        self.session: EtcdSession | None = None    # the daemon's etcd_lease: hosts/ and usage/ hang on it
        self.pid, self.started_at = os.getpid(), clock.wall()
        self._need_register = True              # set by the host watch, or when a usage write is refused
        self._wake = asyncio.Event()            # wakes the keepalive loop to register at once
        self.inventory: HostInventory | None = None
        # (lease id, GPU uuid) -> its record, from the watch: a gang has one record on each of its GPUs.
        self.leases: dict[tuple[str, str], VramLease] = {}
        self.highest_token: dict[str, int] = {}         # gpu uuid -> highest token seen
        self.leases_ready = False                       # the watch-fed view is current
        self.last_usage: tuple[GpuUsage, ...] = ()
        # GPU processes against leases (see coordinator/node/enforce.py); report-only unless told.
        self.enforcer = enforcer or Enforcer()
        self._published: list[dict[str, object]] | None = None   # the gpus of the last usage written
        self._last_write = 0.0
        self._scan_wake = asyncio.Event()    # a lease that covered processes ended: scan now
        self._fast_until = 0.0               # scan often until then (monotonic): a lease with processes ended
        self._tasks: list[asyncio.Task[None]] = []
        self.ready = asyncio.Event()

    async def start(self) -> None:
        self.inventory = dataclasses.replace(
            read_inventory(self.host, self.address, self.source, self.disk_path, __version__), **self.overrides)
        await self.ensure_host_free()
        self.session = await self._new_session()
        try:
            await self._register()
        except BaseException:
            await self.session.close()   # a daemon that may not run leaves no etcd_lease behind
            raise
        self._tasks = [spawn(self._registration_loop(), "the node's registration"),
                       spawn(self._scan_loop(), "the node's scan"), spawn(self._watch_leases(), "the node's lease watch"),
                       spawn(self._watch_host(), "the node's watch of its host key")]
        self.ready.set()

    async def ensure_host_free(self) -> None:
        """Return once ``hosts/<host>`` is free; raise HostTaken while a live daemon holds it.

        Called before binding a port and granting an etcd_lease, for a clear error (the registration
        transaction is what enforces one daemon a host); see ``registration.wait_host_free``.
        """
        await wait_host_free(self.store, self.keys, self.host)

    @property
    def store(self) -> Store:
        """The daemon's etcd connection (the etcd-direct mode only)."""
        if self._store is None:
            raise errors.Unavailable(f"node {self.host} talks to etcd only through a coordinator")
        return self._store

    @property
    def etcd_lease(self) -> int:
        return self.session.etcd_lease if self.session is not None else 0

    reads_etcd = True
    """Whether the daemon talks to etcd itself (the etcd-direct mode); False in the registry mode."""

    @property
    def reaches_etcd(self) -> bool:
        """Whether the daemon's own etcd_lease is being refreshed: when it is not (two keepalives in a row
        failed, or it was lost and no new one granted yet), its view of the host's leases may be stale."""
        return self.session is not None and not self.session.in_doubt and not self.session.done.is_set()

    async def _new_session(self) -> EtcdSession:
        return await EtcdSession(self.store, self.ttl_s, f"node {self.host}").open()

    async def stop(self, revoke: bool = True) -> None:
        await cancel_and_wait(self._tasks)
        if self.session is not None:
            await (self.session.close() if revoke else self.session.orphan())
        self.source.close()

    async def _register(self) -> None:
        """Publish ``hosts/<host>`` and then ``usage/<host>``; raises HostTaken if another daemon holds it."""
        self._need_register = False
        try:
            await self._publish_host()
            await self._publish_usage(force=True)
        except BaseException:
            self._need_register = True
            raise

    def host_value(self) -> bytes:
        """What ``hosts/<host>`` holds: the address, the inventory, and who wrote it."""
        assert self.inventory is not None
        return dumps({"address": self.address, "inventory": self.inventory.to_json(), "version": __version__,
                      "pid": self.pid, "started_at": self.started_at})

    async def _publish_host(self) -> None:
        """``hosts/<host>`` on our etcd_lease (``registration.publish_host``); HostTaken if another daemon's."""
        assert self.inventory is not None
        revision = await publish_host(self.store, self.keys, self.host, self.host_value(), self.etcd_lease)
        metrics.NODE_WRITES.labels("hosts").inc()
        log.info("published host %s (%d GPUs) at revision %d", self.host, len(self.inventory.gpus), revision)

    async def _write_usage(self, value: bytes) -> bool:
        """``usage/<host>``, while ``hosts/<host>`` is ours; False (nothing written) when it is not."""
        if not await write_usage(self.store, self.keys, self.host, value, self.etcd_lease):
            return False
        metrics.NODE_WRITES.labels("usage").inc()
        return True

    async def _publish_usage(self, force: bool = False) -> None:
        try:
            # NVML calls can block (a GPU in trouble): off the event loop, so keepalives and the gRPC
            # server keep going meanwhile.
            usage = await asyncio.to_thread(self.source.usage)
        except NvmlScanError as e:
            log.warning("NVML scan failed, usage not refreshed: %s", e)
            return
        self.last_usage = usage
        attribution = await asyncio.to_thread(self.enforcer.scan, usage, clock.wall())
        leased: dict[str, int] = {}
        for lease in self.leases.values():
            leased[lease.gpu_uuid] = leased.get(lease.gpu_uuid, 0) + lease.vram_mb
        gpus = [{"index": u.index, "uuid": u.uuid, "vram_used_mb": u.vram_used_mb, "vram_free_mb": u.vram_free_mb,
                 "untracked_mb": max(0, u.vram_used_mb - leased.get(u.uuid, 0)),
                 "processes_visible": u.processes_visible, **utilization_doc(u),
                 **bounded_usage(usage_doc(*attribution.for_gpu(u.uuid)))} for u in usage]
        for u in usage:
            metrics.NODE_VRAM_USED.labels(u.uuid).set(u.vram_used_mb * metrics.MIB)
            metrics.NODE_GPU_UTILIZATION.labels(u.uuid).set(u.utilization_pct)
        now = clock.wall()
        changed = gpus != self._published
        # A process left the GPU: someone may be waiting for its VRAM (an evicted lease's processes, G3).
        left = changed and bool(_listed(self._published) - _listed(gpus))
        # Written when it changes (at most about once a second, at once when a process left), and at least
        # every heartbeat_s so that readers can tell fresh usage from a stuck daemon (stale = older than 3
        # heartbeats).
        if self._need_register and not force:
            return    # not registered: the registration writes usage (and a standby writes none)
        if (force or left or (changed and now - self._last_write >= 1.0)
                or now - self._last_write >= self.heartbeat_s):
            value = dumps({"ts": now, "interval_s": self.heartbeat_s, "gpus": gpus})
            if not await self._write_usage(value):
                # hosts/<host> is not ours (gone, or another daemon's): never write over its usage.
                self._host_lost(f"a usage write found hosts/{self.host} not on this daemon's etcd_lease")
                return
            self._published = gpus
            self._last_write = now

    def _host_lost(self, why: str) -> None:
        """Register again at once (the keepalive loop does it)."""
        if not self._need_register:
            log.warning("%s; registering again", why)
        self._need_register = True
        self._wake.set()

    async def _registration_loop(self) -> None:
        """Keeps the registration: a new session when ours ended (etcd out of reach past the TTL), and a
        new registration whenever the host key is not ours. The session refreshes itself."""
        while True:
            assert self.session is not None
            await first_of(self.session.done.wait(), self._wake.wait(), timeout=self.ttl_s / 3)
            self._wake.clear()
            try:
                if self.session.done.is_set():
                    log.warning("the node's etcd_lease is gone; registering host %s again", self.host)
                    self._need_register = True
                    self.session = await self._new_session()
                if self._need_register:
                    # Until both keys are written, every round tries again.
                    await self._register()
            except HostTaken as e:
                # Another daemon registered while we were cut off: it is the host's daemon now. We stay
                # a standby that takes the host back when its registration goes (the host watch wakes us).
                log.error("%s; this daemon (pid %d) is not registered and retries every %.1f s",
                          e.message, self.pid, self.ttl_s / 3)
            except errors.GpucoordError as e:
                log.warning("node keepalive failed: %s", e)

    async def _watch_host(self) -> None:
        """Registers again at once when ``hosts/<host>`` disappears (deleted by hand, or expired)."""
        await retry_forever("the node's watch of its host key", self._watch_host_once)

    async def _watch_host_once(self) -> None:
        key = self.keys.host(self.host)
        snap = await self.store.snapshot([Range(key)])
        self._check_host(snap.ranges[0][0] if snap.ranges[0] else None)
        async for batch in self.store.watch(key, prefix=False, start_revision=snap.revision + 1):
            if batch.resync:
                return
            for ev in batch.events:
                self._check_host(ev.kv if ev.kind == "PUT" else None)

    def _check_host(self, kv: KV | None) -> None:
        if kv is None:
            self._host_lost(f"hosts/{self.host} disappeared")
        elif kv.etcd_lease != self.etcd_lease:
            self._host_lost(f"hosts/{self.host} is on another etcd_lease")

    async def _scan_loop(self) -> None:
        while True:
            # While a gone lease's processes are still listed, scan often: waiters need their VRAM.
            interval = self.scan_interval_s
            if time.monotonic() < self._fast_until:
                interval = min(interval, FAST_SCAN_S)
            try:
                await asyncio.wait_for(self._scan_wake.wait(), interval)
            except asyncio.TimeoutError:
                pass
            self._scan_wake.clear()
            try:
                await self._publish_usage()
            except errors.GpucoordError as e:
                log.warning("usage publish failed: %s", e)

    async def _watch_leases(self) -> None:
        """Keeps ``leases`` (for CheckToken) current; an error starts it over from a fresh read."""
        def not_ready() -> None:
            self.leases_ready = False
        await retry_forever("the node's lease watch", self._watch_leases_once, on_error=not_ready)

    async def _watch_leases_once(self) -> None:
        prefix = self.keys.leases(self.host)
        self.leases_ready = False
        assert self.feed is not None
        snap = await self.feed.get_prefix(prefix)
        before, self.leases = self.leases, {}
        for kv in snap.kvs:
            self._put_kv(kv)
        for lease_id, gpu_uuid in before.keys() - self.leases.keys():
            self.enforcer.lease_deleted(lease_id, clock.wall(), gpu_uuid)   # deleted while the watch was down
        self.leases_ready = True
        async for batch in self.feed.watch(prefix, start_revision=snap.revision + 1):
            if batch.resync:
                return
            for ev in batch.events:
                if ev.kind == "PUT":
                    self._put_kv(ev.kv)
                else:
                    _, (_, gpu_uuid, lease_id) = self.keys.parse(ev.kv.key)
                    gone = self.leases.pop((lease_id, gpu_uuid), None)
                    self.enforcer.lease_deleted(lease_id, clock.wall(), gpu_uuid)
                    if gone is not None and (gone.pids or gone.pgid):
                        # Its processes may still be on the GPU: report at once whether they are (G3).
                        self._fast_until = time.monotonic() + FAST_SCAN_FOR_S
                        self._scan_wake.set()

    def _put_kv(self, kv: KV) -> None:
        try:
            lease = VramLease.from_kv(kv)
        except InvalidRecord as e:
            # Written by no coordinator: set aside (the coordinators refuse admission on the host meanwhile).
            log.warning("ignoring a malformed lease %s: %s", kv.key.decode(errors="replace")[:200], e)
            return
        self._on_put(lease)

    def _on_put(self, lease: VramLease) -> None:
        self.leases[(lease.id, lease.gpu_uuid)] = lease
        self.enforcer.lease_put(lease)
        self.highest_token[lease.gpu_uuid] = max(self.highest_token.get(lease.gpu_uuid, 0), lease.token)

    async def stored_leases(self, gpu_uuid: str) -> tuple[KV, ...]:
        """Every lease record on one GPU of this host, read now (CheckToken of a token the watch has not
        delivered yet)."""
        return (await self.store.get_prefix(self.keys.leases(self.host, gpu_uuid))).kvs

    def check_token(self, gpu_uuid: str, token: int) -> tuple[bool, str]:
        for lease in self.leases.values():
            if lease.gpu_uuid == gpu_uuid and lease.token == token:
                return True, lease.id
        return False, ""


def utilization_doc(u: GpuUsage) -> dict[str, Any]:
    """A GPU's utilization in ``usage/<host>``: ``utilization_pct`` (-1: unknown) and, where the driver samples
    processes, ``process_sm_pct`` ([{pid, sm_pct}], the busiest MAX_LISTED)."""
    out: dict[str, Any] = {"utilization_pct": u.utilization_pct}
    if u.process_sm_pct is not None:
        rows = sorted(u.process_sm_pct, key=lambda x: -x[1])[:MAX_LISTED]
        out["process_sm_pct"] = [{"pid": pid, "sm_pct": pct} for pid, pct in rows]
    return out


def _listed(gpus: Any) -> set[tuple[str, int]]:
    """(GPU uuid, pid) of every process a usage document lists."""
    return {(str(g.get("uuid")), int(p.get("pid", 0))) for g in gpus or () for p in g.get("processes", ())}


def _largest(items: list[dict[str, Any]], what: str, out: dict[str, Any]) -> list[dict[str, Any]]:
    items = sorted(items, key=lambda d: -int(d.get("used_mb", 0)))
    if len(items) > MAX_LISTED:
        out[f"{what}_omitted"] = len(items) - MAX_LISTED
    return items[:MAX_LISTED]


def bounded_usage(doc: dict[str, Any]) -> dict[str, Any]:
    """The per-GPU lists of ``usage/<host>`` cut to MAX_LISTED each, the largest users of VRAM first;
    ``<list>_omitted`` counts what was left out."""
    out: dict[str, Any] = {}
    out["processes"] = _largest(list(doc.get("processes", ())), "processes", out)
    leases = []
    for lease in _largest(list(doc.get("leases", ())), "leases", out):
        pids = list(lease.get("pids", ()))
        lease = {**lease, "pids": pids[:MAX_LISTED]}
        if len(pids) > MAX_LISTED:
            lease["pids_omitted"] = len(pids) - MAX_LISTED
        leases.append(lease)
    out["leases"] = leases
    return out
