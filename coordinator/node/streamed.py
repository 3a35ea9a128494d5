"""A node daemon's copy of the keys its coordinator streams to it (``Registry.Register``): the host's leases
and the revoked certificates, each a snapshot at an etcd revision and then its changes.

It serves them as ``coordinator.etcd.contract.KeyFeed`` (``get_prefix``, ``watch``), so that the daemon's
watch of its leases and its server's deny list read it exactly as they read etcd in the etcd-direct mode.
A new snapshot (the node reconnected, or the coordinator lost history) ends every watch with a resync:
its reader reads the prefix again. Plain data and asyncio, no I/O.
"""
from __future__ import annotations

import asyncio
import collections
import dataclasses
from typing import AsyncIterator

from agent_client.api import registry_pb2 as pb
from coordinator.etcd.types import KV, PrefixRead, WatchBatch, WatchEvent
from coordinator.keys import Keys

MAX_LOGGED = 4096   # change batches kept for a watcher that starts behind (older ones: it resyncs)


def stored_kv(keys: Keys, key: pb.StoredKey) -> KV:
    return KV(key=keys.absolute(key.key), value=key.value, create_revision=key.create_revision,
              mod_revision=key.mod_revision, version=key.version, etcd_lease=key.etcd_lease)


@dataclasses.dataclass
class _Copy:
    """One streamed prefix."""

    kvs: dict[bytes, KV] = dataclasses.field(default_factory=dict)
    revision: int = 0
    floor: int = 0          # batches up to this revision are not in ``log``
    log: collections.deque[WatchBatch] = dataclasses.field(default_factory=collections.deque)
    ready: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)
    watchers: set[asyncio.Queue[WatchBatch]] = dataclasses.field(default_factory=set)
    building: list[KV] | None = None   # a snapshot that is still arriving


class StreamedKeys:
    def __init__(self, keys: Keys, prefixes: tuple[bytes, ...]) -> None:
        self.keys = keys
        self._copies = {p: _Copy() for p in prefixes}

    def _copy_of(self, key: bytes) -> _Copy:
        for prefix, copy in self._copies.items():
            if key.startswith(prefix):
                return copy
        raise ValueError(f"{key!r} is not under a streamed prefix")

    # -- what the coordinator sends --------------------------------------------------------------
    def apply_snapshot(self, msg: pb.KeySnapshot) -> None:
        copy = self._copy_of(self.keys.absolute(msg.prefix))
        if copy.building is None:
            copy.building = []
        copy.building.extend(stored_kv(self.keys, k) for k in msg.kvs)
        if msg.more:
            return
        copy.kvs = {kv.key: kv for kv in copy.building}
        copy.building = None
        copy.revision = copy.floor = msg.revision
        copy.log.clear()
        resync = WatchBatch(msg.revision, (), resync=True)
        for q in copy.watchers:
            q.put_nowait(resync)
        copy.ready.set()

    def apply_changes(self, msg: pb.KeyChanges) -> None:
        copy = self._copy_of(self.keys.absolute(msg.prefix))
        if not copy.ready.is_set() or msg.revision <= copy.revision:
            return   # before the first snapshot, or already in it
        events = []
        for change in msg.changes:
            kv = stored_kv(self.keys, change.kv)
            if change.deleted:
                copy.kvs.pop(kv.key, None)
                events.append(WatchEvent("DELETE", kv, None))
            else:
                copy.kvs[kv.key] = kv
                events.append(WatchEvent("PUT", kv, None))
        batch = WatchBatch(msg.revision, tuple(events))
        copy.revision = msg.revision
        copy.log.append(batch)
        while len(copy.log) > MAX_LOGGED:
            copy.floor = copy.log.popleft().revision
        for q in copy.watchers:
            q.put_nowait(batch)

    # -- KeyFeed ------------------------------------------------------------------------------
    async def get_prefix(self, prefix: bytes) -> PrefixRead:
        copy = self._copy_of(prefix)
        await copy.ready.wait()
        return PrefixRead(copy.revision, tuple(kv for key, kv in sorted(copy.kvs.items()) if key.startswith(prefix)))

    async def watch(self, key: bytes, *, prefix: bool = True, start_revision: int = 0,
                    prev_kv: bool = False) -> AsyncIterator[WatchBatch]:
        copy = self._copy_of(key)
        await copy.ready.wait()
        q: asyncio.Queue[WatchBatch] = asyncio.Queue()
        copy.watchers.add(q)
        try:
            if start_revision and start_revision - 1 < copy.floor:
                yield WatchBatch(copy.revision, (), resync=True)   # what it missed is no longer known
                return
            for batch in list(copy.log):
                if batch.revision >= start_revision:
                    q.put_nowait(batch)
            while True:
                batch = await q.get()
                if batch.resync:
                    yield batch
                    return
                events = tuple(e for e in batch.events if e.kv.key.startswith(key) and (prefix or e.kv.key == key))
                if events and batch.revision >= start_revision:
                    yield WatchBatch(batch.revision, events)
        finally:
            copy.watchers.discard(q)
