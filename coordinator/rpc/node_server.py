"""The Node gRPC server around a ``NodeDaemon``: inventory and fencing-token checks, health and reflection."""
from __future__ import annotations

import asyncio
import functools
from typing import Awaitable, Callable, Sequence, TypeVar

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from agent_client.api import node_pb2 as pb
from agent_client.api import node_pb2_grpc as pb_grpc
from coordinator import errors, metrics
from coordinator.etcd.store import Store
from coordinator.keys import Keys, valid_name
from coordinator.metrics_http import MetricsGate
from coordinator.node.daemon import NodeDaemon, quote_prefix
from coordinator.node.enforce import Enforcer
from coordinator.node.inventory import GpuSource
from coordinator.node.ownership import refused
from coordinator.node.remote import RemoteNodeDaemon
from coordinator.records import InvalidRecord, VramLease
from coordinator.rpc.guard import follow_revocations, make_guard
from coordinator.security import handshakes
from coordinator.security.limits import Limits
from coordinator.security.status import refuse
from coordinator.security.tls import TlsFiles, add_port, check_listen, server_options

MAX_CONFIRM = 256          # pids one ConfirmProcesses may name (AttachProcesses names at most 64)
REVOCATIONS_READY_S = 10.0   # the node serves only once it has read the deny list of certificates

Req = TypeVar("Req")
Resp = TypeVar("Resp")
Servicer = TypeVar("Servicer", bound="NodeServicer")
Method = Callable[[Servicer, Req, grpc.aio.ServicerContext], Awaitable[Resp]]


def _answered(rpc: str, fn: Method[Servicer, Req, Resp]) -> Method[Servicer, Req, Resp | None]:
    """A GpucoordError becomes the call's status (counted in gpucoord_refusals_total like the coordinator's
    refusals), set without an abort (see ``coordinator.security.interceptor``)."""
    @functools.wraps(fn)
    async def wrapper(self: Servicer, request: Req, context: grpc.aio.ServicerContext) -> Resp | None:
        try:
            return await fn(self, request, context)
        except errors.GpucoordError as e:
            metrics.count_refusal(rpc, e)
            refuse(context, e)
            return None
    return wrapper


class NodeServicer(pb_grpc.NodeServicer):  # type: ignore[misc]
    def __init__(self, daemon: NodeDaemon) -> None:
        self.daemon = daemon

    async def _get_inventory(self, request: pb.GetInventoryRequest,
                             context: grpc.aio.ServicerContext) -> pb.GetInventoryResponse:
        inv = self.daemon.inventory
        if inv is None:
            raise errors.Unavailable("the node daemon is starting")
        usage = {u.uuid: u for u in self.daemon.last_usage}
        out = pb.GetInventoryResponse(host=inv.host, address=inv.address, cpu_count=inv.cpu_count,
                                      core_ids=list(inv.core_ids), mem_bytes=inv.mem_bytes, disk_path=inv.disk_path,
                                      disk_bytes=inv.disk_bytes, version=inv.version, simulated=inv.simulated)
        for g in inv.gpus:
            u = usage.get(g.uuid)
            gp = out.gpus.add(index=g.index, uuid=g.uuid, name=g.name, vram_total_mb=g.vram_total_mb,
                              vram_used_mb=u.vram_used_mb if u else -1, vram_free_mb=u.vram_free_mb if u else -1,
                              utilization_percent=u.utilization_pct if u else -1)
            for p in (u.processes if u else ()):
                gp.processes.add(pid=p.pid, used_mb=p.used_mb)
        return out

    GetInventory = _answered("GetInventory", _get_inventory)

    async def _check_token(self, request: pb.CheckTokenRequest,
                           context: grpc.aio.ServicerContext) -> pb.CheckTokenResponse:
        """``gpu_uuid`` names the GPU by uuid or by index (all digits). One that is neither is
        INVALID_ARGUMENT; a well-formed index or uuid that this host does not have is NOT_FOUND."""
        ref = request.gpu_uuid
        if not ref:
            raise errors.InvalidArgument("gpu_uuid: is required", "gpu_uuid")
        if not valid_name(ref):
            raise errors.InvalidArgument(f"gpu_uuid: {quote_prefix(ref)} is neither a GPU index nor a GPU uuid",
                                         "gpu_uuid")
        if request.token <= 0:
            raise errors.InvalidArgument("token: must be > 0", "token")
        inv = self.daemon.inventory
        if inv is None:
            raise errors.Unavailable("the node daemon is starting; retry")
        gpu = inv.gpu(int(ref)) if ref.isdigit() else inv.gpu(ref)
        if gpu is None:
            what = f"index {int(ref)}" if ref.isdigit() else quote_prefix(ref)
            raise errors.NotFound(f"gpu_uuid: host {inv.host!r} has no GPU {what}", "gpu_uuid")
        if not self.daemon.leases_ready:
            raise errors.Unavailable("the node is resynchronising its view of leases; retry")
        if not self.daemon.reaches_etcd:
            # Cut off from etcd, its view of the leases may miss a revocation: no answer is better than "live".
            raise errors.Unavailable(f"node {self.daemon.host} cannot reach etcd: it cannot tell whether the "
                                     "token is live; retry")
        live, lease_id = self.daemon.check_token(gpu.uuid, request.token)
        if not live and request.token > self.daemon.highest_token.get(gpu.uuid, 0):
            # Newer than any token this node has seen: a grant its watch may not have delivered yet (an agent
            # checks right after its acquire returned), so etcd answers rather than a "no" that is too early.
            live, lease_id = await self._check_token_in_etcd(gpu.uuid, request.token)
        return pb.CheckTokenResponse(live=live, lease_id=lease_id,
                                     highest_token=self.daemon.highest_token.get(gpu.uuid, 0))

    CheckToken = _answered("CheckToken", _check_token)

    async def _confirm_processes(self, request: pb.ConfirmProcessesRequest,
                                 context: grpc.aio.ServicerContext) -> pb.ConfirmProcessesResponse:
        """Which of an AttachProcesses' processes do not belong to its caller (``coordinator.node.ownership``);
        the coordinator role only (``coordinator.security.authz``). It reads /proc, off the event loop."""
        if len(request.pids) > MAX_CONFIRM or len(request.peer) > 128 or len(request.lease_id) > 128:
            raise errors.InvalidArgument("pids: too many, or a field too long", "pids")
        out = await asyncio.to_thread(refused, request.lease_id, list(request.pids), request.pgid, request.peer)
        if not out:   # the enforcer kills, once the lease is gone, only what it confirmed (or run started)
            self.daemon.enforcer.confirmed(request.lease_id, [*request.pids, request.pgid])
        return pb.ConfirmProcessesResponse(refused=out)

    ConfirmProcesses = _answered("ConfirmProcesses", _confirm_processes)

    async def _check_token_in_etcd(self, gpu_uuid: str, token: int) -> tuple[bool, str]:
        for kv in await self.daemon.stored_leases(gpu_uuid):
            try:
                lease = VramLease.from_kv(kv)
            except InvalidRecord:
                continue   # a malformed lease proves nothing
            if lease.token == token:
                return True, lease.id
        return False, ""


