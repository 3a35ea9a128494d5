"""A host as one consistent snapshot shows it: the input of every admission decision. Plain data, no I/O."""
from __future__ import annotations

import dataclasses
from typing import Any

from coordinator.host_records import CordonRecord
from coordinator.keys import Keys
from coordinator.policy.admission import GpuView
from coordinator.policy.partition import Partition, default_partition
from coordinator.records import (
    DepartingRecord,
    HostInventory,
    QueueEntry,
    StoredKV,
    VramLease,
)
from coordinator.txn import Compare, Exists, ModRevisionIs, NothingWrittenSince


@dataclasses.dataclass
class HostView:
    """A host as one snapshot shows it."""

    host: str
    revision: int
    inventory: HostInventory | None
    host_kv: StoredKV | None
    partition: Partition | None
    partition_kv: StoredKV | None
    gpus: dict[str, GpuView]
    leases: dict[str, VramLease]
    usage: dict[str, Any] | None
    queue: tuple[StoredKV, ...]
    entries: tuple[QueueEntry, ...] = ()   # the queue, parsed, in rank order
    usage_age_s: float = -1.0     # since the replica saw the current usage report; -1: no report
    usage_stale: bool = False     # then admission keeps the last reported untracked VRAM (never less)
    # Leases bound to processes that ended under an eviction notice while the node still reported their
    # processes (``departing/<host>/``): those still reported count as held on their GPU (GpuView.departing).
    departing: tuple[DepartingRecord, ...] = ()
    # Why a stored value of the host is malformed ("" when none is): the view leaves it out, so it cannot be
    # trusted for admission, which fails closed on this host (status shows the host as INVALID).
    invalid: str = ""
    invalid_kinds: frozenset[str] = frozenset()   # the key kinds of the malformed values (``usage``, ...)
    # ``cordons/<host>``: while it exists the host gets no new grant (every grant compares it: ``Round._guards``).
    cordon: CordonRecord | None = None
    cordon_kv: StoredKV | None = None

    @property
    def departing_held(self) -> frozenset[str]:
        """Ids of the ended leases whose VRAM still counts as held (their processes are still reported)."""
        return frozenset(d.lease_id for g in self.gpus.values() for d in g.departing)

    @property
    def alive(self) -> bool:
        return self.host_kv is not None

    def effective_partition(self) -> Partition:
        if self.partition is not None:
            return self.partition
        assert self.inventory is not None
        return default_partition(self.inventory)


def host_guards(keys: Keys, view: HostView, host_must_live: bool = True) -> list[Compare]:
    """What a transaction that admits or queues on ``view``'s host compares: nothing admitted or queued there since
    the snapshot and none of the records it read rewritten (``Round._guards``; a multi-host gang's grant compares
    this for each of its hosts)."""
    host = view.host
    out: list[Compare] = []
    if host_must_live:
        out.append(ModRevisionIs(keys.host(host), view.host_kv.mod_revision) if view.host_kv is not None
                   else Exists(keys.host(host)))
        out.append(NothingWrittenSince(keys.leases(host), view.revision))
        out.append(NothingWrittenSince(keys.departings(host), view.revision))
    out.append(ModRevisionIs(keys.partition(host), view.partition_kv.mod_revision if view.partition_kv else 0))
    # Not cordoned since the snapshot (issue 31): a cordon racing this round fails it, and it is decided again.
    out.append(ModRevisionIs(keys.cordon(host), view.cordon_kv.mod_revision if view.cordon_kv else 0))
    out += [ModRevisionIs(keys.gpu(host, u), g.ledger.mod_revision) for u, g in sorted(view.gpus.items())]
    # The queue condition: no entry was created or rewritten since the snapshot (G2 across replicas).
    out.append(NothingWrittenSince(keys.queue(host), view.revision))
    return out
