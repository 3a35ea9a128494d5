"""Plain records of every stored value, shared by the node daemon, the coordinator and the pure logic.

No I/O here, and nothing of etcd's client: a record is built from any ``StoredKV`` (the store's ``KV``
satisfies it), and carries the etcd metadata that later compare-and-sets need. Units: VRAM in MiB (``*_mb``), host memory and disk in bytes.
"""
from __future__ import annotations

import dataclasses
import json
from typing import Any, Protocol

import orjson

from coordinator.keys import last_segment


@dataclasses.dataclass(frozen=True)
class GpuInfo:
    """One GPU as NVML (or ``--fake-gpus``) describes it."""

    index: int
    uuid: str
    name: str
    vram_total_mb: int


@dataclasses.dataclass(frozen=True)
class GpuProcess:
    pid: int
    used_mb: int


@dataclasses.dataclass(frozen=True)
class GpuUsage:
    """Live VRAM use of one GPU, as NVML reports it."""

    index: int
    uuid: str
    vram_used_mb: int
    vram_free_mb: int
    processes: tuple[GpuProcess, ...] = ()


@dataclasses.dataclass(frozen=True)
class HostInventory:
    """What a node daemon publishes under ``hosts/<host>``."""

    host: str
    address: str
    cpu_count: int
    core_ids: tuple[int, ...]
    mem_bytes: int
    disk_path: str
    disk_bytes: int
    gpus: tuple[GpuInfo, ...]
    version: str = ""
    simulated: bool = False

    def gpu(self, ref: int | str) -> GpuInfo | None:
        """Find a GPU by index or uuid (an all-digit string counts as an index)."""
        if isinstance(ref, str) and ref.isdigit():
            ref = int(ref)
        for g in self.gpus:
            if (isinstance(ref, int) and g.index == ref) or g.uuid == ref:
                return g
        return None

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> HostInventory:
        return cls(
            host=d["host"],
            address=d.get("address", ""),
            cpu_count=int(d["cpu_count"]),
            core_ids=tuple(int(c) for c in d.get("core_ids", range(int(d["cpu_count"])))),
            mem_bytes=int(d["mem_bytes"]),
            disk_path=d.get("disk_path", "/"),
            disk_bytes=int(d["disk_bytes"]),
            gpus=tuple(GpuInfo(**g) for g in d.get("gpus", ())),
            version=d.get("version", ""),
            simulated=bool(d.get("simulated", False)),
        )


def loads(value: bytes) -> Any:
    """A stored JSON value. orjson decodes gpucoord's small documents several times faster than json; what it
    refuses (the NaN and Infinity that json.dumps may write) is decoded by json, with json's errors."""
    try:
        return orjson.loads(value)
    except orjson.JSONDecodeError:
        return json.loads(value)


def dumps(obj: Any) -> bytes:
    """JSON as stored in etcd: compact, sorted, so `etcdctl get` reads well and diffs are stable."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()


class StoredKV(Protocol):
    """What a record needs of a stored key: the store's ``KV`` has it."""

    @property
    def key(self) -> bytes: ...
    @property
    def value(self) -> bytes: ...
    @property
    def mod_revision(self) -> int: ...
    @property
    def etcd_lease(self) -> int: ...


@dataclasses.dataclass(frozen=True)
class VramLease:
    """A VRAM lease as stored under ``leases/<host>/<gpu_uuid>/<lease_id>``, with its etcd metadata."""

    id: str
    host: str
    gpu_uuid: str
    gpu_index: int
    agent: str
    session_id: str
    vram_mb: int
    priority: int
    preemptible: bool
    request_id: str
    token: int
    created_at: float
    pids: tuple[int, ...] = ()   # processes the lease covers (AttachProcesses); stored only once set
    pgid: int = 0                # a process group it covers, 0 for none
    etcd_lease: int = 0
    mod_revision: int = 0

    def to_json(self) -> dict[str, Any]:
        # Not dataclasses.asdict: it deep-copies, and this runs on every admission.
        d = {f: getattr(self, f) for f in _LEASE_FIELDS}
        if self.pids or self.pgid:
            d["pids"], d["pgid"] = list(self.pids), self.pgid
        return d

    @classmethod
    def from_kv(cls, kv: StoredKV) -> VramLease:
        d = loads(kv.value)
        if "pids" in d:
            d["pids"] = tuple(int(p) for p in d["pids"])
        return cls(**d, etcd_lease=kv.etcd_lease, mod_revision=kv.mod_revision)


_LEASE_FIELDS = tuple(f.name for f in dataclasses.fields(VramLease)
                      if f.name not in ("etcd_lease", "mod_revision", "pids", "pgid"))


@dataclasses.dataclass(frozen=True)
class GpuLedger:
    """``gpus/<host>/<gpu_uuid>``: the compare-and-set point of admission on one GPU."""

    capacity_mb: int
    seq: int
    mod_revision: int = 0  # 0: the ledger does not exist yet

    @classmethod
    def from_kv(cls, kv: StoredKV | None) -> GpuLedger:
        if kv is None:
            return cls(0, 0, 0)
        d = loads(kv.value)
        return cls(int(d["capacity_mb"]), int(d["seq"]), kv.mod_revision)



@dataclasses.dataclass(frozen=True)
class SessionInfo:
    agent: str
    session_id: str
    host: str
    etcd_lease: int
    ttl_s: int = 0      # as opened (0: not known)



@dataclasses.dataclass(frozen=True)
class QueueEntry:
    """``queue/<host>/<rank>``: a waiting request, complete enough for any replica to grant it."""

    rank: str
    agent: str
    session_id: str
    etcd_lease: int
    vram_mb: int
    gpu: str               # the GPU asked for (index or uuid), "" for any
    priority: int
    preemptible: bool
    request_id: str
    lease_id: str
    deadline_unix: float   # the waiter gives up then; the leader sweeps entries left past it
    replica: str           # the replica serving the waiting RPC
    victims: tuple[str, ...] = ()   # leases evicted for it: it is admitted only once they are gone
    # How long the waiter waits from when the entry was written: the leader measures the wait from when it
    # observed the entry (its own clock), not from deadline_unix (another machine's wall clock).
    wait_s: float = 0.0
    mod_revision: int = 0

    def to_json(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d.pop("rank")
        d.pop("mod_revision")
        d["victims"] = list(self.victims)
        return d

    @classmethod
    def from_kv(cls, kv: StoredKV) -> QueueEntry:
        d = loads(kv.value)
        d["victims"] = tuple(d.get("victims", ()))
        return cls(rank=last_segment(kv.key), mod_revision=kv.mod_revision, **d)


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

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_kv(cls, kv: StoredKV) -> EvictionRecord:
        return cls(**loads(kv.value))
