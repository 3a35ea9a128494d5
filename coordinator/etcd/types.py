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

    @classmethod
    def from_pb(cls, kv: Any) -> KV:
        return cls(kv.key, kv.value, kv.create_revision, kv.mod_revision, kv.version, kv.lease)

    def json(self) -> Any:
        return loads(self.value)


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
