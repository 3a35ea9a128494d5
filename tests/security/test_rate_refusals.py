"""Over its rate an identity's calls are RESOURCE_EXHAUSTED naming ``rate`` on every kind of call: a message of a
stream (reflection's included) ends the stream with that status, never UNKNOWN with a traceback in the log;
and health checks count against the caller's rate like any call."""
from __future__ import annotations

import logging
from typing import Iterator

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from coordinator.security.tls import channel_credentials
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
