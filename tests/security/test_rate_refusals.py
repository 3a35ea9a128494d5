"""Over its rate an identity's calls are RESOURCE_EXHAUSTED naming ``rate`` on every kind of call: a message of a
stream (reflection's included) ends the stream with that status, never UNKNOWN with a traceback in the log;
and health checks count against the caller's rate like any call."""
from __future__ import annotations

import json
import logging
from typing import Iterator

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from agent_client.api import coordinator_pb2 as pb
from agent_client.api import coordinator_pb2_grpc as pb_grpc
from agent_client.api import registry_pb2 as rpb
from agent_client.api import registry_pb2_grpc as rpb_grpc
from coordinator.security import certs
from coordinator.security.tls import TlsFiles, channel_credentials
from tests.support.cluster import Cluster
from tests.support.pki import Pki, coordinator_tls, secure_cluster

pytestmark = pytest.mark.integration
C = grpc.StatusCode


@pytest.fixture
def cluster(own_etcd: list[str], pki: Pki) -> Iterator[Cluster]:
    with secure_cluster(own_etcd, pki, "rate", "h1") as c:
        yield c


def test_streams_and_health_checks_over_the_rate_are_resource_exhausted_naming_rate(
        cluster: Cluster, pki: Pki, caplog: pytest.LogCaptureFixture) -> None:
    addr = cluster.start_coordinator(calls_per_s_per_identity=0.5, call_burst_per_identity=4, **coordinator_tls(pki))
    caplog.set_level(logging.DEBUG)
    with grpc.secure_channel(addr, channel_credentials(pki["agent-a"])) as ch:
        # Reflection: one stream of many messages, past the bucket.
        requests = iter([reflection_pb2.ServerReflectionRequest(list_services="") for _ in range(20)])
        answered = 0
        with pytest.raises(grpc.RpcError) as info:
            for _ in reflection_pb2_grpc.ServerReflectionStub(ch).ServerReflectionInfo(requests, timeout=30):
                answered += 1
        assert info.value.code() == C.RESOURCE_EXHAUSTED and info.value.details().startswith("rate: "), \
            (info.value.code(), info.value.details())
        assert 0 < answered < 20
        # Health checks take from the same bucket.
        health = health_pb2_grpc.HealthStub(ch)
        with pytest.raises(grpc.RpcError) as info:
            for _ in range(20):
                health.Check(health_pb2.HealthCheckRequest(), timeout=30)
        assert info.value.code() == C.RESOURCE_EXHAUSTED and info.value.details().startswith("rate: ")
    noisy = [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]
    assert noisy == [], [r.getMessage()[:200] for r in noisy]


def _over_the_rate(info: pytest.ExceptionInfo[grpc.RpcError]) -> bool:
    return bool(info.value.code() == C.RESOURCE_EXHAUSTED and info.value.details().startswith("rate: "))


def test_keepalive_and_register_streams_and_unary_calls_over_the_rate_are_resource_exhausted_naming_rate(
        cluster: Cluster, pki: Pki, caplog: pytest.LogCaptureFixture) -> None:
    """gpucoord's own streams (an agent's KeepAlive, a node's Register) and a unary call: past the identity's
    bucket each ends RESOURCE_EXHAUSTED naming ``rate`` (never UNKNOWN), with no error or traceback logged."""
    addr = cluster.start_coordinator(calls_per_s_per_identity=0.5, call_burst_per_identity=12, **coordinator_tls(pki))
    caplog.set_level(logging.DEBUG)
    with grpc.secure_channel(addr, channel_credentials(pki["agent-a"])) as ch:
        stub = pb_grpc.CoordinatorStub(ch)
        opened = stub.OpenSession(pb.OpenSessionRequest(agent="agent-a", host="h1", ttl_seconds=30), timeout=30)
        ref = pb.SessionRef(agent="agent-a", session_id=opened.session_id)
        with pytest.raises(grpc.RpcError) as info:
            for _ in stub.KeepAlive(iter([pb.KeepAliveRequest(session=ref) for _ in range(20)]), timeout=30):
                pass
        assert _over_the_rate(info), (info.value.code(), info.value.details())
        with pytest.raises(grpc.RpcError) as info:
            for _ in range(20):
                stub.Ping(pb.PingRequest(), timeout=30)
        assert _over_the_rate(info), (info.value.code(), info.value.details())

    node = certs.issue(pki.dir, "node", "h9")
    files = TlsFiles(str(pki.dir / "ca.crt"), str(node.cert), str(node.key))
    inventory = json.dumps({"host": "h9", "address": "127.0.0.1:1", "cpu_count": 1, "mem_bytes": 1 << 30,
                            "disk_bytes": 1 << 30, "gpus": [{"index": 0, "uuid": "GPU-x", "name": "n",
                                                             "vram_total_mb": 1024}]})
    register = rpb.RegisterRequest(register=rpb.HostRegistration(host="h9", address="127.0.0.1:1",
                                                                 inventory_json=inventory, ttl_seconds=5))
    heartbeats = [rpb.RegisterRequest(heartbeat=rpb.Heartbeat()) for _ in range(30)]
    with grpc.secure_channel(addr, channel_credentials(files)) as ch:
        with pytest.raises(grpc.RpcError) as info:
            for _ in rpb_grpc.RegistryStub(ch).Register(iter([register, *heartbeats]), timeout=30):
                pass
        assert _over_the_rate(info), (info.value.code(), info.value.details())
    noisy = [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]
    assert noisy == [], [r.getMessage()[:200] for r in noisy]
