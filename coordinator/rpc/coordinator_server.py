"""The Coordinator gRPC server: translates messages and errors around ``CoordinatorService``."""
from __future__ import annotations

import asyncio
import functools
import json
import logging
import time
from typing import Any, AsyncIterator, Awaitable, Callable, TypeVar

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from coordinator import errors, metrics
from coordinator.policy.departing import process_state
from coordinator.records import EvictionRecord, InvalidRecord, VramLease
from agent_client.api import coordinator_pb2 as pb
from agent_client.api import coordinator_pb2_grpc as pb_grpc
from coordinator.config import MAX_STREAM_CALLS, CoordinatorConfig
from coordinator.replica.service import CoordinatorService
from coordinator.replica.status import status_json
from coordinator.replica.validate import check_lease_id, validate_acquire, validate_attach
from coordinator.rpc.answers import AnswerQueue, send_answers
from coordinator.rpc.forward import Forwarder, forwarded_by
from coordinator.rpc.guard import follow_revocations, make_guard
from coordinator.security.authz import COORDINATOR, SESSION_STREAM_CALLS
from coordinator.security.interceptor import Refused, audit_call, current_caller, refuse
from coordinator.security.tls import add_port, check_listen, server_options

log = logging.getLogger(__name__)

T = TypeVar("T")


def lease_pb(lease: VramLease, ttl_remaining: int = 0) -> pb.Lease:
    return pb.Lease(id=lease.id, host=lease.host, gpu_uuid=lease.gpu_uuid, gpu_index=lease.gpu_index,
                    vram_mb=lease.vram_mb, priority=lease.priority, preemptible=lease.preemptible, token=lease.token,
                    agent=lease.agent, session_id=lease.session_id, request_id=lease.request_id,
                    created_at=lease.created_at, ttl_remaining=ttl_remaining, pids=list(lease.pids), pgid=lease.pgid)


def _rpc(fn: Callable[..., Awaitable[T]], name: str = "") -> Callable[..., Awaitable[T | None]]:
    """Every error becomes a gRPC status with its message: the one translation point of the server.
    ``name``: the RPC counted in the metrics, when not the function's own name. The status is set and the
    handler returns (no abort: see ``coordinator.security.interceptor``)."""
    rpc = name or fn.__name__

    @functools.wraps(fn)
    async def wrapper(self: Any, request: Any, context: Any) -> T | None:
        try:
            self.svc.reach.check()   # cut off from etcd: UNAVAILABLE at once, the caller tries another replica
            return await fn(self, request, context)
        except errors.GpucoordError as e:
            metrics.count_refusal(rpc, e)
            refuse(context, e)
        except InvalidRecord as e:   # a malformed stored value that the call needed: it is left as it is
            error = errors.FailedPrecondition(f"record: a stored value this call needs is malformed ({str(e)[:200]})",
                                              "record")
            metrics.count_refusal(rpc, error)
            refuse(context, error)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            log.exception("%s failed", rpc)
            metrics.count_refusal(rpc, e)
            context.set_code(grpc.StatusCode.INTERNAL)
            context.set_details(f"internal error: {repr(e)[:200]}")
        return None

    return wrapper


class _CallContext:
    """What a handler sees of its call when the call came as a Session stream message: the stream's peer and
    metadata, and a status of this call alone."""

    def __init__(self, stream: grpc.aio.ServicerContext) -> None:
        self._stream = stream
        self.status: tuple[grpc.StatusCode, str] | None = None

    def set_code(self, code: grpc.StatusCode) -> None:
        self.status = (code, self.status[1] if self.status else "")

    def set_details(self, details: str) -> None:
        self.status = (self.status[0] if self.status else grpc.StatusCode.UNKNOWN, details)

    def invocation_metadata(self) -> Any:
        return self._stream.invocation_metadata()

    def peer(self) -> str:
        return str(self._stream.peer())


def _refusal(call_id: int, code: grpc.StatusCode, details: str) -> pb.SessionResponse:
    return pb.SessionResponse(call_id=call_id, code=code.value[0], message=details)


