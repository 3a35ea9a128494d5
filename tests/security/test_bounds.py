"""Bounded input: malformed bytes, message size, spec size and agent count, pid, and the per-agent cap on
open sessions (10,000 OpenSession calls leave at most the cap). Plaintext loopback, real etcd."""
from __future__ import annotations

import asyncio
import json
import logging
from typing import Any, Iterator

import grpc
import pytest

from agent_client.api import coordinator_pb2 as pb
from agent_client.api import coordinator_pb2_grpc as pb_grpc
from agent_client.api import node_pb2
from coordinator.config import CoordinatorConfig
from tests.harness import Cluster, wait_for
from tests.security.conftest import writes_since

pytestmark = pytest.mark.integration
C = grpc.StatusCode


@pytest.fixture
def cluster(own_etcd: list[str], prefix: str) -> Iterator[Cluster]:
    c = Cluster(own_etcd, prefix)
    try:
        yield c
    finally:
        c.close()


@pytest.fixture
def env(cluster: Cluster) -> Iterator[tuple[Cluster, str, str, grpc.Channel]]:
    daemon = cluster.start_node("h1", "2x16GiB", heartbeat_s=3600)
    addr = cluster.start_coordinator()
    # The replica registers and runs for leader in the background: let that write land first.
    wait_for(lambda: cluster.get_prefix(cluster.keys.election()), 10, "the coordinator's election key")
    with grpc.insecure_channel(addr) as ch:
        yield cluster, addr, daemon.address, ch


def _revision(cluster: Cluster) -> int:
    from coordinator.etcd.ops import range_req
    return int(cluster.lt.run(cluster.store.snapshot([range_req(b"/")])).revision)


def test_malformed_bytes_are_invalid_argument_without_a_traceback(
        env: tuple[Cluster, str, str, grpc.Channel], caplog: pytest.LogCaptureFixture) -> None:
    cluster, _, node_addr, ch = env
    caplog.set_level(logging.INFO)
    before = _revision(cluster)
    garbage = [b"\xff\xff\xff\xff", b"\x0a\xff\x01abc", b"\x08" + b"\xff" * 11, b"\x12\x05ab"]
    methods = ["OpenSession", "Acquire", "Release", "CloseSession", "GetStatus", "ApplyPartition", "GetPartition",
               "EvictLease", "RevokeLease", "Ping"]
    for method in methods:
        raw = ch.unary_unary(f"/gpucoord.v1.Coordinator/{method}")
        for g in garbage:
            with pytest.raises(grpc.RpcError) as info:
                raw(g, timeout=10)
            assert info.value.code() == C.INVALID_ARGUMENT, (method, g, info.value.code(), info.value.details())
            assert info.value.details().startswith("request: not a valid message"), info.value.details()
    stream = ch.stream_stream("/gpucoord.v1.Coordinator/KeepAlive")
    with pytest.raises(grpc.RpcError) as info:
        list(stream(iter([b"\xff\xff\xff"]), timeout=10))
    assert info.value.code() == C.INVALID_ARGUMENT and "request" in info.value.details()
    with grpc.insecure_channel(node_addr) as nch:
        with pytest.raises(grpc.RpcError) as info:
            nch.unary_unary("/gpucoord.v1.Node/CheckToken")(b"\xff\xff", timeout=10)
        assert info.value.code() == C.INVALID_ARGUMENT
    assert not writes_since(cluster, before)
    assert not [r for r in caplog.records if r.exc_info], "a malformed request logged a traceback"
    assert pb_grpc.CoordinatorStub(ch).Ping(pb.PingRequest(), timeout=5) is not None


