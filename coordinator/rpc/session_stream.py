"""The server side of a session's streams: KeepAlive, and Session (a session's calls as messages of one stream);
KeepAliveSessions, many sessions' keepalives on one stream, is ``coordinator.rpc.keepalive_sessions``.

Each call a Session message carries goes to the handler of its unary call (after the interceptor has
checked it as that call), runs as its own task and is answered on the stream as it finishes, with the
status the unary call would have had (``coordinator.security.status``: code, message and the same rich
details). A session kept alive on either stream gets its eviction notices there.
"""
from __future__ import annotations

import asyncio
import logging
from typing import AsyncIterator, Awaitable, Callable

import grpc
from google.protobuf.message import Message

from agent_client.api import coordinator_pb2 as pb
from coordinator import errors, metrics
from coordinator.aio import spawn
from coordinator.limits import MAX_STREAM_CALLS
from coordinator.records import EvictionRecord, SessionInfo
from coordinator.replica.service import CoordinatorService
from coordinator.rpc.answers import AnswerQueue, read_requests, send_answers
from coordinator.rpc.keepalive_sessions import KeepAliveSessions
from coordinator.security.authz import COORDINATOR, SESSION_STREAM_CALLS
from coordinator.security.interceptor import Refused, audit_call
from coordinator.security.status import WireStatus, deadline_exceeded, wire_status

log = logging.getLogger(__name__)

Handler = Callable[[Message, "_CallContext"], Awaitable[Message | None]]


class _CallContext:
    """What a handler sees of its call when the call came as a Session stream message: the stream's peer and
    metadata, and a status of this call alone."""

    def __init__(self, stream: grpc.aio.ServicerContext) -> None:
        self._stream = stream
        self.code: grpc.StatusCode | None = None
        self.details = ""
        self.trailing: tuple[tuple[str, bytes], ...] = ()

    def set_code(self, code: grpc.StatusCode) -> None:
        self.code = code

    def set_details(self, details: str) -> None:
        self.details = details

    def set_trailing_metadata(self, metadata: tuple[tuple[str, bytes], ...]) -> None:
        self.trailing = metadata

    def invocation_metadata(self) -> grpc.aio.Metadata | None:
        return self._stream.invocation_metadata()

    def peer(self) -> str:
        return str(self._stream.peer())

    def status(self) -> WireStatus | None:
        if self.code is None:
            return None
        return WireStatus(self.code, self.details, b"".join(v for _, v in self.trailing))


def _refusal(call_id: int, status: WireStatus) -> pb.SessionResponse:
    return pb.SessionResponse(call_id=call_id, code=status.code.value[0], message=status.message,
                              details=status.details)


