"""G9: every RPC of both services x every kind of caller, over real mTLS against a real etcd.

One coordinator and one node daemon with TLS serve the whole module. A denied call must be refused with
PERMISSION_DENIED naming the identity and the action (or, without a certificate the CA vouches for, fail
at the TLS handshake), and must leave etcd's revision where it was.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import subprocess
import uuid
from typing import Any, Callable, Iterator

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from agent_client.api import coordinator_pb2 as pb
from agent_client.api import coordinator_pb2_grpc as pb_grpc
from agent_client.api import node_pb2, node_pb2_grpc, registry_pb2, registry_pb2_grpc
from coordinator.security.tls import TlsFiles, channel_credentials
from coordinator.txn import Range
from tests.support.cluster import Cluster, writes_since
from tests.support.pki import Pki, coordinator_tls
from tests.support.rpcs import session_call
from tests.support.waiting import wait_for

pytestmark = pytest.mark.integration
C = grpc.StatusCode
HOST = "h1"


@dataclasses.dataclass
class Stubs:
    coord: Any
    node: Any
    health: Any
    node_health: Any
    channels: list[grpc.Channel]
    registry: Any = None


@dataclasses.dataclass
class World:
    cluster: Cluster
    addr: str
    node_addr: str
    pki: Pki
    gpu_uuid: str
    session_id: str = ""     # agent-a's long-lived session, holding ``lease``
    lease: Any = None
    stubs_by_role: dict[str, Stubs] = dataclasses.field(default_factory=dict)

    def stubs(self, role: str) -> Stubs:
        if role not in self.stubs_by_role:
            if role == "nocert":
                with open(self.pki.ca, "rb") as f:
                    creds = grpc.ssl_channel_credentials(root_certificates=f.read())
            else:
                creds = channel_credentials(ROLE_FILES[role](self.pki))
            chans = [grpc.secure_channel(a, creds) for a in (self.addr, self.node_addr)]
            self.stubs_by_role[role] = Stubs(pb_grpc.CoordinatorStub(chans[0]), node_pb2_grpc.NodeStub(chans[1]),
                                             health_pb2_grpc.HealthStub(chans[0]),
                                             health_pb2_grpc.HealthStub(chans[1]), chans,
                                             registry_pb2_grpc.RegistryStub(chans[0]))
        return self.stubs_by_role[role]

    # -- set-up through agent-a itself (allowed) ---------------------------------------------------
    def open_session(self) -> str:
        resp = self.stubs("self").coord.OpenSession(pb.OpenSessionRequest(agent="agent-a", host=HOST, ttl_seconds=30),
                                                    timeout=10)
        return str(resp.session_id)

    def acquire(self, session_id: str | None = None) -> Any:
        return self.stubs("self").coord.Acquire(pb.AcquireRequest(
            session=self.ref(session_id), vram_mb=64, request_id=uuid.uuid4().hex), timeout=10).lease

    def ref(self, session_id: str | None = None) -> pb.SessionRef:
        return pb.SessionRef(agent="agent-a", session_id=session_id or self.session_id)

    def revision(self) -> int:
        return int(self.cluster.lt.run(self.cluster.store.snapshot([Range(b"/")])).revision)


ROLE_FILES: dict[str, Callable[[Pki], TlsFiles]] = {
    "self": lambda p: p["agent-a"], "other": lambda p: p["agent-b"], "operator": lambda p: p["operator"],
    "node": lambda p: p["node"], "other-ca": lambda p: p["other-ca"], "expired": lambda p: p["expired"],
}
ROLES = ("self", "other", "operator", "node", "nocert", "other-ca", "expired")
IDENTITY = {"self": "gpucoord://agent/agent-a", "other": "gpucoord://agent/agent-b",
            "operator": "gpucoord://operator/ops", "node": f"gpucoord://node/{HOST}"}


@pytest.fixture(scope="module")
def world(own_etcd: list[str], pki: Pki) -> Iterator[World]:
    cluster = Cluster(own_etcd, f"/gpucoord-g9-{os.getpid()}-{uuid.uuid4().hex[:6]}/")
    try:
        addr = cluster.start_coordinator(**coordinator_tls(pki))
        # No usage heartbeats during the module: the revision moves only when a call writes. The node runs
        # in the registry mode, with its certificate as the coordinator's client and no etcd connection.
        daemon = cluster.start_node(HOST, "2x16GiB", heartbeat_s=3600, tls=pki["node"], via=[addr],
                                    credentials=channel_credentials(pki["node"]))
        assert daemon.inventory is not None and not daemon.reads_etcd
        node_addr = daemon.address
        wait_for(lambda: cluster.get_prefix(cluster.keys.election()), 10, "the coordinator's election key")
        w = World(cluster, addr, node_addr, pki, daemon.inventory.gpus[0].uuid)
        w.session_id = w.open_session()
        w.lease = w.acquire()
        yield w
        for s in w.stubs_by_role.values():
            for ch in s.channels:
                ch.close()
    finally:
        cluster.close()


def _call(rpc: str, w: World, s: Stubs) -> Callable[[], Any]:
    """The call of ``rpc`` by the caller with stubs ``s``, on agent-a's things (set up beforehand)."""
    if rpc == "OpenSession":
        return lambda: s.coord.OpenSession(pb.OpenSessionRequest(agent="agent-a", host=HOST, ttl_seconds=10),
                                           timeout=10)
    if rpc == "KeepAlive":
        return lambda: next(iter(s.coord.KeepAlive(iter([pb.KeepAliveRequest(session=w.ref())]), timeout=10)))
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


