"""The etcd boundary: the only module that talks to etcd, and the only one that translates its errors.

The contract of each operation lives here, on the ``Store`` methods (as Patroni's ``AbstractDCS`` does):
whether it is one transaction, whether it may be retried, and which ``coordinator.errors`` it raises.
It is built on ``aetcd`` (asyncio, native gRPC): its generated etcd stubs are used directly, on one channel
that ``_open_channel`` builds (round robin over the members, a reconnect backoff capped at about a second).

It never sends a read-only transaction. etcd 3.5.0-3.5.6 crash when one is cancelled by its client deadline
(etcd-io/etcd#14110, #14891), so a read of several ranges at one revision is a linearizable Range that fixes
the revision, then Ranges at that revision; ``commit`` refuses a transaction without a write. Prefix reads
are paginated, so no response comes near gRPC's 4 MiB message limit whatever the size of the state.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import random
from collections import defaultdict, deque
from typing import Any, AsyncIterator, Awaitable, Iterable, Sequence, TypeVar

import aetcd
import grpc
from aetcd import rpc
from tenacity import AsyncRetrying, retry_if_exception_type, stop_after_delay, wait_random_exponential

from coordinator import errors, metrics
from coordinator.etcd.ops import cmp_absent, cmp_exists, cmp_mod_revision, op_delete, op_put, range_req  # noqa: F401 (re-exported)
from coordinator.etcd.versions import MINIMUM_PRODUCTION, crash_bugs, format_version, parse_etcd_version
from coordinator.keys import prefix_range_end

log = logging.getLogger(__name__)
T = TypeVar("T")

# Keys per page of a range read: about 0.5 MiB with gpucoord's values, far below gRPC's 4 MiB limit. A page
# that still exceeds it (large values) is read again at half the size.
PAGE_KEYS = 1024


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
    """Several ranges read at one etcd ``revision`` (the state just after that revision)."""

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
    if "database space exceeded" in details:
        metrics.ETCD_NOSPACE.inc()
        return errors.EtcdNoSpace(
            "etcd is out of space (alarm NOSPACE, \"database space exceeded\"): it refuses every write until an "
            "operator frees space: etcdctl compact <current revision>, etcdctl defrag (every member), then "
            "etcdctl alarm disarm; or raise --quota-backend-bytes (see the README, \"Production: etcd\")")
    if "lease not found" in details:
        return errors.SessionGone(f"etcd: {details}")
    if "compacted" in details:
        return errors.Compacted(f"etcd: {details}", 0)
    # etcd answers a deadline that passed while it served the call as UNKNOWN "context deadline exceeded".
    if code == grpc.StatusCode.DEADLINE_EXCEEDED or "context deadline exceeded" in details:
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


# Round robin over the members: a dead member leaves the rotation, so an etcd minority loss costs at most one
# failed (and retried) call. gRPC's default reconnect backoff grows to 120 s, which once left a replica
# unable to reach a restarted etcd for 90 s; capped at 1 s, every replica is back within about a second.
# min_reconnect_backoff_ms is also the shortest connect timeout: plenty on the networks etcd runs on.
CHANNEL_OPTIONS: dict[str, Any] = {
    "grpc.lb_policy_name": "round_robin",
    "grpc.keepalive_time_ms": 10_000,
    "grpc.keepalive_timeout_ms": 5_000,
    "grpc.enable_retries": 1,
    "grpc.initial_reconnect_backoff_ms": 100,
    "grpc.min_reconnect_backoff_ms": 1_000,
    "grpc.max_reconnect_backoff_ms": 1_000,
}


def _open_channel(target: str) -> grpc.aio.Channel:
    """The one place a gRPC channel to etcd is built (etcd TLS credentials belong here)."""
    return grpc.aio.insecure_channel(target, options=list(CHANNEL_OPTIONS.items()))


class _Client(aetcd.Client):  # type: ignore[misc]
    """aetcd's client, on a channel from ``_open_channel`` to a list of endpoints rather than one host:port."""

    def __init__(self, endpoints: Sequence[str], timeout: float) -> None:
        super().__init__(host="unused", port=0, timeout=timeout)
        self._gpucoord_target = _target(endpoints)

    async def connect(self) -> None:
        if self._connected.is_set():
            return
        self.channel = _open_channel(self._gpucoord_target)
        self.kvstub = rpc.KVStub(self.channel)
        self.clusterstub = rpc.ClusterStub(self.channel)
        self.leasestub = rpc.LeaseStub(self.channel)
        self.maintenancestub = rpc.MaintenanceStub(self.channel)
        self._connected.set()


