"""G9: every RPC of both services x every kind of caller, over real mTLS against a real etcd.

One coordinator and one node daemon with TLS serve the whole module (the ``world`` fixture,
tests/support/tls_world.py). A denied call must be refused with PERMISSION_DENIED naming the identity and the
action (or, without a certificate the CA vouches for, fail at the TLS handshake), and must leave etcd's revision
where it was. Sessions of others, audit lines and redacted views: tests/security/test_identity.py.
"""
from __future__ import annotations

import json
import os
import uuid
from typing import Any, Callable

import grpc
import pytest
from grpc_health.v1 import health_pb2

from agent_client.api import coordinator_pb2 as pb
from agent_client.api import node_pb2, registry_pb2
from tests.support.cluster import writes_since
from tests.support.rpcs import session_call
from tests.support.tls_world import HOST, IDENTITY, ROLES, Stubs, World

pytestmark = pytest.mark.integration
C = grpc.StatusCode


def _call(rpc: str, w: World, s: Stubs) -> Callable[[], Any]:
    """The call of ``rpc`` by the caller with stubs ``s``, on agent-a's things (set up beforehand)."""
    if rpc == "OpenSession":
        return lambda: s.coord.OpenSession(pb.OpenSessionRequest(agent="agent-a", host=HOST, ttl_seconds=10),
                                           timeout=10)
    if rpc == "KeepAlive":
        return lambda: next(iter(s.coord.KeepAlive(iter([pb.KeepAliveRequest(session=w.ref())]), timeout=10)))
    if rpc == "KeepAliveSessions":
        request = pb.KeepAliveSessionsRequest(seq=1, sessions=[w.ref()])
        return lambda: next(iter(s.coord.KeepAliveSessions(iter([request]), timeout=10)))
    if rpc == "Acquire":
        return lambda: s.coord.Acquire(pb.AcquireRequest(session=w.ref(), vram_mb=64,
                                                         request_id=uuid.uuid4().hex), timeout=10)
    if rpc == "Release":
        lease = w.acquire()
        return lambda: s.coord.Release(pb.ReleaseRequest(session=w.ref(), lease_id=lease.id), timeout=10)
    if rpc == "AttachProcesses":
        lease = w.acquire()
        return lambda: s.coord.AttachProcesses(pb.AttachProcessesRequest(session=w.ref(), lease_id=lease.id,
                                                                         pids=[os.getpid()]), timeout=10)
    if rpc == "CloseSession":
        sid = w.open_session()
        return lambda: s.coord.CloseSession(pb.CloseSessionRequest(session=w.ref(sid)), timeout=10)
    if rpc == "Session(Acquire)":   # the same calls as messages of the Session stream
        return lambda: session_call(s.coord, "acquire", pb.AcquireRequest(session=w.ref(), vram_mb=64,
                                                                          request_id=uuid.uuid4().hex))
    if rpc == "Session(Release)":
        lease = w.acquire()
        return lambda: session_call(s.coord, "release", pb.ReleaseRequest(session=w.ref(), lease_id=lease.id))
    if rpc == "Session(KeepAlive)":
        return lambda: session_call(s.coord, "keepalive", pb.KeepAliveRequest(session=w.ref()))
    if rpc == "GetStatus(host)":
        return lambda: s.coord.GetStatus(pb.GetStatusRequest(host=HOST), timeout=10)
    if rpc == "GetStatus(all)":
        return lambda: s.coord.GetStatus(pb.GetStatusRequest(), timeout=10)
    if rpc == "GetPartition":
        return lambda: s.coord.GetPartition(pb.GetPartitionRequest(host=HOST), timeout=10)
    if rpc == "ApplyPartition":
        spec = json.dumps({"host": HOST, "mode": "shared"})
        return lambda: s.coord.ApplyPartition(pb.ApplyPartitionRequest(spec_json=spec), timeout=10)
    if rpc == "EvictLease":
        lease = w.acquire()
        return lambda: s.coord.EvictLease(pb.EvictLeaseRequest(lease_id=lease.id, grace_seconds=60), timeout=10)
    if rpc == "RevokeLease":
        lease = w.acquire()
        return lambda: s.coord.RevokeLease(pb.RevokeLeaseRequest(lease_id=lease.id), timeout=10)
    if rpc == "SetTeam":
        return lambda: s.coord.SetTeam(pb.SetTeamRequest(name=f"t-{uuid.uuid4().hex[:8]}", quota_mb=64), timeout=10)
    if rpc == "GetTeam":
        return lambda: s.coord.GetTeam(pb.GetTeamRequest(name="default"), timeout=10)
    if rpc == "ListTeams":
        return lambda: s.coord.ListTeams(pb.ListTeamsRequest(), timeout=10)
    if rpc == "DeleteTeam":
        name = f"t-{uuid.uuid4().hex[:8]}"
        w.stubs("operator").coord.SetTeam(pb.SetTeamRequest(name=name), timeout=10)
        return lambda: s.coord.DeleteTeam(pb.DeleteTeamRequest(name=name), timeout=10)
    if rpc == "RevokeCertificate":   # a serial no certificate of the module has
        request = pb.RevokeCertificateRequest(certificate=pb.RevokedCertificate(serial=uuid.uuid4().hex))
        return lambda: s.coord.RevokeCertificate(request, timeout=10)
    if rpc == "ListRevokedCertificates":
        return lambda: s.coord.ListRevokedCertificates(pb.ListRevokedCertificatesRequest(), timeout=10)
    if rpc == "CordonHost":   # uncordoned at once where it is allowed: the module's other calls need h1
        return lambda: (s.coord.CordonHost(pb.CordonHostRequest(host=HOST, reason="matrix"), timeout=10),
                        s.coord.UncordonHost(pb.UncordonHostRequest(host=HOST), timeout=10))[0]
    if rpc == "UncordonHost":
        return lambda: s.coord.UncordonHost(pb.UncordonHostRequest(host=HOST), timeout=10)
    if rpc == "Ping":
        return lambda: s.coord.Ping(pb.PingRequest(), timeout=10)
    if rpc == "Health":
        return lambda: s.health.Check(health_pb2.HealthCheckRequest(), timeout=10)
    if rpc == "Node.GetInventory":
        return lambda: s.node.GetInventory(node_pb2.GetInventoryRequest(), timeout=10)
    if rpc == "Node.CheckToken":
        return lambda: s.node.CheckToken(node_pb2.CheckTokenRequest(gpu_uuid=w.lease.gpu_uuid, token=w.lease.token),
                                         timeout=10)
    if rpc == "Node.ConfirmProcesses":   # the coordinator's question before an attach: no one else's
        return lambda: s.node.ConfirmProcesses(node_pb2.ConfirmProcessesRequest(
            lease_id=w.lease.id, pids=[os.getpid()], peer="ipv4:127.0.0.1:1"), timeout=10)
    if rpc == "Node.Health":
        return lambda: s.node_health.Check(health_pb2.HealthCheckRequest(), timeout=10)
    if rpc == "Registry.ListLeases":
        return lambda: s.registry.ListLeases(registry_pb2.ListLeasesRequest(host=HOST, gpu_uuid=w.lease.gpu_uuid),
                                             timeout=10)
    if rpc == "Registry.ListLeases(other host)":
        return lambda: s.registry.ListLeases(registry_pb2.ListLeasesRequest(host="h2", gpu_uuid=w.lease.gpu_uuid),
                                             timeout=10)
    if rpc == "Registry.Register(other host)":
        inventory = json.dumps({"host": "h2", "address": "127.0.0.1:1", "cpu_count": 1, "mem_bytes": 1,
                                "disk_bytes": 1, "gpus": []})
        register = registry_pb2.HostRegistration(host="h2", address="127.0.0.1:1", inventory_json=inventory,
                                                 ttl_seconds=10)
        return lambda: next(iter(s.registry.Register(iter([registry_pb2.RegisterRequest(register=register)]),
                                                     timeout=10)))
    raise AssertionError(rpc)


