"""The Registry service of a coordinator replica: node daemons register their host, keep the registration
alive, publish the host's usage and follow the host's leases and the revoked certificates through it, and
never talk to etcd (docs/operations.md "Node daemons"; ``proto/gpucoord/v1/registry.proto``).

One ``Register`` stream is one host's registration. Its etcd_lease is granted and refreshed by the replica
that holds the stream, once per heartbeat of the node: a node whose daemon is gone (killed, stopped, cut
off) sends no heartbeat, and its registration expires within its TTL of the last one, so its host gets no
new admissions (G4). A replica that dies leaves the etcd_lease to run: the node reconnects to another
replica within the TTL and resumes its registration (``etcd_lease`` of its ``register`` message), which that
replica refreshes from then on. A resumed etcd_lease is refreshed only once ``hosts/<host>`` is found on it:
a node cannot keep any other etcd_lease alive through this service.

With TLS the interceptor admits only ``gpucoord://node/HOST`` here, and only for its own host
(``coordinator.security.authz``): the first message names the host, and every later message of the stream
acts on it. Each message takes its cost of the identity's call rate; the stream counts against its
streams (``coordinator.security.limits``).
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
from typing import AsyncIterator

import grpc

from agent_client.api import registry_pb2 as pb
from agent_client.api import registry_pb2_grpc as pb_grpc
from coordinator import errors
from coordinator.aio import cancel_and_wait, retry_forever, spawn
from coordinator.etcd.types import WatchBatch
from coordinator.node.registration import (
    HostTaken,
    publish_host,
    wait_host_free,
    write_usage,
)
from coordinator.replica.service import CoordinatorService
from coordinator.rpc import registry_fields as fields
from coordinator.rpc.answers import AnswerQueue, read_requests, send_answers
from coordinator.security.status import refuse
from coordinator.txn import Range

log = logging.getLogger(__name__)

SNAPSHOT_CHUNK = 256          # keys per snapshot message
ANSWERS_MAX = 16_384          # a node's stream: answers it may leave unread ...
ANSWER_BYTES_MAX = 16 << 20   # ... and their bytes, before the stream ends (the node reconnects)
SILENT_TTLS = 3               # a stream without a message for this many TTLs is ended


@dataclasses.dataclass
class _Host:
    """One Register stream's registration."""

    reg: fields.Registration
    etcd_lease: int = 0
    taken: str = ""


