"""The etcd boundary: the only module that talks to etcd, and the only one that translates its errors.

The contract of each operation lives here, on the ``Store`` methods (as Patroni's ``AbstractDCS`` does):
whether it is one transaction, whether it may be retried, and which ``coordinator.errors`` it raises.
It is built on ``aetcd`` (asyncio, native gRPC): its generated etcd stubs are used directly, on one channel
that ``default_channel`` builds (round robin over the members, a reconnect backoff capped at about a
second), or the factory given to ``Store(channel=)``.

It never sends a read-only transaction. etcd 3.5.0-3.5.6 crash when one is cancelled by its client deadline
(etcd-io/etcd#14110, #14891), so a read of several ranges at one revision is a linearizable Range that fixes
the revision, then Ranges at that revision; ``commit`` refuses a transaction without a write. Prefix reads
are paginated, so no response comes near gRPC's 4 MiB message limit whatever the size of the state.
"""
from __future__ import annotations

import asyncio
import logging
from typing import AsyncIterator, Iterable, Sequence, TypeVar

import aetcd
import grpc
from aetcd import rpc
from tenacity import (
    AsyncRetrying,
    retry_if_exception,
    retry_if_exception_type,
    stop_after_delay,
    stop_before_delay,
    wait_random_exponential,
)

from coordinator import errors
from coordinator.etcd import _compile
from coordinator.etcd.auth import CHANNEL_OPTIONS, ChannelFactory, default_channel
from coordinator.etcd.keepalive import KeepAliveStream
from coordinator.etcd.server_info import ServerInfo, endpoint_target, gather_or_cancel
from coordinator.etcd.translate import (
    future_revision,
    read_may_be_retried,
    response_too_large,
    translate,
)
from coordinator.etcd.types import (
    KV,
    PrefixRead,
    Snapshot,
    TxnResult,
    WatchBatch,
    WatchEvent,
)
from coordinator.etcd.watch import watch_batches
from coordinator.security.etcd_auth import EtcdSecurity
from coordinator.txn import Compare, Delete, Op, Put, Range, has_write

# Re-exported for callers written against the store module alone.
__all__ = ["CHANNEL_OPTIONS", "KV", "PAGE_KEYS", "ChannelFactory", "PrefixRead", "Snapshot", "Store", "TxnResult", "WatchBatch", "WatchEvent",
           "default_channel"]

log = logging.getLogger(__name__)
T = TypeVar("T")

# Keys in the first page of a range read: about 0.5 MiB with gpucoord's values. Each full page doubles the next,
# up to PAGE_KEYS_MAX: etcd (3.4, 3.5) counts every key left in the range for each page, so a replica's first
# read of 200,000 keys in pages of 1,024 cost etcd seconds of counting. A page that exceeds gRPC's 4 MiB limit
# (large values, or the largest pages) is read again at half the size, and pages grow no more past that size.
PAGE_KEYS = 1024
PAGE_KEYS_MAX = 8192
KEYS_AT_ONCE = 128   # single-key Ranges of ``get_many`` in flight together


def _call_timeout(own: float, deadline: float | None) -> float:
    """``own``, or what is left until ``deadline`` (a ``loop.time()`` instant) if that is less. A call with
    no time left is not made: ``errors.Timeout``."""
    if deadline is None:
        return own
    left = deadline - asyncio.get_running_loop().time()
    if left <= 0.001:
        raise errors.Timeout("etcd: the time for this work is spent (etcd did not answer in time)")
    return min(own, left)


class _Client(aetcd.Client):  # type: ignore[misc]
    """aetcd's client, on a channel from the store's channel factory to a list of endpoints rather than one
    host:port."""

    def __init__(self, endpoints: Sequence[str], timeout: float, channel: ChannelFactory) -> None:
        super().__init__(host="unused", port=0, timeout=timeout)
        self._gpucoord_target = endpoint_target(endpoints)
        self._gpucoord_channel = channel

    async def connect(self) -> None:
        if self._connected.is_set():
            return
        self.channel = self._gpucoord_channel(self._gpucoord_target)
        self.kvstub = rpc.KVStub(self.channel)
        self.clusterstub = rpc.ClusterStub(self.channel)
        self.leasestub = rpc.LeaseStub(self.channel)
        self.maintenancestub = rpc.MaintenanceStub(self.channel)
        self._connected.set()


