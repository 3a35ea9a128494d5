"""G9: the highest priority an agent may ask for is set by the operator (``[priority_caps]`` of the host's
partition spec); with TLS an agent the operator has not named gets a low default (priority 0, preemptible
leases only), so it can no longer evict every other agent by asking for priority 1,000,000. A request above
its cap is PERMISSION_DENIED naming ``priority`` (or ``preemptible``) and the cap, and writes nothing.
Real mTLS coordinator and node, real etcd."""
from __future__ import annotations

import json
import os
import uuid
from typing import Any, Iterator

import grpc
import pytest

from agent_client.api import coordinator_pb2 as pb
from agent_client.api import coordinator_pb2_grpc as pb_grpc
from coordinator.security.tls import channel_credentials
from tests.support.cluster import Cluster, writes_since
from tests.support.pki import Pki, coordinator_tls
from tests.support.waiting import wait_for

pytestmark = pytest.mark.integration
C = grpc.StatusCode
HOST = "h1"


class World:
    def __init__(self, cluster: Cluster, addr: str, pki: Pki | None) -> None:
        self.cluster, self.addr = cluster, addr
        self.channels: dict[str, grpc.Channel] = {}
        self.pki = pki
        self.sessions: dict[str, str] = {}

    def stub(self, who: str) -> Any:
        if who not in self.channels:
            self.channels[who] = (grpc.secure_channel(self.addr, channel_credentials(self.pki[who]))
                                  if self.pki is not None else grpc.insecure_channel(self.addr))
        return pb_grpc.CoordinatorStub(self.channels[who])

    def ref(self, agent: str) -> pb.SessionRef:
        if agent not in self.sessions:
            self.sessions[agent] = self.stub(agent).OpenSession(
                pb.OpenSessionRequest(agent=agent, host=HOST, ttl_seconds=60), timeout=10).session_id
        return pb.SessionRef(agent=agent, session_id=self.sessions[agent])

    def acquire(self, agent: str, priority: int = 0, preemptible: bool = True, vram_mb: int = 1024,
                by: str | None = None, wait: float = 0.0) -> Any:
        return self.stub(by or agent).Acquire(pb.AcquireRequest(
            session=self.ref(agent), vram_mb=vram_mb, priority=priority, preemptible=preemptible,
            request_id=uuid.uuid4().hex, wait_seconds=wait), timeout=10).lease

    def release(self, agent: str, lease: Any) -> None:
        self.stub(agent).Release(pb.ReleaseRequest(session=self.ref(agent), lease_id=lease.id), timeout=10)

    def apply(self, caps: dict[str, Any]) -> None:
        spec = {"host": HOST, "mode": "shared", "priority_caps": caps}
        self.stub("operator").ApplyPartition(pb.ApplyPartitionRequest(spec_json=json.dumps(spec)), timeout=10)

    def close(self) -> None:
        for ch in self.channels.values():
            ch.close()


@pytest.fixture(scope="module")
def world(own_etcd: list[str], pki: Pki) -> Iterator[World]:
    cluster = Cluster(own_etcd, f"/gpucoord-caps-{os.getpid()}-{uuid.uuid4().hex[:6]}/")
    try:
        cluster.start_node(HOST, "1x16GiB", heartbeat_s=3600, tls=pki["node"])
        w = World(cluster, cluster.start_coordinator(**coordinator_tls(pki)), pki)
        w.ref("agent-a"), w.ref("agent-b")   # opened up front: "refused writes nothing" compares revisions
        yield w
        w.close()
    finally:
        cluster.close()


def refused(world: World, field: str, fn: Any) -> str:
    before = world.cluster.lt.run(world.cluster.store.get_prefix(b"/")).revision
    with pytest.raises(grpc.RpcError) as info:
        fn()
    assert info.value.code() == C.PERMISSION_DENIED, (info.value.code(), info.value.details())
    assert info.value.details().startswith(f"{field}: "), info.value.details()
    assert not writes_since(world.cluster, before)
    return str(info.value.details())


