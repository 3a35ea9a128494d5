"""A session kept alive on its own: one KeepAlive stream at a time, to the replica the calls use, moved to the
next replica when it breaks or goes silent, for as long as the session's TTL allows. The stream's answers
carry the session's eviction notices. Clients keep their sessions alive together
(``agent_client.kept_together``) and come here only where a replica does not serve that stream."""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable, Protocol

import grpc

from agent_client import errors
from agent_client._aio import drain, first_of, spawn
from agent_client.api import coordinator_pb2 as pb
from agent_client.api import coordinator_pb2_grpc as pb_grpc
from agent_client.lease import EvictionNotice
from agent_client.transport import Transport

log = logging.getLogger(__name__)


def notice_of(n: pb.EvictionNotice) -> EvictionNotice:
    """A notice as the client keeps it: its deadline on this process's monotonic clock."""
    left = (n.grace_left_seconds if n.HasField("grace_left_seconds")
            else n.deadline_unix - time.time())   # an older coordinator: wall clocks
    return EvictionNotice(n.lease_id, n.gpu_uuid, n.reason, n.requested_by, n.deadline_unix,
                          time.monotonic() + left, n.revoke, n.reclaim_team, n.withdrawn, n.asked_by)


class KeptSession(Protocol):
    """What the keepalive reads and ends of its session (``AsyncClient``)."""

    agent: str
    session_id: str
    ttl: int
    keepalive_interval: float
    done: asyncio.Event
    expired: bool

    def _ref(self) -> pb.SessionRef: ...

    def _deliver(self, notice: EvictionNotice) -> None: ...


class KeepAlive:
    """The keepalive of ``session`` over ``transport``: ``run()`` until the session is over."""

    def __init__(self, transport: Transport, session: KeptSession) -> None:
        self.transport = transport
        self.session = session
        self.last_refresh = time.monotonic()   # when a replica last answered with the TTL

    async def run(self) -> None:
        """One KeepAlive stream; on UNAVAILABLE, the next replica, for as long as the TTL allows."""
        s = self.session
        while not s.done.is_set():
            queue: asyncio.Queue[pb.KeepAliveRequest | None] = asyncio.Queue()
            # The stream's own replica: what it moves away from when it fails. The calls share the position in
            # the list, and may have moved on from that replica already (a failed acquire): then the
            # keepalive follows them, rather than going on to the next address, which could be the one
            # they left.
            addr = self.transport.address()
            call = pb_grpc.CoordinatorStub(self.transport.channel(addr)).KeepAlive(drain(queue))
            opened = time.monotonic()
            tick = spawn(self._ticker(queue), f"keepalive ticker of session {s.session_id}")
            try:
                first, _ = await first_of(self._read(call), self._watchdog(opened))
                if first == 1:
                    log.info("keepalive: no answer from %s for %.1fs; trying the next replica",
                             addr, time.monotonic() - self.last_refresh)
                self.transport.move_from(addr)   # the server ended it, or went silent: try the next replica
            except grpc.aio.AioRpcError as e:
                if errors.session_gone(e):
                    log.warning("session %s of %s expired: %s", s.session_id, s.agent, e.details())
                    s.expired = True
                    s.done.set()
                    return
                if e.code() == grpc.StatusCode.CANCELLED and s.done.is_set():
                    return
                log.info("keepalive stream broke (%s); reconnecting", e.code().name)
                self.transport.move_from(addr)
            finally:
                tick.cancel()
                queue.put_nowait(None)
                call.cancel()
            if time.monotonic() - self.last_refresh > s.ttl:
                log.warning("session %s: no keepalive for longer than its TTL; it is gone", s.session_id)
                s.expired = True
                s.done.set()
                return
            await asyncio.sleep(min(0.2, s.keepalive_interval))

    async def _ticker(self, queue: asyncio.Queue[pb.KeepAliveRequest | None]) -> None:
        while True:
            queue.put_nowait(pb.KeepAliveRequest(session=self.session._ref()))
            await asyncio.sleep(self.session.keepalive_interval)

    async def _read(self, call: grpc.aio.StreamStreamCall) -> None:
        async for resp in call:
            if resp.ttl_seconds > 0:
                self.last_refresh = time.monotonic()
            for n in resp.notices:
                self.session._deliver(notice_of(n))

    async def _watchdog(self, opened: float) -> None:
        await silent(lambda: max(self.last_refresh, opened), self.session.keepalive_interval)


async def silent(answered: Callable[[], float], interval: float) -> None:
    """Returns once no answer came for two intervals since ``answered()`` (a monotonic time the stream's reader
    moves): a replica that hangs without closing its socket (SIGSTOP, a stuck loop, a partition that drops
    packets) never breaks the stream."""
    stale = max(1.0, 2 * interval)
    while time.monotonic() - answered() < stale:  # noqa: ASYNC110 - a timestamp the reader moves; no event to wait on
        await asyncio.sleep(min(0.5, interval / 2))
