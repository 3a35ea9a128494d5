"""The Coordinator gRPC server: translates messages and errors around ``CoordinatorService``."""
from __future__ import annotations

import asyncio
import functools
import json
import logging
import time
from typing import Any, AsyncIterator, Awaitable, Callable, TypeVar

import grpc
from grpc.aio import ServicerContext
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from agent_client.api import coordinator_pb2 as pb
from agent_client.api import coordinator_pb2_grpc as pb_grpc
from agent_client.api import registry_pb2, registry_pb2_grpc
from coordinator import errors, metrics
from coordinator.config import CoordinatorConfig
from coordinator.etcd.store import ChannelFactory
from coordinator.limits import quote
from coordinator.metrics_http import MetricsGate
from coordinator.policy import time_limits
from coordinator.records import EvictionRecord, Gang, SessionInfo, VramLease
from coordinator.replica.cordons import Cordons
from coordinator.replica.service import CoordinatorService
from coordinator.replica.teams import Teams, mirror_membership
from coordinator.rpc import certificates, validate
from coordinator.rpc import teams as team_rpcs
from coordinator.rpc.forward import Forwarder, forwarded_by
from coordinator.rpc.guard import follow_revocations, make_guard
from coordinator.rpc.node_client import NodeCalls, host_address
from coordinator.rpc.registry_server import RegistryServicer
from coordinator.rpc.session_stream import SessionStreams
from coordinator.rpc.status_json import message_to_json, status_objects
from coordinator.rpc.status_message import (
    cordon_pb,
    lease_pb,
    redact_for_agent,
    status_response,
)
from coordinator.security import handshakes
from coordinator.security.interceptor import current_caller
from coordinator.security.status import as_error, internal, set_status, wire_status
from coordinator.security.tls import add_port, check_listen, server_options
from coordinator.web.app import console_app

log = logging.getLogger(__name__)
ETCD_MEMBERS_S = 1.0   # how long a fleet status waits for etcd's member list

T = TypeVar("T")
Req = TypeVar("Req")
Servicer = TypeVar("Servicer", bound="CoordinatorServicer")


def _rpc(fn: Callable[[Servicer, Req, ServicerContext], Awaitable[T]],
         name: str = "") -> Callable[[Servicer, Req, ServicerContext], Awaitable[T | None]]:
    """Every error becomes a gRPC status with its message: the one translation point of the server.
    ``name``: the RPC counted in the metrics, when not the function's own name. The status is set and the
    handler returns (no abort: see ``coordinator.security.interceptor``)."""
    rpc = name or fn.__name__

    @functools.wraps(fn)
    async def wrapper(self: Servicer, request: Req, context: ServicerContext) -> T | None:
        try:
            self.svc.reach.check()   # cut off from etcd: UNAVAILABLE at once, the caller tries another replica
            return await fn(self, request, context)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            error = as_error(e)
            if error is None:
                log.exception("%s failed", rpc)
            metrics.count_refusal(rpc, error or e)
            set_status(context, internal(e) if error is None else wire_status(error))
        return None

    return wrapper


