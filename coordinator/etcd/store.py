"""The etcd boundary: the only module that talks to etcd, and the only one that translates its errors.

The contract of each operation lives here, on the ``Store`` methods (as Patroni's ``AbstractDCS`` does):
whether it is one transaction, whether it may be retried, and which ``coordinator.errors`` it raises.
It is built on ``aetcd`` (asyncio, native gRPC). ``aetcd.Client`` owns the channel and authentication;
its generated etcd stubs are used directly where its high-level API hides what admission needs (the
header revision of a multi-range read-only transaction, the shared LeaseKeepAlive stream, resumable
watches with progress notifications).
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import random
from collections import defaultdict, deque
from typing import Any, AsyncIterator, Iterable, Sequence

import aetcd
import grpc
from aetcd import rpc
from tenacity import AsyncRetrying, retry_if_exception_type, stop_after_delay, wait_random_exponential

from coordinator import errors
from coordinator.etcd.ops import cmp_absent, cmp_exists, cmp_mod_revision, op_delete, op_put, range_req  # noqa: F401 (re-exported)
from coordinator.keys import prefix_range_end
from coordinator.security.etcd_auth import EtcdSecurity

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class KV:
    """One etcd key with its metadata. Every update is a compare-and-set on ``mod_revision``."""

    key: bytes
    value: bytes
    create_revision: int
    mod_revision: int
    version: int
    etcd_lease: int

    @classmethod
    def from_pb(cls, kv: Any) -> KV:
        return cls(kv.key, kv.value, kv.create_revision, kv.mod_revision, kv.version, kv.lease)

    def json(self) -> Any:
        return json.loads(self.value)


@dataclasses.dataclass(frozen=True)
class Snapshot:
    """The result of one read-only transaction: every range as of the same ``revision``."""

    revision: int
    ranges: tuple[tuple[KV, ...], ...]


@dataclasses.dataclass(frozen=True)
class TxnResult:
    succeeded: bool
    revision: int
    responses: tuple[Any, ...]


@dataclasses.dataclass(frozen=True)
class WatchEvent:
    kind: str  # "PUT" or "DELETE"
    kv: KV
    prev_kv: KV | None


@dataclasses.dataclass(frozen=True)
class WatchBatch:
    """Events of one watch response. ``resync`` means history was lost (compaction): re-read state."""

    revision: int
    events: tuple[WatchEvent, ...]
    resync: bool = False


def _translate(e: grpc.aio.AioRpcError, write: bool) -> errors.GpucoordError:
    """The one place etcd's failures become gpucoord errors."""
    code, details = e.code(), (e.details() or "")
    if "lease not found" in details:
        return errors.SessionGone(f"etcd: {details}")
    if "compacted" in details:
        return errors.Compacted(f"etcd: {details}", 0)
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        if write:
            return errors.OutcomeUnknown(f"etcd write timed out, outcome unknown: {details}")
        return errors.Timeout(f"etcd read timed out: {details}")
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED, grpc.StatusCode.UNKNOWN):
        if write and code != grpc.StatusCode.UNAVAILABLE:
            return errors.OutcomeUnknown(f"etcd write interrupted, outcome unknown: {details}")
        return errors.Unavailable(f"etcd unavailable: {details}")
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return errors.InvalidArgument(f"etcd rejected the request: {details}")
    return errors.Unavailable(f"etcd error {code.name}: {details}")


def _target(endpoints: Sequence[str]) -> str:
    eps = [e.removeprefix("http://") for e in endpoints]
    if len(eps) == 1:
        return eps[0]
    return "ipv4:" + ",".join(eps)


