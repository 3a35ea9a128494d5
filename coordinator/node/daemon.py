"""The node daemon: one per host. Publishes the host's inventory and live VRAM usage under its own
etcd_lease, and serves the gRPC ``Node`` service (inventory, fencing-token checks).

When the daemon dies its etcd_lease expires and ``hosts/<host>`` disappears: the coordinators then admit
nothing more on that host.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from typing import Any


from coordinator import __version__, errors, metrics
from coordinator.aio import cancel_and_wait, retry_forever
from coordinator.records import GpuUsage, HostInventory, VramLease, dumps
from coordinator.keys import Keys, last_segment
from coordinator.node.inventory import GpuSource, NvmlScanError, read_inventory
from coordinator.etcd.store import Store
from coordinator.etcd.ops import op_put

log = logging.getLogger(__name__)


class NodeDaemon:
    """Publishes ``hosts/<host>`` and ``usage/<host>``; keeps a watch-fed view of the host's VRAM leases."""

    def __init__(self, store: Store, keys: Keys, host: str, address: str, source: GpuSource, disk_path: str = "/",
                 ttl_s: int = 10, scan_interval_s: float = 1.0, heartbeat_s: float = 5.0,
                 overrides: dict[str, Any] | None = None) -> None:
        self.store, self.keys, self.host, self.address = store, keys, host, address
        self.source, self.disk_path = source, disk_path
        self.ttl_s, self.scan_interval_s, self.heartbeat_s = ttl_s, scan_interval_s, heartbeat_s
        self.overrides = overrides or {}   # simulated hosts: cpu_count, core_ids, mem_bytes, disk_bytes
        self.etcd_lease = 0
        self._registered = False
        self.inventory: HostInventory | None = None
        self.leases: dict[str, VramLease] = {}          # lease id -> lease, from the watch
        self.highest_token: dict[str, int] = {}         # gpu uuid -> highest token seen
        self.leases_ready = False                       # the watch-fed view is current
        self.last_usage: tuple[GpuUsage, ...] = ()
        self._published: Any = None
        self._last_write = 0.0
        self._tasks: list[asyncio.Task[None]] = []
        self.ready = asyncio.Event()

    async def start(self) -> None:
        self.inventory = dataclasses.replace(
            read_inventory(self.host, self.address, self.source, self.disk_path, __version__), **self.overrides)
        self.etcd_lease = await self.store.grant(self.ttl_s)
        await self._publish_host()
        await self._publish_usage(force=True)
        self._registered = True
        self._tasks = [asyncio.create_task(self._keepalive_loop()), asyncio.create_task(self._scan_loop()),
                       asyncio.create_task(self._watch_leases())]
        self.ready.set()

    async def stop(self, revoke: bool = True) -> None:
        await cancel_and_wait(self._tasks)
        if revoke and self.etcd_lease:
            try:
                await self.store.revoke(self.etcd_lease)
            except errors.GpucoordError as e:
                log.warning("could not revoke the node's etcd_lease: %s", e)
        self.source.close()

    async def _publish_host(self) -> None:
        assert self.inventory is not None
        value = dumps({"address": self.address, "inventory": self.inventory.to_json(), "version": __version__,
                       "started_at": time.time()})
        res = await self.store.commit([], [op_put(self.keys.host(self.host), value, self.etcd_lease)])
        metrics.NODE_WRITES.labels("hosts").inc()
        log.info("published host %s (%d GPUs) at revision %d", self.host, len(self.inventory.gpus), res.revision)

    async def _publish_usage(self, force: bool = False) -> None:
        try:
            # NVML calls can block (a GPU in trouble): off the event loop, so keepalives and the gRPC
            # server keep going meanwhile.
            usage = await asyncio.to_thread(self.source.usage)
        except NvmlScanError as e:
            log.warning("NVML scan failed, usage not refreshed: %s", e)
            return
        self.last_usage = usage
        leased: dict[str, int] = {}
        for lease in self.leases.values():
            leased[lease.gpu_uuid] = leased.get(lease.gpu_uuid, 0) + lease.vram_mb
        gpus = [{"index": u.index, "uuid": u.uuid, "vram_used_mb": u.vram_used_mb, "vram_free_mb": u.vram_free_mb,
                 "untracked_mb": max(0, u.vram_used_mb - leased.get(u.uuid, 0)),
                 "processes": [{"pid": p.pid, "used_mb": p.used_mb} for p in u.processes]} for u in usage]
        for u in usage:
            metrics.NODE_VRAM_USED.labels(u.uuid).set(u.vram_used_mb)
        now = time.time()
        changed = gpus != self._published
        # Written when it changes (at most about once a second), and at least every heartbeat_s so that
        # readers can tell fresh usage from a stuck daemon (stale = older than 3 heartbeats).
        if force or (changed and now - self._last_write >= 1.0) or now - self._last_write >= self.heartbeat_s:
            value = dumps({"ts": now, "interval_s": self.heartbeat_s, "gpus": gpus})
            await self.store.commit([], [op_put(self.keys.usage(self.host), value, self.etcd_lease)])
            metrics.NODE_WRITES.labels("usage").inc()
            self._published = gpus
            self._last_write = now

    async def _keepalive_loop(self) -> None:
        while True:
            await asyncio.sleep(self.ttl_s / 3)
            try:
                ttl = await self.store.keepalive(self.etcd_lease) if self.etcd_lease else 0
                if ttl <= 0:
                    # Our etcd_lease expired (etcd was unreachable past the TTL): register again.
                    log.warning("the node's etcd_lease is gone; registering host %s again", self.host)
                    self.etcd_lease = 0
                    self._registered = False
                    self.etcd_lease = await self.store.grant(self.ttl_s)
                if not self._registered:
                    # Until both keys are written, every round tries again.
                    await self._publish_host()
                    await self._publish_usage(force=True)
                    self._registered = True
            except errors.GpucoordError as e:
                log.warning("node keepalive failed: %s", e)

    async def _scan_loop(self) -> None:
        while True:
            await asyncio.sleep(self.scan_interval_s)
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
        snap = await self.store.get_prefix(prefix)
        self.leases = {}
        for kv in snap.ranges[0]:
            self._on_put(VramLease.from_kv(kv))
        self.leases_ready = True
        async for batch in self.store.watch(prefix, start_revision=snap.revision + 1):
            if batch.resync:
                return
            for ev in batch.events:
                lease_id = last_segment(ev.kv.key)
                if ev.kind == "PUT":
                    self._on_put(VramLease.from_kv(ev.kv))
                else:
                    self.leases.pop(lease_id, None)

    def _on_put(self, lease: VramLease) -> None:
        self.leases[lease.id] = lease
        self.highest_token[lease.gpu_uuid] = max(self.highest_token.get(lease.gpu_uuid, 0), lease.token)

    def check_token(self, gpu_uuid: str, token: int) -> tuple[bool, str]:
        for lease in self.leases.values():
            if lease.gpu_uuid == gpu_uuid and lease.token == token:
                return True, lease.id
        return False, ""
