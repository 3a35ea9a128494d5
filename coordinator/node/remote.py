"""The node daemon in the registry mode (``gpucoord node --coordinator ADDR[,ADDR...]``): it holds no etcd
credentials and talks to etcd only through a coordinator's ``Registry`` service.

One ``Register`` stream to one coordinator replica at a time carries the daemon's registration (its
inventory), a heartbeat every TTL/3, which the replica turns into a refresh of the registration's
etcd_lease, and its usage reports; back come the acknowledgements and the host's leases and the revoked
certificates (``coordinator.node.streamed``), which feed the same lease watch and deny list as in the
etcd-direct mode. When the stream breaks, or a heartbeat goes unanswered for two periods, the daemon moves
to the next address and resumes its registration there (the same etcd_lease, while it lives), so a replica
that dies loses no live node's registration. A daemon that is gone sends no heartbeats: its registration
expires within its TTL (G4). A host held by another live daemon is refused at start (``HostTaken``); one
taken later (while this daemon was cut off past its TTL) is reported on every heartbeat until it is free.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
from typing import Any, Sequence

import grpc

from agent_client.api import registry_pb2 as pb
from agent_client.api import registry_pb2_grpc as pb_grpc
from coordinator import __version__, errors
from coordinator.aio import cancel_and_wait, drain, first_of, spawn
from coordinator.etcd.types import KV
from coordinator.keys import Keys
from coordinator.node.daemon import NodeDaemon
from coordinator.node.enforce import Enforcer
from coordinator.node.inventory import GpuSource, read_inventory
from coordinator.node.registration import HostTaken
from coordinator.node.streamed import StreamedKeys, stored_kv

log = logging.getLogger(__name__)

START_WITHIN_S = 20.0   # a daemon that reaches no coordinator for this long at start gives up
CALL_TIMEOUT_S = 5.0


def _error(e: grpc.aio.AioRpcError) -> errors.GpucoordError:
    """A coordinator's refusal as the daemon raises it."""
    message = e.details() or e.code().name
    by_code: dict[grpc.StatusCode, type[errors.GpucoordError]] = {
        grpc.StatusCode.FAILED_PRECONDITION: HostTaken, grpc.StatusCode.INVALID_ARGUMENT: errors.InvalidArgument,
        grpc.StatusCode.PERMISSION_DENIED: errors.NotOwner, grpc.StatusCode.RESOURCE_EXHAUSTED: errors.CapacityError,
        grpc.StatusCode.NOT_FOUND: errors.NotFound}
    return by_code.get(e.code(), errors.Unavailable)(message)


