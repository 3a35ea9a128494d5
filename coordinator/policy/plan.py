"""The planner's vocabulary: what it reads of a call (``Caller``), what it is decided against (``Context``),
and what it answers (``Plan``). Plain data; ``policy/planner.py`` holds the decision itself."""
from __future__ import annotations

import dataclasses
from typing import Collection, Generic, Mapping, Protocol, TypeVar

from coordinator import errors
from coordinator.config import CoordinatorConfig
from coordinator.keys import Keys
from coordinator.policy.team_admission import TeamState
from coordinator.records import EvictionRecord, QueueEntry, SessionInfo, VramLease
from coordinator.txn import Compare, Op


class Caller(Protocol):
    """What the planner reads of a call that a replica serves (``replica.admitter.AcquireCall``)."""

    @property
    def session(self) -> SessionInfo: ...
    @property
    def vram_mb(self) -> int: ...
    @property
    def gpu_ref(self) -> str | None: ...
    @property
    def priority(self) -> int: ...
    @property
    def preemptible(self) -> bool: ...
    @property
    def request_id(self) -> str: ...
    @property
    def lease_id(self) -> str: ...
    @property
    def wait_s(self) -> float: ...
    @property
    def arrival_ns(self) -> int: ...
    @property
    def deadline(self) -> float: ...       # monotonic
    @property
    def rank(self) -> str | None: ...      # its queue entry's rank, once queued
    @property
    def gone(self) -> bool: ...            # answered already, or its caller went away
    @property
    def gpu_count(self) -> int: ...
    @property
    def exclusive(self) -> bool: ...
    @property
    def topology(self) -> str: ...
    @property
    def gpus(self) -> tuple[str, ...]: ...   # the exact GPUs asked for, () for any
    @property
    def min_runtime_s(self) -> float: ...    # teams: before another team may reclaim its lease
    @property
    def time_limit_s(self) -> float: ...     # time limits: its lease's limit (0: none) and warning
    @property
    def time_limit_warning_s(self) -> float: ...


C = TypeVar("C", bound=Caller)


@dataclasses.dataclass
class Wait(Generic[C]):
    """A call that waits in the queue after this round: its entry's rank, and the entry's mod_revision as
    the snapshot showed it (0: this round's transaction writes the entry). ``deadline`` (monotonic), when set,
    is later than the call's own: a retry that joined an entry keeps the entry's deadline, so that it is never
    answered before the deadline its queue entry states."""

    call: C
    rank: str
    revision: int
    deadline: float | None = None


@dataclasses.dataclass
class Plan(Generic[C]):
    """What a round decided: the transaction to commit and what to tell the callers.

    ``refusals`` need no write and are answered at once; everything else (grants, ``failures`` whose entry
    this transaction removes, waits) is told only once the transaction has committed.
    """

    compares: list[Compare] = dataclasses.field(default_factory=list)
    ops: list[Op] = dataclasses.field(default_factory=list)
    grants: list[tuple[C | None, VramLease]] = dataclasses.field(default_factory=list)
    waits: list[Wait[C]] = dataclasses.field(default_factory=list)
    refusals: list[tuple[C, errors.GpucoordError]] = dataclasses.field(default_factory=list)
    failures: list[tuple[C, errors.GpucoordError]] = dataclasses.field(default_factory=list)
    left: list[QueueEntry] = dataclasses.field(default_factory=list)   # entries removed without a grant
    superseded: list[C] = dataclasses.field(default_factory=list)      # replaced by a retry
    new_leases: list[VramLease] = dataclasses.field(default_factory=list)   # a gang: one per GPU
    # Every part of each gang lease the plan answers (granted now or already held), by lease id, in index
    # order; ``grants`` name a gang by its first part.
    gangs: dict[str, tuple[VramLease, ...]] = dataclasses.field(default_factory=dict)
    new_entries: int = 0
    deferred: list[C] = dataclasses.field(default_factory=list)  # past the budget: next round
    more: bool = False          # something was left for the next round (evictions past the budget)
    # Seconds until a lease that reclaim could take comes out of its minimum runtime (teams): decide again then.
    wake_after: float | None = None
    sessions: dict[str, SessionInfo] = dataclasses.field(default_factory=dict)  # of new grants and waits
    evictions: list[EvictionRecord] = dataclasses.field(default_factory=list)
    # Lease ids of queued requests whose victims' leases are gone but whose processes are still reported:
    # held back this round for them (the metric of such waits).
    held_by_processes: list[str] = dataclasses.field(default_factory=list)
    # Lease ids of the requests that wait for their team's limit alone (G11), with why (``limit_refusal``): they
    # hold no GPU back and choose no victims; a wait that ends so is answered naming ``team``.
    team_waits: dict[str, str] = dataclasses.field(default_factory=dict)
    # Lease ids of the requests that wait on a cordoned host (``policy/cordon.py``), with why (naming ``host``).
    cordon_waits: dict[str, str] = dataclasses.field(default_factory=dict)
    withdrawn: list[str] = dataclasses.field(default_factory=list)   # notices this transaction withdraws


@dataclasses.dataclass(frozen=True)
class Context:
    """What a round is decided against, besides the snapshot and the calls."""

    keys: Keys
    config: CoordinatorConfig
    replica_id: str
    evicting: Collection[str]   # lease ids under an eviction notice: admission counts them as leaving
    now: float                  # the monotonic clock of the callers' deadlines
    wall: float                 # seconds since the epoch, for what is stored
    overdue: Collection[str] = frozenset()   # lease ids under a notice whose deadline has passed
    # The teams (G11), when any team is stored: grants are charged to them, and a grant that would take a team
    # above its limit is not made. None: no team is configured, nothing is charged.
    teams: TeamState | None = None
    # Without teams: the revision as of which no team was stored (0: not known). A round that grants compares
    # that no team was written since, so that a team created meanwhile is counted (the grant is decided again).
    no_teams_since: int = 0
    # This host's eviction notices as the replica's mirror shows them: lease id -> (the notice's mod_revision,
    # the notice). A round withdraws the notices a request no longer needs comparing these (``policy/notices``).
    notices: Mapping[str, tuple[int, EvictionRecord]] = dataclasses.field(default_factory=dict)
    # The lease ids this replica judges idle (replica/idle.py): eviction and reclaim take them first among equals.
    idle: Collection[str] = frozenset()