RPCS = ("OpenSession", "KeepAlive", "KeepAliveSessions", "Acquire", "Release", "AttachProcesses", "CloseSession", "Session(Acquire)",
        "Session(Release)", "Session(KeepAlive)", "GetStatus(host)", "GetStatus(all)",
        "GetPartition", "ApplyPartition", "EvictLease", "RevokeLease", "Ping", "Health", "Node.GetInventory",
        "Node.CheckToken", "Node.ConfirmProcesses", "Node.Health", "SetTeam", "GetTeam", "ListTeams", "DeleteTeam",
        "RevokeCertificate", "ListRevokedCertificates",
        "Registry.ListLeases", "Registry.ListLeases(other host)", "Registry.Register(other host)", "CordonHost",
        "UncordonHost")
REGISTRY_RPCS = {r for r in RPCS if r.startswith("Registry.")}
TEAM_RPCS = {"SetTeam", "GetTeam", "ListTeams", "DeleteTeam"}
ALLOWED = {
    "self": set(RPCS) - {"ApplyPartition", "EvictLease", "RevokeLease", "RevokeCertificate", "ListRevokedCertificates",
                         "CordonHost", "UncordonHost",
                         "Node.ConfirmProcesses"} - TEAM_RPCS - REGISTRY_RPCS,
    # GetStatus of every host: an agent's own view, the hosts it has a live session on (none for "other").
    "other": {"Ping", "Health", "Node.GetInventory", "Node.CheckToken", "Node.Health", "GetStatus(all)"},
    # only a node registers a host, and only its own; ConfirmProcesses is a coordinator's only
    "operator": set(RPCS) - REGISTRY_RPCS - {"Node.ConfirmProcesses"},
    "node": {"Health", "Node.Health", "Registry.ListLeases"},
    "nocert": set(), "other-ca": set(), "expired": set(),
}