class CoordinatorServicer(pb_grpc.CoordinatorServicer):  # type: ignore[misc]
    def __init__(self, svc: CoordinatorService, forward: bool = True) -> None:
        self.svc = svc
        cfg = svc.config
        # With TLS a forwarded call would carry the replica's identity, not the agent's: replicas then do not forward
        # (each decides what it receives; compare-and-set keeps it correct), only tell clients the owner's address.
        self.forward = forward
        self.forwarder = Forwarder(svc.replica_id, margin_s=max(2.0, 2 * cfg.etcd_timeout_s),
                                   avoid_s=float(cfg.election_ttl_s))
        self.streams = SessionStreams(svc, {"acquire": self.Acquire, "release": self.Release,
                                            "keepalive": self._keepalive_call}, self._notice, self._session)
        self.teams = Teams(svc.ctx)
        self.cordons = Cordons(svc.ctx, svc.leases)
        self.nodes = NodeCalls(svc.config.tls_files())

    def _notice(self, record: EvictionRecord) -> pb.EvictionNotice:
        """An eviction notice as an agent gets it: with the seconds left as this replica measures them."""
        return pb.EvictionNotice(lease_id=record.lease_id, gpu_uuid=record.gpu_uuid, reason=record.reason,
                                 requested_by=record.requested_by, deadline_unix=record.deadline_unix,
                                 grace_left_seconds=self.svc.grace_left(record), revoke=record.revoke,
                                 reclaim_team=record.reclaim, withdrawn=record.withdrawn, asked_by=record.asked_by)
    def _time_limit(self, request: pb.AcquireRequest) -> tuple[float, float]:
        """The new lease's (limit, warning): as asked, or the default (its team's, else the fleet's); above the
        maximum (the fleet's or its team's, the tighter): INVALID_ARGUMENT."""
        c = self.svc.config
        membership = mirror_membership(self.svc.ctx.mirror)
        team = membership.team(membership.team_of(request.session.agent)) if membership is not None else None
        default, most = time_limits.team_limits(c.default_time_limit_s, c.max_time_limit_s,
                                                team.default_time_limit_s if team is not None else 0.0,
                                                team.max_time_limit_s if team is not None else 0.0)
        return time_limits.resolve(request.time_limit_seconds, request.time_limit_warning_seconds, default, most,
                                   c.time_limit_warning_s, request.min_runtime_seconds)

    async def _session(self, ref: pb.SessionRef) -> SessionInfo:
        """The session a call names, once the call's own fields are valid: its fields, then the lookup."""
        validate.session_ref(ref)
        return await self.svc.session(ref.agent, ref.session_id)

    @_rpc
    async def OpenSession(self, request: pb.OpenSessionRequest, context: ServicerContext) -> pb.OpenSessionResponse:
        validate.open_session(request)
        sid, ttl = await self.svc.open_session(request.agent, request.host, request.ttl_seconds, request.pid,
                                               request.client_version)
        interval = min(self.svc.config.keepalive_interval_s, ttl / 3)
        return pb.OpenSessionResponse(session_id=sid, ttl_seconds=ttl, keepalive_interval_seconds=interval)

    async def KeepAlive(self, requests: AsyncIterator[pb.KeepAliveRequest], context: ServicerContext) -> None:
        await self.streams.keepalive(requests, context)

    async def KeepAliveSessions(self, requests: AsyncIterator[pb.KeepAliveSessionsRequest], context: ServicerContext,
                                ) -> None:   # the sessions of one agent process (coordinator.rpc.keepalive_sessions)
        await self.streams.kept_together.serve(requests, context)

    async def Session(self, request_iterator: AsyncIterator[pb.SessionRequest], context: ServicerContext) -> None:
        await self.streams.session(request_iterator, context)

    async def _keepalive(self, request: pb.KeepAliveRequest, context: ServicerContext) -> pb.KeepAliveResponse:
        return pb.KeepAliveResponse(ttl_seconds=await self.svc.keepalive(await self._session(request.session)))

    _keepalive_call = _rpc(_keepalive, "KeepAlive")   # a KeepAlive message of a Session stream

    @_rpc
    async def CloseSession(self, request: pb.CloseSessionRequest, context: ServicerContext) -> pb.CloseSessionResponse:
        await self.svc.close_session(await self._session(request.session))
        return pb.CloseSessionResponse()

    @_rpc
    async def Acquire(self, request: pb.AcquireRequest, context: ServicerContext) -> pb.AcquireResponse:
        t0 = time.perf_counter()
        try:
            # Fields first, then the session: a bad request costs no etcd read.
            validate.acquire(request)
            time_limit = self._time_limit(request)
            info = await self._session(request.session)
            wait_s = request.wait_seconds
            # A multi-host gang is no one host's: the replica that receives it decides it (no forwarding).
            owner = self.svc.owner(info.host) if request.hosts <= 1 else None
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
            parts = await self.svc.acquire(info, request.vram_mb, request.gpu, request.priority, preemptible,
                                           request.request_id, wait_s, forwarded=bool(forwarded_by(context)),
                                           capped=not operator, min_runtime_s=request.min_runtime_seconds,
                                           time_limit=time_limit,
                                           gang=Gang(max(request.gpu_count, 1), request.exclusive,
                                                     request.topology or "any", tuple(request.gpus),
                                                     hosts=max(request.hosts, 1), same=request.same,
                                                     prefer=request.prefer))
            return pb.AcquireResponse(lease=lease_pb(parts[0], parts=parts), owner=owner[1] if owner is not None else "")
        finally:
            metrics.ACQUIRE_LATENCY.observe(time.perf_counter() - t0)

    @_rpc
    async def Release(self, request: pb.ReleaseRequest, context: ServicerContext) -> pb.ReleaseResponse:
        validate.release(request)
        info = await self._session(request.session)
        return pb.ReleaseResponse(released=await self.svc.release(info, request.lease_id))

    @_rpc
    async def AttachProcesses(self, request: pb.AttachProcessesRequest,
                              context: ServicerContext) -> pb.AttachProcessesResponse:
        validate.attach(request)
        info = await self._session(request.session)
        peer = context.peer() or ""

        async def confirm(lease: VramLease) -> None:
            """G9: every process must be the caller's, as the node of the lease's host sees it."""
            kv = await self.svc.store.get(self.svc.keys.host(lease.host))
            address = host_address(kv.value) if kv is not None else ""
            refused = await self.nodes.refused(lease.host, address, lease.id, list(request.pids), request.pgid,
                                               peer)
            if refused:
                shown = ", ".join(str(p) for p in refused[:8]) + (", ..." if len(refused) > 8 else "")
                raise errors.NotOwner(f"pids: {shown} not processes of this caller on host {quote(lease.host)} "
                                      "(a process must carry the lease's GPUCOORD_LEASE_ID, or descend from "
                                      "the process that calls); nothing was recorded", "pids")

        changed = await self.svc.attach_processes(info, request.lease_id, list(request.pids), request.pgid,
                                                  confirm)
        return pb.AttachProcessesResponse(changed=changed)

    @_rpc
    async def GetStatus(self, request: pb.GetStatusRequest, context: ServicerContext) -> pb.GetStatusResponse:
        caller = current_caller()
        agent = caller is not None and caller.identity is not None and caller.identity.role == "agent"
        out = await self.fleet_status(request.host, teams=not agent)
        if agent:
            assert caller is not None and caller.identity is not None
            if not request.host:   # its own view: the hosts it has a live session on (authz lets it ask)
                mine = await self.svc.agent_hosts(caller.identity.name)
                kept = [h for h in out.hosts if h.host in mine]
                del out.hosts[:]
                out.hosts.extend(kept)
            redact_for_agent(out, caller.identity.name)
        return out

    async def fleet_status(self, host: str, teams: bool = True) -> pb.GetStatusResponse:
        """The status of ``host`` (every host: "") as an operator sees it: GetStatus's answer, and the fleet
        console's (``coordinator.web``). ``teams``: with the teams' usage (over the fleet: every host only)."""
        self.svc.reach.check()
        validate.status_host(host)
        # etcd's members, read beside the hosts, for an operator's view of every host (an agent's gets none)
        members = None if host or not teams else asyncio.ensure_future(self._etcd_members())
        try:
            report = await self.svc.status(host)
        except BaseException:
            if members is not None:
                members.cancel()
            raise
        if host and not any(v.inventory is not None or v.host_kv is not None or v.gpus or v.leases
                            or v.partition is not None or v.entries or v.departing or v.cordon is not None
                            for v in report.views):
            # Nothing of that name, not even a gone host's leases: NOT_FOUND (and no series is made for it).
            raise errors.NotFound(f"host: no host {quote(host)} ('gpucoord status' lists them)", "host")
        out = await status_response(report, self._notice)
        if not host and teams:
            teams_pb, days = await team_rpcs.status_teams(self.teams, report.views)
            out.teams.extend(teams_pb)
            out.usage_days.extend(days)
        if members is not None:
            out.etcd_members.extend(await members)
        return out

    async def _etcd_members(self) -> list[pb.EtcdMember]:
        """etcd's members for the status, within a second: a member list that fails or takes longer (a member
        out of reach) is left out, logged, and never holds the status back."""
        try:
            members = await asyncio.wait_for(self.svc.ctx.store.members(), ETCD_MEMBERS_S)
        except (errors.GpucoordError, TimeoutError) as e:
            log.warning("status: could not list etcd's members: %r", e)
            return []
        return [pb.EtcdMember(name=m.name, id=f"{m.id:x}", client_urls=list(m.client_urls), leader=m.leader)
                for m in members]

    @_rpc
    async def ApplyPartition(self, request: pb.ApplyPartitionRequest,
                             context: ServicerContext) -> pb.ApplyPartitionResponse:
        spec = validate.partition_spec(request.spec_json)
        partition, applied = await self.svc.apply_partition(spec, request.dry_run, request.evict)
        return pb.ApplyPartitionResponse(partition_json=json.dumps(partition.to_json()), applied=applied)

    @_rpc
    async def GetPartition(self, request: pb.GetPartitionRequest, context: ServicerContext) -> pb.GetPartitionResponse:
        validate.check_name("host", request.host)
        partition, explicit = await self.svc.get_partition(request.host)
        return pb.GetPartitionResponse(partition_json=json.dumps(partition.to_json()), explicit=explicit)

    @_rpc
    async def EvictLease(self, request: pb.EvictLeaseRequest, context: ServicerContext) -> pb.EvictLeaseResponse:
        validate.evict(request)
        deadline = await self.svc.evict(request.lease_id, request.grace_seconds, request.reason,
                                        asked_by=str(current_caller() or "unknown"))
        return pb.EvictLeaseResponse(deadline_unix=deadline)

    @_rpc
    async def RevokeLease(self, request: pb.RevokeLeaseRequest, context: ServicerContext) -> pb.RevokeLeaseResponse:
        validate.check_lease_id(request.lease_id)
        revoked, processes = await self.svc.revoke_by_operator(request.lease_id,
                                                               asked_by=str(current_caller() or "unknown"))
        return pb.RevokeLeaseResponse(revoked=revoked, processes=processes)

    async def Ping(self, request: pb.PingRequest, context: ServicerContext) -> pb.PingResponse:
        return pb.PingResponse()

    # -- cordon and drain (operator only: coordinator.security.authz; replica/cordons.py) -------------
    @_rpc
    async def CordonHost(self, request: pb.CordonHostRequest, context: ServicerContext) -> pb.CordonHostResponse:
        validate.cordon(request)
        record, created, leases, notices = await self.cordons.cordon(
            request.host, request.reason, request.drain, request.grace_seconds,
            asked_by=str(current_caller() or "unknown"))
        return pb.CordonHostResponse(cordon=cordon_pb(record), created=created, leases=leases, notices=notices)

    @_rpc
    async def UncordonHost(self, request: pb.UncordonHostRequest,
                           context: ServicerContext) -> pb.UncordonHostResponse:
        validate.check_name("host", request.host)
        return pb.UncordonHostResponse(uncordoned=await self.cordons.uncordon(request.host))

    # -- teams (operator only: coordinator.security.authz) -------------------------------------------
    @_rpc
    async def SetTeam(self, request: pb.SetTeamRequest, context: ServicerContext) -> pb.SetTeamResponse:
        return await team_rpcs.set_team(self.teams, request)

    @_rpc
    async def GetTeam(self, request: pb.GetTeamRequest, context: ServicerContext) -> pb.GetTeamResponse:
        return await team_rpcs.get_team(self.teams, request)

    @_rpc
    async def ListTeams(self, request: pb.ListTeamsRequest, context: ServicerContext) -> pb.ListTeamsResponse:
        return await team_rpcs.list_teams(self.teams)

    @_rpc
    async def DeleteTeam(self, request: pb.DeleteTeamRequest, context: ServicerContext) -> pb.DeleteTeamResponse:
        return await team_rpcs.delete_team(self.teams, request)

    # -- certificates (operator only): the deny list, so that operators need no etcd credentials -------
    @_rpc
    async def RevokeCertificate(self, request: pb.RevokeCertificateRequest,
                                context: ServicerContext) -> pb.RevokeCertificateResponse:
        return await certificates.revoke(self.svc.store, self.svc.keys, request,
                                         revoked_by=str(current_caller() or "unknown"))

    @_rpc
    async def ListRevokedCertificates(self, request: pb.ListRevokedCertificatesRequest,
                                      context: ServicerContext) -> pb.ListRevokedCertificatesResponse:
        return await certificates.list_revoked(self.svc.store, self.svc.keys)


