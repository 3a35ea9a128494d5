"""The client's end of the ``Session`` stream: a session's acquires and releases to one replica as messages
of one gRPC stream, each with a call id, instead of a unary call each (a unary call costs the coordinator
several times the CPU of a stream message).

A call's outcome is the unary call's: its answer, or ``grpc.aio.AioRpcError`` with the status code and
message the server answered it with, or DEADLINE_EXCEEDED when its timeout passes (the server is told the
same deadline and drops the call then). A stream that breaks fails the calls in flight on it with
``StreamBroken`` (UNAVAILABLE, or the status the stream ended with when that is the caller's answer, such
as PERMISSION_DENIED or UNIMPLEMENTED), and the client opens a new one for its next call.
"""
from __future__ import annotations

import asyncio
import itertools

import grpc
from google.protobuf.message import Message

from agent_client._aio import spawn
from agent_client.api import coordinator_pb2 as pb
from agent_client.api import coordinator_pb2_grpc as pb_grpc
from agent_client.errors import DETAILS_KEY

_CODES = {c.value[0]: c for c in grpc.StatusCode}
# What a stream ends with that is an answer to the caller, not a failure of the transport.
_ANSWERS = (grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.INVALID_ARGUMENT,
            grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.RESOURCE_EXHAUSTED)


def rpc_error(code: grpc.StatusCode, details: str, status_details: bytes = b"") -> grpc.aio.AioRpcError:
    """The error a unary call would have raised: code, message and (as its trailer) the rich details."""
    trailing = grpc.aio.Metadata((DETAILS_KEY, status_details)) if status_details else grpc.aio.Metadata()
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), trailing, details=details)


class StreamBroken(grpc.aio.AioRpcError):  # type: ignore[misc]
    """The stream itself failed (not one call's answer): it is of no use any more."""


class SessionStream:
    """One Session stream to one replica; any number of calls in flight, answered in any order."""

    def __init__(self, channel: grpc.aio.Channel, address: str) -> None:
        self.address = address
        self._call = pb_grpc.CoordinatorStub(channel).Session()
        self._pending: dict[int, asyncio.Future[pb.SessionResponse]] = {}
        self._ids = itertools.count(1)
        self._writing = asyncio.Lock()   # gRPC takes one write at a time
        self.broken: StreamBroken | None = None
        self._reader = spawn(self._read(), f"session stream reader of {address}")

    @property
    def in_flight(self) -> int:
        return len(self._pending)

    async def call(self, field: str, request: Message, timeout: float) -> Message:
        """``field``: acquire or release. The answer, or the error the unary call would have raised."""
        if self.broken is not None:
            raise self.broken
        call_id = next(self._ids)
        future: asyncio.Future[pb.SessionResponse] = asyncio.get_running_loop().create_future()
        self._pending[call_id] = future
        sent = False
        try:
            async with asyncio.timeout(timeout):
                async with self._writing:
                    await self._write(pb.SessionRequest(call_id=call_id, timeout_seconds=timeout,
                                                        **{field: request}))
                sent = True
                response = await future
        except TimeoutError:
            self._drop(call_id, sent, future)
            raise rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded") from None
        except asyncio.CancelledError:
            self._drop(call_id, sent, future)
            raise
        finally:
            self._pending.pop(call_id, None)
            if future.done() and not future.cancelled():
                future.exception()   # retrieved: a write that broke the stream failed this future too, unread
        if response.code != 0:
            raise rpc_error(_CODES.get(response.code, grpc.StatusCode.UNKNOWN), response.message, response.details)
        return getattr(response, field)

    async def _write(self, message: pb.SessionRequest) -> None:
        try:
            await self._call.write(message)
        except grpc.aio.AioRpcError as e:
            raise self._fail(e) from None
        except Exception as e:   # noqa: BLE001 - e.g. the call is already over
            raise self._fail(e) from None

    def _drop(self, call_id: int, sent: bool, future: asyncio.Future[pb.SessionResponse]) -> None:
        """The caller gave up on a call (its deadline, or a cancel): the server is told to drop it, as it
        drops a unary call whose client cancels it or whose deadline passes."""
        answered = future.done() and not future.cancelled()   # (a cancelled await cancels the future)
        if sent and self.broken is None and not answered:
            spawn(self._cancel(call_id), f"cancel of call {call_id} on the session stream to {self.address}")

    async def _cancel(self, call_id: int) -> None:
        try:
            async with self._writing:
                await self._call.write(pb.SessionRequest(cancel=call_id))
        except Exception:   # noqa: BLE001 - a broken stream drops every call anyway
            pass

    async def _read(self) -> None:
        try:
            while True:
                response = await self._call.read()
                if response is grpc.aio.EOF:
                    self._fail(None)
                    return
                future = self._pending.get(response.call_id)
                if future is not None and not future.done():
                    future.set_result(response)
        except asyncio.CancelledError:
            self._fail(None)
            raise
        except Exception as e:   # noqa: BLE001 - whatever ended the stream fails its calls
            self._fail(e)

    def _fail(self, e: BaseException | None) -> StreamBroken:
        if self.broken is None:
            if isinstance(e, grpc.aio.AioRpcError) and e.code() in _ANSWERS:
                self.broken = StreamBroken(e.code(), grpc.aio.Metadata(), e.trailing_metadata(), details=e.details())
            else:
                why = f"{e.code().name}: {e.details()}" if isinstance(e, grpc.aio.AioRpcError) else \
                    repr(e) if e is not None else "the server ended it"
                self.broken = StreamBroken(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                           details=f"the session stream to {self.address} broke ({why})")
            for future in self._pending.values():
                if not future.done():
                    future.set_exception(self.broken)
        return self.broken

    def close(self) -> None:
        self._fail(None)
        self._reader.cancel()
        self._call.cancel()