def _has_write(ops: Iterable[Any]) -> bool:
    """Whether these RequestOps put or delete anything (nested transactions included)."""
    for op in ops:
        kind = op.WhichOneof("request")
        if kind in ("request_put", "request_delete_range"):
            return True
        if kind == "request_txn" and (_has_write(op.request_txn.success) or _has_write(op.request_txn.failure)):
            return True
    return False


def _response_too_large(e: grpc.aio.AioRpcError) -> bool:
    return e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "larger than max" in (e.details() or "")


def _future_revision(e: grpc.aio.AioRpcError) -> bool:
    return "future revision" in (e.details() or "")


async def _gather(coros: Iterable[Awaitable[T]]) -> list[T]:
    """``asyncio.gather`` that cancels (and waits for) the others when one fails."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


class Store:
    """etcd as gpucoord uses it.

    * ``snapshot`` reads several ranges at ONE revision, never as a transaction: a linearizable Range fixes
      the revision R, the other ranges (and further pages) are Ranges at R, read concurrently. A prefix is
      read in pages (``PAGE_KEYS``, halved while a page exceeds gRPC's message limit), all at R, so a read
      has no size limit. It may be retried (no side effect), and is retried as a whole when R has been
      compacted meanwhile. Raises Unavailable or Timeout; EtcdNoSpace never (reads work under NOSPACE).
    * ``commit`` is ONE write transaction with compares. It is never retried here: a compare failure is
      ``TxnResult(succeeded=False)``, and the caller re-reads and decides again. A write whose outcome is
      unknown raises OutcomeUnknown; a put on an expired etcd_lease raises SessionGone; a full etcd
      (alarm NOSPACE) raises EtcdNoSpace. A transaction without a put or delete is refused (ValueError)
      before it is sent: it would be a read-only transaction, which crashes etcd 3.5.0-3.5.6.
    * ``grant``/``revoke``/``keepalive`` manage etcd_leases. All sessions of a process share one
      LeaseKeepAlive stream. ``keepalive`` answers the remaining TTL, 0 when the etcd_lease is gone.
    * ``watch`` yields batches from a start revision and resumes by itself after a disconnect, from the
      revision after the last one delivered. After a compaction it yields one ``resync`` batch and carries
      on from the current revision: the caller must re-read what it caches.
    * ``check_server_version`` asks every endpoint for its version (Maintenance Status) and logs a
      WARNING for versions with known crash bugs. It never raises.
    Every etcd call has a deadline (``timeout``).
    """

    def __init__(self, endpoints: Sequence[str], timeout: float = 5.0, retry_for: float = 10.0) -> None:
        if not endpoints:
            raise ValueError("etcd endpoints: at least one is needed")
        self.endpoints = list(endpoints)
        self.timeout = timeout
        self.retry_for = retry_for
        self._client = _Client(endpoints, timeout=int(max(1, timeout)))
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

    def _retrying(self, *also: type[Exception]) -> AsyncRetrying:
        return AsyncRetrying(
            retry=retry_if_exception_type((errors.Unavailable, errors.Timeout, *also)),
            wait=wait_random_exponential(multiplier=0.05, max=1.0),
            stop=stop_after_delay(self.retry_for),
            reraise=True,
        )

    # -- reads ---------------------------------------------------------------------------------
    async def snapshot(self, ranges: Iterable[Any], serializable: bool = False) -> Snapshot:
        """Read several ranges (``range_req``) at one revision.

        ``serializable`` reads are served by the member the call lands on, without a round of consensus:
        they may be slightly stale. Use them only where a later compare-and-set validates the decision.
        """
        reqs = list(ranges)
        if not reqs:
            raise ValueError("snapshot: at least one range is needed")
        for r in reqs:
            if r.sort_order or r.sort_target or r.revision:
                raise ValueError("snapshot: ranges are read in key order at the snapshot's own revision")
        snap = Snapshot(0, ())
        async for attempt in self._retrying(errors.Compacted):
            with attempt:
                snap = await self._snapshot_once(reqs, serializable)
        return snap

    async def _snapshot_once(self, reqs: list[Any], serializable: bool) -> Snapshot:
        first, revision = await self._read_range(reqs[0], 0, serializable)
        rest = await _gather(self._read_range(r, revision, True) for r in reqs[1:])
        return Snapshot(revision, (first, *(kvs for kvs, _ in rest)))

    async def _read_range(self, req: Any, revision: int, serializable: bool) -> tuple[tuple[KV, ...], int]:
        """One range, page by page, at ``revision`` (0: now, linearizable unless ``serializable``).
        Returns its keys and the revision they were read at.

        Pages after the first are read at the revision the first one fixed. They may be served by any member
        that has applied it (data at a past revision never changes), so they are serializable; a member that
        has not applied it yet answers "future revision", and the page is read again linearizably.
        """
        paged = bool(req.range_end) and not req.count_only
        wanted = req.limit
        page = PAGE_KEYS
        key = req.key
        out: list[KV] = []
        while True:
            r = rpc.RangeRequest()
            r.CopyFrom(req)
            r.key, r.revision, r.serializable = key, revision, serializable
            if paged:
                r.limit = min(page, wanted - len(out)) if wanted else page
            try:
                resp = await self._kv.Range(r, timeout=self.timeout, wait_for_ready=True)
            except grpc.aio.AioRpcError as e:
                if paged and page > 1 and _response_too_large(e):
                    page //= 2
                    continue
                if serializable and revision and _future_revision(e):
                    serializable = False
                    continue
                raise _translate(e, write=False) from e
            if not revision:
                revision, serializable = resp.header.revision, True
            out.extend(KV.from_pb(kv) for kv in resp.kvs)
            if not (paged and resp.more and resp.kvs) or (wanted and len(out) >= wanted):
                return tuple(out), revision
            key = resp.kvs[-1].key + b"\0"

    async def get(self, key: bytes) -> KV | None:
        snap = await self.snapshot([range_req(key)])
        return snap.ranges[0][0] if snap.ranges[0] else None

    async def get_prefix(self, prefix: bytes) -> Snapshot:
        """Every key under ``prefix`` at one revision, read in pages (any number, any size)."""
        return await self.snapshot([range_req(prefix, prefix=True)])

    # -- writes --------------------------------------------------------------------------------
    async def commit(self, compares: Sequence[Any], success: Sequence[Any], failure: Sequence[Any] = ()) -> TxnResult:
        if not (_has_write(success) or _has_write(failure)):
            raise ValueError("commit: a transaction without a put or delete would be read-only (it can crash "
                             "etcd 3.5.0-3.5.6 when its deadline cancels it); read with snapshot() instead")
        req = rpc.TxnRequest(compare=list(compares), success=list(success), failure=list(failure))
        try:
            resp = await self._kv.Txn(req, timeout=self.timeout, wait_for_ready=True)
        except grpc.aio.AioRpcError as e:
            raise _translate(e, write=True) from e
        return TxnResult(resp.succeeded, resp.header.revision, tuple(resp.responses))

    async def compact(self, revision: int) -> None:
        """Compact etcd's history below ``revision`` (an operator's or a test's act; watches resync)."""
        try:
            await self._kv.Compact(rpc.CompactionRequest(revision=revision), timeout=self.timeout,
                                   wait_for_ready=True)
        except grpc.aio.AioRpcError as e:
            raise _translate(e, write=True) from e

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

    # -- the server --------------------------------------------------------------------------
    async def server_versions(self) -> dict[str, str]:
        """Each endpoint's etcd version, from its Maintenance Status ("" where it did not answer)."""
        async def one(endpoint: str) -> str:
            channel = _open_channel(_target([endpoint]))
            try:
                resp = await rpc.MaintenanceStub(channel).Status(rpc.StatusRequest(), timeout=min(self.timeout, 5.0))
                return str(resp.version)
            except grpc.aio.AioRpcError as e:
                log.info("etcd %s did not say its version: %s", endpoint, e.code().name)
                return ""
            finally:
                await channel.close()
        return dict(zip(self.endpoints, await _gather(one(ep) for ep in self.endpoints)))

    async def check_server_version(self) -> dict[str, str]:
        """Log every member's version, with a WARNING for versions with known crash bugs. Never raises."""
        try:
            versions = await self.server_versions()
        except Exception as e:  # noqa: BLE001 - a check at start must not stop the start
            log.warning("could not read the etcd server version: %r", e)
            return {}
        for endpoint, text in versions.items():
            version = parse_etcd_version(text) if text else None
            if version is None:
                continue
            bugs = crash_bugs(version)
            if bugs:
                log.warning("etcd %s runs %s, which has known crash bugs: %s. Run etcd %s or newer in "
                            "production.", endpoint, format_version(version), "; ".join(bugs), MINIMUM_PRODUCTION)
            else:
                log.info("etcd %s runs %s", endpoint, format_version(version))
        return versions

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
