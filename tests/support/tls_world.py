"""The world of the G9 tests over real mTLS (tests/security/test_matrix.py, test_identity.py): one TLS coordinator
and one node daemon in the registry mode, stubs for every kind of caller (``ROLES``), agent-a's session and lease;
the ``world`` fixture of tests/security/conftest.py."""
from __future__ import annotations

import contextlib
import dataclasses
import os
import uuid
from typing import Any, Callable, Iterator

import grpc
from grpc_health.v1 import health_pb2_grpc

from agent_client.api import coordinator_pb2 as pb
from agent_client.api import coordinator_pb2_grpc as pb_grpc
from agent_client.api import node_pb2_grpc, registry_pb2_grpc
from coordinator.security.tls import TlsFiles, channel_credentials
from coordinator.txn import Range
from tests.support.cluster import Cluster
from tests.support.pki import Pki, coordinator_tls
from tests.support.waiting import wait_for

HOST = "h1"   # the node certificate of the pki fixture is gpucoord://node/h1


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


@contextlib.contextmanager
def tls_world(own_etcd: list[str], pki: Pki) -> Iterator[World]:
    """One TLS coordinator and one TLS node daemon (registry mode) on ``own_etcd``, agent-a's session and lease."""
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
