"""A forwarded acquire whose caller goes away in the very turn in which the owner's call fails: nobody reads that
failure, and asyncio must not report it as never retrieved in the replica's log. The owner's call is a future
the test completes (the race is one turn of the loop, which a real channel cannot be made to hit each time)."""
from __future__ import annotations

import asyncio
import gc
from typing import Any

import grpc
import pytest

from agent_client.api import coordinator_pb2 as pb
from coordinator.rpc.forward import Forwarder

pytestmark = pytest.mark.unit


class _Owner:
    """A stub whose Acquire is a future the test completes."""

    def __init__(self) -> None:
        self.call: asyncio.Future[pb.AcquireResponse] = asyncio.get_running_loop().create_future()

    def Acquire(self, request: pb.AcquireRequest, **_: Any) -> asyncio.Future[pb.AcquireResponse]:
        return self.call


@pytest.mark.parametrize("code", [grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INTERNAL],
                         ids=["a status it falls back on", "a status it passes on"])
def test_a_forwarded_acquire_whose_caller_leaves_as_the_owner_fails_leaves_no_error_unread(
        code: grpc.StatusCode) -> None:
    unretrieved: list[str] = []

    async def main() -> None:
        asyncio.get_running_loop().set_exception_handler(lambda _, ctx: unretrieved.append(ctx["message"]))
        owner = _Owner()
        forwarder = Forwarder("replica-a", margin_s=2.0, avoid_s=5.0)
        forwarder._stub = lambda address: owner   # type: ignore[method-assign]
        caller = asyncio.ensure_future(forwarder.acquire("owner:1", pb.AcquireRequest(wait_seconds=1.0),
                                                         owner_alive=lambda: True))
        await asyncio.sleep(0)                                  # the forwarder waits on the owner's call now
        owner.call.add_done_callback(lambda _: caller.cancel())  # after the forwarder's own: the same turn
        owner.call.set_exception(grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), "gone"))
        with pytest.raises(asyncio.CancelledError):
            await caller

    asyncio.run(main())
    gc.collect()     # the owner's call, unread, is collected with main's frame at the latest now
    assert not unretrieved, unretrieved