class _Client(aetcd.Client):  # type: ignore[misc]
    """aetcd's client, connected to a list of endpoints rather than one host:port."""

    def __init__(self, endpoints: Sequence[str], timeout: float, security: EtcdSecurity | None = None,
                 **kw: Any) -> None:
        super().__init__(host="unused", port=0, timeout=timeout, **kw)
        self._gpucoord_target = _target(endpoints)
        self._gpucoord_security = security or EtcdSecurity()

    async def connect(self) -> None:
        if self._connected.is_set():
            return
        # Round robin over the members: a dead member leaves the rotation, so an etcd minority loss
        # costs at most one failed (and retried) call.
        options: dict[str, Any] = {
            "grpc.lb_policy_name": "round_robin",
            "grpc.keepalive_time_ms": 10_000,
            "grpc.keepalive_timeout_ms": 5_000,
            "grpc.enable_retries": 1,
            **self._options,
        }
        self._options: dict[str, Any] = options
        orig = aetcd.rpc.insecure_channel
        target, security = self._gpucoord_target, self._gpucoord_security
        try:
            # The one place that picks plaintext or TLS, and adds etcd's auth token (security.channel).
            aetcd.rpc.insecure_channel = lambda _t, options=None: security.channel(target, list(options or ()))
            await super().connect()
        finally:
            aetcd.rpc.insecure_channel = orig


