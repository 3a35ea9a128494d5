"""What the parts of a replica share, instead of the whole service: the store, the key schema, the config,
the replica's identity, the watch-fed mirror and the book of eviction notices."""
from __future__ import annotations

import dataclasses

from coordinator.config import CoordinatorConfig
from coordinator.etcd.store import Store
from coordinator.keys import Keys
from coordinator.records import EvictionRecord
from coordinator.replica.mirror import Mirror


@dataclasses.dataclass
class ReplicaContext:
    store: Store
    keys: Keys
    config: CoordinatorConfig
    replica_id: str
    advertise: str
    mirror: Mirror
    # Eviction notices, from the replica's watch: lease id -> record. Admission counts their leases as
    # leaving; the leader enforces their deadlines. One dict, updated in place by the watch.
    evictions: dict[str, EvictionRecord] = dataclasses.field(default_factory=dict)