def _eviction_or_none(kv: Any) -> EvictionRecord | None:
    """A stored eviction notice; None for a malformed one (the replica's watch logged it)."""
    try:
        return EvictionRecord.from_kv(kv)
    except InvalidRecord:
        return None


def redact_for_agent(status: pb.GetStatusResponse, agent: str) -> None:
    """What an agent may see of a host (G9): its own leases in full; of other agents' leases, neither the
    session id, the request id nor the processes (pids, pgid), nor who asked for an eviction. Of the GPUs'
    processes only its own leases' appear (of other agents' departing leases, neither their processes nor
    who asked); the queue shows no other agent's request id."""
    for hs in status.hosts:
        own = {lease.id for lease in hs.leases if lease.agent == agent}
        for lease in hs.leases:
            if lease.agent == agent:
                continue
            lease.session_id = lease.request_id = ""
            del lease.pids[:]
            lease.pgid = 0
            if lease.HasField("eviction"):
                lease.eviction.requested_by = ""
        for gpu in hs.gpus:
            mine = [p for p in gpu.processes if p.lease_id in own]
            del gpu.processes[:]
            gpu.processes.extend(mine)
            for use in gpu.lease_use:
                if use.lease_id not in own:
                    del use.pids[:]
            for gone in gpu.departing:
                if gone.agent != agent:
                    del gone.pids[:]
                    gone.requested_by = ""
        for entry in hs.queue:
            if entry.agent != agent:
                entry.request_id = ""


