"""The agent's side: a session kept alive in the background, VRAM leases as context managers.

``AsyncClient`` is the implementation; ``agent_client.sync.Client`` runs one on a private event loop in a
background thread.
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
import random
import time
import uuid
from typing import Any, Callable, Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from agent_client import errors
from agent_client._version import __version__
from agent_client.api import coordinator_pb2 as pb
from agent_client.api import coordinator_pb2_grpc as pb_grpc
from agent_client.lease import AsyncLease, EvictionNotice
from agent_client.run import AsyncBoundProcess
from agent_client.stream import SessionStream, StreamBroken
from agent_client.tls import aio_channel, credentials

log = logging.getLogger(__name__)

# gRPC's default reconnect backoff grows to minutes: a replica back after a restart must be found again
# well within a session TTL, so the client retries connecting at least every second.
_CHANNEL_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
]


class _ReplicaHung(Exception):
    """A replica stopped answering health checks while an attempt waited on it."""


_FAILOVER_CODES = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
_TO_OWNER = ("Acquire", "Release")    # calls sent to the host's owning replica first, when known
# The calls that travel on a replica's Session stream when it serves one (the unary call otherwise).
_STREAMED = {"Acquire": "acquire", "Release": "release"}
# Calls in flight on a stream past which a call goes unary: a stream's answers are written one after the
# other, where unary calls are answered side by side (a burst of waits that end together, say).
_STREAM_IN_FLIGHT = 8


class AsyncClient:
    """A session of one agent on one host, talking to any of several coordinator replicas.

    Failover: every attempt of a call has its own short deadline, ``attempt_timeout`` (3 s), plus the wait
    left for an acquire. An attempt that answers UNAVAILABLE, or runs past its deadline, or waits on a
    replica that stops answering health checks (probed every ``attempt_timeout`` while an acquire waits),
    moves the client to the next address, which gets the same request, until ``retry_for`` (default: the
    session TTL) has passed. No call outlasts ``rpc_timeout`` (plus the wait of an acquire).

    Only calls that are safe to repeat are retried: an acquire keeps its request_id, so a retry never mints
    a second lease; a release, a close and the reads are idempotent. An OpenSession whose answer was lost
    may have opened a session on the replica that hung: that session holds nothing and nobody keeps it
    alive, so etcd removes it when its TTL passes.

    The session is opened by ``connect()`` (``async with``) or by the first call that needs one.

    Acquires and releases go as messages of one ``Session`` stream per replica (cheaper for the coordinator
    than a unary call each) with the same outcomes, deadlines and failover; a replica that does not serve
    the stream (UNIMPLEMENTED: an older server) gets unary calls from then on, and a stream that breaks is
    opened again for the next call. With 8 calls in flight on a stream, more go unary (a stream writes its
    answers one at a time). ``session_stream=False`` keeps to unary calls.
    """

    def __init__(self, addresses: str | Sequence[str], agent: str, host: str, ttl: int | None = None,
                 keepalive_interval: float | None = None, rpc_timeout: float = 10.0,
                 retry_for: float | None = None, attempt_timeout: float = 3.0, tls_ca: str | None = None,
                 tls_cert: str | None = None, tls_key: str | None = None, session_stream: bool = True) -> None:
        """``ttl`` None takes the coordinator's session TTL, and ``keepalive_interval`` None the interval the
        coordinator answers (at most a third of the TTL). ``tls_ca``/``tls_cert``/``tls_key`` (else
        ``GPUCOORD_TLS_CA/CERT/KEY``) turn on mTLS."""
        self.addresses = [a.strip() for a in (addresses.split(",") if isinstance(addresses, str) else addresses)
                          if a.strip()]
        if not self.addresses:
            raise ValueError("addresses: at least one coordinator address is needed")
        if not attempt_timeout > 0:
            raise ValueError(f"attempt_timeout: must be > 0, got {attempt_timeout}")
        self.agent, self.host = agent, host
        # mTLS: the three files from the arguments, else GPUCOORD_TLS_CA/CERT/KEY; none: plaintext.
        self._tls = credentials(tls_ca, tls_cert, tls_key)
        self.ttl = ttl or 0                 # 0 until connected: the coordinator's default
        self._keepalive_arg = keepalive_interval
        self.keepalive_interval = keepalive_interval or max(0.5, (ttl or 10) / 4)
        self.rpc_timeout = rpc_timeout
        self.attempt_timeout = attempt_timeout
        self._retry_for_arg = retry_for
        self.retry_for = retry_for if retry_for is not None else float(ttl or 10)
        self.session_id = ""
        self.done = asyncio.Event()        # set when the session is over (closed, expired, orphaned)
        self.expired = False
        self._addr_i = 0
        self._owner = ""        # the replica that owns our host (host ownership), as the last acquire said
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._streams: dict[str, SessionStream] = {}
        self._unary_only: set[str] = set()    # replicas that answered the stream UNIMPLEMENTED
        self.session_stream = session_stream
        self._leases: dict[str, AsyncLease] = {}
        self._early_notices: dict[str, EvictionNotice] = {}
        self._keepalive_task: asyncio.Task[None] | None = None
        self._last_refresh = 0.0
        self._connecting = asyncio.Lock()

    # -- plumbing ------------------------------------------------------------------------------
    def _channel(self, addr: str) -> grpc.aio.Channel:
        ch = self._channels.get(addr)
        if ch is None:
            ch = self._channels[addr] = aio_channel(addr, self._tls, _CHANNEL_OPTIONS)
        return ch

    def _address(self) -> str:
        return self.addresses[self._addr_i % len(self.addresses)]

    def _stub(self) -> pb_grpc.CoordinatorStub:
        return pb_grpc.CoordinatorStub(self._channel(self._address()))

    def _next_address(self) -> None:
        self._addr_i = (self._addr_i + 1) % len(self.addresses)

    def _move_from(self, addr: str) -> None:
        """Leave ``addr`` for the next address, unless another call has moved on from it already."""
        if self._address() == addr:
            self._next_address()

    async def _call(self, method: str, request: Any, retry_for: float | None = None,
                    wait_left: Callable[[], float] | None = None) -> Any:
        """A unary call with failover (see the class docstring). Only for calls that are safe to repeat.

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
            addr = self._owner if method in _TO_OWNER and self._owner else self._address()
            req = request() if callable(request) else request
            waiting = wait_left() if wait_left else 0.0
            timeout = max(0.05, min(self.attempt_timeout + waiting, give_up_at - time.monotonic()))
            try:
                return await self._attempt(addr, method, req, timeout, probe=waiting > 0)
            except grpc.aio.AioRpcError as e:
                code, why = e.code(), f"{e.code().name}: {e.details()}"
                last: errors.GpucoordError = errors.from_rpc_error(e)
            except _ReplicaHung as e:
                code, why = grpc.StatusCode.DEADLINE_EXCEEDED, str(e)
                last = errors.DeadlineExceeded(f"{method}: coordinator {addr} stopped answering")
            now = time.monotonic()
            if code not in _FAILOVER_CODES or now + delay > min(retry_until, give_up_at - 0.1):
                raise last from None
            log.info("%s: coordinator %s failed (%s); trying the next one", method, addr, why)
            if addr == self._owner:
                self._owner = ""      # back to our own list: any replica forwards to the owner
            self._move_from(addr)     # and not to the same replica again, if our list is at it
            if code == grpc.StatusCode.UNAVAILABLE:
                # Refused at once (a replica down, or all of them): back off. A timed-out attempt has
                # waited already.
                await asyncio.sleep(delay * (1 + random.random()))
                delay = min(delay * 2, 1.0)

    async def _attempt(self, addr: str, method: str, request: Any, timeout: float, probe: bool) -> Any:
        """One attempt on one replica. With ``probe``, the replica's health is checked while it holds
        the call, so that a replica that hangs (SIGSTOP, a stuck loop, packets dropped) is left within
        two ``attempt_timeout`` rather than at the end of the wait."""
        stream = self._streams.get(addr)
        if method in _STREAMED and self.session_stream and addr not in self._unary_only and \
                (stream is None or stream.in_flight < _STREAM_IN_FLIGHT):
            try:
                return await self._attempt_on_stream(addr, method, request, timeout, probe)
            except StreamBroken as e:
                if e.code() != grpc.StatusCode.UNIMPLEMENTED:
                    raise
                log.info("coordinator %s serves no Session stream: unary calls from now on", addr)
                self._unary_only.add(addr)
        call = getattr(pb_grpc.CoordinatorStub(self._channel(addr)), method)(request, timeout=timeout)
        return await self._probed(addr, call, probe)

    async def _attempt_on_stream(self, addr: str, method: str, request: Any, timeout: float, probe: bool) -> Any:
        """The attempt as a message of the Session stream to ``addr``; a stream that broke before the message
        was sent is replaced first. A broken stream is dropped, so that the next attempt opens a new one."""
        stream = self._streams.get(addr)
        if stream is not None and stream.broken is not None:
            stream.close()
            stream = None
        if stream is None:
            stream = self._streams[addr] = SessionStream(self._channel(addr), addr)
        try:
            if not probe:
                return await stream.call(_STREAMED[method], request, timeout)
            return await self._probed(addr, asyncio.ensure_future(stream.call(_STREAMED[method], request, timeout)),
                                      probe)
        except (StreamBroken, _ReplicaHung):
            if self._streams.get(addr) is stream:
                del self._streams[addr]
            stream.close()
            raise

    async def _probed(self, addr: str, call: Any, probe: bool) -> Any:
        """Await ``call`` (a unary call, or a stream message's task), probing the replica when asked."""
        if not probe:
            return await call
        hung = asyncio.get_running_loop().create_task(self._hung(addr))

        def said_hung(t: asyncio.Task[bool]) -> bool:
            return t.done() and not t.cancelled() and t.exception() is None and t.result()
        hung.add_done_callback(lambda t: call.cancel() if said_hung(t) else None)
        try:
            return await call
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if said_hung(hung) and (task is None or not task.cancelling()):
                raise _ReplicaHung(f"no answer to a health check within {self.attempt_timeout:.1f}s") from None
            raise
        finally:
            hung.cancel()

    async def _hung(self, addr: str) -> bool:
        """True once the replica at ``addr`` leaves a health check unanswered for ``attempt_timeout``."""
        stub = health_pb2_grpc.HealthStub(self._channel(addr))
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

    def _ref(self) -> pb.SessionRef:
        return pb.SessionRef(agent=self.agent, session_id=self.session_id)

    # -- session -------------------------------------------------------------------------------
    async def connect(self) -> AsyncClient:
        """Open the session. Optional: the first call that needs a session (``acquire``, ``release``,
        ``attach_processes``, ``run``) opens it. Unavailable names the addresses it tried."""
        async with self._connecting:   # two first calls at once open one session, not two
            if self.session_id:
                return self   # already connected: a second session would orphan the first one's leases
            try:
                resp = await self._call("OpenSession", pb.OpenSessionRequest(
                    agent=self.agent, host=self.host, ttl_seconds=self.ttl, pid=os.getpid(),
                    client_version=__version__), retry_for=max(self.retry_for, 5.0))
            except (errors.Unavailable, errors.DeadlineExceeded) as e:
                raise type(e)(f"cannot open a session at {', '.join(self.addresses)}: {e.message}") from None
            self._opened(resp)
        return self

    async def _session_ref(self) -> pb.SessionRef:
        """This client's session, opened on first use."""
        if not self.session_id and not self.done.is_set():
            await self.connect()
        return self._ref()

    def _opened(self, resp: pb.OpenSessionResponse) -> None:
        self.session_id, self.ttl = resp.session_id, resp.ttl_seconds
        if self._keepalive_arg is None and resp.keepalive_interval_seconds > 0:
            self.keepalive_interval = resp.keepalive_interval_seconds
        if self._retry_for_arg is None:
            self.retry_for = float(self.ttl)
        self._last_refresh = time.monotonic()
        self._keepalive_task = asyncio.get_running_loop().create_task(self._keepalive())

    async def _keepalive(self) -> None:
        """One KeepAlive stream; on UNAVAILABLE, the next replica, for as long as the TTL allows."""
        while not self.done.is_set():
            queue: asyncio.Queue[pb.KeepAliveRequest | None] = asyncio.Queue()

            async def requests() -> Any:
                while True:
                    item = await queue.get()  # noqa: B023 - the stream's own queue, read within this iteration
                    if item is None:
                        return
                    yield item

            # The stream's own replica: what it moves away from when it fails. The calls share the position in
            # the list, and may have moved on from that replica already (a failed acquire): then the
            # keepalive follows them, rather than going on to the next address, which could be the one
            # they left.
            addr = self._address()
            call = pb_grpc.CoordinatorStub(self._channel(addr)).KeepAlive(requests())
            opened = time.monotonic()

            async def ticker() -> None:
                while True:
                    queue.put_nowait(pb.KeepAliveRequest(session=self._ref()))  # noqa: B023 - the stream's own queue, fed within this iteration
                    await asyncio.sleep(self.keepalive_interval)

            async def read() -> None:
                async for resp in call:  # noqa: B023 - this iteration's call; its reader is cancelled before the next
                    if resp.ttl_seconds > 0:
                        self._last_refresh = time.monotonic()
                    for n in resp.notices:
                        left = (n.grace_left_seconds if n.HasField("grace_left_seconds")
                                else n.deadline_unix - time.time())   # an older coordinator: wall clocks
                        self._deliver(EvictionNotice(n.lease_id, n.gpu_uuid, n.reason, n.requested_by,
                                                     n.deadline_unix, time.monotonic() + left, n.revoke))

            async def watchdog() -> None:
                # A replica that hangs without closing its socket (SIGSTOP, a stuck loop, a partition that
                # drops packets) never breaks the stream: no answer for two intervals means move on.
                stale = max(1.0, 2 * self.keepalive_interval)
                while time.monotonic() - max(self._last_refresh, opened) < stale:  # noqa: ASYNC110,B023 - this iteration's watchdog on a timestamp the reader moves; no event to wait on
                    await asyncio.sleep(min(0.5, self.keepalive_interval / 2))

            tick = asyncio.get_running_loop().create_task(ticker())
            reader = asyncio.get_running_loop().create_task(read())
            dog = asyncio.get_running_loop().create_task(watchdog())
            try:
                await asyncio.wait({reader, dog}, return_when=asyncio.FIRST_COMPLETED)
                if reader.done():
                    reader.result()          # raises what broke the stream
                    self._move_from(addr)    # the server ended it: try the next replica
                else:
                    log.info("keepalive: no answer from %s for %.1fs; trying the next replica",
                             addr, time.monotonic() - self._last_refresh)
                    self._move_from(addr)
            except grpc.aio.AioRpcError as e:
                if errors.session_gone(e):
                    log.warning("session %s of %s expired: %s", self.session_id, self.agent, e.details())
                    self.expired = True
                    self.done.set()
                    return
                if e.code() == grpc.StatusCode.CANCELLED and self.done.is_set():
                    return
                log.info("keepalive stream broke (%s); reconnecting", e.code().name)
                self._move_from(addr)
            finally:
                for t in (tick, reader, dog):
                    t.cancel()
                queue.put_nowait(None)
                call.cancel()
            if time.monotonic() - self._last_refresh > self.ttl:
                log.warning("session %s: no keepalive for longer than its TTL; it is gone", self.session_id)
                self.expired = True
                self.done.set()
                return
            await asyncio.sleep(min(0.2, self.keepalive_interval))

    def _deliver(self, notice: EvictionNotice) -> None:
        lease = self._leases.get(notice.lease_id)
        if lease is not None:
            lease._notify(notice)
        else:
            # It may come before the acquire that made the lease has returned: keep it for that lease.
            self._early_notices[notice.lease_id] = notice

    async def close(self) -> None:
        """End the session: revokes its etcd_lease, and so releases every lease it holds."""
        if self.done.is_set() and not self.session_id:
            return
        already = self.done.is_set()
        self.done.set()
        if self._keepalive_task is not None:
            self._keepalive_task.cancel()
            # Its stream ends before the channels close: no call is left behind to be destroyed pending.
            await asyncio.gather(self._keepalive_task, return_exceptions=True)
        if self.session_id and not already:
            try:
                await self._call("CloseSession", pb.CloseSessionRequest(session=self._ref()),
                                 retry_for=2 * self.attempt_timeout)
            except errors.GpucoordError as e:
                log.info("close session: %s", e)
        await self._close_channels()

    async def orphan(self) -> None:
        """Stop keeping the session alive but leave its keys: they go when the TTL passes."""
        self.done.set()
        if self._keepalive_task is not None:
            self._keepalive_task.cancel()
        await self._close_channels()

    async def _close_channels(self) -> None:
        for stream in self._streams.values():
            stream.close()
        self._streams.clear()
        for ch in self._channels.values():
            await ch.close()
        self._channels.clear()

    async def __aenter__(self) -> AsyncClient:
        return await self.connect()

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    # -- leases --------------------------------------------------------------------------------
    async def acquire(self, vram_mb: int = 0, gpu: int | str | None = None, priority: int = 0, preemptible: bool = True,
                      wait: float = 0.0, request_id: str | None = None, *, gpu_count: int = 1,
                      exclusive: bool = False, topology: str = "any",
                      gpus: Sequence[int | str] = ()) -> AsyncLease:
        """Acquire ``vram_mb`` MiB on one GPU, or a gang: ``vram_mb`` on each of ``gpu_count`` GPUs (whole
        GPUs with ``exclusive``, ``vram_mb`` 0), joined by ``topology`` (``any``, ``numa``, ``nvlink``), or the
        exact ``gpus``; all granted together or not at all, as one lease (``lease.gpus``). Raises
        ResourceExhausted when it does not fit (after ``wait``)."""
        if self.done.is_set():
            raise errors.SessionExpired(f"session {self.session_id} of {self.agent} is over")
        session = await self._session_ref()
        request_id = request_id or uuid.uuid4().hex
        until = time.monotonic() + wait

        def request() -> pb.AcquireRequest:
            # A retry (through another replica) keeps the same request_id, so it keeps its place in the
            # queue, and waits only for what is left of ``wait``.
            return pb.AcquireRequest(session=session, vram_mb=vram_mb, gpu="" if gpu is None else str(gpu),
                                     priority=priority, preemptible=preemptible, request_id=request_id,
                                     wait_seconds=max(0.0, until - time.monotonic()) if wait else 0.0,
                                     gpu_count=gpu_count, exclusive=exclusive, topology=topology,
                                     gpus=[str(g) for g in gpus])
        resp = await self._call("Acquire", request, retry_for=max(self.retry_for, wait),
                                wait_left=lambda: max(0.0, until - time.monotonic()) if wait else 0.0)
        # Host ownership: the next acquires go straight to the replica that admits on our host, saving
        # the hop through a replica that would forward them (any replica still would).
        self._owner = resp.owner
        if (gpu_count != 1 or exclusive or topology != "any" or gpus) and not resp.lease.gpus:
            # A replica of a release before gangs ignores their fields: it granted one plain GPU. Give it back.
            await self.release(resp.lease.id)
            raise errors.FailedPrecondition(
                "gpu_count: the coordinator does not support gangs (a replica of an older release answered); "
                "upgrade every replica first", "NOT_SUPPORTED", "gpu_count")
        lease = AsyncLease(self, resp.lease)
        self._leases[lease.id] = lease
        early = self._early_notices.pop(lease.id, None)
        if early is not None:
            lease._notify(early)
        return lease

    async def release(self, lease_id: str) -> bool:
        resp = await self._call("Release", pb.ReleaseRequest(session=await self._session_ref(), lease_id=lease_id))
        self._leases.pop(lease_id, None)
        return bool(resp.released)

    async def attach_processes(self, lease_id: str, pids: Sequence[int], pgid: int = 0) -> bool:
        """Record the processes a lease of this session covers; NotFound once the lease is gone."""
        resp = await self._call("AttachProcesses", pb.AttachProcessesRequest(
            session=await self._session_ref(), lease_id=lease_id, pids=list(pids), pgid=pgid))
        return bool(resp.changed)

    def run(self, cmd: Sequence[str], vram_mb: int, **options: Any) -> AsyncBoundProcess:
        """A command bound to a new VRAM lease of this session: ``async with client.run([...], vram_mb=...)
        as proc``. See :mod:`agent_client.run` for the options and what happens on eviction."""
        return AsyncBoundProcess(self, cmd, vram_mb, **options)

    async def status(self, host: str | None = None) -> pb.GetStatusResponse:
        resp: pb.GetStatusResponse = await self._call("GetStatus", pb.GetStatusRequest(host=host or ""))
        return resp

    async def partition(self) -> dict[str, Any]:
        """This host's partition (spec and allocation per agent), and this agent's share of it."""
        resp = await self._call("GetPartition", pb.GetPartitionRequest(host=self.host))
        doc: dict[str, Any] = json.loads(resp.partition_json)
        doc["explicit"] = resp.explicit
        doc["mine"] = next((a for a in doc.get("allocations", ()) if a.get("agent") == self.agent), None)
        return doc