class Store:
    """etcd as gpucoord uses it.

    * ``snapshot`` is ONE read-only transaction: every range is read at the same revision. It may be
      retried (no side effect). Raises Unavailable or Timeout.
    * ``commit`` is ONE write transaction with compares. It is never retried here: a compare failure is
      ``TxnResult(succeeded=False)``, and the caller re-reads and decides again. A write whose outcome is
      unknown raises OutcomeUnknown; a put on an expired etcd_lease raises SessionGone.
    * ``grant``/``revoke``/``keepalive`` manage etcd_leases. All sessions of a process share one
      LeaseKeepAlive stream. ``keepalive`` answers the remaining TTL, 0 when the etcd_lease is gone.
    * ``watch`` yields batches from a start revision and resumes by itself after a disconnect, from the
      revision after the last one delivered. After a compaction it yields one ``resync`` batch and carries
      on from the current revision: the caller must re-read what it caches.
    Every call has a deadline (``timeout``).
    """

    def __init__(self, endpoints: Sequence[str], timeout: float = 5.0, retry_for: float = 10.0,
                 security: EtcdSecurity | None = None) -> None:
        if not endpoints:
            raise ValueError("etcd endpoints: at least one is needed")
        self.endpoints = list(endpoints)
        self.timeout = timeout
        self.retry_for = retry_for
        self._client = _Client(endpoints, timeout=int(max(1, timeout)), security=security)
        self._keepalive: _KeepAliveStream | None = None
        self.closed = False

    async def connect(self) -> None:
        await self._client.connect()
        self._keepalive = _KeepAliveStream(self)

    async def close(self) -> None:
        self.closed = True
        if self._keepalive is not None:
            await self._keepalive.close()
        await self._client.close()

    async def __aenter__(self) -> Store:
        await self.connect()
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    @property
    def _kv(self) -> Any:
        return self._client.kvstub

    def _retrying(self) -> AsyncRetrying:
        return AsyncRetrying(
            retry=retry_if_exception_type((errors.Unavailable, errors.Timeout)),
            wait=wait_random_exponential(multiplier=0.05, max=1.0),
            stop=stop_after_delay(self.retry_for),
            reraise=True,
        )

    # -- reads ---------------------------------------------------------------------------------
    async def _txn(self, req: Any, write: bool) -> Any:
        try:
            # wait_for_ready: while etcd is briefly unreachable (a restart, a leader change) the call waits for
            # the channel, up to its deadline, rather than failing at once.
            return await self._kv.Txn(req, timeout=self.timeout, wait_for_ready=True)
        except grpc.aio.AioRpcError as e:
            raise _translate(e, write) from e

    async def snapshot(self, ranges: Iterable[Any], serializable: bool = False) -> Snapshot:
        """Read several ranges (``range_req``) at one revision, in one read-only transaction.

        ``serializable`` reads are served by the member the call lands on, without a round of consensus:
        they may be slightly stale. Use them only where a later compare-and-set validates the decision.
        """
        ranges = list(ranges)
        if serializable:
            for r in ranges:
                r.serializable = True
        req = rpc.TxnRequest(success=[rpc.RequestOp(request_range=r) for r in ranges])
        async for attempt in self._retrying():
            with attempt:
                resp = await self._txn(req, write=False)
        out = tuple(tuple(KV.from_pb(kv) for kv in r.response_range.kvs) for r in resp.responses)
        return Snapshot(resp.header.revision, out)

    async def get(self, key: bytes) -> KV | None:
        snap = await self.snapshot([range_req(key)])
        return snap.ranges[0][0] if snap.ranges[0] else None

    async def get_prefix(self, prefix: bytes) -> Snapshot:
        return await self.snapshot([range_req(prefix, prefix=True)])

    # -- writes --------------------------------------------------------------------------------
    async def commit(self, compares: Sequence[Any], success: Sequence[Any], failure: Sequence[Any] = ()) -> TxnResult:
        req = rpc.TxnRequest(compare=list(compares), success=list(success), failure=list(failure))
        resp = await self._txn(req, write=True)
        return TxnResult(resp.succeeded, resp.header.revision, tuple(resp.responses))

    async def put(self, key: bytes, value: bytes, etcd_lease: int = 0) -> int:
        return (await self.commit([], [op_put(key, value, etcd_lease)])).revision

    async def delete(self, key: bytes, prefix: bool = False) -> int:
        return (await self.commit([], [op_delete(key, prefix)])).revision

    # -- etcd_leases ---------------------------------------------------------------------------
    async def grant(self, ttl: int) -> int:
        try:
            resp = await self._client.leasestub.LeaseGrant(rpc.LeaseGrantRequest(TTL=ttl), timeout=self.timeout,
                                                           wait_for_ready=True)
        except grpc.aio.AioRpcError as e:
            raise _translate(e, write=True) from e
        return int(resp.ID)

    async def revoke(self, etcd_lease: int) -> None:
        """Revoke an etcd_lease, deleting every key on it. Revoking one that is gone is not an error."""
        try:
            await self._client.leasestub.LeaseRevoke(rpc.LeaseRevokeRequest(ID=etcd_lease), timeout=self.timeout,
                                                     wait_for_ready=True)
        except grpc.aio.AioRpcError as e:
            err = _translate(e, write=True)
            if not isinstance(err, errors.SessionGone):
                raise err from e

    async def time_to_live(self, etcd_lease: int) -> int:
        """Remaining TTL in seconds, -1 when the etcd_lease is gone."""
        try:
            resp = await self._client.leasestub.LeaseTimeToLive(
                rpc.LeaseTimeToLiveRequest(ID=etcd_lease), timeout=self.timeout, wait_for_ready=True)
        except grpc.aio.AioRpcError as e:
            raise _translate(e, write=False) from e
        return int(resp.TTL)

    async def keepalive(self, etcd_lease: int) -> int:
        """Refresh an etcd_lease over the process's shared LeaseKeepAlive stream; 0 when it is gone."""
        assert self._keepalive is not None, "Store.connect() first"
        return await self._keepalive.refresh(etcd_lease)

    # -- watches -------------------------------------------------------------------------------
    async def watch(self, key: bytes, *, prefix: bool = True, start_revision: int = 0,
                    prev_kv: bool = False) -> AsyncIterator[WatchBatch]:
        """Watch ``key`` (a prefix by default) from ``start_revision`` (0: from now)."""
        next_rev = start_revision
        backoff = 0.05
        while not self.closed:
            create = rpc.WatchCreateRequest(key=key, start_revision=next_rev, prev_kv=prev_kv,
                                            progress_notify=True)
            if prefix:
                create.range_end = prefix_range_end(key)
            requests: asyncio.Queue[Any] = asyncio.Queue()
            requests.put_nowait(rpc.WatchRequest(create_request=create))

            async def _reqs() -> AsyncIterator[Any]:
                while True:
                    item = await requests.get()
                    if item is None:
                        return
                    yield item

            call = rpc.WatchStub(self._client.channel).Watch(_reqs(), wait_for_ready=True)
            try:
                async for resp in call:
                    backoff = 0.05
                    if resp.compact_revision:
                        log.warning("watch on %r lost history below revision %d: resync", key, resp.compact_revision)
                        next_rev = 0
                        yield WatchBatch(resp.header.revision, (), resync=True)
                        break
                    if resp.canceled:
                        raise errors.Unavailable(f"etcd cancelled the watch: {resp.cancel_reason}")
                    evs = tuple(
                        WatchEvent("DELETE" if ev.type == rpc.Event.DELETE else "PUT", KV.from_pb(ev.kv),
                                   KV.from_pb(ev.prev_kv) if ev.HasField("prev_kv") else None)
                        for ev in resp.events)
                    if evs:
                        next_rev = evs[-1].kv.mod_revision + 1
                    elif resp.header.revision and not resp.created:
                        next_rev = max(next_rev, resp.header.revision + 1)
                    if evs or resp.created:
                        if resp.created and next_rev == 0:
                            next_rev = resp.header.revision + 1
                        yield WatchBatch(resp.header.revision, evs)
            except grpc.aio.AioRpcError as e:
                if self.closed:
                    return
                log.info("watch on %r broke (%s); resuming from revision %d", key, e.code().name, next_rev)
                await asyncio.sleep(backoff * (1 + random.random()))
                backoff = min(backoff * 2, 2.0)
            finally:
                requests.put_nowait(None)
                call.cancel()


