"""What the store hands out: keys with their etcd metadata, snapshots, transaction results, watch events."""
from __future__ import annotations

import dataclasses
from typing import Any

from coordinator.records import loads


@dataclasses.dataclass(frozen=True)
class KV:
    """One etcd key with its metadata. Every update is a compare-and-set on ``mod_revision``."""

    key: bytes
    value: bytes
    create_revision: int
    mod_revision: int
    version: int
    etcd_lease: int

    def json(self) -> Any:
        return loads(self.value)


@dataclasses.dataclass(frozen=True)
class Snapshot:
    """Several ranges read at one etcd ``revision`` (the state just after that revision)."""

    revision: int
    ranges: tuple[tuple[KV, ...], ...]


@dataclasses.dataclass(frozen=True)
class PrefixRead:
    """Every key under a prefix, read at one etcd ``revision`` (the read's own revision, not the highest
    ``mod_revision`` among the keys: a watch resumes at ``revision + 1``)."""

    revision: int
    kvs: tuple[KV, ...]


@dataclasses.dataclass(frozen=True)
class PutResult:
    """What a ``Put`` of a transaction answers (nothing gpucoord reads)."""


@dataclasses.dataclass(frozen=True)
class DeleteResult:
    """What a ``Delete`` answers: how many keys went, and which (when it asked for ``prev_kv``)."""

    deleted: int
    prev: tuple[KV, ...] = ()


@dataclasses.dataclass(frozen=True)
class GetResult:
    """What a ``Get`` answers: the key, or nothing when it is absent."""

    kvs: tuple[KV, ...]


@dataclasses.dataclass(frozen=True)
class NestedResult:
    """What a nested ``Txn`` answers: which branch ran, and what its operations answered, in order."""

    succeeded: bool
    responses: tuple[OpResult, ...]


OpResult = PutResult | DeleteResult | GetResult | NestedResult


@dataclasses.dataclass(frozen=True)
class TxnResult:
    """A committed transaction: which branch ran, at which revision, and what each of its operations
    answered, in the order they were given."""

    succeeded: bool
    revision: int
    responses: tuple[OpResult, ...]


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


@dataclasses.dataclass(frozen=True)
class EtcdMember:
    """One member of the etcd cluster as its member list says, and whether it is the raft leader."""

    name: str
    id: int
    client_urls: tuple[str, ...]
    leader: bool
