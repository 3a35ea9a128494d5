"""G7 from the client's side: a replica that ends a call CANCELLED (as a server does with the calls in flight
when it stops) is left for the next replica, like one that answers UNAVAILABLE; only the caller's own
cancellation ends the call. Two real gRPC servers on loopback stand in for the replicas (no etcd is
involved: this is the client transport's rule)."""
from __future__ import annotations

import asyncio
from typing import Any

import grpc
import pytest

from agent_client import errors
from agent_client.api import coordinator_pb2 as pb
from agent_client.api import coordinator_pb2_grpc as pb_grpc
from agent_client.transport import Transport

pytestmark = pytest.mark.integration


class _Replica(pb_grpc.CoordinatorServicer):
    def __init__(self, ends_with: grpc.StatusCode | None) -> None:
        self.ends_with, self.calls = ends_with, 0

    async def Release(self, request: Any, context: Any) -> Any:
        self.calls += 1
        if self.ends_with is not None:
            await context.abort(self.ends_with, "the replica is stopping")
        return pb.ReleaseResponse()


async def _serve(replica: _Replica) -> tuple[grpc.aio.Server, str]:
    server = grpc.aio.server()
    pb_grpc.add_CoordinatorServicer_to_server(replica, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


async def _release_through(first: _Replica, second: _Replica) -> Any:
    (s1, a1), (s2, a2) = await _serve(first), await _serve(second)
    t = Transport([a1, a2], None, rpc_timeout=20, attempt_timeout=5, retry_for=20, session_stream=False)
    try:
        return await t.call("Release", pb.ReleaseRequest(lease_id="x"))
    finally:
        await t.close()
        await s1.stop(None)
        await s2.stop(None)


@pytest.mark.parametrize("code", [grpc.StatusCode.CANCELLED, grpc.StatusCode.UNAVAILABLE])
def test_a_call_a_replica_ends_while_stopping_is_answered_by_the_next_replica(code: grpc.StatusCode) -> None:
    first, second = _Replica(code), _Replica(None)
    assert isinstance(asyncio.run(_release_through(first, second)), pb.ReleaseResponse)
    assert (first.calls, second.calls) == (1, 1)


def test_an_answer_that_is_the_callers_is_not_retried_elsewhere() -> None:
    first, second = _Replica(grpc.StatusCode.FAILED_PRECONDITION), _Replica(None)
    with pytest.raises(errors.GpucoordError):
        asyncio.run(_release_through(first, second))
    assert (first.calls, second.calls) == (1, 0)


def test_a_call_every_replica_ends_cancelled_is_answered_deadline_exceeded_when_its_time_is_up() -> None:
    async def scene() -> None:
        (s1, a1), (s2, a2) = (await _serve(_Replica(grpc.StatusCode.CANCELLED)),
                              await _serve(_Replica(grpc.StatusCode.CANCELLED)))
        t = Transport([a1, a2], None, rpc_timeout=20, attempt_timeout=5, retry_for=0.3, session_stream=False)
        try:
            with pytest.raises(errors.DeadlineExceeded, match="no replica answered in time"):
                await t.call("Release", pb.ReleaseRequest(lease_id="x"))
        finally:
            await t.close()
            await s1.stop(None)
            await s2.stop(None)
    asyncio.run(scene())