class RemoteNodeDaemon(NodeDaemon):
    reads_etcd = False

    def __init__(self, coordinators: Sequence[str], keys: Keys, host: str, address: str, source: GpuSource,
                 disk_path: str = "/", ttl_s: int = 10, scan_interval_s: float = 1.0, heartbeat_s: float = 5.0,
                 overrides: dict[str, Any] | None = None, enforcer: Enforcer | None = None,
                 credentials: grpc.ChannelCredentials | None = None) -> None:
        super().__init__(None, keys, host, address, source, disk_path, ttl_s, scan_interval_s, heartbeat_s,
                         overrides, enforcer)
        if not coordinators:
            raise ValueError("--coordinator: at least one address is needed")
        self.coordinators = list(coordinators)
        self.credentials = credentials
        self.streamed = StreamedKeys(keys, (keys.leases(host), keys.revocations()))
        self.feed = self.streamed
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._next = 0
        self._requests: asyncio.Queue[pb.RegisterRequest | None] | None = None   # the open stream's
        self._call: Any = None
        self._registration_lease = 0     # the registration's etcd_lease, as the coordinator last said
        self._acked = 0.0                # monotonic time of the last acknowledgement
        self._registered = asyncio.Event()
        self._start_error: errors.GpucoordError | None = None
        self._taken = ""
        self.coordinator = ""            # the address of the replica that holds the registration now
        self._abandon = asyncio.Event()  # the replica answers no heartbeat: leave it
        self._stopping = False
        self._failed: set[str] = set()   # addresses whose failure was logged since the last registration

    # -- what the base class reads ----------------------------------------------------------------
    @property
    def etcd_lease(self) -> int:
        return self._registration_lease

    @property
    def period_s(self) -> float:
        return self.ttl_s / 3

    @property
    def reaches_etcd(self) -> bool:
        """Registered, and acknowledged by a coordinator within two heartbeat periods: the lease view is fed."""
        return bool(self._registration_lease) and time.monotonic() - self._acked < 2 * self.period_s + 1.0

    async def ensure_host_free(self) -> None:
        """Nothing to do here: the coordinator waits out a dead daemon's registration when this one registers."""

    async def stored_leases(self, gpu_uuid: str) -> tuple[KV, ...]:
        stub = pb_grpc.RegistryStub(self._channel(self.coordinator or self.coordinators[0]))
        try:
            resp = await stub.ListLeases(pb.ListLeasesRequest(host=self.host, gpu_uuid=gpu_uuid),
                                         timeout=CALL_TIMEOUT_S)
        except grpc.aio.AioRpcError as e:
            raise _error(e) from None
        return tuple(stored_kv(self.keys, k) for k in resp.kvs)

    async def _write_usage(self, value: bytes) -> bool:
        if self._requests is None or not self._registration_lease:
            return False
        self._requests.put_nowait(pb.RegisterRequest(usage=pb.UsageReport(usage_json=value.decode())))
        return True

    def _host_lost(self, why: str) -> None:
        self._need_register = True   # the coordinator registers again; the next acknowledgement says so

    # -- life ---------------------------------------------------------------------------------------
    async def start(self) -> None:
        self.inventory = dataclasses.replace(
            read_inventory(self.host, self.address, self.source, self.disk_path, __version__), **self.overrides)
        self._tasks = [spawn(self._connection_loop(), "the node's registry stream")]
        try:
            await first_of(self._registered.wait(), timeout=START_WITHIN_S)
            if self._start_error is not None:
                raise self._start_error
            if not self._registered.is_set():
                raise errors.Unavailable(f"no coordinator of {', '.join(self.coordinators)} registered host "
                                         f"{self.host} within {START_WITHIN_S:g} s")
        except BaseException:
            await cancel_and_wait(self._tasks)
            await self._close_channels()
            raise
        self._tasks += [spawn(self._heartbeat_loop(), "the node's heartbeats"),
                        spawn(self._scan_loop(), "the node's scan"),
                        spawn(self._watch_leases(), "the node's lease watch")]
        self.ready.set()

    async def stop(self, revoke: bool = True) -> None:
        """``revoke``: end the registration at once (else it runs down within its TTL)."""
        self._stopping = True
        if self._requests is not None:
            if revoke:
                self._requests.put_nowait(pb.RegisterRequest(deregister=pb.Deregister()))
            self._requests.put_nowait(None)
            if self._tasks:
                await asyncio.wait(self._tasks[:1], timeout=2.0)   # the coordinator ends the stream
        await cancel_and_wait(self._tasks)
        await self._close_channels()
        self.source.close()

    async def _close_channels(self) -> None:
        for channel in self._channels.values():
            await channel.close()
        self._channels.clear()

    def _channel(self, address: str) -> grpc.aio.Channel:
        channel = self._channels.get(address)
        if channel is None:
            channel = self._channels[address] = (
                grpc.aio.insecure_channel(address) if self.credentials is None
                else grpc.aio.secure_channel(address, self.credentials))
        return channel

    def _registration(self) -> pb.HostRegistration:
        assert self.inventory is not None
        inventory = dataclasses.replace(self.inventory, address=self.address)
        return pb.HostRegistration(host=self.host, address=self.address,
                                   inventory_json=json.dumps(inventory.to_json()), ttl_seconds=self.ttl_s,
                                   pid=self.pid, started_at=self.started_at, version=__version__,
                                   etcd_lease=self._registration_lease)

    async def _connection_loop(self) -> None:
        """One stream at a time; when it ends, the next address, resuming the registration."""
        backoff = 0.1
        while not self._stopping:
            address = self.coordinators[self._next % len(self.coordinators)]
            self._abandon.clear()
            try:
                first = await first_of(self._stream(address), self._abandon.wait())
                assert first is not None
                if first.cancelled() or first.result() is True:
                    log.warning("coordinator %s answers no heartbeat; moving to the next", address)
                elif not self._stopping:
                    log.warning("coordinator %s ended the registry stream; moving on", address)
            except grpc.aio.AioRpcError as e:
                error = _error(e)
                if not self._registered.is_set() and not isinstance(error, errors.Unavailable):
                    self._start_error = error     # refused at start: the daemon does not run
                    self._registered.set()
                    return
                # Once per address until a registration succeeds: a coordinator that is down is retried often.
                level = logging.ERROR if isinstance(error, HostTaken) else logging.WARNING
                if address in self._failed:
                    level = logging.DEBUG
                self._failed.add(address)
                log.log(level, "coordinator %s: %s (%s); trying the next", address, error.message, e.code().name)
            finally:
                self._requests, self._call, self.coordinator = None, None, ""
            if self._acked and time.monotonic() - self._acked < self.ttl_s:
                backoff = 0.1
            self._next += 1
            await asyncio.sleep(backoff)
            backoff = min(2 * backoff, 1.0)

    async def _stream(self, address: str) -> None:
        requests: asyncio.Queue[pb.RegisterRequest | None] = asyncio.Queue()
        requests.put_nowait(pb.RegisterRequest(register=self._registration()))
        call = pb_grpc.RegistryStub(self._channel(address)).Register(drain(requests))
        self._requests, self._call, self.coordinator = requests, call, address
        self._acked = time.monotonic()   # the ack timeout runs from the opening
        async for resp in call:
            event = resp.WhichOneof("event")
            if event == "registered":
                self._on_registered(resp.registered, address)
            elif event == "snapshot":
                self.streamed.apply_snapshot(resp.snapshot)
            elif event == "changes":
                self.streamed.apply_changes(resp.changes)

    def _on_registered(self, msg: pb.Registered, address: str) -> None:
        self._acked = time.monotonic()
        was = self._registration_lease
        self._registration_lease = msg.etcd_lease
        self._need_register = not msg.etcd_lease
        if msg.etcd_lease:
            self._failed.clear()
        if msg.etcd_lease and msg.etcd_lease != was:
            log.info("host %s registered through coordinator %s (etcd_lease %x)", self.host, address, msg.etcd_lease)
            self._last_write = 0.0     # publish usage at once
            self._scan_wake.set()
        if msg.taken and msg.taken != self._taken:
            log.error("%s; this daemon (pid %d) is not registered and retries every %.1f s", msg.taken, self.pid,
                      self.period_s)
        self._taken = msg.taken
        self._registered.set()

    async def _heartbeat_loop(self) -> None:
        """A heartbeat every TTL/3; a coordinator that leaves two unanswered is left for the next one."""
        while True:
            await asyncio.sleep(self.period_s)
            if self._requests is not None:
                self._requests.put_nowait(pb.RegisterRequest(heartbeat=pb.Heartbeat()))
            if self._call is not None and time.monotonic() - self._acked > 2 * self.period_s:
                self._abandon.set()
