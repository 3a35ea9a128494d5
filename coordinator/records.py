"""Plain records of every stored value, shared by the node daemon, the coordinator and the pure logic.

No I/O here, and nothing of etcd's client: a record is built from any ``StoredKV`` (the store's ``KV``
satisfies it), and carries the etcd metadata that later compare-and-sets need. Units: VRAM in MiB (``*_mb``), host memory and disk in bytes.
"""
from __future__ import annotations

import dataclasses
import json
import math
from typing import Any, Protocol

import orjson

from coordinator.keys import last_segment, valid_name

# The largest number a stored record may hold where an amount is expected (VRAM in MiB, bytes, tokens): above
# it a value is no amount but a corruption, and the record is refused rather than trusted.
MAX_STORED_INT = 2**62


class InvalidRecord(ValueError):
    """A stored value that is not what its key's schema says (``keys.py``): the message says why, naming the
    field. Every ``from_kv``/``from_json`` below raises it (and only it) for a malformed value, so that a
    reader can set one record (or one host) aside and carry on with the rest."""


def _fail(field: str, why: str) -> InvalidRecord:
    return InvalidRecord(f"{field}: {why}")


def _int(d: Any, field: str, lo: int = 0, hi: int = MAX_STORED_INT, default: int | None = None) -> int:
    v = d.get(field, default) if isinstance(d, dict) else None
    if isinstance(v, bool) or not isinstance(v, int):
        raise _fail(field, f"expected an integer, got {type(v).__name__}")
    if not lo <= v <= hi:
        raise _fail(field, f"{str(v)[:24]} is outside [{lo}, {hi}]")
    return v


def _num(d: Any, field: str, default: float | None = None) -> float:
    v = d.get(field, default) if isinstance(d, dict) else None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise _fail(field, f"expected a finite number, got {type(v).__name__}")
    return float(v)


def _str(d: Any, field: str, default: str | None = None, name: bool = False) -> str:
    v = d.get(field, default) if isinstance(d, dict) else None
    if not isinstance(v, str):
        raise _fail(field, f"expected a string, got {type(v).__name__}")
    if name and not valid_name(v):
        raise _fail(field, "not a valid name")
    return v


def _bool(d: Any, field: str, default: bool | None = None) -> bool:
    v = d.get(field, default) if isinstance(d, dict) else None
    if not isinstance(v, bool):
        raise _fail(field, f"expected true or false, got {type(v).__name__}")
    return v


def _list(d: Any, field: str, default: Any = None) -> list[Any]:
    v = d.get(field, default) if isinstance(d, dict) else None
    if not isinstance(v, (list, tuple)):   # a tuple: a record's own to_json before it is stored
        raise _fail(field, f"expected a list, got {type(v).__name__}")
    return list(v)


def _dict(v: Any, field: str) -> dict[str, Any]:
    if not isinstance(v, dict):
        raise _fail(field, f"expected an object, got {type(v).__name__}")
    return v


def load_record(value: bytes, field: str = "value") -> dict[str, Any]:
    """A stored JSON object; InvalidRecord for anything else (bad JSON, another type, nesting too deep)."""
    try:
        doc = loads(value)
    except (ValueError, RecursionError) as e:
        raise _fail(field, f"not valid JSON ({str(e)[:60]})") from None
    return _dict(doc, field)


@dataclasses.dataclass(frozen=True)
class GpuInfo:
    """One GPU as NVML (or ``--fake-gpus``) describes it.

    Topology: ``numa_node`` is the NUMA node the GPU sits on, None when unknown; ``nvlink_peers`` are the
    indexes of the GPUs it reaches over an active NVLink (directly or through an NVSwitch), sorted, () when
    it has none or they are unknown. Records written before these fields existed read as unknown.
    """

    index: int
    uuid: str
    name: str
    vram_total_mb: int
    numa_node: int | None = None
    nvlink_peers: tuple[int, ...] = ()

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> GpuInfo:
        """Parse a stored GPU (InvalidRecord naming the field when malformed); fields this release does not
        know are ignored, missing topology is unknown."""
        index = _int(d, "index", hi=1 << 16)
        numa = d.get("numa_node")
        if numa is not None and (isinstance(numa, bool) or not isinstance(numa, int) or not 0 <= numa < 1 << 16):
            raise _fail("numa_node", "expected a whole number >= 0 or null")
        peers = _list(d, "nvlink_peers", [])
        if len(peers) > 1 << 16 or not all(isinstance(p, int) and not isinstance(p, bool) and 0 <= p < 1 << 16
                                           for p in peers):
            raise _fail("nvlink_peers", "expected a list of GPU indexes")
        return cls(index=index, uuid=_str(d, "uuid", name=True), name=_str(d, "name", ""),
                   vram_total_mb=_int(d, "vram_total_mb", hi=1 << 30), numa_node=numa,
                   nvlink_peers=tuple(sorted(set(peers) - {index})))


