"""The client's way to the coordinator replicas: one channel per address, a Session stream per replica, and
failover between replicas.

Every attempt of a call has its own short deadline, ``attempt_timeout``, plus the wait left for an acquire.
An attempt that answers UNAVAILABLE (or CANCELLED: a replica that stops ends its calls so), or runs past its deadline, or waits on a replica that stops answering
health checks (probed every ``attempt_timeout`` while an acquire waits), moves the transport to the next
address, which gets the same request, until ``retry_for`` has passed. No call outlasts ``rpc_timeout``
(plus the wait of an acquire). Only calls that are safe to repeat go through ``call``.

Acquires and releases go as messages of one ``Session`` stream per replica when ``session_stream`` is on;
a replica that answers the stream UNIMPLEMENTED gets unary calls from then on, a stream that breaks is
opened again for the next call, and with 8 calls in flight on a stream more go unary.
"""
from __future__ import annotations

import asyncio
import logging
import random
import time
from typing import Callable, Sequence

import grpc
from google.protobuf.message import Message
from grpc_health.v1 import health_pb2, health_pb2_grpc

from agent_client import errors
from agent_client._aio import spawn
from agent_client.api import coordinator_pb2_grpc as pb_grpc
from agent_client.stream import SessionStream, StreamBroken
from agent_client.tls import aio_channel

log = logging.getLogger(__name__)

# gRPC's default reconnect backoff grows to minutes: a replica back after a restart must be found again
# well within a session TTL, so the client retries connecting at least every second.
CHANNEL_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
]

# CANCELLED here is the server's (a replica ends the calls in flight so when it stops): the caller's own
# cancellation never comes back as a status but as asyncio.CancelledError, which ends the call.
FAILOVER_CODES = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED)
TO_OWNER = ("Acquire", "Release")    # calls sent to the host's owning replica first, when known
# The calls that travel on a replica's Session stream when it serves one (the unary call otherwise).
STREAMED = {"Acquire": "acquire", "Release": "release"}
# Calls in flight on a stream past which a call goes unary: a stream's answers are written one after the
# other, where unary calls are answered side by side (a burst of waits that end together, say).
STREAM_IN_FLIGHT = 8


class ReplicaHung(Exception):
    """A replica stopped answering health checks while an attempt waited on it."""