class Store(ServerInfo):
    """etcd as gpucoord uses it: the implementation of ``coordinator.etcd.contract.KVStore``."""

    def __init__(self, endpoints: Sequence[str], timeout: float = 5.0, retry_for: float = 10.0,
                 security: EtcdSecurity | None = None, channel: ChannelFactory | None = None) -> None:
        """``channel`` builds the channel to etcd (default: ``default_channel(security)``); a test passes one
        that records or intercepts every call, etcd staying real."""
        if not endpoints:
            raise ValueError("etcd endpoints: at least one is needed")
        self.endpoints = list(endpoints)
        self.timeout = timeout
        self.retry_for = retry_for
        # A read is one call bounded by ``timeout`` in all (or ``retry_for``, if longer), made of attempts
        # of half of it when it may be retried: an attempt that met a hung member (SIGSTOP, a stalled VM:
        # its connection stays open and round robin still picks it) is tried again on the next member in
        # time, and without a quorum the read ends when ``timeout`` does, not a retry later.
        self._read_budget = max(timeout, retry_for)
        self._read_attempt = timeout / 2 if retry_for >= timeout else timeout
        self._channel = channel or default_channel(security or EtcdSecurity())
        self._client = _Client(endpoints, timeout=int(max(1, timeout)), channel=self._channel)
        self._keepalive: KeepAliveStream | None = None
        self.closed = False
        self._answered_at = 0.0

    async def connect(self) -> None:
        await self._client.connect()
        self._keepalive = KeepAliveStream(lambda: self._client.leasestub, self.timeout)

    async def close(self) -> None:
        self.closed = True
        if self._keepalive is not None:
            await self._keepalive.close()
        await self._client.close()

    async def __aenter__(self) -> Store:
        await self.connect()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    @property
    def _kv(self) -> rpc.KVStub:
        return self._client.kvstub

    def _answered(self) -> None:
        self._answered_at = asyncio.get_running_loop().time()

    def answered_at(self) -> float:
        """``loop.time()`` of etcd's last answer to this store (a read, a write, a lease call, a keepalive, a
        watch response): a caller whose own call is late tells from it whether etcd answers at all."""
        keepalive = self._keepalive.last_response if self._keepalive is not None else 0.0
        return max(self._answered_at, keepalive)

    def _retrying(self, *kinds: type[Exception]) -> AsyncRetrying:
        return AsyncRetrying(
            retry=retry_if_exception_type(kinds),
            wait=wait_random_exponential(multiplier=0.05, max=1.0),
            stop=stop_after_delay(self.retry_for),
            reraise=True,
        )

    async def _range(self, req: rpc.RangeRequest, deadline: float | None) -> rpc.RangeResponse:
        """One Range call: attempts of ``_read_attempt``, each on the next member (round robin), retried
        while etcd is unavailable or slow, all within ``_read_budget``. Raises the last gRPC error."""
        loop = asyncio.get_running_loop()
        budget = _call_timeout(self._read_budget, deadline)
        until = loop.time() + budget
        resp: rpc.RangeResponse = None
        async for attempt in AsyncRetrying(retry=retry_if_exception(read_may_be_retried),
                                           wait=wait_random_exponential(multiplier=0.02, max=0.5),
                                           stop=stop_before_delay(budget - 0.01), reraise=True):
            with attempt:
                resp = await self._kv.Range(req, timeout=max(0.001, min(self._read_attempt, until - loop.time())),
                                            wait_for_ready=True)
                self._answered()
        return resp

    # -- reads ---------------------------------------------------------------------------------
    async def snapshot(self, ranges: Iterable[Range], serializable: bool = False,
                       deadline: float | None = None) -> Snapshot:
        """Read several ranges at one revision, in the order given.

        ``serializable`` reads are served by the member the call lands on, without a round of consensus:
        they may be slightly stale. Use them only where a later compare-and-set validates the decision.
        """
        reqs = [_compile.range_request(r) for r in ranges]
        if not reqs:
            raise ValueError("snapshot: at least one range is needed")
        snap = Snapshot(0, ())
        async for attempt in self._retrying(errors.Compacted):   # each Range retries by itself
            with attempt:
                snap = await self._snapshot_once(reqs, serializable, deadline)
        return snap

    async def _snapshot_once(self, reqs: list[rpc.RangeRequest], serializable: bool, deadline: float | None) -> Snapshot:
        first, revision = await self._read_range(reqs[0], 0, serializable, deadline)
        rest = await gather_or_cancel(self._read_range(r, revision, True, deadline) for r in reqs[1:])
        return Snapshot(revision, (first, *(kvs for kvs, _ in rest)))

    async def read_at(self, rng: Range, revision: int) -> tuple[KV, ...]:
        """One range as it was at ``revision`` (a past one: history, as tests check it). Raises Compacted
        once etcd has compacted it away, Unavailable, Timeout."""
        kvs, _ = await self._read_range(_compile.range_request(rng), revision, False)
        return kvs

    async def _read_range(self, req: rpc.RangeRequest, revision: int, serializable: bool,
                          deadline: float | None = None) -> tuple[tuple[KV, ...], int]:
        """One range, page by page, at ``revision`` (0: now, linearizable unless ``serializable``).
        Returns its keys and the revision they were read at.

        Pages after the first are read at the revision the first one fixed. They may be served by any member
        that has applied it (data at a past revision never changes), so they are serializable; a member that
        has not applied it yet answers "future revision", and the page is read again linearizably.
        """
        paged = bool(req.range_end) and not req.count_only
        wanted = req.limit
        page, most = PAGE_KEYS, PAGE_KEYS_MAX
        key = req.key
        out: list[KV] = []
        while True:
            r = rpc.RangeRequest()
            r.CopyFrom(req)
            r.key, r.revision, r.serializable = key, revision, serializable
            if paged:
                r.limit = min(page, wanted - len(out)) if wanted else page
            try:
                resp = await self._range(r, deadline)
            except grpc.aio.AioRpcError as e:
                if paged and page > 1 and response_too_large(e):
                    page = most = page // 2
                    continue
                if serializable and revision and future_revision(e):
                    serializable = False
                    continue
                raise translate(e, write=False) from e
            if not revision:
                revision, serializable = resp.header.revision, True
            out.extend(_compile.kv(kv) for kv in resp.kvs)
            if not (paged and resp.more and resp.kvs) or (wanted and len(out) >= wanted):
                return tuple(out), revision
            key = resp.kvs[-1].key + b"\0"
            page = min(page * 2, most)

    async def get(self, key: bytes) -> KV | None:
        snap = await self.snapshot([Range(key)])
        return snap.ranges[0][0] if snap.ranges[0] else None

    async def get_many(self, keys: Sequence[bytes], *, keys_only: bool = False) -> dict[bytes, KV | None]:
        """Each of ``keys`` now (linearizable), None for one not found: ``KEYS_AT_ONCE`` at a time, each group at
        one revision (not the whole)."""
        read: dict[bytes, KV | None] = {}
        for at in range(0, len(keys), KEYS_AT_ONCE):
            chunk = keys[at:at + KEYS_AT_ONCE]
            snap = await self.snapshot([Range(key, keys_only=keys_only) for key in chunk])
            read.update((key, kvs[0] if kvs else None) for key, kvs in zip(chunk, snap.ranges))
        return read

    async def get_prefix(self, prefix: bytes, *, keys_only: bool = False) -> PrefixRead:
        """Every key under ``prefix`` at one revision, read in pages (any number, any size)."""
        snap = await self.snapshot([Range(prefix, prefix=True, keys_only=keys_only)])
        return PrefixRead(snap.revision, snap.ranges[0])

    # -- writes --------------------------------------------------------------------------------
    async def commit(self, compares: Sequence[Compare], success: Sequence[Op], failure: Sequence[Op] = (),
                     deadline: float | None = None) -> TxnResult:
        if not (has_write(success) or has_write(failure)):
            raise ValueError("commit: a transaction without a put or delete would be read-only (it can crash "
                             "etcd 3.5.0-3.5.6 when its deadline cancels it); read with snapshot() instead")
        req = _compile.txn_request(compares, success, failure)
        try:
            resp = await self._kv.Txn(req, timeout=_call_timeout(self.timeout, deadline), wait_for_ready=True)
        except grpc.aio.AioRpcError as e:
            raise translate(e, write=True) from e
        self._answered()
        return TxnResult(resp.succeeded, resp.header.revision, tuple(_compile.result(r) for r in resp.responses))

    async def compact(self, revision: int) -> None:
        """Compact etcd's history below ``revision`` (an operator's or a test's act; watches resync)."""
        try:
            await self._kv.Compact(rpc.CompactionRequest(revision=revision), timeout=self.timeout,
                                   wait_for_ready=True)
        except grpc.aio.AioRpcError as e:
            raise translate(e, write=True) from e

    async def put(self, key: bytes, value: bytes, etcd_lease: int = 0) -> int:
        return (await self.commit([], [Put(key, value, etcd_lease)])).revision

    async def delete(self, key: bytes, prefix: bool = False) -> int:
        return (await self.commit([], [Delete(key, prefix)])).revision

    # -- etcd_leases ---------------------------------------------------------------------------
    async def grant(self, ttl: int) -> int:
        try:
            resp = await self._client.leasestub.LeaseGrant(rpc.LeaseGrantRequest(TTL=ttl),
                                                           timeout=self.timeout,
                                                           wait_for_ready=True)
        except grpc.aio.AioRpcError as e:
            raise translate(e, write=True) from e
        self._answered()
        return int(resp.ID)

    async def revoke(self, etcd_lease: int) -> None:
        """Revoke an etcd_lease, deleting every key on it. Revoking one that is gone is not an error."""
        try:
            await self._client.leasestub.LeaseRevoke(rpc.LeaseRevokeRequest(ID=etcd_lease),
                                                     timeout=self.timeout,
                                                     wait_for_ready=True)
        except grpc.aio.AioRpcError as e:
            err = translate(e, write=True)
            if not isinstance(err, errors.SessionGone):
                raise err from e

    async def time_to_live(self, etcd_lease: int) -> int:
        """Remaining TTL in seconds, -1 when the etcd_lease is gone."""
        try:
            resp = await self._client.leasestub.LeaseTimeToLive(
                rpc.LeaseTimeToLiveRequest(ID=etcd_lease), timeout=self.timeout, wait_for_ready=True)
        except grpc.aio.AioRpcError as e:
            raise translate(e, write=False) from e
        return int(resp.TTL)

    async def keepalive(self, etcd_lease: int, timeout: float | None = None) -> int:
        """Refresh an etcd_lease over the process's shared LeaseKeepAlive stream; 0 when it is gone."""
        assert self._keepalive is not None, "Store.connect() first"
        return await self._keepalive.refresh(etcd_lease, timeout)

    # -- watches -------------------------------------------------------------------------------
    def watch(self, key: bytes, *, prefix: bool = True, start_revision: int = 0,
              prev_kv: bool = False, deletes_only: bool = False) -> AsyncIterator[WatchBatch]:
        """Watch ``key`` (a prefix by default) from ``start_revision`` (0: from now); see ``etcd.watch``."""
        return watch_batches(lambda: self._client.channel, self._answered, lambda: self.closed, key,
                             prefix=prefix, start_revision=start_revision, prev_kv=prev_kv,
                             deletes_only=deletes_only)