def test_an_agent_cannot_evict_everyone_by_asking_for_priority_a_million(world: World) -> None:
    """The finding: any agent could ask for priority 1,000,000 and evict every other agent's preemptible
    leases. With TLS and no cap the operator wrote, the default caps it at 0."""
    held = world.acquire("agent-b", priority=0, vram_mb=16384)        # the whole GPU, preemptible
    try:
        details = refused(world, "priority", lambda: world.acquire("agent-a", priority=1_000_000, wait=5))
        assert "max_priority 0" in details and "the default" in details, details
        assert not world.cluster.get_prefix(world.cluster.keys.evictions()), "agent-b's lease got a notice"
        refused(world, "preemptible", lambda: world.acquire("agent-a", preemptible=False, vram_mb=1))
        # What the default allows still works (it waits for room like anyone).
        with pytest.raises(grpc.RpcError) as info:
            world.acquire("agent-a", priority=0)
        assert info.value.code() == C.RESOURCE_EXHAUSTED
    finally:
        world.release("agent-b", held)


def test_the_operator_sets_each_agents_cap_by_name_or_pattern(world: World) -> None:
    world.apply({"agent-a": {"max_priority": 100, "non_preemptible": True}, "agent-*": {"max_priority": 5}})
    try:
        world.release("agent-a", world.acquire("agent-a", priority=100))
        world.release("agent-a", world.acquire("agent-a", priority=10, preemptible=False))
        details = refused(world, "priority", lambda: world.acquire("agent-a", priority=101))
        assert "max_priority 100" in details and "'agent-a'" in details, details
        world.release("agent-b", world.acquire("agent-b", priority=5))
        details = refused(world, "priority", lambda: world.acquire("agent-b", priority=6))
        assert "max_priority 5" in details and "'agent-*'" in details, details
        refused(world, "preemptible", lambda: world.acquire("agent-b", priority=1, preemptible=False))
        # On the Session stream too: the same answer, as a message.
        answers = list(world.stub("agent-b").Session(iter([pb.SessionRequest(
            call_id=1, timeout_seconds=10, acquire=pb.AcquireRequest(session=world.ref("agent-b"), vram_mb=1,
                                                                     priority=6))]), timeout=15))
        assert [(a.call_id, a.code) for a in answers] == [(1, C.PERMISSION_DENIED.value[0])]
        assert answers[0].message.startswith("priority: ")
        # Lowered caps apply to the next request at once, on every path (no cache to wait out).
        world.apply({"agent-a": {"max_priority": 1}})
        refused(world, "priority", lambda: world.acquire("agent-a", priority=2))
        # An operator's own acquire is not capped (it acts on the agent's session, with its own identity).
        world.release("agent-a", world.acquire("agent-a", priority=1000, preemptible=False, by="operator"))
    finally:
        world.apply({})


def test_without_tls_there_is_no_identity_to_cap_but_the_operators_caps_apply_by_name(own_etcd: list[str]) -> None:
    cluster = Cluster(own_etcd, f"/gpucoord-caps-plain-{os.getpid()}-{uuid.uuid4().hex[:6]}/")
    try:
        cluster.start_node(HOST, "1x16GiB", heartbeat_s=3600)
        w = World(cluster, cluster.start_coordinator(), None)
        wait_for(lambda: cluster.get_prefix(cluster.keys.election()), 10, "the coordinator's election key")
        w.ref("agent-a")
        w.release("agent-a", w.acquire("agent-a", priority=1_000_000, preemptible=False))   # no default cap
        w.apply({"agent-a": {"max_priority": 3}})
        refused(w, "priority", lambda: w.acquire("agent-a", priority=4))
        w.release("agent-c", w.acquire("agent-c", priority=1_000_000))   # not named: uncapped
        w.close()
    finally:
        cluster.close()