class CoordinatorServicer(pb_grpc.CoordinatorServicer):  # type: ignore[misc]
    def __init__(self, svc: CoordinatorService, forward: bool = True) -> None:
        self.svc = svc
        self.streams: set[asyncio.Task[Any]] = set()
        cfg = svc.config
        # With TLS a forwarded call would carry the replica's identity, not the agent's: replicas then do
        # not forward (each decides what it receives; compare-and-set keeps it correct) and only tell
        # clients the owner's address, which they follow.
        self.forward = forward
        self.forwarder = Forwarder(svc.replica_id, margin_s=max(2.0, 2 * cfg.etcd_timeout_s),
                                   avoid_s=float(cfg.election_ttl_s))


    def _answers(self) -> AnswerQueue:
        """A stream's queue of answers, bounded as configured (README "Limits")."""
        cfg = self.svc.config
        return AnswerQueue(cfg.stream_answers_max, cfg.stream_answer_bytes_max)

    async def _send(self, out: AnswerQueue, context: grpc.aio.ServicerContext, rpc_name: str,
                    as_notice: Callable[[pb.KeepAliveResponse], Any]) -> None:
        """What a session's stream (KeepAlive or Session) sends: the items of ``out`` until None. An error
        ends the stream with its status; an eviction notice the service pushes goes out as
        ``as_notice(KeepAliveResponse)``; an overflow of ``out`` ends it with RESOURCE_EXHAUSTED."""
        def convert(item: Any) -> Any:
            if isinstance(item, EvictionRecord):
                return as_notice(pb.KeepAliveResponse(ttl_seconds=-1, notices=[self._notice(item)]))
            return item
        await send_answers(out, context, rpc_name, convert)

    def _notice(self, record: EvictionRecord) -> pb.EvictionNotice:
        """An eviction notice as an agent gets it: with the seconds left as this replica measures them."""
        return pb.EvictionNotice(lease_id=record.lease_id, gpu_uuid=record.gpu_uuid, reason=record.reason,
                                 requested_by=record.requested_by, deadline_unix=record.deadline_unix,
                                 grace_left_seconds=self.svc.grace_left(record), revoke=record.revoke)
    async def _session(self, ref: pb.SessionRef) -> Any:
        return await self.svc.session(ref.agent, ref.session_id)

    @_rpc
    async def OpenSession(self, request: pb.OpenSessionRequest, context: Any) -> pb.OpenSessionResponse:
        sid, ttl = await self.svc.open_session(request.agent, request.host, request.ttl_seconds, request.pid,
                                               request.client_version)
        interval = min(self.svc.config.keepalive_interval_s, ttl / 3)
        return pb.OpenSessionResponse(session_id=sid, ttl_seconds=ttl, keepalive_interval_seconds=interval)

    async def KeepAlive(self, request_iterator: AsyncIterator[pb.KeepAliveRequest],
                        context: grpc.aio.ServicerContext) -> None:
        """Answers each keepalive with the remaining TTL, and pushes eviction notices as they appear."""
        out = self._answers()
        registered: list[str] = []

        async def read() -> None:
            try:
                async for req in request_iterator:
                    info = await self._session(req.session)
                    ttl = await self.svc.keepalive(info)
                    if not registered:
                        registered.append(info.session_id)
                        self.svc.register_stream(info.session_id, out)
                    out.put_nowait(pb.KeepAliveResponse(ttl_seconds=ttl))
                out.put_nowait(None)
            except errors.GpucoordError as e:
                out.put_nowait(e)
            except asyncio.CancelledError:
                raise
            except Exception as e:
                # The caller went away (or the server is stopping): the stream just ends.
                log.debug("keepalive stream ended: %r", e)
                out.put_nowait(None)

        metrics.SESSIONS.inc()
        reader = asyncio.get_running_loop().create_task(read())
        try:
            await self._send(out, context, "KeepAlive", lambda r: r)
        finally:
            reader.cancel()
            if registered:
                self.svc.unregister_stream(registered[0], out)
            metrics.SESSIONS.dec()

    async def Session(self, request_iterator: AsyncIterator[Any], context: grpc.aio.ServicerContext) -> None:
        """A session's Acquire, Release and KeepAlive calls as messages, answered on the stream as they
        finish: each one goes to the handler of its unary call (after the interceptor has checked it as that
        call), runs as its own task, and is cancelled when its deadline passes, when the caller cancels it or
        when the stream ends. A session kept alive here also gets its eviction notices here (call_id 0)."""
        out = self._answers()
        calls: dict[int, asyncio.Task[None]] = {}
        registered: list[str] = []
        handlers: dict[str, Callable[[Any, Any], Awaitable[Any]]] = {
            "acquire": self.Acquire, "release": self.Release, "keepalive": self._keepalive_call}

        async def answer(call_id: int, field: str, request: Any, timeout_s: float) -> None:
            method = COORDINATOR + SESSION_STREAM_CALLS[field]
            call_context = _CallContext(context)
            try:
                async with asyncio.timeout(timeout_s if timeout_s > 0 else None):
                    result = await handlers[field](request, call_context)
                if call_context.status is not None:
                    code, details = call_context.status
                    out.put_nowait(_refusal(call_id, code, details))
                    audit_call(method, request, code)
                    return
            except TimeoutError:
                out.put_nowait(_refusal(call_id, grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded"))
                audit_call(method, request, grpc.StatusCode.DEADLINE_EXCEEDED)
                return
            finally:
                calls.pop(call_id, None)
            out.put_nowait(pb.SessionResponse(call_id=call_id, **{field: result}))
            if field == "keepalive" and not registered:
                # Kept alive here: the session's eviction notices come here from now on.
                registered.append(request.session.session_id)
                self.svc.register_stream(request.session.session_id, out)
            audit_call(method, request, grpc.StatusCode.OK)

        async def read() -> None:
            loop = asyncio.get_running_loop()
            try:
                async for request in request_iterator:
                    if isinstance(request, Refused):   # by the interceptor, as the unary call would be
                        out.put_nowait(_refusal(request.request.call_id, grpc.StatusCode[request.error.code],
                                                request.error.message))
                        continue
                    call_id, field = request.call_id, request.WhichOneof("call")
                    if field == "cancel":
                        task = calls.get(request.cancel)
                        if task is not None:
                            task.cancel()   # as a unary call's handler is when its caller cancels
                    elif field is None:
                        out.put_nowait(_refusal(call_id, grpc.StatusCode.INVALID_ARGUMENT,
                                                "call: one of acquire, release or keepalive is required"))
                    elif call_id == 0 or call_id in calls:
                        why = "must be > 0" if call_id == 0 else "already names a call in flight on this stream"
                        out.put_nowait(_refusal(call_id, grpc.StatusCode.INVALID_ARGUMENT, f"call_id: {why}"))
                    elif len(calls) >= MAX_STREAM_CALLS:
                        out.put_nowait(_refusal(call_id, grpc.StatusCode.RESOURCE_EXHAUSTED,
                                                f"call_id: {MAX_STREAM_CALLS} calls already in flight on this "
                                                "stream; wait for answers or open another stream"))
                    else:
                        calls[call_id] = loop.create_task(answer(call_id, field, getattr(request, field),
                                                                 request.timeout_seconds))
                # The client has sent its last call: answer what is in flight, then end the stream.
                while calls:
                    await asyncio.gather(*calls.values(), return_exceptions=True)
                out.put_nowait(None)
            except errors.GpucoordError as e:
                out.put_nowait(e)   # malformed bytes: the stream ends with INVALID_ARGUMENT
            except asyncio.CancelledError:
                raise
            except Exception as e:
                log.debug("session stream ended: %r", e)   # the caller went away, or the server stops
                out.put_nowait(None)

        reader = asyncio.get_running_loop().create_task(read())
        try:
            await self._send(out, context, "Session", lambda r: pb.SessionResponse(keepalive=r))
        finally:
            reader.cancel()
            for task in list(calls.values()):
                task.cancel()
            if registered:
                self.svc.unregister_stream(registered[0], out)

    async def _keepalive(self, request: pb.KeepAliveRequest, context: Any) -> pb.KeepAliveResponse:
        return pb.KeepAliveResponse(ttl_seconds=await self.svc.keepalive(await self._session(request.session)))

    _keepalive_call = _rpc(_keepalive, "KeepAlive")   # a KeepAlive message of a Session stream

    @_rpc
    async def CloseSession(self, request: pb.CloseSessionRequest, context: Any) -> pb.CloseSessionResponse:
        await self.svc.close_session(await self._session(request.session))
        return pb.CloseSessionResponse()

    @_rpc
    async def Acquire(self, request: pb.AcquireRequest, context: Any) -> pb.AcquireResponse:
        t0 = time.perf_counter()
        try:
            # Fields first, then the session: a bad request costs no etcd read.
            validate_acquire(request.vram_mb, request.gpu, request.priority, request.request_id,
                             request.wait_seconds)
            info = await self._session(request.session)
            wait_s = request.wait_seconds
            owner = self.svc.owner(info.host)
            if owner is not None and owner[0] != self.svc.replica_id and owner[1] \
                    and self.forward and not forwarded_by(context) and self.forwarder.usable(owner[1]):
                sent, owner_id = time.monotonic(), owner[0]
                answer = await self.forwarder.acquire(
                    owner[1], request, owner_alive=lambda: owner_id in self.svc.live_replicas())
                if answer is not None:
                    return answer
                # The owner could not answer: decide here, within what is left of the wait.
                wait_s = max(0.0, wait_s - (time.monotonic() - sent))
                owner = None
            preemptible = request.preemptible if request.HasField("preemptible") else True
            caller = current_caller()
            operator = caller is not None and caller.identity is not None and caller.identity.role == "operator"
            lease = await self.svc.acquire(info, request.vram_mb, request.gpu, request.priority, preemptible,
                                           request.request_id, wait_s, forwarded=bool(forwarded_by(context)),
                                           capped=not operator)
            return pb.AcquireResponse(lease=lease_pb(lease), owner=owner[1] if owner is not None else "")
        finally:
            metrics.ACQUIRE_LATENCY.observe(time.perf_counter() - t0)

    @_rpc
    async def Release(self, request: pb.ReleaseRequest, context: Any) -> pb.ReleaseResponse:
        check_lease_id(request.lease_id)
        info = await self._session(request.session)
        return pb.ReleaseResponse(released=await self.svc.release(info, request.lease_id))

    @_rpc
    async def AttachProcesses(self, request: pb.AttachProcessesRequest, context: Any) -> pb.AttachProcessesResponse:
        validate_attach(request.lease_id, list(request.pids), request.pgid)
        info = await self._session(request.session)
        changed = await self.svc.attach_processes(info, request.lease_id, list(request.pids), request.pgid)
        return pb.AttachProcessesResponse(changed=changed)

    @_rpc
    async def GetStatus(self, request: pb.GetStatusRequest, context: Any) -> pb.GetStatusResponse:
        revision, views, ttls = await self.svc.status(request.host)
        doc = status_json(revision, views, ttls)
        # The notices, read just after the snapshot: shown next to the leases they are about.
        notices = {n.lease_id: n for n in map(_eviction_or_none,
                                              (await self.svc.store.get_prefix(self.svc.keys.evictions())).ranges[0])
                   if n is not None}
        leader = self.svc.leadership.leader_id if self.svc.leadership is not None else ""
        out = pb.GetStatusResponse(revision=revision, leader=leader)
        for h in doc["hosts"]:
            hs = out.hosts.add(host=h["host"], address=h["address"], alive=h["alive"], simulated=h["simulated"],
                               invalid=h["invalid"],
                               usage_age_seconds=h["usage_age_s"], usage_stale=h["usage_stale"], partition_mode=h["partition_mode"],
                               cpu_count=h["cpu_count"], mem_bytes=h["mem_bytes"], disk_bytes=h["disk_bytes"])
            for g in h["gpus"]:
                gs = hs.gpus.add(index=g["index"], uuid=g["uuid"], name=g["name"], total_mb=g["total_mb"],
                                 usable_mb=g["usable_mb"], leased_mb=g["leased_mb"], used_mb=g["used_mb"],
                                 untracked_mb=g["untracked_mb"], free_mb=g["free_mb"], seq=g["seq"],
                                 numa_node=g["numa_node"], nvlink_peers=g["nvlink_peers"])
                for p in g["processes"]:
                    gs.processes.add(pid=int(p["pid"]), used_mb=int(p["used_mb"]), state=str(p.get("state", "")),
                                     lease_id=str(p.get("lease_id", "")))
                for u in g["lease_use"]:
                    gs.lease_use.add(lease_id=u["lease_id"], agent=u["agent"], vram_mb=int(u["vram_mb"]),
                                     used_mb=int(u["used_mb"]), over_use=bool(u["over_use"]),
                                     pids=[int(x) for x in u["pids"]])
                gs.departing_mb = int(g["departing_mb"])
                for d in g["departing"]:
                    gs.departing.add(**d)
                metrics.VRAM.labels(h["host"], g["uuid"], "leased").set(g["leased_mb"])
                metrics.VRAM.labels(h["host"], g["uuid"], "free").set(g["free_mb"])
            for a in h["agents"]:
                hs.agents.add(agent=a["agent"], allocation_json=json.dumps(a["allocation"]),
                              leased_mb=a["leased_mb"], leases=a["leases"])
            view = views[[v.host for v in views].index(h["host"])]
            for lease in view.leases.values():
                msg = lease_pb(lease, ttls.get(lease.etcd_lease, -1))
                notice = notices.get(lease.id)
                if notice is not None:
                    msg.eviction.CopyFrom(self._notice(notice))
                    msg.eviction.processes = process_state(view.usage, lease.gpu_uuid, lease.id, lease.pids,
                                                           lease.pgid)
                hs.leases.append(msg)
            for q in h["queue"]:
                hs.queue.add(rank=q["rank"], agent=q.get("agent", ""), vram_mb=q.get("vram_mb", 0),
                             priority=q.get("priority", 0), gpu=q.get("gpu", ""), request_id=q.get("request_id", ""))
            metrics.LEASES.labels(h["host"]).set(len(h["leases"]))
        caller = current_caller()
        if caller is not None and caller.identity is not None and caller.identity.role == "agent":
            redact_for_agent(out, caller.identity.name)
        return out

    @_rpc
    async def ApplyPartition(self, request: pb.ApplyPartitionRequest, context: Any) -> pb.ApplyPartitionResponse:
        try:
            spec = json.loads(request.spec_json)
        except (ValueError, RecursionError) as e:
            raise errors.InvalidArgument(f"spec_json: not valid JSON: {e}", "spec_json") from e
        if not isinstance(spec, dict):
            raise errors.InvalidArgument("spec_json: must be a JSON object", "spec_json")
        partition, applied = await self.svc.apply_partition(spec, request.dry_run, request.evict)
        return pb.ApplyPartitionResponse(partition_json=json.dumps(partition.to_json()), applied=applied)

    @_rpc
    async def GetPartition(self, request: pb.GetPartitionRequest, context: Any) -> pb.GetPartitionResponse:
        partition, explicit = await self.svc.get_partition(request.host)
        return pb.GetPartitionResponse(partition_json=json.dumps(partition.to_json()), explicit=explicit)

    @_rpc
    async def EvictLease(self, request: pb.EvictLeaseRequest, context: Any) -> pb.EvictLeaseResponse:
        deadline = await self.svc.evict(request.lease_id, request.grace_seconds, request.reason,
                                        asked_by=str(current_caller() or "unknown"))
        return pb.EvictLeaseResponse(deadline_unix=deadline)

    @_rpc
    async def RevokeLease(self, request: pb.RevokeLeaseRequest, context: Any) -> pb.RevokeLeaseResponse:
        revoked, processes = await self.svc.revoke_by_operator(request.lease_id,
                                                               asked_by=str(current_caller() or "unknown"))
        return pb.RevokeLeaseResponse(revoked=revoked, processes=processes)

    async def Ping(self, request: pb.PingRequest, context: Any) -> pb.PingResponse:
        return pb.PingResponse()


async def create_server(config: CoordinatorConfig) -> tuple[grpc.aio.Server, int, CoordinatorService]:
    """A started Coordinator server on ``config.listen`` (port 0 picks a free one) -> (server, port, service)."""
    tls = config.tls_files()
    check_listen(config.listen, tls, config.insecure)
    # Identity, revocation, limits, authorization, bounds and audit: one interceptor, before any handler
    # (coordinator.security).
    guard = make_guard(tls is not None, config.calls_per_s_per_identity, config.call_burst_per_identity,
                       config.max_streams_per_identity)
    server = grpc.aio.server(interceptors=[guard], options=server_options())
    port = add_port(server, config.listen, tls)
    svc = CoordinatorService(config, advertise=config.advertise or f"{config.listen.rpartition(':')[0]}:{port}")
    await svc.start()
    guard.agent_hosts = svc.agent_hosts
    servicer = CoordinatorServicer(svc, forward=tls is None)
    svc.on_stop.append(servicer.forwarder.close)
    pb_grpc.add_CoordinatorServicer_to_server(servicer, server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = (pb.DESCRIPTOR.services_by_name["Coordinator"].full_name, health.SERVICE_NAME,
             reflection.SERVICE_NAME)
    reflection.enable_server_reflection(names, server)
    await server.start()
    await follow_revocations(server, guard, svc.store, svc.keys, config.etcd_timeout_s * 3)
    await health_servicer.set(pb.DESCRIPTOR.services_by_name["Coordinator"].full_name,
                              health_pb2.HealthCheckResponse.SERVING)
    await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    return server, port, svc


async def serve(config: CoordinatorConfig, ready: Callable[[int], None] | None = None,
                stop: asyncio.Event | None = None) -> None:
    """Run a coordinator until ``stop`` is set (or forever)."""
    if config.metrics_listen:
        metrics.serve(config.metrics_listen, config.tls_files())
    server, port, svc = await create_server(config)
    await svc.store.check_server_version()
    log.info("coordinator %s serving on port %d", svc.replica_id, port)
    if ready is not None:
        ready(port)
    try:
        await (stop.wait() if stop is not None else asyncio.Event().wait())
    finally:
        # Waiting RPCs get UNAVAILABLE (their queue entries stay in etcd), and so does anything that
        # arrives while we stop; nothing hangs.
        await svc.stop()
        await server.stop(grace=1.0)
