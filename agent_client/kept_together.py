"""The sessions of one process kept alive together: one ``KeepAliveSessions`` stream, and one message per
interval naming every session, whatever the process holds (docs/agents.md "Sessions").

The clients of one event loop that name the same coordinator addresses, the same TLS files and the same
keepalive interval share a group (``join``). The group keeps one stream at a time, to one replica, and moves
it to the next replica when it breaks or goes silent, as a single session's keepalive does: every session of
the group moves with it. Each request is answered with the sessions that were not kept: one that is gone
ends at once (``expired``); one that no replica refreshes for longer than its TTL ends then. Eviction notices
come on the stream, each naming its session.

A replica that does not serve the stream (UNIMPLEMENTED: a release before it) turns the group into a
``KeepAlive`` stream per session, its own transport's, from then on.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import time
import weakref
from typing import Sequence

import grpc

from agent_client import errors
from agent_client._aio import drain, first_of, spawn
from agent_client.api import coordinator_pb2 as pb
from agent_client.api import coordinator_pb2_grpc as pb_grpc
from agent_client.keepalive import KeepAlive, KeptSession, notice_of, silent
from agent_client.transport import Transport

log = logging.getLogger(__name__)

CHUNK = 4096   # sessions per request; the server takes 10,000 at most
GroupKey = tuple[tuple[str, ...], tuple[str, str, str], float]
_GROUPS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[GroupKey, KeepAliveGroup]] = \
    weakref.WeakKeyDictionary()


def join(session: KeptSession, own: Transport, tls_files: tuple[str, str, str]) -> KeepAliveGroup:
    """Keep ``session`` alive in its process's group (made if it is the first). ``own``: the session's own
    transport, which a per-session keepalive uses if the group falls back to one. Leave with ``leave``."""
    key: GroupKey = (tuple(own.addresses), tls_files, session.keepalive_interval)
    groups = _GROUPS.setdefault(asyncio.get_running_loop(), {})
    group = groups.get(key)
    if group is None:
        group = groups[key] = KeepAliveGroup(key, own.addresses, own.tls, own.attempt_timeout,
                                             session.keepalive_interval)
    group.add(session, own)
    return group


class KeepAliveGroup:
    """The sessions of one process kept alive through one stream (the module's docstring)."""

    def __init__(self, key: GroupKey, addresses: Sequence[str], tls: grpc.ChannelCredentials | None,
                 attempt_timeout: float, interval: float) -> None:
        self.key = key
        self.interval = interval
        self.transport = Transport(addresses, tls, rpc_timeout=attempt_timeout, attempt_timeout=attempt_timeout,
                                   retry_for=0.0, session_stream=False)
        self.members: dict[str, tuple[KeptSession, Transport]] = {}
        self.last_refresh: dict[str, float] = {}      # when a replica last kept each session alive
        self.answered = time.monotonic()               # when the stream last answered anything
        self._pending: dict[int, list[str]] = {}      # a request's seq -> the sessions it named
        self._left: set[str] = set()                   # sessions that left since the last request
        self._seq = itertools.count(1)
        self._task: asyncio.Task[None] | None = None
        self.legacy: dict[str, asyncio.Task[None]] | None = None   # per-session KeepAlive, after UNIMPLEMENTED

    def add(self, session: KeptSession, own: Transport) -> None:
        self.members[session.session_id] = (session, own)
        self.last_refresh[session.session_id] = time.monotonic()
        if self.legacy is not None:
            self._keep_alone(session, own)
        elif self._task is None or self._task.done():   # done: its sessions all ended before this one came
            self._task = spawn(self.run(), f"keepalive of {len(self.members)} sessions")

    async def leave(self, session: KeptSession) -> None:
        """Stop keeping ``session`` alive here; the last session to leave ends the stream and the group."""
        self._drop(session.session_id)
        alone = self.legacy.pop(session.session_id, None) if self.legacy is not None else None
        if alone is not None:
            alone.cancel()
            await asyncio.gather(alone, return_exceptions=True)
        if self.members:
            return
        groups = _GROUPS.get(asyncio.get_running_loop(), {})
        if groups.get(self.key) is self:
            del groups[self.key]
        if self._task is not None:
            self._task.cancel()
            # The stream ends before the channels close: no call is left behind to be destroyed pending.
            await asyncio.gather(self._task, return_exceptions=True)
        await self.transport.close()

    def _drop(self, session_id: str) -> None:
        if self.members.pop(session_id, None) is not None:
            self._left.add(session_id)   # the replica stops sending its notices here
        self.last_refresh.pop(session_id, None)

    def _end(self, session: KeptSession, why: str) -> None:
        log.warning("session %s of %s %s", session.session_id, session.agent, why)
        self._drop(session.session_id)
        session.expired = True
        session.done.set()

    async def run(self) -> None:
        """One stream; on a failure or a silence, the next replica, while any session is left."""
        while self.members:
            queue: asyncio.Queue[pb.KeepAliveSessionsRequest | None] = asyncio.Queue()
            addr = self.transport.address()
            call = pb_grpc.CoordinatorStub(self.transport.channel(addr)).KeepAliveSessions(drain(queue))
            opened = time.monotonic()
            self._pending.clear()
            tick = spawn(self._ticker(queue), "keepalive ticker of a process's sessions")
            try:
                first, _ = await first_of(self._read(call), self._watchdog(opened))
                if first == 1:
                    log.info("keepalive: no answer from %s for %.1fs; trying the next replica", addr,
                             time.monotonic() - max(self.answered, opened))
                self.transport.move_from(addr)   # the server ended it, or went silent: the next replica
            except grpc.aio.AioRpcError as e:
                if e.code() == grpc.StatusCode.UNIMPLEMENTED:
                    log.info("coordinator %s serves no KeepAliveSessions: a KeepAlive stream per session", addr)
                    self._to_legacy()
                    return
                if e.code() == grpc.StatusCode.CANCELLED and not self.members:
                    return
                log.info("keepalive stream of %d sessions broke (%s); reconnecting", len(self.members),
                         e.code().name)
                self.transport.move_from(addr)
            finally:
                tick.cancel()
                queue.put_nowait(None)
                call.cancel()
            self._expire_overdue()
            await asyncio.sleep(min(0.2, self.interval))

    def _to_legacy(self) -> None:
        self.legacy = {}
        for session, own in list(self.members.values()):
            self._keep_alone(session, own)

    def _keep_alone(self, session: KeptSession, own: Transport) -> None:
        assert self.legacy is not None
        self.legacy[session.session_id] = spawn(KeepAlive(own, session).run(),
                                                f"keepalive of session {session.session_id}")

    def _expire_overdue(self) -> None:
        now = time.monotonic()
        for session, _ in list(self.members.values()):
            if now - self.last_refresh.get(session.session_id, now) > session.ttl > 0:
                self._end(session, "had no keepalive for longer than its TTL: it is gone")

    async def _ticker(self, queue: asyncio.Queue[pb.KeepAliveSessionsRequest | None]) -> None:
        while True:
            self._expire_overdue()
            ids = list(self.members)
            left, self._left = sorted(self._left), set()
            for i in range(0, max(len(ids), 1), CHUNK):
                chunk = ids[i:i + CHUNK]
                seq = next(self._seq)
                self._pending[seq] = chunk
                queue.put_nowait(pb.KeepAliveSessionsRequest(
                    seq=seq, sessions=[self.members[sid][0]._ref() for sid in chunk], left=left if i == 0 else ()))
            await asyncio.sleep(self.interval)

    async def _read(self, call: grpc.aio.StreamStreamCall) -> None:
        async for resp in call:
            now = self.answered = time.monotonic()
            not_kept = {n.session_id: n for n in resp.not_kept}
            for sid in self._pending.pop(resp.seq, []) if resp.seq else []:
                member = self.members.get(sid)
                refusal = not_kept.get(sid)
                if member is None:
                    continue
                if refusal is None:
                    self.last_refresh[sid] = now
                elif refusal.reason == errors.SESSION_GONE:
                    self._end(member[0], f"expired: {refusal.message}")
                else:
                    log.info("keepalive of session %s refused: %s", sid, refusal.message)
            for n in resp.notices:
                member = self.members.get(n.session_id)
                if member is not None:
                    member[0]._deliver(notice_of(n.notice))

    async def _watchdog(self, opened: float) -> None:
        await silent(lambda: max(self.answered, opened), self.interval)
