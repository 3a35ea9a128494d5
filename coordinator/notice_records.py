"""The records of eviction notices (``evictions/<lease_id>``) and of ended leases whose processes the node still
reports (``departing/<host>/<gpu_uuid>/<lease_id>``). Plain records, no I/O; ``coordinator.records`` re-exports
them."""
from __future__ import annotations

import dataclasses
from typing import Protocol

from coordinator.record_fields import (
    bool_of,
    fail,
    int_of,
    ints_of,
    load_record,
    num_of,
    str_of,
    unknown_fields,
)


class StoredKV(Protocol):
    """What a record needs of a stored key: the store's ``KV`` has it (``coordinator.records`` re-exports it)."""

    @property
    def key(self) -> bytes: ...
    @property
    def value(self) -> bytes: ...
    @property
    def mod_revision(self) -> int: ...
    @property
    def etcd_lease(self) -> int: ...


@dataclasses.dataclass(frozen=True)
class EvictionRecord:
    """``evictions/<lease_id>``: a notice to a lease's holder, with the deadline the leader enforces."""

    lease_id: str
    host: str
    gpu_uuid: str
    agent: str              # the victim's agent and session
    session_id: str
    victim_priority: int
    requested_by: str       # "agent/request_id" of the request it makes room for, or "operator"
    requester_priority: int | None   # None for an operator's eviction
    reason: str
    deadline_unix: float
    created_at: float
    asked_by: str = ""      # who asked for an operator's eviction: its verified identity (or its address)
    # An operator's revoke of a lease bound to processes: the holder kills them at once (no SIGTERM grace);
    # the deadline is the revoke's time, and the kill margin after it bounds the wait for them.
    revoke: bool = False
    # Teams (issue 22): the team whose request below its quota reclaims this over-quota lease of another
    # team, whatever their priorities ("" for an eviction by priority, G3, or by an operator).
    reclaim: str = ""
    # Never stored: what a replica pushes to the victim's client when the notice is deleted while its lease
    # lives (withdrawn: the requester no longer needs it).
    withdrawn: bool = False

    def to_json(self) -> dict[str, object]:
        # Not dataclasses.asdict (it deep-copies): every eviction notice writes one.
        d: dict[str, object] = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        del d["withdrawn"]
        if not self.revoke:
            del d["revoke"]
        if not self.reclaim:
            del d["reclaim"]
        return d

    @classmethod
    def from_kv(cls, kv: StoredKV) -> EvictionRecord:
        """InvalidRecord (naming the field) for a malformed value."""
        d = load_record(kv.value)
        unknown_fields(d, _EVICTION_KEYS)
        if "requester_priority" not in d:
            raise fail("requester_priority", "missing")
        asker = d["requester_priority"]
        return cls(lease_id=str_of(d, "lease_id"), host=str_of(d, "host"), gpu_uuid=str_of(d, "gpu_uuid"),
                   agent=str_of(d, "agent"), session_id=str_of(d, "session_id"),
                   victim_priority=int_of(d, "victim_priority", -(1 << 31), 1 << 31),
                   requested_by=str_of(d, "requested_by"),
                   requester_priority=None if asker is None else int_of(d, "requester_priority", -(1 << 31), 1 << 31),
                   reason=str_of(d, "reason"), deadline_unix=num_of(d, "deadline_unix"),
                   created_at=num_of(d, "created_at"), asked_by=str_of(d, "asked_by", ""),
                   revoke=bool_of(d, "revoke", False), reclaim=str_of(d, "reclaim", ""))


_EVICTION_KEYS = frozenset(f.name for f in dataclasses.fields(EvictionRecord))


def requester_agent(requested_by: str) -> str:
    """The agent of a notice's ``requested_by`` (``agent/request_id``), or ``operator`` (an operator's notice)."""
    return requested_by.partition("/")[0] or "operator"


@dataclasses.dataclass(frozen=True)
class DepartingRecord:
    """``departing/<host>/<gpu_uuid>/<lease_id>``: a lease bound to processes that ended under an eviction
    notice (released by its holder, or revoked at the kill margin) while the node still reported some of its
    processes on the GPU. Until the node's report lists none of them, its VRAM counts as held (G3); once the
    bound has passed (``forced``) it counts as free, and the node (``--enforce kill``) kills what is left.

    The bound is ``bound_unix - created_at`` seconds after the record was first seen (two wall times of the
    one writer: no two clocks need agree)."""

    lease_id: str
    host: str
    gpu_uuid: str
    agent: str
    vram_mb: int
    pids: tuple[int, ...]      # the lease's recorded processes (the node also matches its process group)
    pgid: int
    requested_by: str          # as in the notice: "agent/request_id", or "operator"
    reason: str
    created_at: float          # the writer's wall clock, when the lease ended
    bound_unix: float          # the writer's wall clock: the notice's deadline plus the kill margin
    forced: bool = False       # the bound passed with its processes still reported
    revoke: bool = False       # it ended by an operator's revoke
    mod_revision: int = 0
    create_revision: int = 0

    def to_json(self) -> dict[str, object]:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
             if f.name not in ("mod_revision", "create_revision")}
        d["pids"] = list(self.pids)
        return d

    @classmethod
    def from_kv(cls, kv: StoredKV) -> DepartingRecord:
        """InvalidRecord (naming the field) for a malformed value."""
        d = load_record(kv.value)
        unknown = set(d) - _DEPARTING_KEYS
        if unknown:
            raise fail(sorted(unknown)[0][:32], "unknown field")
        pids = ints_of(d, "pids", 1 << 32, "process ids")
        return cls(lease_id=str_of(d, "lease_id", name=True), host=str_of(d, "host"), gpu_uuid=str_of(d, "gpu_uuid"),
                   agent=str_of(d, "agent"), vram_mb=int_of(d, "vram_mb", 1, 1 << 30), pids=tuple(pids),
                   pgid=int_of(d, "pgid", hi=1 << 32, default=0), requested_by=str_of(d, "requested_by", ""),
                   reason=str_of(d, "reason", ""), created_at=num_of(d, "created_at"), bound_unix=num_of(d, "bound_unix"),
                   forced=bool_of(d, "forced", False), revoke=bool_of(d, "revoke", False),
                   mod_revision=kv.mod_revision, create_revision=getattr(kv, "create_revision", 0))


_DEPARTING_KEYS = frozenset(f.name for f in dataclasses.fields(DepartingRecord)) - {"mod_revision",
                                                                                    "create_revision"}