class Transport:
    """Channels, Session streams and failover over ``addresses`` (see the module's docstring)."""

    def __init__(self, addresses: Sequence[str], tls: grpc.ChannelCredentials | None, rpc_timeout: float,
                 attempt_timeout: float, retry_for: float, session_stream: bool) -> None:
        self.addresses = list(addresses)
        self.tls = tls
        self.rpc_timeout = rpc_timeout
        self.attempt_timeout = attempt_timeout
        self.retry_for = retry_for          # a call's default; the client sets it to the session TTL
        self.session_stream = session_stream
        self.owner = ""         # the replica that owns our host (host ownership), as the last acquire said
        self.channels: dict[str, grpc.aio.Channel] = {}
        self.streams: dict[str, SessionStream] = {}
        self.unary_only: set[str] = set()    # replicas that answered the stream UNIMPLEMENTED
        self._addr_i = 0

    # -- addresses and channels --------------------------------------------------------------------
    def channel(self, addr: str) -> grpc.aio.Channel:
        ch = self.channels.get(addr)
        if ch is None:
            ch = self.channels[addr] = aio_channel(addr, self.tls, CHANNEL_OPTIONS)
        return ch

    def address(self) -> str:
        """The address calls go to now (a position in the list that failover moves on)."""
        return self.addresses[self._addr_i % len(self.addresses)]

    def _next_address(self) -> None:
        self._addr_i = (self._addr_i + 1) % len(self.addresses)

    def move_from(self, addr: str) -> None:
        """Leave ``addr`` for the next address, unless another call has moved on from it already."""
        if self.address() == addr:
            self._next_address()

    async def close(self) -> None:
        for stream in self.streams.values():
            stream.close()
        self.streams.clear()
        for ch in self.channels.values():
            await ch.close()
        self.channels.clear()

    # -- calls ---------------------------------------------------------------------------------------
    async def call(self, method: str, request: Message | Callable[[], Message], retry_for: float | None = None,
                   wait_left: Callable[[], float] | None = None) -> Message:
        """A unary call with failover (see the module's docstring). Only for calls that are safe to repeat.

        ``request`` may be a callable that builds the request for each attempt, and ``wait_left`` says how
        long the server may hold an attempt by design (an acquire sends the wait that is left).
        """
        started = time.monotonic()
        retry_until = started + (self.retry_for if retry_for is None else retry_for)
        give_up_at = started + self.rpc_timeout + (wait_left() if wait_left else 0.0)
        delay = 0.05
        while True:
            # An acquire goes first to the replica that owns the host, when one told us (see acquire), and
            # so does a release: the owner's admitter then hears of the room at once, not through its watch.
            addr = self.owner if method in TO_OWNER and self.owner else self.address()
            req = request() if callable(request) else request
            waiting = wait_left() if wait_left else 0.0
            timeout = max(0.05, min(self.attempt_timeout + waiting, give_up_at - time.monotonic()))
            try:
                return await self._attempt(addr, method, req, timeout, probe=waiting > 0)
            except grpc.aio.AioRpcError as e:
                code, why = e.code(), f"{e.code().name}: {e.details()}"
                last: errors.GpucoordError = errors.from_rpc_error(e)
            except ReplicaHung as e:
                code, why = grpc.StatusCode.DEADLINE_EXCEEDED, str(e)
                last = errors.DeadlineExceeded(f"{method}: coordinator {addr} stopped answering")
            now = time.monotonic()
            if code not in FAILOVER_CODES or now + delay > min(retry_until, give_up_at - 0.1):
                if code == grpc.StatusCode.CANCELLED:
                    # Every replica tried ended the call (stopping, or starved): past its time, the caller hears
                    # that no answer came in time, a documented status, not a bare CANCELLED.
                    raise errors.DeadlineExceeded(f"{method}: no replica answered in time (the last, {addr}: "
                                                  f"{why[:200]})") from None
                raise last from None
            log.info("%s: coordinator %s failed (%s); trying the next one", method, addr, why)
            if addr == self.owner:
                self.owner = ""       # back to our own list: any replica forwards to the owner
            self.move_from(addr)      # and not to the same replica again, if our list is at it
            if code == grpc.StatusCode.UNAVAILABLE:
                # Refused at once (a replica down, or all of them): back off. A timed-out attempt has
                # waited already.
                await asyncio.sleep(delay * (1 + random.random()))
                delay = min(delay * 2, 1.0)

    async def _attempt(self, addr: str, method: str, request: Message, timeout: float, probe: bool) -> Message:
        """One attempt on one replica. With ``probe``, the replica's health is checked while it holds
        the call, so that a replica that hangs (SIGSTOP, a stuck loop, packets dropped) is left within
        two ``attempt_timeout`` rather than at the end of the wait."""
        stream = self.streams.get(addr)
        if method in STREAMED and self.session_stream and addr not in self.unary_only and \
                (stream is None or stream.in_flight < STREAM_IN_FLIGHT):
            try:
                return await self._attempt_on_stream(addr, method, request, timeout, probe)
            except StreamBroken as e:
                if e.code() != grpc.StatusCode.UNIMPLEMENTED:
                    raise
                log.info("coordinator %s serves no Session stream: unary calls from now on", addr)
                self.unary_only.add(addr)
        call = getattr(pb_grpc.CoordinatorStub(self.channel(addr)), method)(request, timeout=timeout)
        return await self._probed(addr, call, probe)

    async def _attempt_on_stream(self, addr: str, method: str, request: Message, timeout: float,
                                 probe: bool) -> Message:
        """The attempt as a message of the Session stream to ``addr``; a stream that broke before the message
        was sent is replaced first. A broken stream is dropped, so that the next attempt opens a new one."""
        stream = self.streams.get(addr)
        if stream is not None and stream.broken is not None:
            stream.close()
            stream = None
        if stream is None:
            stream = self.streams[addr] = SessionStream(self.channel(addr), addr)
        try:
            if not probe:
                return await stream.call(STREAMED[method], request, timeout)
            return await self._probed(addr, asyncio.ensure_future(stream.call(STREAMED[method], request, timeout)),
                                      probe)
        except (StreamBroken, ReplicaHung):
            if self.streams.get(addr) is stream:
                del self.streams[addr]
            stream.close()
            raise

    async def _probed(self, addr: str, call: asyncio.Future[Message] | grpc.aio.UnaryUnaryCall,
                      probe: bool) -> Message:
        """Await ``call`` (a unary call, or a stream message's task), probing the replica when asked."""
        if not probe:
            return await call
        hung = spawn(self._hung(addr), f"health probe of {addr}")

        def said_hung(t: asyncio.Task[bool]) -> bool:
            return t.done() and not t.cancelled() and t.exception() is None and t.result()
        hung.add_done_callback(lambda t: call.cancel() if said_hung(t) else None)
        try:
            return await call
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if said_hung(hung) and (task is None or not task.cancelling()):
                raise ReplicaHung(f"no answer to a health check within {self.attempt_timeout:.1f}s") from None
            raise
        finally:
            hung.cancel()

    async def _hung(self, addr: str) -> bool:
        """True once the replica at ``addr`` leaves a health check unanswered for ``attempt_timeout``."""
        stub = health_pb2_grpc.HealthStub(self.channel(addr))
        while True:
            await asyncio.sleep(self.attempt_timeout)
            try:
                await stub.Check(health_pb2.HealthCheckRequest(), timeout=self.attempt_timeout)
            except grpc.aio.AioRpcError as e:
                if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                    return True
                if e.code() != grpc.StatusCode.UNAVAILABLE:
                    return False   # no health service there: nothing to tell from
                # UNAVAILABLE: the connection broke, and the call fails with it by itself.
            except Exception:   # noqa: BLE001 - e.g. the channel was closed: the call ends by itself
                return False
