"""Host ownership at the RPC layer: an acquire for a host that another replica owns goes to that replica.

Each host is admitted by one replica at a time (``CoordinatorService.owner``: rendezvous hashing over the
replicas registered in ``coordinators/``), so one replica group-commits all of a host's acquires and two
replicas never invalidate each other's compare-and-set on the host's ledgers. A replica that receives an
acquire for a host it does not own forwards it, as it came, to the owner's address with the
``gpucoord-forwarded-by`` header; a forwarded call is always decided where it lands (never a second hop).

Ownership is never needed for correctness: when the owner cannot be reached (connection refused,
UNAVAILABLE, shutting down), does not answer within the wait plus a margin, or leaves ``coordinators/``
while a forwarded call waits, the replica decides the acquire itself, with the time left of the wait, and
compare-and-set settles any overlap. The request keeps its request_id, so a grant the owner made
meanwhile is the one found (G6). An owner that failed a forward is avoided for a few seconds, and so is one
that had not answered well past the wait when our caller gave up on the call (its answers may be lost on the
way back: the client's retry must then be decided here, not sent into the same silence).
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable

import grpc

from agent_client.api import coordinator_pb2 as pb
from agent_client.api import coordinator_pb2_grpc as pb_grpc
from coordinator import errors, metrics
from coordinator.security.status import error_info

log = logging.getLogger(__name__)

FORWARDED_BY = "gpucoord-forwarded-by"
FALL_BACK = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED)
# An owner that has not answered a forwarded acquire this long past its wait when our caller gives up is avoided.
SILENT_OWNER_S = 0.5


class Relayed(errors.GpucoordError):
    """The owner's answer (an error status), passed on to our caller as it is: code, message, reason, field."""

    def __init__(self, status: errors.Status, message: str) -> None:
        super().__init__(message, status.field or None)
        self.relayed = status

    @property
    def status(self) -> errors.Status:
        return self.relayed


class Forwarder:
    def __init__(self, replica_id: str, margin_s: float, avoid_s: float) -> None:
        self.replica_id = replica_id
        self.margin_s = margin_s       # added to the wait: the owner's own time to decide and commit
        self.avoid_s = avoid_s         # how long an owner that failed a forward is not asked again
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._avoid: dict[str, float] = {}

    def usable(self, address: str) -> bool:
        until = self._avoid.get(address)
        return until is None or time.monotonic() >= until

    def _stub(self, address: str) -> pb_grpc.CoordinatorStub:
        channel = self._channels.get(address)
        if channel is None:
            channel = self._channels[address] = grpc.aio.insecure_channel(address)
        return pb_grpc.CoordinatorStub(channel)

    async def acquire(self, address: str, request: pb.AcquireRequest,
                      owner_alive: Callable[[], bool]) -> pb.AcquireResponse | None:
        """The owner's answer; raises ``Relayed`` with the owner's refusal; None when the caller must decide
        itself (the owner could not be reached, hung, or went away)."""
        timeout = request.wait_seconds + self.margin_s
        sent = time.monotonic()
        call = asyncio.ensure_future(self._stub(address).Acquire(
            request, timeout=timeout, metadata=((FORWARDED_BY, self.replica_id),)))
        try:
            while True:
                done, _ = await asyncio.wait({call}, timeout=0.5)
                if done:
                    break
                if not owner_alive():
                    log.info("owner %s left while a forwarded acquire waited: deciding here", address)
                    call.cancel()
                    await asyncio.gather(call, return_exceptions=True)
                    self._avoid[address] = time.monotonic() + self.avoid_s
                    metrics.FORWARDS.labels("fallback").inc()
                    return None
            response: pb.AcquireResponse = call.result()
            metrics.FORWARDS.labels("forwarded").inc()
            return response
        except grpc.aio.AioRpcError as e:
            if e.code() in FALL_BACK:
                log.info("forwarding an acquire to %s failed (%s: %s): deciding here", address, e.code().name,
                         e.details())
                self._avoid[address] = time.monotonic() + self.avoid_s
                metrics.FORWARDS.labels("fallback").inc()
                return None
            metrics.FORWARDS.labels("forwarded").inc()
            raise Relayed(relayed_status(e), e.details() or e.code().name) from None
        finally:
            if not call.done():
                call.cancel()     # our caller went away: so does the forwarded call (the owner dequeues it)
                if time.monotonic() - sent > request.wait_seconds + SILENT_OWNER_S:
                    # It gave up on an owner that had not answered well past the wait (the owner hangs, or its
                    # answers are lost on the way): its retry, and the next ones, are decided here for a while.
                    log.info("owner %s did not answer a forwarded acquire before its caller gave up: avoided",
                             address)
                    self._avoid[address] = time.monotonic() + self.avoid_s
            elif not call.cancelled():
                call.exception()  # retrieved: our caller left in the very turn the owner's call failed (unread)

    async def close(self) -> None:
        channels, self._channels = list(self._channels.values()), {}
        await asyncio.gather(*(c.close() for c in channels), return_exceptions=True)


def relayed_status(e: grpc.aio.AioRpcError) -> errors.Status:
    """The owner's status: its code, and the reason and field of its details."""
    reason, field = error_info(e.trailing_metadata())
    return errors.Status(e.code().name, reason or e.code().name, field)


def forwarded_by(context: grpc.aio.ServicerContext) -> str:
    """The replica that forwarded this call to us, or ''."""
    for key, value in context.invocation_metadata() or ():
        if key == FORWARDED_BY:
            return str(value)
    return ""