RPCS = ("OpenSession", "KeepAlive", "Acquire", "Release", "AttachProcesses", "CloseSession", "Session(Acquire)",
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


def test_agent_cannot_use_another_agents_session_under_its_own_name(world: World) -> None:
    """Session ownership: agent-b naming itself with agent-a's session id finds no session of its own."""
    b = world.stubs("other").coord
    ref = pb.SessionRef(agent="agent-b", session_id=world.session_id)
    calls = [lambda: b.Acquire(pb.AcquireRequest(session=ref, vram_mb=64), timeout=10),
             lambda: b.Release(pb.ReleaseRequest(session=ref, lease_id=world.lease.id), timeout=10),
             lambda: b.CloseSession(pb.CloseSessionRequest(session=ref), timeout=10),
             lambda: next(iter(b.KeepAlive(iter([pb.KeepAliveRequest(session=ref)]), timeout=10))),
             lambda: session_call(b, "acquire", pb.AcquireRequest(session=ref, vram_mb=64)),
             lambda: session_call(b, "release", pb.ReleaseRequest(session=ref, lease_id=world.lease.id)),
             lambda: session_call(b, "keepalive", pb.KeepAliveRequest(session=ref))]
    for call in calls:
        before = world.revision()
        with pytest.raises(grpc.RpcError) as info:
            call()
        assert info.value.code() == C.NOT_FOUND, info.value.details()
        assert not writes_since(world.cluster, before)
    assert world.stubs("self").coord.Release(pb.ReleaseRequest(session=world.ref(), lease_id="x" * 20),
                                             timeout=10).released is False   # agent-a's session still works


def test_plaintext_client_cannot_talk_to_a_tls_coordinator(world: World) -> None:
    before = world.revision()
    with grpc.insecure_channel(world.addr) as ch:
        with pytest.raises(grpc.RpcError) as info:
            pb_grpc.CoordinatorStub(ch).OpenSession(pb.OpenSessionRequest(agent="agent-a", host=HOST), timeout=5)
    assert info.value.code() == C.UNAVAILABLE
    assert not writes_since(world.cluster, before)


def test_operator_actions_and_refusals_are_audited(world: World, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="gpucoord.audit")
    lease = world.acquire()
    op = world.stubs("operator").coord
    op.EvictLease(pb.EvictLeaseRequest(lease_id=lease.id, grace_seconds=60, reason="maintenance"), timeout=10)
    # The eviction record in etcd names who asked.
    record = json.loads(world.cluster.get_prefix(world.cluster.keys.eviction(lease.id))[0].value)
    assert record["asked_by"] == "gpucoord://operator/ops" and record["requested_by"] == "operator"
    with pytest.raises(grpc.RpcError):
        world.stubs("self").coord.RevokeLease(pb.RevokeLeaseRequest(lease_id=lease.id), timeout=10)
    lines = [json.loads(r.getMessage()) for r in caplog.records if r.name == "gpucoord.audit"]
    assert {"audit": True, "identity": "gpucoord://operator/ops", "action": "EvictLease",
            "target": f"lease {lease.id!r}", "outcome": "ok"} in lines
    denied = [x for x in lines if x["action"] == "RevokeLease" and x["identity"] == "gpucoord://agent/agent-a"]
    assert denied and denied[0]["outcome"].startswith("denied: ") and denied[0]["target"] == f"lease {lease.id!r}"
    op.RevokeLease(pb.RevokeLeaseRequest(lease_id=lease.id), timeout=10)


def test_session_stream_calls_are_audited_as_the_unary_calls(world: World, caplog: pytest.LogCaptureFixture) -> None:
    """An operator's acquire on the stream is audited like its unary acquire; an agent's refused one too."""
    caplog.set_level(logging.INFO, logger="gpucoord.audit")
    lease = session_call(world.stubs("operator").coord, "acquire", pb.AcquireRequest(
        session=world.ref(), vram_mb=64, request_id=uuid.uuid4().hex)).lease
    with pytest.raises(grpc.RpcError):
        session_call(world.stubs("other").coord, "release", pb.ReleaseRequest(session=world.ref(), lease_id=lease.id))
    lines = [json.loads(r.getMessage()) for r in caplog.records if r.name == "gpucoord.audit"]
    target = f"session {world.session_id!r} of agent 'agent-a'"
    assert {"audit": True, "identity": "gpucoord://operator/ops", "action": "Acquire", "target": target,
            "outcome": "ok"} in lines, lines
    denied = [x for x in lines if x["action"] == "Release" and x["identity"] == "gpucoord://agent/agent-b"]
    assert denied and denied[0]["outcome"].startswith("denied: ") and lease.id in denied[0]["target"], lines
    world.stubs("self").coord.Release(pb.ReleaseRequest(session=world.ref(), lease_id=lease.id), timeout=10)


def test_an_agent_sees_other_agents_leases_without_session_request_or_processes(
        world: World, request: pytest.FixtureRequest) -> None:
    """Session ids are no secrets (etcd trusts no agent certificate), but an agent's GetStatus still shows
    other agents' leases without their session id, request id or processes; its own leases in full. The
    operator sees everything."""
    request_id = uuid.uuid4().hex
    lease = world.stubs("self").coord.Acquire(pb.AcquireRequest(session=world.ref(), vram_mb=64, request_id=request_id),
                                              timeout=10).lease
    # Its own processes only (G9): itself, and a group this process started.
    group = subprocess.Popen(["sleep", "120"], start_new_session=True)
    request.addfinalizer(lambda: (group.kill(), group.wait()))
    world.stubs("self").coord.AttachProcesses(pb.AttachProcessesRequest(session=world.ref(), lease_id=lease.id,
                                                                        pids=[os.getpid()], pgid=group.pid),
                                              timeout=10)
    b = world.stubs("other").coord
    b_sid = b.OpenSession(pb.OpenSessionRequest(agent="agent-b", host=HOST, ttl_seconds=30), timeout=10).session_id
    b_ref = pb.SessionRef(agent="agent-b", session_id=b_sid)
    b_lease = b.Acquire(pb.AcquireRequest(session=b_ref, vram_mb=64, request_id="b-request"), timeout=10).lease
    try:
        def seen(role: str) -> dict[str, Any]:
            (host,) = world.stubs(role).coord.GetStatus(pb.GetStatusRequest(host=HOST), timeout=10).hosts
            return {x.id: x for x in host.leases}
        by_b, by_operator = seen("other"), seen("operator")
        assert by_operator[lease.id].session_id == world.session_id and by_operator[lease.id].request_id == request_id
        assert list(by_operator[lease.id].pids) == [os.getpid()]
        other = by_b[lease.id]
        assert (other.agent, other.vram_mb, other.session_id, other.request_id, list(other.pids), other.pgid) == \
            ("agent-a", 64, "", "", [], 0), other
        own = by_b[b_lease.id]
        assert (own.session_id, own.request_id) == (b_sid, "b-request"), own
        assert world.session_id not in str(world.stubs("other").coord.GetStatus(pb.GetStatusRequest(host=HOST),
                                                                                timeout=10))
    finally:
        b.CloseSession(pb.CloseSessionRequest(session=b_ref), timeout=10)
        world.stubs("self").coord.Release(pb.ReleaseRequest(session=world.ref(), lease_id=lease.id), timeout=10)


def test_an_agent_asks_for_every_host_and_gets_its_own_view(world: World) -> None:
    """``gpucoord status`` as an agent (issue 29): GetStatus without a host answers with the hosts the agent has
    a live session on, redacted as for one host, and no teams (their use is the fleet's); an agent with no
    session sees no host. The operator sees every host."""
    mine = world.stubs("self").coord.GetStatus(pb.GetStatusRequest(), timeout=10)
    assert [h.host for h in mine.hosts] == [HOST] and not mine.teams
    assert not world.stubs("other").coord.GetStatus(pb.GetStatusRequest(), timeout=10).hosts
    assert HOST in [h.host for h in world.stubs("operator").coord.GetStatus(pb.GetStatusRequest(), timeout=10).hosts]