@dataclasses.dataclass(frozen=True)
class GpuProcess:
    pid: int
    used_mb: int


@dataclasses.dataclass(frozen=True)
class GpuUsage:
    """Live VRAM use of one GPU, as NVML reports it. ``processes_visible``: ``processes`` is the GPU's whole
    process list (NVML listed them; false when it cannot, and for simulated GPUs without processes)."""

    index: int
    uuid: str
    vram_used_mb: int
    vram_free_mb: int
    processes: tuple[GpuProcess, ...] = ()
    processes_visible: bool = True


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
        """The inventory as stored; InvalidRecord (naming the field) when it is malformed."""
        d = _dict(d, "inventory")
        cpu_count = _int(d, "cpu_count", hi=1 << 20)
        cores = _list(d, "core_ids", list(range(cpu_count)))
        if len(cores) > 1 << 20 or not all(isinstance(c, int) and not isinstance(c, bool) and 0 <= c < 1 << 20
                                           for c in cores):
            raise _fail("core_ids", "expected a list of core ids")
        gpus = []
        for i, g in enumerate(_list(d, "gpus", [])[:1024]):
            try:
                g = _dict(g, "gpu")
                gpus.append(GpuInfo.from_json(g))
            except InvalidRecord as e:
                raise _fail(f"gpus[{i}]", str(e)) from None
        return cls(
            host=_str(d, "host"),
            address=_str(d, "address", ""),
            cpu_count=cpu_count,
            core_ids=tuple(cores),
            mem_bytes=_int(d, "mem_bytes"),
            disk_path=_str(d, "disk_path", "/"),
            disk_bytes=_int(d, "disk_bytes"),
            gpus=tuple(gpus),
            version=_str(d, "version", ""),
            simulated=_bool(d, "simulated", False),
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


def check_usage(doc: Any) -> dict[str, Any]:
    """``usage/<host>`` as readers use it, checked: per GPU a uuid and vram_used_mb (and untracked_mb,
    processes_visible, processes_omitted), and the processes and leases lists status shows. Fields it does not
    read may be anything. InvalidRecord else."""
    checked = _dict(doc, "usage")
    if "interval_s" in checked and not 0 < _num(checked, "interval_s") < 1e6:
        raise _fail("interval_s", "must be > 0")
    for i, g in enumerate(_list(checked, "gpus", [])):
        f = f"gpus[{i}]"
        try:
            g = _dict(g, "gpu")
            _str(g, "uuid")
            _int(g, "vram_used_mb", hi=1 << 30)
            if "untracked_mb" in g:
                _int(g, "untracked_mb", hi=1 << 30)
            if "processes_visible" in g:
                _bool(g, "processes_visible")
            if "processes_omitted" in g:
                _int(g, "processes_omitted", hi=1 << 32)
            for j, p in enumerate(_list(g, "processes", [])):
                p = _dict(p, f"processes[{j}]")
                _int(p, "pid", hi=1 << 32)
                _int(p, "used_mb", hi=1 << 30)
                _str(p, "state", "")
                _str(p, "lease_id", "")
            for j, u in enumerate(_list(g, "leases", [])):
                u = _dict(u, f"leases[{j}]")
                _str(u, "lease_id")
                _str(u, "agent", "")
                _int(u, "vram_mb", hi=1 << 30, default=0)
                _int(u, "used_mb", hi=1 << 30, default=0)
                _bool(u, "over_use", False)
                pids = _list(u, "pids", [])
                if not all(isinstance(x, int) and not isinstance(x, bool) and 0 <= x < 1 << 32 for x in pids):
                    raise _fail("pids", "expected a list of process ids")
        except InvalidRecord as e:
            raise _fail(f, str(e)) from None
    return checked


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
        """InvalidRecord (naming the field) for a malformed value."""
        d = load_record(kv.value)
        pids = _list(d, "pids", [])
        if len(pids) > 1 << 16 or not all(isinstance(p, int) and not isinstance(p, bool) and 0 <= p < 1 << 32
                                          for p in pids):
            raise _fail("pids", "expected a list of process ids")
        unknown = set(d) - _LEASE_KEYS
        if unknown:
            raise _fail(sorted(unknown)[0][:32], "unknown field")
        return cls(id=_str(d, "id", name=True), host=_str(d, "host"), gpu_uuid=_str(d, "gpu_uuid"),
                   gpu_index=_int(d, "gpu_index", hi=1 << 16), agent=_str(d, "agent"),
                   session_id=_str(d, "session_id"), vram_mb=_int(d, "vram_mb", 1, 1 << 30),
                   priority=_int(d, "priority", -(1 << 31), 1 << 31), preemptible=_bool(d, "preemptible"),
                   request_id=_str(d, "request_id"), token=_int(d, "token"), created_at=_num(d, "created_at"),
                   pids=tuple(pids), pgid=_int(d, "pgid", hi=1 << 32, default=0),
                   etcd_lease=kv.etcd_lease, mod_revision=kv.mod_revision)


_LEASE_FIELDS = tuple(f.name for f in dataclasses.fields(VramLease)
                      if f.name not in ("etcd_lease", "mod_revision", "pids", "pgid"))
_LEASE_KEYS = frozenset(_LEASE_FIELDS) | {"pids", "pgid"}


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
        d = load_record(kv.value)
        return cls(_int(d, "capacity_mb", hi=1 << 30), _int(d, "seq"), kv.mod_revision)


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
        """InvalidRecord (naming the field) for a malformed value."""
        d = load_record(kv.value)
        victims = _list(d, "victims", [])
        if not all(isinstance(v, str) for v in victims):
            raise _fail("victims", "expected a list of lease ids")
        unknown = set(d) - _QUEUE_KEYS
        if unknown:
            raise _fail(sorted(unknown)[0][:32], "unknown field")
        return cls(rank=last_segment(kv.key), agent=_str(d, "agent"), session_id=_str(d, "session_id"),
                   etcd_lease=_int(d, "etcd_lease", hi=2**64 - 1), vram_mb=_int(d, "vram_mb", 1, 1 << 30),
                   gpu=_str(d, "gpu"), priority=_int(d, "priority", -(1 << 31), 1 << 31),
                   preemptible=_bool(d, "preemptible"), request_id=_str(d, "request_id"),
                   lease_id=_str(d, "lease_id"), deadline_unix=_num(d, "deadline_unix"), replica=_str(d, "replica"),
                   victims=tuple(victims), wait_s=_num(d, "wait_s", 0.0), mod_revision=kv.mod_revision)


_QUEUE_KEYS = frozenset(f.name for f in dataclasses.fields(QueueEntry)) - {"rank", "mod_revision"}


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

    def to_json(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        if not self.revoke:
            del d["revoke"]
        return d

    @classmethod
    def from_kv(cls, kv: StoredKV) -> EvictionRecord:
        """InvalidRecord (naming the field) for a malformed value."""
        d = load_record(kv.value)
        try:
            record = cls(**d)
        except TypeError as e:
            raise _fail("value", str(e)[:80]) from None
        for f in ("lease_id", "host", "gpu_uuid", "agent", "session_id", "requested_by", "reason", "asked_by"):
            _str(d, f, "")
        _int(d, "victim_priority", -(1 << 31), 1 << 31)
        if d.get("requester_priority") is not None:
            _int(d, "requester_priority", -(1 << 31), 1 << 31)
        _num(d, "deadline_unix")
        _num(d, "created_at")
        _bool(d, "revoke", False)
        return record


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

    def to_json(self) -> dict[str, Any]:
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
            raise _fail(sorted(unknown)[0][:32], "unknown field")
        pids = _list(d, "pids", [])
        if len(pids) > 1 << 16 or not all(isinstance(p, int) and not isinstance(p, bool) and 0 <= p < 1 << 32
                                          for p in pids):
            raise _fail("pids", "expected a list of process ids")
        return cls(lease_id=_str(d, "lease_id", name=True), host=_str(d, "host"), gpu_uuid=_str(d, "gpu_uuid"),
                   agent=_str(d, "agent"), vram_mb=_int(d, "vram_mb", 1, 1 << 30), pids=tuple(pids),
                   pgid=_int(d, "pgid", hi=1 << 32, default=0), requested_by=_str(d, "requested_by", ""),
                   reason=_str(d, "reason", ""), created_at=_num(d, "created_at"), bound_unix=_num(d, "bound_unix"),
                   forced=_bool(d, "forced", False), revoke=_bool(d, "revoke", False),
                   mod_revision=kv.mod_revision, create_revision=getattr(kv, "create_revision", 0))


_DEPARTING_KEYS = frozenset(f.name for f in dataclasses.fields(DepartingRecord)) - {"mod_revision",
                                                                                    "create_revision"}