def test_message_and_spec_size_and_agent_count(env: tuple[Cluster, str, str, grpc.Channel]) -> None:
    cluster, _, _, ch = env
    stub = pb_grpc.CoordinatorStub(ch)
    before = _revision(cluster)
    with pytest.raises(grpc.RpcError) as info:   # over gRPC's max receive size (1 MiB)
        stub.ApplyPartition(pb.ApplyPartitionRequest(spec_json="x" * (1 << 20 + 1)), timeout=10)
    assert info.value.code() == C.RESOURCE_EXHAUSTED
    spec = json.dumps({"host": "h1", "mode": "shared", "pad": "x" * (300 * 1024)})
    with pytest.raises(grpc.RpcError) as info:
        stub.ApplyPartition(pb.ApplyPartitionRequest(spec_json=spec, dry_run=True), timeout=10)
    assert info.value.code() == C.INVALID_ARGUMENT and info.value.details().startswith("spec_json:")
    many = json.dumps({"host": "h1", "mode": "auto-split", "agents": [f"a{i}" for i in range(257)]})
    with pytest.raises(grpc.RpcError) as info:
        stub.ApplyPartition(pb.ApplyPartitionRequest(spec_json=many), timeout=10)
    assert info.value.code() == C.INVALID_ARGUMENT and "agents" in info.value.details()
    deep = "[" * 100_000 + "]" * 100_000
    with pytest.raises(grpc.RpcError) as info:
        stub.ApplyPartition(pb.ApplyPartitionRequest(spec_json=deep), timeout=10)
    assert info.value.code() == C.INVALID_ARGUMENT and "spec_json" in info.value.details()
    with pytest.raises(grpc.RpcError) as info:
        stub.OpenSession(pb.OpenSessionRequest(agent="a", host="h1", pid=-1), timeout=10)
    assert info.value.code() == C.INVALID_ARGUMENT and info.value.details().startswith("pid:")
    assert not writes_since(cluster, before)


def test_ten_thousand_open_sessions_leave_at_most_the_cap(env: tuple[Cluster, str, str, grpc.Channel]) -> None:
    cluster, addr, _, _ = env
    cap = CoordinatorConfig().max_sessions_per_agent
    assert cap == 64

    async def flood() -> dict[str, int]:
        codes: dict[str, int] = {}
        async with grpc.aio.insecure_channel(addr) as ch:
            stub = pb_grpc.CoordinatorStub(ch)
            sem = asyncio.Semaphore(64)

            async def one() -> None:
                async with sem:
                    try:
                        await stub.OpenSession(pb.OpenSessionRequest(agent="flood", host="h1", ttl_seconds=60),
                                               timeout=30)
                        code = "OK"
                    except grpc.aio.AioRpcError as e:
                        code = e.code().name
                        assert e.code() in (C.RESOURCE_EXHAUSTED, C.UNAVAILABLE), (e.code(), e.details())
                        if e.code() == C.RESOURCE_EXHAUSTED:
                            assert e.details().startswith("sessions:"), e.details()
                    codes[code] = codes.get(code, 0) + 1
            await asyncio.gather(*(one() for _ in range(10_000)))
        return codes

    codes = asyncio.run(flood())
    sessions = cluster.get_prefix(cluster.keys.sessions("flood"))
    assert len(sessions) == codes.get("OK", 0) <= cap, codes
    assert len(sessions) == cap, codes   # the cap is reached, not undershot
    print(f"10,000 OpenSession calls: {codes}; {len(sessions)} sessions in etcd (cap {cap})")
    # Another agent is not affected by this one's cap.
    with grpc.insecure_channel(addr) as ch:
        assert pb_grpc.CoordinatorStub(ch).OpenSession(pb.OpenSessionRequest(agent="calm", host="h1"), timeout=10)


def test_node_check_token_bounds(env: tuple[Cluster, str, str, grpc.Channel]) -> None:
    _, _, node_addr, _ = env
    from agent_client.api import node_pb2_grpc
    with grpc.insecure_channel(node_addr) as ch:
        stub: Any = node_pb2_grpc.NodeStub(ch)
        with pytest.raises(grpc.RpcError) as info:
            stub.CheckToken(node_pb2.CheckTokenRequest(gpu_uuid="G" * 100_000, token=1), timeout=10)
        assert info.value.code() == C.INVALID_ARGUMENT and info.value.details().startswith("gpu_uuid:")
        assert len(info.value.details()) < 200
