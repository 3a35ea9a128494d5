"""gRPC: ``coordinator_stub``, ``node_stub``, ``acquire_req``, ``expect_refused`` (the right status, a message
naming the field, nothing written); ``session_call`` (one call as a message of the Session stream, its answer or
``StreamCallError``)."""
from __future__ import annotations

from typing import Any, Callable, Sequence

import grpc
import pytest

from agent_client.api import coordinator_pb2 as pb
from agent_client.api import coordinator_pb2_grpc as pb_grpc
from agent_client.api import node_pb2_grpc as npb_grpc
from tests.support.cluster import Cluster


def coordinator_stub(addr: str) -> pb_grpc.CoordinatorStub:
    return pb_grpc.CoordinatorStub(grpc.insecure_channel(addr))


def node_stub(address: str) -> npb_grpc.NodeStub:
    return npb_grpc.NodeStub(grpc.insecure_channel(address))


def acquire_req(agent: str, session_id: str, vram_mb: int, request_id: str, wait: float = 0.0,
                **kw: Any) -> pb.AcquireRequest:
    return pb.AcquireRequest(session=pb.SessionRef(agent=agent, session_id=session_id), vram_mb=vram_mb,
                             request_id=request_id, wait_seconds=wait, **kw)


class StreamCallError(grpc.RpcError):  # type: ignore[misc]
    """A Session stream message answered with an error status: read like a unary call's RpcError."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


def session_call(stub: pb_grpc.CoordinatorStub, field: str, request: Any, timeout: float = 10,
                 call_id: int = 1, before: Sequence[pb.SessionRequest] = ()) -> Any:
    """``request`` (an AcquireRequest, ReleaseRequest or KeepAliveRequest, by ``field``) as one message of a
    new Session stream, after the messages ``before``: its answer, or StreamCallError with the code and the
    message it was answered with. An error that ends the stream itself is raised as gRPC raises it."""
    messages = [*before, pb.SessionRequest(call_id=call_id, timeout_seconds=timeout, **{field: request})]
    for response in stub.Session(iter(messages), timeout=timeout + 5):
        if response.call_id == call_id:
            if response.code:
                codes = {c.value[0]: c for c in grpc.StatusCode}
                raise StreamCallError(codes[response.code], response.message)
            return getattr(response, field)
    raise AssertionError(f"the Session stream ended without answering call {call_id}")


def expect_refused(cluster: Cluster, fn: Callable[[], Any], code: grpc.StatusCode, field: str) -> None:
    """``fn()`` fails with ``code``, its message names ``field``, and it wrote nothing to etcd."""
    before = cluster.state()
    with pytest.raises(grpc.RpcError) as info:
        fn()
    assert info.value.code() == code, info.value.details()
    assert field in info.value.details(), info.value.details()
    assert cluster.state() == before, "a refused request wrote to etcd"
