"""gpucoord_refusals_total counts every error answer, labelled by RPC, reason and field, including the
refusals decided before admission (bad input, unknown session, the security interceptor's) and those of
the node's CheckToken."""
from __future__ import annotations

from typing import Any, Callable

import grpc
import pytest

from agent_client import Client, errors
from agent_client.api import coordinator_pb2 as pb
from agent_client.api import coordinator_pb2_grpc as pb_grpc
from agent_client.api import node_pb2, node_pb2_grpc
from coordinator import metrics
from tests.support.cluster import Cluster

pytestmark = pytest.mark.integration


def refusals(rpc: str, reason: str, field: str) -> float:
    return metrics.REGISTRY.get_sample_value("gpucoord_refusals_total",
                                             {"rpc": rpc, "reason": reason, "field": field}) or 0.0


def counted(labels: tuple[str, str, str], call: Callable[[], Any], error: type[BaseException]) -> None:
    """``call`` fails with ``error`` and adds exactly one to the refusals with ``labels``."""
    before = refusals(*labels)
    with pytest.raises(error):
        call()
    assert refusals(*labels) == before + 1, labels


def test_every_refusal_is_counted_by_rpc_reason_and_field(cluster: Cluster) -> None:
    cluster.start_node("h1", "1x16GiB")
    addr = cluster.start_coordinator()
    stub = pb_grpc.CoordinatorStub(grpc.insecure_channel(addr))
    with Client(addr, agent="agent-a", host="h1") as c:
        me = pb.SessionRef(agent="agent-a", session_id=c.session_id)

        def acquire(**kw: Any) -> Callable[[], Any]:
            return lambda: stub.Acquire(pb.AcquireRequest(session=kw.pop("session", me), **{"vram_mb": 1000, **kw}),
                                        timeout=10)
        # Decided before admission: validation and the session lookup.
        counted(("Acquire", "invalid_argument", "vram_mb"), acquire(vram_mb=0), grpc.RpcError)
        counted(("Acquire", "invalid_argument", "priority"), acquire(priority=10**9), grpc.RpcError)
        counted(("Acquire", "invalid_argument", "request_id"), acquire(request_id="a/b"), grpc.RpcError)
        counted(("Acquire", "session_gone", "session"),
                acquire(session=pb.SessionRef(agent="agent-a", session_id="123abc")), grpc.RpcError)
        counted(("Release", "invalid_argument", "lease_id"),
                lambda: stub.Release(pb.ReleaseRequest(session=me, lease_id="a/b"), timeout=10), grpc.RpcError)
        # Decided by admission: can never fit, does not fit now, did not fit within the wait.
        counted(("Acquire", "invalid_argument", "vram_mb"), lambda: c.acquire(vram_mb=20000), errors.InvalidArgument)
        held = c.acquire(vram_mb=16000)
        counted(("Acquire", "capacity", "vram_mb"), lambda: c.acquire(vram_mb=1000), errors.ResourceExhausted)
        counted(("Acquire", "wait_timeout", "vram_mb"), lambda: c.acquire(vram_mb=1000, wait=0.3),
                errors.ResourceExhausted)
        held.release()
        # Operator RPCs and the node's CheckToken count the same way.
        counted(("EvictLease", "not_found", "lease_id"),
                lambda: stub.EvictLease(pb.EvictLeaseRequest(lease_id="nope"), timeout=10), grpc.RpcError)
        counted(("ApplyPartition", "invalid_argument", "spec_json"),
                lambda: stub.ApplyPartition(pb.ApplyPartitionRequest(spec_json="[1]"), timeout=10), grpc.RpcError)
        daemon = cluster.nodes["h1"][0]
        node = node_pb2_grpc.NodeStub(grpc.insecure_channel(daemon.address))
        counted(("CheckToken", "invalid_argument", "token"),
                lambda: node.CheckToken(node_pb2.CheckTokenRequest(gpu_uuid="GPU-x", token=0), timeout=10),
                grpc.RpcError)
        # Refused by the servers' security interceptor, before any handler runs: bytes that are no message.
        raw = grpc.insecure_channel(addr).unary_unary("/gpucoord.v1.Coordinator/Acquire")
        counted(("Acquire", "invalid_argument", "request"), lambda: raw(b"\xff\xff", timeout=10), grpc.RpcError)
        raw_node = grpc.insecure_channel(daemon.address).unary_unary("/gpucoord.v1.Node/CheckToken")
        counted(("CheckToken", "invalid_argument", "request"), lambda: raw_node(b"\xff\xff", timeout=10),
                grpc.RpcError)