class SessionStreams:
    """The KeepAlive and Session streams of one servicer. ``handlers``: the call a Session message carries
    (acquire, release, keepalive) -> the handler of its unary call, which validates its fields and translates
    its errors (``coordinator.rpc.coordinator_server._rpc``); ``notice``: an eviction record as an agent gets
    it; ``session``: the servicer's lookup of the session a KeepAlive message names."""

    def __init__(self, svc: CoordinatorService, handlers: dict[str, Handler],
                 notice: Callable[[EvictionRecord], pb.EvictionNotice],
                 session: Callable[[pb.SessionRef], Awaitable[SessionInfo]]) -> None:
        self.svc = svc
        self.session_of = session   # a KeepAlive message's session: its fields validated, then looked up
        self.notice = notice
        self.handlers = handlers
        self.kept_together = KeepAliveSessions(svc, session, notice)   # the KeepAliveSessions stream

    def _answers(self) -> AnswerQueue:
        """A stream's queue of answers, bounded as configured (docs/guarantees.md "Limits")."""
        cfg = self.svc.config
        return AnswerQueue(cfg.stream_answers_max, cfg.stream_answer_bytes_max)

    async def _send(self, out: AnswerQueue, context: grpc.aio.ServicerContext, rpc_name: str,
                    as_notice: Callable[[pb.KeepAliveResponse], Message]) -> None:
        """What a session's stream sends: the items of ``out`` until None. An error ends the stream with its
        status; an eviction notice the service pushes goes out as ``as_notice(KeepAliveResponse)``; an
        overflow of ``out`` ends it with RESOURCE_EXHAUSTED."""
        def convert(item: object) -> object:
            if isinstance(item, EvictionRecord):
                return as_notice(pb.KeepAliveResponse(ttl_seconds=-1, notices=[self.notice(item)]))
            return item
        await send_answers(out, context, rpc_name, convert)

    async def keepalive(self, request_iterator: AsyncIterator[pb.KeepAliveRequest],
                        context: grpc.aio.ServicerContext) -> None:
        """Answers each keepalive with the remaining TTL, and pushes eviction notices as they appear."""
        out = self._answers()
        registered: list[str] = []

        async def read() -> None:
            async for req in request_iterator:
                info = await self.session_of(req.session)
                ttl = await self.svc.keepalive(info)
                if not registered:
                    registered.append(info.session_id)
                    self.svc.register_stream(info.session_id, out)
                out.put_nowait(pb.KeepAliveResponse(ttl_seconds=ttl))

        metrics.SESSIONS.inc()
        reader = spawn(read_requests(out, read, "keepalive"), "keepalive stream reader")
        try:
            await self._send(out, context, "KeepAlive", lambda r: r)
        finally:
            reader.cancel()
            if registered:
                self.svc.unregister_stream(registered[0], out)
            metrics.SESSIONS.dec()

    async def session(self, request_iterator: AsyncIterator[pb.SessionRequest | Refused],
                      context: grpc.aio.ServicerContext) -> None:
        """A session's Acquire, Release and KeepAlive calls as messages, answered on the stream as they
        finish: each one goes to the handler of its unary call, runs as its own task, and is cancelled when
        its deadline passes, when the caller cancels it or when the stream ends. A session kept alive here
        also gets its eviction notices here (call_id 0)."""
        out = self._answers()
        calls: dict[int, asyncio.Task[None]] = {}
        registered: list[str] = []

        async def answer(call_id: int, field: str, request: Message, timeout_s: float) -> None:
            method = COORDINATOR + SESSION_STREAM_CALLS[field]
            call_context = _CallContext(context)
            try:
                async with asyncio.timeout(timeout_s if timeout_s > 0 else None):
                    result = await self.handlers[field](request, call_context)
                status = call_context.status()
                if status is not None:
                    out.put_nowait(_refusal(call_id, status))
                    audit_call(method, request, status.code)
                    return
            except TimeoutError:
                out.put_nowait(_refusal(call_id, deadline_exceeded()))
                audit_call(method, request, grpc.StatusCode.DEADLINE_EXCEEDED)
                return
            finally:
                calls.pop(call_id, None)
            out.put_nowait(pb.SessionResponse(call_id=call_id, **{field: result}))
            if field == "keepalive" and not registered:
                # Kept alive here: the session's eviction notices come here from now on.
                registered.append(request.session.session_id)
                self.svc.register_stream(request.session.session_id, out)
            audit_call(method, request, grpc.StatusCode.OK)

        def refuse(call_id: int, error: errors.GpucoordError) -> None:
            out.put_nowait(_refusal(call_id, wire_status(error)))

        async def read() -> None:
            async for request in request_iterator:
                if isinstance(request, Refused):   # by the interceptor, as the unary call would be
                    refuse(request.request.call_id, request.error)
                    continue
                call_id, field = request.call_id, request.WhichOneof("call")
                if field == "cancel":
                    task = calls.get(request.cancel)
                    if task is not None:
                        task.cancel()   # as a unary call's handler is when its caller cancels
                elif field is None:
                    refuse(call_id, errors.InvalidArgument(
                        "call: one of acquire, release or keepalive is required", "call"))
                elif call_id == 0 or call_id in calls:
                    why = "must be > 0" if call_id == 0 else "already names a call in flight on this stream"
                    refuse(call_id, errors.InvalidArgument(f"call_id: {why}", "call_id"))
                elif len(calls) >= MAX_STREAM_CALLS:
                    refuse(call_id, errors.CapacityError(
                        f"call_id: {MAX_STREAM_CALLS} calls already in flight on this stream; wait for "
                        "answers or open another stream", "call_id"))
                else:
                    calls[call_id] = spawn(answer(call_id, field, getattr(request, field),
                                                  request.timeout_seconds), f"session stream call {call_id}")
            # The client has sent its last call: answer what is in flight, then end the stream.
            while calls:
                await asyncio.gather(*calls.values(), return_exceptions=True)

        # Malformed bytes raise a GpucoordError from the iterator: the stream ends with INVALID_ARGUMENT.
        reader = spawn(read_requests(out, read, "session"), "session stream reader")
        try:
            await self._send(out, context, "Session", lambda r: pb.SessionResponse(keepalive=r))
        finally:
            reader.cancel()
            for task in list(calls.values()):
                task.cancel()
            if registered:
                self.svc.unregister_stream(registered[0], out)