async def create_node_server(daemon: NodeDaemon, listen: str, tls: TlsFiles | None = None,
                             insecure: bool = False, calls_per_s: float = Limits.DEFAULT_CALLS_PER_S,
                             burst: int = Limits.DEFAULT_BURST,
                             max_streams: int = Limits.DEFAULT_MAX_STREAMS,
                             metrics_gate: MetricsGate | None = None) -> tuple[grpc.aio.Server, int]:
    check_listen(listen, tls, insecure)
    # The same guard as the coordinator's (coordinator.security): identity, authorization, bounds; no
    # SO_REUSEPORT, so a second daemon on a port in use fails to start instead of sharing it.
    guard = make_guard(tls is not None, calls_per_s, burst, max_streams)
    if metrics_gate is not None:   # /metrics honours this server's deny list of certificates
        metrics_gate.revocations = guard.revocations
    server = grpc.aio.server(interceptors=[guard], options=server_options())
    pb_grpc.add_NodeServicer_to_server(NodeServicer(daemon), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (pb.DESCRIPTOR.services_by_name["Node"].full_name, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    port = add_port(server, listen, tls)
    await server.start()
    assert daemon.feed is not None
    # A daemon in the registry mode reads the list through the coordinator's stream, which opens only once
    # the daemon has registered (with this server's port): it does not wait here, and its server refuses
    # calls (UNAVAILABLE, retry) until the list has come.
    await follow_revocations(server, guard, daemon.feed, daemon.keys, REVOCATIONS_READY_S,
                             wait=daemon.reads_etcd)
    await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    return server, port


def client_credentials(tls: TlsFiles | None) -> grpc.ChannelCredentials | None:
    """The node's certificate as a client's (to its coordinators), or None without TLS."""
    if tls is None:
        return None
    ca, cert, key = tls.read()
    return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)


async def run_node(store: Store | None, keys: Keys, host: str, listen: str, source: GpuSource, disk_path: str,
                   ttl_s: int, stop: asyncio.Event, ready: Callable[[int], None] | None = None,
                   metrics_listen: str = "", heartbeat_s: float = 5.0, overrides: dict[str, object] | None = None,
                   enforcer: Enforcer | None = None, tls: TlsFiles | None = None, insecure: bool = False,
                   advertise: str | None = None, coordinators: Sequence[str] = ()) -> None:
    """Serve until ``stop`` is set. Raises HostTaken (having cleaned up) when the host has a live daemon.
    ``advertise`` is the address published in ``hosts/<host>`` (default: the listen address with the bound
    port), for a node that listens on 0.0.0.0 or behind a NAT. With ``coordinators`` (and no ``store``) the
    daemon runs in the registry mode: through those coordinators, with no etcd connection."""
    handshakes.install(metrics.HANDSHAKE_FAILURES.inc)   # gRPC core's line per failed handshake, aggregated
    gate = MetricsGate()
    if metrics_listen:
        check_listen(metrics_listen, tls, insecure, what="metrics-listen")
        metrics.serve(metrics_listen, tls, metrics.NODE_REGISTRY, gate)
    server: grpc.aio.Server | None = None
    daemon: NodeDaemon
    if coordinators:
        daemon = RemoteNodeDaemon(coordinators, keys, host, listen, source, disk_path, ttl_s,
                                  heartbeat_s=heartbeat_s, overrides=overrides, enforcer=enforcer,
                                  credentials=client_credentials(tls))
    else:
        assert store is not None
        await store.connect()
        await store.check_server_version()
        daemon = NodeDaemon(store, keys, host, listen, source, disk_path, ttl_s, heartbeat_s=heartbeat_s,
                            overrides=overrides, enforcer=enforcer)
    try:
        await daemon.ensure_host_free()   # before binding: a taken host is reported as such, not as a busy port
        # Bind first, so that the published address carries the real port.
        server, port = await create_node_server(daemon, listen, tls, insecure, metrics_gate=gate)
        daemon.address = advertise or f"{listen.rpartition(':')[0]}:{port}"
        await daemon.start()
        if ready is not None:
            ready(port)
        await stop.wait()
    finally:
        if server is not None:
            await server.stop(grace=1.0)
        await daemon.stop()
        if store is not None:
            await store.close()
