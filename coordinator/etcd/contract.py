"""The storage contract: what every operation of the store promises (as Patroni's ``AbstractDCS`` does).

``coordinator.etcd.store.Store`` implements it on etcd; the tests in ``tests/etcd/`` check it against a real
etcd. Each method says whether it is one transaction, whether it may be retried, and what it raises (from
``coordinator.errors``).
"""
from __future__ import annotations

from typing import AsyncIterator, Iterable, Protocol, Sequence

from coordinator.etcd.types import KV, PrefixRead, Snapshot, TxnResult, WatchBatch
from coordinator.txn import Compare, Op, Range


class KVStore(Protocol):
    """etcd as gpucoord uses it: the contract.

    * ``snapshot`` reads several ranges at ONE revision, never as a transaction: a linearizable Range fixes
      the revision R, the other ranges (and further pages) are Ranges at R, read concurrently. A prefix is
      read in pages (``PAGE_KEYS``, doubled after each full page up to ``PAGE_KEYS_MAX``, halved while a page
      exceeds gRPC's message limit), all at R, so a read
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

    async def snapshot(self, ranges: Iterable[Range], serializable: bool = False,
                       deadline: float | None = None) -> Snapshot:
        """Several ranges at one revision. May be retried, until ``deadline`` (a ``loop.time()`` instant) if
        given. Raises Unavailable, Timeout."""
        ...

    async def get(self, key: bytes) -> KV | None:
        """One key, linearizable. Raises Unavailable, Timeout."""
        ...

    async def get_many(self, keys: Sequence[bytes], *, keys_only: bool = False) -> dict[bytes, KV | None]:
        """Each of ``keys`` (None for one not found), linearizable, in groups each at one revision. Raises
        Unavailable, Timeout."""
        ...

    async def get_prefix(self, prefix: bytes, *, keys_only: bool = False) -> PrefixRead:
        """Every key under ``prefix``, paged, at one revision (the read's). Raises Unavailable, Timeout."""
        ...

    async def commit(self, compares: Sequence[Compare], success: Sequence[Op],
                     failure: Sequence[Op] = (), deadline: float | None = None) -> TxnResult:
        """ONE write transaction; never retried; not sent (Timeout) once ``deadline`` (a ``loop.time()``
        instant) has passed. Raises OutcomeUnknown, SessionGone, EtcdNoSpace, Unavailable, Timeout."""
        ...

    async def grant(self, ttl: int) -> int:
        """A new etcd_lease of ``ttl`` seconds. Raises Unavailable, OutcomeUnknown."""
        ...

    async def revoke(self, etcd_lease: int) -> None:
        """Revoke an etcd_lease and every key on it; one that is gone is not an error."""
        ...

    async def keepalive(self, etcd_lease: int, timeout: float | None = None) -> int:
        """Refresh over the shared stream: the remaining TTL, 0 when the etcd_lease is gone. Raises Timeout
        after ``timeout`` (default: the store's)."""
        ...

    def watch(self, key: bytes, *, prefix: bool = True, start_revision: int = 0,
              prev_kv: bool = False) -> AsyncIterator[WatchBatch]:
        """Batches from ``start_revision``, resumed after disconnects; one ``resync`` batch after a compaction."""
        ...


class KeyFeed(Protocol):
    """What a watcher of one prefix reads: the prefix now, then its changes from a revision (as ``watch``
    above). ``KVStore`` has it; so does a node daemon's copy of what its coordinator streams to it
    (``coordinator.node.remote``), whose revisions are etcd's."""

    async def get_prefix(self, prefix: bytes) -> PrefixRead: ...

    def watch(self, key: bytes, *, prefix: bool = True, start_revision: int = 0,
              prev_kv: bool = False) -> AsyncIterator[WatchBatch]: ...
