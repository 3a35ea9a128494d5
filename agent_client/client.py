"""The agent's side: a session kept alive in the background, VRAM leases as context managers.

``AsyncClient`` is the implementation; ``agent_client.sync.Client`` runs one on a private event loop in a
background thread.
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
import time
import uuid
from typing import Mapping, Sequence, TypedDict, Unpack

from agent_client import errors, kept_together
from agent_client._version import __version__
from agent_client.api import coordinator_pb2 as pb
from agent_client.lease import AsyncLease, EvictionNotice
from agent_client.run import AsyncBoundProcess, RunOptions
from agent_client.stream import SessionStream
from agent_client.tls import credentials, files
from agent_client.transport import Transport

log = logging.getLogger(__name__)


class ClientOptions(TypedDict, total=False):
    """The keyword options of ``AsyncClient`` (and of the sync ``Client``, which passes them on)."""

    keepalive_interval: float | None
    rpc_timeout: float
    retry_for: float | None
    attempt_timeout: float
    tls_ca: str | None
    tls_cert: str | None
    tls_key: str | None
    session_stream: bool


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
        self._tls_files = files(tls_ca, tls_cert, tls_key)   # which sessions may share one keepalive stream
        self.ttl = ttl or 0                 # 0 until connected: the coordinator's default
        self._keepalive_arg = keepalive_interval
        self.keepalive_interval = keepalive_interval or max(0.5, (ttl or 10) / 4)
        self._retry_for_arg = retry_for
        self._transport = Transport(self.addresses, self._tls, rpc_timeout, attempt_timeout,
                                    retry_for if retry_for is not None else float(ttl or 10), session_stream)
        self._call = self._transport.call
        self.session_id = ""
        self.done = asyncio.Event()        # set when the session is over (closed, expired, orphaned)
        self.expired = False
        self._leases: dict[str, AsyncLease] = {}
        self._early_notices: dict[str, EvictionNotice] = {}
        self._kept: kept_together.KeepAliveGroup | None = None   # the group keeping the session alive
        self._connecting = asyncio.Lock()

    # -- the transport's state, read through (the tests read _owner, _streams, _unary_only) --------------
    @property
    def _owner(self) -> str:
        return self._transport.owner

    @property
    def _streams(self) -> dict[str, SessionStream]:
        return self._transport.streams

    @property
    def _unary_only(self) -> set[str]:
        return self._transport.unary_only

    @property
    def retry_for(self) -> float:
        """How long a call tries the replicas (default: the session TTL)."""
        return self._transport.retry_for

    @retry_for.setter
    def retry_for(self, value: float) -> None:
        self._transport.retry_for = value

    @property
    def session_stream(self) -> bool:
        """Whether acquires and releases go as Session stream messages (else unary calls)."""
        return self._transport.session_stream

    @session_stream.setter
    def session_stream(self, value: bool) -> None:
        self._transport.session_stream = value

    @property
    def rpc_timeout(self) -> float:
        return self._transport.rpc_timeout

    @property
    def attempt_timeout(self) -> float:
        return self._transport.attempt_timeout

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
        self._kept = kept_together.join(self, self._transport, self._tls_files)

    def _deliver(self, notice: EvictionNotice) -> None:
        lease = self._leases.get(notice.lease_id)
        if lease is not None:
            lease._notify(notice)
        elif notice.withdrawn:
            self._early_notices.pop(notice.lease_id, None)
        else:
            # It may come before the acquire that made the lease has returned: keep it for that lease.
            self._early_notices[notice.lease_id] = notice

    async def close(self) -> None:
        """End the session: revokes its etcd_lease, and so releases every lease it holds."""
        if self.done.is_set() and not self.session_id:
            return
        already = self.done.is_set()
        self.done.set()
        await self._leave_group()
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
        await self._leave_group()
        await self._close_channels()

    async def _leave_group(self) -> None:
        """No longer kept alive (its group's stream ends with its last session, before the channels close)."""
        group, self._kept = self._kept, None
        if group is not None:
            await group.leave(self)

    async def _close_channels(self) -> None:
        await self._transport.close()

    async def __aenter__(self) -> AsyncClient:
        return await self.connect()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # -- leases --------------------------------------------------------------------------------
    async def acquire(self, vram_mb: int = 0, gpu: int | str | None = None, priority: int = 0, preemptible: bool = True,
                      wait: float = 0.0, request_id: str | None = None, *, gpu_count: int = 1,
                      exclusive: bool = False, topology: str = "any",
                      gpus: Sequence[int | str] = (), min_runtime: float = 0.0, time_limit: float = 0.0,
                      time_limit_warning: float = 0.0, hosts: int = 1, same: str = "",
                      prefer: str = "") -> AsyncLease:
        """Acquire ``vram_mb`` MiB on one GPU, or a gang: ``vram_mb`` on each of ``gpu_count`` GPUs (whole
        GPUs with ``exclusive``, ``vram_mb`` 0), joined by ``topology`` (``any``, ``numa``, ``nvlink``), or the
        exact ``gpus``; all granted together or not at all, as one lease (``lease.gpus``). Raises
        ResourceExhausted when it does not fit (after ``wait``). ``min_runtime``: seconds the lease runs before
        another team may reclaim it while it is over its team's quota (capped by the team's maximum).
        ``time_limit``: seconds after the grant at which the lease is revoked (0: none, or the fleet's default;
        at most 30 days and the fleet's maximum, else InvalidArgument naming ``time_limit_seconds``), with an
        eviction notice (reason ``time-limit``) ``time_limit_warning`` seconds before (0: the fleet's warning;
        capped at the limit). docs/policies.md "Time limits".
        ``hosts``: a multi-host gang, ``gpu_count`` GPUs (``vram_mb`` each, or ``exclusive``, by ``topology``)
        on each of ``hosts`` distinct hosts (1 to 64; this session's host need not be one), granted and ended
        as one lease: ``lease.hosts`` names them in rank order, ``lease.part(rank)`` gives each one's GPUs.
        ``same``: a host label key whose value every host shares; ``prefer``: one whose shared value is
        preferred (both only with ``hosts`` of 2 or more; no ``gpu`` or ``gpus`` then). docs/agents.md."""
        if self.done.is_set():
            # The same reason and field as the coordinator's answer for a gone session: which of the two the
            # caller meets first (the keepalive stream's or its own call's) is a matter of speed.
            raise errors.SessionExpired(f"session {self.session_id} of {self.agent} is over", errors.SESSION_GONE,
                                        "session")
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
                                     gpus=[str(g) for g in gpus], min_runtime_seconds=min_runtime,
                                     time_limit_seconds=time_limit, time_limit_warning_seconds=time_limit_warning,
                                     hosts=hosts, same=same, prefer=prefer)
        resp = await self._call("Acquire", request, retry_for=max(self.retry_for, wait),
                                wait_left=lambda: max(0.0, until - time.monotonic()) if wait else 0.0)
        # Host ownership: the next acquires go straight to the replica that admits on our host, saving
        # the hop through a replica that would forward them (any replica still would). A multi-host gang's
        # answer names no owner (it is no one host's): it leaves ours as it was.
        if hosts <= 1:
            self._transport.owner = resp.owner
        if hosts > 1 and not resp.lease.hosts:
            # A replica of a release before multi-host gangs ignores ``hosts``: it granted one host. Give it back.
            await self.release(resp.lease.id)
            raise errors.FailedPrecondition(
                "hosts: the coordinator does not support multi-host gangs (a replica of an older release "
                "answered); upgrade every replica first", "NOT_SUPPORTED", "hosts")
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

    def run(self, cmd: Sequence[str], vram_mb: int, **options: Unpack[RunOptions]) -> AsyncBoundProcess:
        """A command bound to a new VRAM lease of this session: ``async with client.run([...], vram_mb=...)
        as proc``. See :mod:`agent_client.run` for the options and what happens on eviction."""
        return AsyncBoundProcess(self, cmd, vram_mb, **options)

    async def status(self, host: str | None = None) -> pb.GetStatusResponse:
        resp: pb.GetStatusResponse = await self._call("GetStatus", pb.GetStatusRequest(host=host or ""))
        return resp

    async def partition(self) -> dict[str, object]:
        """This host's partition (spec and allocation per agent), and this agent's share of it."""
        resp = await self._call("GetPartition", pb.GetPartitionRequest(host=self.host))
        doc: dict[str, object] = json.loads(resp.partition_json)
        doc["explicit"] = resp.explicit
        allocations = doc.get("allocations", ())
        doc["mine"] = next((a for a in allocations if isinstance(a, Mapping) and a.get("agent") == self.agent),
                           None) if isinstance(allocations, (list, tuple)) else None
        return doc