# What an allowed call's answer must say (one field), by RPC; the others are checked in _check_success.
SAYS = {"OpenSession": "session_id", "KeepAlive": "ttl_seconds", "Session(KeepAlive)": "ttl_seconds",
        "Release": "released", "Session(Release)": "released", "RevokeLease": "revoked", "AttachProcesses": "changed",
        "DeleteTeam": "deleted", "Node.CheckToken": "live"}


def _check_success(rpc: str, resp: Any) -> None:
    if rpc in SAYS:
        assert getattr(resp, SAYS[rpc]), (rpc, resp)
    elif rpc == "KeepAliveSessions":   # kept: named in no refusal
        assert resp.seq == 1 and not resp.not_kept, resp
    elif rpc == "GetStatus(host)":
        assert [h.host for h in resp.hosts] == [HOST]
    elif rpc == "GetStatus(all)":
        assert {h.host for h in resp.hosts} <= {HOST}
    elif rpc == "SetTeam":
        assert resp.created and resp.team.quota_mb == 64
    elif rpc == "RevokeCertificate":   # revoked by the operator's identity, at the coordinator's clock
        assert resp.created and resp.certificate.revoked_by == IDENTITY["operator"] and resp.certificate.revoked_at
    elif rpc == "CordonHost":
        assert resp.created and resp.cordon.reason == "matrix"
    elif rpc == "GetTeam":
        assert resp.team.team.name == "default"
    elif rpc == "ListTeams":
        assert "default" in [t.team.name for t in resp.teams]
    elif rpc in ("Health", "Node.Health"):
        assert resp.status == health_pb2.HealthCheckResponse.SERVING
    elif rpc == "Registry.ListLeases":
        assert resp.kvs and all(k.key.startswith(f"leases/{HOST}/") for k in resp.kvs)


@pytest.mark.parametrize("role", ROLES)
@pytest.mark.parametrize("rpc", RPCS)
def test_role_rpc_matrix(world: World, role: str, rpc: str) -> None:
    stubs = world.stubs(role)
    call = _call(rpc, world, stubs)
    before = world.revision()
    if rpc in ALLOWED[role]:
        _check_success(rpc, call())
        return
    with pytest.raises(grpc.RpcError) as info:
        call()
    err = info.value
    written = writes_since(world.cluster, before)
    assert not written, f"a refused {rpc} by {role} wrote to etcd: {written}"
    if role in ("nocert", "other-ca", "expired"):
        # No certificate the CA vouches for: the TLS handshake fails, no handler ever runs.
        assert err.code() == C.UNAVAILABLE, (err.code(), err.details())
        return
    assert err.code() == C.PERMISSION_DENIED, (err.code(), err.details())
    assert IDENTITY[role] in err.details(), err.details()
    # A Session stream message is refused as the call it carries; a role that may not open the stream at
    # all is refused the stream.
    names = {rpc.split("(")[0].removeprefix("Node.").removeprefix("Registry.")} if not rpc.startswith("Session(") else \
        {"Session", rpc[len("Session("):-1]}
    assert any(n in err.details() for n in names), err.details()