class _KeepAliveStream:
    """One LeaseKeepAlive stream for every etcd_lease of the process (etcd's Go client does the same)."""

    def __init__(self, store: Store) -> None:
        self._store = store
        self._requests: asyncio.Queue[Any] | None = None
        self._waiters: dict[int, deque[asyncio.Future[int]]] = defaultdict(deque)
        self._task: asyncio.Task[None] | None = None
        self._last_response = 0.0

    def _ensure_running(self) -> asyncio.Queue[Any]:
        if self._task is None or self._task.done():
            self._requests = asyncio.Queue()
            self._task = asyncio.get_running_loop().create_task(self._run(self._requests))
        assert self._requests is not None
        return self._requests

    async def _run(self, requests: asyncio.Queue[Any]) -> None:
        async def _reqs() -> AsyncIterator[Any]:
            while True:
                item = await requests.get()
                if item is None:
                    return
                yield item

        call = self._store._client.leasestub.LeaseKeepAlive(_reqs(), wait_for_ready=True)
        try:
            async for resp in call:
                self._last_response = asyncio.get_running_loop().time()
                q = self._waiters.get(resp.ID)
                if q:
                    fut = q.popleft()
                    if not fut.done():
                        fut.set_result(int(resp.TTL))
        except grpc.aio.AioRpcError as e:
            err = _translate(e, write=False)
            for q in self._waiters.values():
                while q:
                    fut = q.popleft()
                    if not fut.done():
                        fut.set_exception(err)
        finally:
            call.cancel()

    async def refresh(self, etcd_lease: int) -> int:
        requests = self._ensure_running()
        fut: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self._waiters[etcd_lease].append(fut)
        requests.put_nowait(rpc.LeaseKeepAliveRequest(ID=etcd_lease))
        sent_at = asyncio.get_running_loop().time()
        try:
            return await asyncio.wait_for(fut, self._store.timeout)
        except asyncio.TimeoutError:
            # A stuck stream (no answer to anyone since we asked): drop it, so that the next refresh opens
            # a fresh one. A stream that answers others is left alone.
            if self._task is not None and self._last_response < sent_at:
                self._task.cancel()
            raise errors.Timeout(f"etcd keepalive of etcd_lease {etcd_lease:x} timed out") from None
        finally:
            q = self._waiters.get(etcd_lease)
            if q is not None:
                if fut in q:
                    q.remove(fut)
                if not q:
                    self._waiters.pop(etcd_lease, None)

    async def close(self) -> None:
        if self._requests is not None:
            self._requests.put_nowait(None)
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):
                pass