class RegistryServicer(pb_grpc.RegistryServicer):  # type: ignore[misc]
    def __init__(self, svc: CoordinatorService) -> None:
        self.svc, self.store, self.keys = svc, svc.store, svc.keys

    # -- the registration ----------------------------------------------------------------------
    async def _resume(self, h: _Host) -> bool:
        """Adopt the etcd_lease the node names, if ``hosts/<host>`` is on it and it is alive."""
        kv = await self.store.get(self.keys.host(h.reg.host))
        if kv is None or kv.etcd_lease != h.reg.resume_etcd_lease:
            return False
        if await self.store.keepalive(kv.etcd_lease) <= 0:
            return False
        h.etcd_lease = kv.etcd_lease
        await publish_host(self.store, self.keys, h.reg.host, h.reg.value, h.etcd_lease)   # the new address
        log.info("host %s: registration resumed on etcd_lease %x", h.reg.host, h.etcd_lease)
        return True

    async def _register(self, h: _Host, wait: bool) -> None:
        """A new registration; HostTaken while another live one holds the host. ``wait``: a registration
        left by a dead daemon is waited out (``wait_host_free``); else HostTaken at once."""
        h.etcd_lease = 0
        if wait:
            await wait_host_free(self.store, self.keys, h.reg.host)
        etcd_lease = await self.store.grant(h.reg.ttl_s)
        try:
            await publish_host(self.store, self.keys, h.reg.host, h.reg.value, etcd_lease)
        except BaseException:
            await self.store.revoke(etcd_lease)
            raise
        h.etcd_lease, h.taken = etcd_lease, ""
        log.info("host %s registered on etcd_lease %x (TTL %d s)", h.reg.host, etcd_lease, h.reg.ttl_s)

    async def _again(self, h: _Host, out: AnswerQueue) -> None:
        """Register anew (the registration is gone); while another daemon holds the host, say so."""
        try:
            await self._register(h, wait=False)
        except HostTaken as e:
            if e.message != h.taken:
                log.warning("host %s: %s", h.reg.host, e.message)
            h.taken = e.message
        out.put_nowait(self._registered(h))

    def _registered(self, h: _Host) -> pb.RegisterResponse:
        return pb.RegisterResponse(registered=pb.Registered(etcd_lease=h.etcd_lease, ttl_seconds=h.reg.ttl_s,
                                                            taken=h.taken[:512]))

    async def _heartbeat(self, h: _Host, out: AnswerQueue) -> None:
        if h.etcd_lease and await self.store.keepalive(h.etcd_lease) > 0:
            out.put_nowait(self._registered(h))
            return
        await self._again(h, out)   # expired (the node was silent past its TTL), revoked, or never had one

    async def _usage(self, h: _Host, value: bytes, out: AnswerQueue) -> None:
        if h.etcd_lease and await write_usage(self.store, self.keys, h.reg.host, value, h.etcd_lease):
            return
        await self._again(h, out)   # hosts/<host> is not on our etcd_lease
        if h.etcd_lease:
            await write_usage(self.store, self.keys, h.reg.host, value, h.etcd_lease)

    # -- what the node follows -------------------------------------------------------------------
    async def _follow(self, host: str, out: AnswerQueue) -> None:
        """The host's leases and the revoked certificates: a snapshot of each at one revision, then changes;
        a lost history (compaction) starts over with new snapshots."""
        prefixes = (self.keys.leases(host), self.keys.revocations())

        async def once() -> None:
            snap = await self.store.snapshot([Range(p, prefix=True) for p in prefixes])
            for prefix, kvs in zip(prefixes, snap.ranges):
                self._snapshot(prefix, snap.revision, kvs, out)
            watches = [spawn(self._watch(p, snap.revision + 1, out), "a registry watch") for p in prefixes]
            try:
                done, _ = await asyncio.wait(watches, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    task.result()
            finally:
                await cancel_and_wait(watches)
        await retry_forever(f"the registry's watch of host {host}", once)

    def _snapshot(self, prefix: bytes, revision: int, kvs: tuple[object, ...], out: AnswerQueue) -> None:
        rel = self._rel(prefix)
        chunks = [kvs[i:i + SNAPSHOT_CHUNK] for i in range(0, len(kvs), SNAPSHOT_CHUNK)] or [()]
        for i, chunk in enumerate(chunks):
            out.put_nowait(pb.RegisterResponse(snapshot=pb.KeySnapshot(
                prefix=rel, revision=revision, kvs=[fields.stored_key(self.keys, kv) for kv in chunk],  # type: ignore[arg-type]
                more=i < len(chunks) - 1)))

    async def _watch(self, prefix: bytes, start: int, out: AnswerQueue) -> None:
        rel = self._rel(prefix)
        batch: WatchBatch
        async for batch in self.store.watch(prefix, start_revision=start):
            if batch.resync:
                return   # history lost: start over
            changes = [pb.KeyChange(deleted=ev.kind != "PUT", kv=fields.stored_key(self.keys, ev.kv))
                       for ev in batch.events]
            if changes:
                out.put_nowait(pb.RegisterResponse(changes=pb.KeyChanges(prefix=rel, revision=batch.revision,
                                                                         changes=changes)))

    def _rel(self, prefix: bytes) -> str:
        return self.keys.relative(prefix)

    # -- the RPCs ----------------------------------------------------------------------------------
    async def Register(self, request_iterator: AsyncIterator[pb.RegisterRequest],
                       context: grpc.aio.ServicerContext) -> None:
        out = AnswerQueue(ANSWERS_MAX, ANSWER_BYTES_MAX)
        tasks: list[asyncio.Task[None]] = []

        async def read() -> None:
            requests = request_iterator.__aiter__()
            try:
                first = await requests.__anext__()
            except StopAsyncIteration:
                return
            if first.WhichOneof("call") != "register":
                raise errors.InvalidArgument("register: the stream's first message must register the host",
                                             "register")
            self.svc.reach.check()
            h = _Host(fields.registration(first.register))
            if not (h.reg.resume_etcd_lease and await self._resume(h)):
                # A new daemon waits out a dead one's registration; one that resumes in vain (its own
                # registration ran out and another daemon holds the host) is told at once.
                await self._register(h, wait=not h.reg.resume_etcd_lease)
            out.put_nowait(self._registered(h))
            tasks.append(spawn(self._follow(h.reg.host, out), f"the registry stream of host {h.reg.host}"))
            while True:
                try:
                    request = await asyncio.wait_for(requests.__anext__(), SILENT_TTLS * h.reg.ttl_s)
                except StopAsyncIteration:
                    break
                except TimeoutError:
                    # Stopped (SIGSTOP) or gone without closing: its registration has run out by now.
                    raise errors.Unavailable(f"heartbeat: none from host {h.reg.host} for "
                                             f"{SILENT_TTLS * h.reg.ttl_s} s", "heartbeat") from None
                self.svc.reach.check()   # cut off from etcd: the node moves to another replica
                call = request.WhichOneof("call")
                if call == "heartbeat":
                    await self._heartbeat(h, out)
                elif call == "usage":
                    await self._usage(h, fields.usage(request.usage), out)
                elif call == "deregister":
                    if h.etcd_lease:
                        await self.store.revoke(h.etcd_lease)
                        log.info("host %s deregistered", h.reg.host)
                    h.etcd_lease = 0
                    break
                elif call == "register":
                    raise errors.InvalidArgument("register: only the stream's first message registers",
                                                 "register")
                else:
                    raise errors.InvalidArgument("call: one of heartbeat, usage or deregister is required",
                                                 "call")
            # The node closed its side: the registration runs down by itself unless it resumes elsewhere.

        tasks.append(spawn(read_requests(out, read, "register"), "registry stream reader"))
        try:
            await send_answers(out, context, "Register", lambda item: item)
        finally:
            await cancel_and_wait(tasks)

    async def ListLeases(self, request: pb.ListLeasesRequest,
                         context: grpc.aio.ServicerContext) -> pb.ListLeasesResponse | None:
        try:
            self.svc.reach.check()
            host, gpu_uuid = fields.list_leases(request)
            snap = await self.store.get_prefix(self.keys.leases(host, gpu_uuid))
            return pb.ListLeasesResponse(revision=snap.revision,
                                         kvs=[fields.stored_key(self.keys, kv) for kv in snap.kvs])
        except errors.GpucoordError as e:
            refuse(context, e)
            return None