async def create_server(config: CoordinatorConfig, etcd_channel: ChannelFactory | None = None,
                        metrics_gate: MetricsGate | None = None) -> tuple[grpc.aio.Server, int, CoordinatorService]:
    """A started Coordinator server on ``config.listen`` (port 0 picks a free one) -> (server, port, service).
    ``etcd_channel``: how its store builds the channel to etcd (``Store(channel=)``; tests record calls).
    ``metrics_gate``: the /metrics server's, which then honours this server's deny list of certificates."""
    tls = config.tls_files()
    check_listen(config.listen, tls, config.insecure)
    # One interceptor before any handler: identity, revocation, limits, authorization, bounds, audit.
    guard = make_guard(tls is not None, config.calls_per_s_per_identity, config.call_burst_per_identity,
                       config.max_streams_per_identity)
    if metrics_gate is not None:
        metrics_gate.revocations = guard.revocations
    server = grpc.aio.server(interceptors=[guard], options=server_options())
    port = add_port(server, config.listen, tls)
    svc = CoordinatorService(config, advertise=config.advertise or f"{config.listen.rpartition(':')[0]}:{port}",
                             channel=etcd_channel)
    await svc.start()
    guard.agent_hosts = svc.agent_hosts
    servicer = CoordinatorServicer(svc, forward=tls is None)
    svc.on_stop.append(servicer.forwarder.close)
    svc.on_stop.append(servicer.nodes.close)
    if metrics_gate is not None:   # the fleet console, on the /metrics server's port
        async def console_doc() -> dict[str, Any]:   # what 'gpucoord status --json' prints
            return status_objects(message_to_json(await servicer.fleet_status("")))
        metrics_gate.console = console_app(console_doc, asyncio.get_running_loop())
    pb_grpc.add_CoordinatorServicer_to_server(servicer, server)
    registry_pb2_grpc.add_RegistryServicer_to_server(RegistryServicer(svc), server)   # node daemons' calls
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = (pb.DESCRIPTOR.services_by_name["Coordinator"].full_name,
             registry_pb2.DESCRIPTOR.services_by_name["Registry"].full_name, health.SERVICE_NAME,
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
    handshakes.install(metrics.HANDSHAKE_FAILURES.inc)   # gRPC core's line per failed handshake, aggregated
    gate = MetricsGate()
    if config.metrics_listen:
        metrics.serve(config.metrics_listen, config.tls_files(), gate=gate)
    server, port, svc = await create_server(config, metrics_gate=gate)
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
