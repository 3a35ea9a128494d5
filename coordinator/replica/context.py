"""What the parts of a replica share, instead of the whole service: the store, the key schema, the config,
the replica's identity, the watch-fed mirror and the book of eviction notices."""
from __future__ import annotations

import dataclasses
from typing import Callable

from coordinator.config import CoordinatorConfig
from coordinator.etcd.shared_commits import SharedCommits
from coordinator.etcd.store import Store
from coordinator.etcd.types import KV
from coordinator.keys import Keys
from coordinator.policy.idle import UtilizationHistory
from coordinator.records import EvictionRecord
from coordinator.replica.idle_judged import IdleJudgments
from coordinator.replica.mirror import Mirror
from coordinator.replica.observed import Observed
from coordinator.replica.reach import EtcdReach


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
    # When this replica first saw each usage report, eviction notice and queue entry (the watch feeds it):
    # ages and deadlines are measured on our own monotonic clock from then, never against another
    # machine's wall clock.
    observed: Observed = dataclasses.field(default_factory=Observed)
    # Each GPU's reported utilization over time, sampled by replica/idle.py (docs/policies.md "Idle GPUs").
    utilization: UtilizationHistory = dataclasses.field(default_factory=UtilizationHistory)
    # Every lease's idle judgment, as far as it is kept between passes (replica/idle_judged.py).
    idle_judgments: IdleJudgments = dataclasses.field(default_factory=IdleJudgments)
    # Each team's fair-share factor over time (replica/fair_share.py), as last computed: admission's reclaim order.
    fair_share: dict[str, float] = dataclasses.field(default_factory=dict)
    # The fleet's GPU VRAM beyond the teams' quotas, as last computed with the factors (None: not yet).
    borrowable_mb: int | None = None
    # Whether this replica can reach etcd (its candidacy's keepalives tell; replica/reach.py).
    reach: EtcdReach = dataclasses.field(default_factory=lambda: EtcdReach(""))
    # The replica's admission rounds and releases commit through it: those of different hosts share etcd
    # transactions (docs/etcd.md "Shared commits").
    commits: SharedCommits = dataclasses.field(init=False)
    # The hosts whose admitter has a waiter held back by its team's limit alone at its last round (G11): a lease's
    # end on any host wakes them (``Follower._on_events``), without a look at each of a fleet's admitters.
    team_waiting: set[str] = dataclasses.field(default_factory=set)
    # The seconds a session this replica keeps alive has left (replica/liveness.py); None for another's.
    session_left: Callable[[str], float | None] = lambda _session_id: None

    def __post_init__(self) -> None:
        self.reach.replica_id = self.replica_id
        self.commits = SharedCommits(self.store, self.config.etcd_max_txn_ops, self.config.shared_commit_max)

    def usage_age(self, kv: KV) -> float:
        """Seconds since this replica saw this usage report (``usage/<host>`` at this mod_revision)."""
        return self.observed.age(kv.key, kv.mod_revision)

    def notice_deadline(self, kv: KV, record: EvictionRecord) -> float:
        """The monotonic time at which an eviction notice's grace ends, as this replica measures it: the
        grace (two wall times written by the same process) from when we first saw the notice."""
        grace = max(0.0, record.deadline_unix - record.created_at)
        return self.observed.saw(kv.key, kv.create_revision) + grace
