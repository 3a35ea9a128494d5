"""The server side of KeepAliveSessions: the sessions of one process kept alive by one message per interval.

Each request names every session the process keeps alive through this replica. A session known here, tracked
here and not due for a refresh of its etcd lease is kept in memory on the spot
(``CoordinatorService.kept_in_memory``: no task, no etcd call). The others take the full keepalive (their
lookup, a takeover, a refresh of their etcd lease), ``SLOW_AT_ONCE`` at a time. The answer names the sessions
that were not kept, each with the status KeepAlive would have ended with; a fault of the replica rather than
of a session (etcd out of reach, a refresh past its time) ends the stream with its status, as it ends
KeepAlive, so the client moves all of its sessions to the next replica together.

A session kept alive here gets its eviction notices on this stream, each naming it, from its first keepalive
here until a request names it in ``left``, it is found gone, or the stream ends. A process may need several
requests per interval (10,000 sessions at most in each); past ``KEPT_MAX`` sessions registered, the ones a
request does not name are let go (a client that never says which sessions left holds no more than that).
"""
from __future__ import annotations

import asyncio
from typing import AsyncIterator, Awaitable, Callable

import grpc

from agent_client.api import coordinator_pb2 as pb
from coordinator import errors, metrics
from coordinator.aio import spawn
from coordinator.records import EvictionRecord, SessionInfo
from coordinator.replica.service import CoordinatorService
from coordinator.rpc.answers import AnswerQueue, read_requests, send_answers
from coordinator.security.status import as_error

MAX_SESSIONS = 10_000   # sessions one request may name (a request of 10,000 is about 0.6 MB)
KEPT_MAX = 4 * MAX_SESSIONS   # sessions one stream gets notices for, past which unnamed ones are let go
SLOW_AT_ONCE = 64       # full keepalives (takeovers, refreshes) of one request in flight at once
# What a session's own keepalive may fail with and leave the others kept: the session is gone, its reference
# is malformed, its record is. Anything else is the replica's fault and ends the stream.
SESSION_FAULTS = frozenset({"NOT_FOUND", "INVALID_ARGUMENT", "FAILED_PRECONDITION", "PERMISSION_DENIED"})


class _Tagged:
    """One session's outbox on the shared stream: a notice the service pushes goes out naming the session; an
    error (the replica stopping) ends the stream."""

    def __init__(self, out: AnswerQueue, session_id: str) -> None:
        self.out, self.session_id = out, session_id

    def put_nowait(self, item: object) -> None:
        self.out.put_nowait((self.session_id, item) if isinstance(item, EvictionRecord) else item)


class KeepAliveSessions:
    """The KeepAliveSessions stream of one servicer: ``session`` looks a reference up (validating it first),
    ``notice`` makes an eviction record the agent's notice."""

    def __init__(self, svc: CoordinatorService, session: Callable[[pb.SessionRef], Awaitable[SessionInfo]],
                 notice: Callable[[EvictionRecord], pb.EvictionNotice]) -> None:
        self.svc = svc
        self.session_of = session
        self.notice = notice

    async def serve(self, request_iterator: AsyncIterator[pb.KeepAliveSessionsRequest],
                    context: grpc.aio.ServicerContext) -> None:
        cfg = self.svc.config
        out = AnswerQueue(cfg.stream_answers_max, cfg.stream_answer_bytes_max)
        kept: dict[str, _Tagged] = {}   # the sessions kept alive here: their notices come on this stream

        async def read() -> None:
            async for request in request_iterator:
                out.put_nowait(await self._answer(request, kept, out))

        def convert(item: object) -> object:
            if isinstance(item, tuple):
                session_id, record = item
                return pb.KeepAliveSessionsResponse(notices=[pb.SessionNotice(session_id=session_id,
                                                                                notice=self.notice(record))])
            return item

        metrics.SESSIONS.inc()
        reader = spawn(read_requests(out, read, "keepalive sessions"), "keepalive sessions stream reader")
        try:
            await send_answers(out, context, "KeepAliveSessions", convert)
        finally:
            reader.cancel()
            for session_id, outbox in kept.items():
                self.svc.unregister_stream(session_id, outbox)
            metrics.SESSIONS.dec()

    async def _answer(self, request: pb.KeepAliveSessionsRequest, kept: dict[str, _Tagged],
                      out: AnswerQueue) -> pb.KeepAliveSessionsResponse:
        refs = request.sessions
        if len(refs) > MAX_SESSIONS:
            raise errors.InvalidArgument(f"sessions: at most {MAX_SESSIONS} in one request, got {len(refs)}",
                                         "sessions")
        named = {ref.session_id for ref in refs}
        if len(named) != len(refs):
            raise errors.InvalidArgument("sessions: a session is named twice in one request", "sessions")
        fast = self.svc.kept_in_memory
        slow = [ref for ref in refs if not fast(ref.agent, ref.session_id)]
        faults = await self._full(slow) if slow else []
        not_kept = []
        for ref, fault in zip(slow, faults):
            if fault is not None:
                status = fault.status
                not_kept.append(pb.SessionNotKept(session_id=ref.session_id, code=grpc.StatusCode[status.code].value[0],
                                                  message=fault.message, reason=status.reason, field=status.field))
        gone = {k.session_id for k in not_kept}
        drop = gone.union(request.left)
        if len(kept) + len(named) > KEPT_MAX:
            # A client that never says which sessions left: what it did not name now goes (a bound on memory).
            drop |= kept.keys() - named
        for session_id in drop & kept.keys():
            self.svc.unregister_stream(session_id, kept.pop(session_id))
        for session_id in named - gone - kept.keys():
            kept[session_id] = _Tagged(out, session_id)
            self.svc.register_stream(session_id, kept[session_id])
        return pb.KeepAliveSessionsResponse(seq=request.seq, not_kept=not_kept)

    async def _full(self, refs: list[pb.SessionRef]) -> list[errors.GpucoordError | None]:
        """The full keepalive of each of ``refs``, ``SLOW_AT_ONCE`` at a time: None where kept, else the
        session's own fault. The replica's first fault is raised once they have all ended."""
        gate = asyncio.Semaphore(SLOW_AT_ONCE)

        async def one(ref: pb.SessionRef) -> errors.GpucoordError | None:
            async with gate:
                try:
                    await self.svc.keepalive(await self.session_of(ref))
                    return None
                except Exception as e:
                    error = as_error(e)
                    if error is None:
                        raise
                    return error
        faults = await asyncio.gather(*(one(ref) for ref in refs))
        for fault in faults:
            if fault is not None and fault.status.code not in SESSION_FAULTS:
                raise fault
        return faults
