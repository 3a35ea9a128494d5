"""Plain records of every stored value, shared by the node daemon, the coordinator and the pure logic.

No I/O here, and nothing of etcd's client: a record is built from any ``StoredKV`` (the store's ``KV``
satisfies it), and carries the etcd metadata that later compare-and-sets need. Units: VRAM in MiB (``*_mb``), host memory and disk in bytes.
"""
from __future__ import annotations

import dataclasses

from coordinator.host_records import GpuInfo, GpuProcess, GpuUsage, HostInventory
from coordinator.keys import last_segment
from coordinator.notice_records import DepartingRecord, EvictionRecord, StoredKV
from coordinator.record_fields import (
    FORMAT,
    MAX_STORED_INT,
    InvalidRecord,
    NewerFormat,
    bool_of,
    check_usage,
    dumps,
    fail,
    format_of,
    int_of,
    ints_of,
    list_of,
    load_record,
    loads,
    num_of,
    seconds_of,
    str_of,
    unknown_fields,
)

__all__ = ["FORMAT", "DepartingRecord", "EvictionRecord", "StoredKV", "MAX_STORED_INT", "TOPOLOGIES", "GpuInfo", "GpuProcess", "GpuUsage", "HostInventory",
           "InvalidRecord", "NewerFormat", "check_usage", "dumps", "load_record", "loads"]

# How the GPUs of a gang must be joined: ``any``; ``numa``: all on one NUMA node; ``nvlink``: every pair joined.
TOPOLOGIES = ("any", "numa", "nvlink")


@dataclasses.dataclass(frozen=True)
class Gang:
    """What an acquire asks beyond one GPU (issue 21): ``gpu_count`` GPUs, whole ones (``exclusive``), joined
    by ``topology``, or exactly ``gpus`` (indexes or uuids). ``Gang()`` is a plain single-GPU request."""

    gpu_count: int = 1
    exclusive: bool = False
    topology: str = "any"
    gpus: tuple[str, ...] = ()
    # Multi-host gangs (issue 30): ``gpu_count`` GPUs on each of ``hosts`` distinct hosts; ``same``: a label key
    # every host must share the value of; ``prefer``: a label key whose shared value is preferred.
    hosts: int = 1
    same: str = ""
    prefer: str = ""


# A multi-host gang's parts, in rank order: (host, the uuids of its GPUs there, in index order).
Parts = tuple[tuple[str, tuple[str, ...]], ...]


@dataclasses.dataclass(frozen=True)
class VramLease:
    """A VRAM lease on one GPU as stored under ``leases/<host>/<gpu_uuid>/<lease_id>``, with its etcd metadata.

    A gang lease (several GPUs, granted in one transaction) is one record per GPU, all with the lease's id:
    each holds that GPU's VRAM (``vram_mb``; with ``exclusive``, the GPU's whole usable VRAM) and that GPU's
    fencing token, so capacity (G1) and fencing (G5) stay per GPU; ``gang`` lists the uuids of all its GPUs
    (in index order) on every one of them. Such a record is stored in format 2; a single-GPU lease that is
    neither exclusive nor placed by topology is stored in format 1, as the releases before gangs wrote it.
    """

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
    gang: tuple[str, ...] = ()   # the uuids of all the lease's GPUs, in index order; () for a single GPU
    exclusive: bool = False      # whole GPUs: no other lease on them
    topology: str = "any"        # as asked: any | numa | nvlink
    # Teams (issue 22), format 3: how long the lease runs before it may be reclaimed by another team (as
    # declared; capped by its team's max_min_runtime_s when reclaim chooses), and whether it was over its
    # team's quota when granted (the quota mark, written while teams are stored; None: unmarked. Reclaim
    # classifies the live leases again, oldest first).
    min_runtime_s: float = 0.0
    over_quota: bool | None = None
    # Time limits (issue 31), format 4: revoked time_limit_s after its grant (0: no limit), with an eviction
    # notice (reason ``time-limit``) time_limit_warning_s before (``replica/time_limits.py``).
    time_limit_s: float = 0.0
    time_limit_warning_s: float = 0.0
    # Multi-host gangs (issue 30), format 5: every host's part, in rank order (this record's host among them;
    # ``gang`` still lists this host's GPUs when it holds two or more). () for a lease of one host.
    hosts: Parts = ()
    etcd_lease: int = 0
    mod_revision: int = 0

    @property
    def gpus(self) -> tuple[str, ...]:
        """The uuids of every GPU the lease holds on this record's host (this one alone for a single GPU)."""
        return self.gang or (self.gpu_uuid,)

    @property
    def parts(self) -> Parts:
        """Every host's part of the lease, in rank order (one part, this host's, for a lease of one host)."""
        return self.hosts or ((self.host, self.gpus),)

    @property
    def rank(self) -> int:
        """This record's host's rank in a multi-host gang (0 for a lease of one host)."""
        return next((n for n, (h, _) in enumerate(self.hosts) if h == self.host), 0)

    @property
    def format(self) -> int:
        if self.hosts:
            return 5
        if self.time_limit_s:
            return 4
        if self.min_runtime_s or self.over_quota is not None:
            return 3
        return 2 if self.gang or self.exclusive or self.topology != "any" else 1

    def to_json(self) -> dict[str, object]:
        # Not dataclasses.asdict: it deep-copies, and this runs on every admission.
        d: dict[str, object] = {f: getattr(self, f) for f in _LEASE_FIELDS}
        if self.pids or self.pgid:
            d["pids"], d["pgid"] = list(self.pids), self.pgid
        if self.format > 1:
            d.update(format=self.format, gang=list(self.gang), exclusive=self.exclusive, topology=self.topology)
        if self.format > 2:
            d["min_runtime_s"] = self.min_runtime_s
            if self.over_quota is not None:
                d["over_quota"] = self.over_quota
        if self.format > 3:
            d.update(time_limit_s=self.time_limit_s, time_limit_warning_s=self.time_limit_warning_s)
        if self.format > 4:
            d["hosts"] = [[h, list(u)] for h, u in self.hosts]
        return d

    @classmethod
    def from_kv(cls, kv: StoredKV) -> VramLease:
        """InvalidRecord (naming the field) for a malformed value; NewerFormat for a newer release's."""
        d = load_record(kv.value)
        version = format_of(d, "lease")
        unknown_fields(d, _LEASE_KEYS if version > 4 else _LEASE_KEYS_V4 if version > 3 else _LEASE_KEYS_V3 if version > 2 else _LEASE_KEYS_V2
                       if version > 1 else _LEASE_KEYS_V1)
        gpu_uuid = str_of(d, "gpu_uuid")
        gang, exclusive, topology = gang_of(d, gpu_uuid)
        host = str_of(d, "host")
        hosts = parts_of(d, host, gang or (gpu_uuid,))
        return cls(id=str_of(d, "id", name=True), host=host, gpu_uuid=gpu_uuid,
                   gpu_index=int_of(d, "gpu_index", hi=1 << 16), agent=str_of(d, "agent"),
                   session_id=str_of(d, "session_id"), vram_mb=int_of(d, "vram_mb", 1, 1 << 30),
                   priority=int_of(d, "priority", -(1 << 31), 1 << 31), preemptible=bool_of(d, "preemptible"),
                   request_id=str_of(d, "request_id"), token=int_of(d, "token"), created_at=num_of(d, "created_at"),
                   pids=ints_of(d, "pids", 1 << 32, "process ids"), pgid=int_of(d, "pgid", hi=1 << 32, default=0),
                   gang=gang, exclusive=exclusive, topology=topology,
                   min_runtime_s=seconds_of(d, "min_runtime_s"), over_quota=bool_of(d, "over_quota") if "over_quota" in d else None,
                   time_limit_s=seconds_of(d, "time_limit_s"), time_limit_warning_s=seconds_of(d, "time_limit_warning_s"),
                   hosts=hosts, etcd_lease=kv.etcd_lease, mod_revision=kv.mod_revision)


MAX_GANG_HOSTS = 64


def parts_of(d: dict[str, object], host: str, own: tuple[str, ...]) -> Parts:
    """A lease record's ``hosts`` (format 5): two hosts or more, distinct, this record's host among them with
    exactly its own GPUs; () when absent."""
    raw = list_of(d, "hosts", [])
    if not raw:
        return ()
    if not 2 <= len(raw) <= MAX_GANG_HOSTS:
        raise fail("hosts", f"expected 2 to {MAX_GANG_HOSTS} parts")
    out = []
    for part in raw:
        if (not isinstance(part, list) or len(part) != 2 or not isinstance(part[0], str)
                or not isinstance(part[1], list) or not 1 <= len(part[1]) <= 1024
                or not all(isinstance(u, str) for u in part[1])):
            raise fail("hosts", "expected [host, [gpu uuids]] parts")
        out.append((part[0], tuple(str(u) for u in part[1])))
    names = [h for h, _ in out]
    if len(set(names)) != len(names) or dict(out).get(host) != tuple(own):
        raise fail("hosts", "expected distinct hosts, this record's with its own GPUs")
    return tuple(out)


def gang_of(d: dict[str, object], gpu_uuid: str) -> tuple[tuple[str, ...], bool, str]:
    """A lease record's ``gang``, ``exclusive`` and ``topology`` (absent in format 1: a single shared GPU)."""
    gang = list_of(d, "gang", [])
    if len(gang) > 1024 or not all(isinstance(u, str) for u in gang) or len(set(gang)) != len(gang):
        raise fail("gang", "expected a list of distinct GPU uuids")
    if gang and (len(gang) < 2 or gpu_uuid not in gang):
        raise fail("gang", "a gang lists two GPUs or more, this record's among them")
    topology = str_of(d, "topology", "any")
    if topology not in TOPOLOGIES:
        raise fail("topology", f"expected one of {', '.join(TOPOLOGIES)}")
    return tuple(str(u) for u in gang), bool_of(d, "exclusive", False), topology


_LEASE_FIELDS = tuple(f.name for f in dataclasses.fields(VramLease)
                      if f.name not in ("etcd_lease", "mod_revision", "pids", "pgid", "gang", "exclusive",
                                        "topology", "min_runtime_s", "over_quota", "time_limit_s",
                                        "time_limit_warning_s", "hosts"))
_LEASE_KEYS_V1 = frozenset(_LEASE_FIELDS) | {"pids", "pgid"}
_LEASE_KEYS_V2 = _LEASE_KEYS_V1 | {"format", "gang", "exclusive", "topology"}
_LEASE_KEYS_V3 = _LEASE_KEYS_V2 | {"min_runtime_s", "over_quota"}
_LEASE_KEYS_V4 = _LEASE_KEYS_V3 | {"time_limit_s", "time_limit_warning_s"}
_LEASE_KEYS = _LEASE_KEYS_V4 | {"hosts"}


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
        return cls(int_of(d, "capacity_mb", hi=1 << 30), int_of(d, "seq"), kv.mod_revision)


@dataclasses.dataclass(frozen=True)
class SessionInfo:
    agent: str
    session_id: str
    host: str
    etcd_lease: int
    ttl_s: int = 0      # as opened (0: not known)


@dataclasses.dataclass(frozen=True)
class QueueEntry:
    """``queue/<host>/<rank>``: a waiting request, complete enough for any replica to grant it. A gang waits
    as one entry (format 2 when it asks for more than format 1 can say)."""

    rank: str
    agent: str
    session_id: str
    etcd_lease: int
    vram_mb: int           # per GPU; 0 for an exclusive request
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
    gpu_count: int = 1
    exclusive: bool = False
    topology: str = "any"
    gpus: tuple[str, ...] = ()      # the exact GPUs asked for (indexes or uuids), () for any
    min_runtime_s: float = 0.0      # format 3: the minimum runtime its lease declares (teams' reclaim)
    time_limit_s: float = 0.0       # format 4: its lease's time limit and warning (as on VramLease)
    time_limit_warning_s: float = 0.0
    # Format 5, a multi-host gang (issue 30): ``gpu_count`` GPUs on each of ``hosts`` hosts (``same``/``prefer``:
    # label keys). Its request waits as ``gangqueue/<rank>``; under ``queue/<host>/<rank>`` an entry of it is its
    # reservation there: ``reserve`` lists the GPUs (uuids) that no request ranked after it is granted (G2).
    hosts: int = 1
    same: str = ""
    prefer: str = ""
    reserve: tuple[str, ...] = ()
    start_after: float = 0.0   # the gang's earliest start (unix s; 0: unknown): backfill (policy/backfill.py)
    mod_revision: int = 0

    @property
    def multi_host(self) -> bool:
        return self.hosts > 1

    @property
    def format(self) -> int:
        if self.hosts > 1:
            return 5
        if self.time_limit_s:
            return 4
        if self.min_runtime_s:
            return 3
        return 2 if self.gpu_count != 1 or self.exclusive or self.topology != "any" or self.gpus else 1

    def to_json(self) -> dict[str, object]:
        # Not dataclasses.asdict (it deep-copies): every waiting request writes one.
        d: dict[str, object] = {name: getattr(self, name) for name in _QUEUE_FIELDS}
        d["victims"] = list(self.victims)
        if self.format > 1:
            d.update(format=self.format, gpus=list(self.gpus))
        else:
            for f in _QUEUE_V2:
                d.pop(f)
        if self.format < 3:
            d.pop("min_runtime_s")
        if self.format < 4:
            d.pop("time_limit_s"), d.pop("time_limit_warning_s")
        if self.format < 5:
            for f in _QUEUE_V5:
                d.pop(f)
        else:
            d["reserve"] = list(self.reserve)
        return d

    @classmethod
    def from_kv(cls, kv: StoredKV) -> QueueEntry:
        """InvalidRecord (naming the field) for a malformed value; NewerFormat for a newer release's."""
        d = load_record(kv.value)
        version = format_of(d, "queue")
        below5 = _QUEUE_KEYS - _QUEUE_V5
        unknown_fields(d, _QUEUE_KEYS if version > 4 else below5 if version > 3 else below5 - _QUEUE_V4 if version > 2
                       else below5 - _QUEUE_V3 - _QUEUE_V4 if version > 1
                       else below5 - _QUEUE_V2 - _QUEUE_V3 - _QUEUE_V4 - {"format"})
        reserve = list_of(d, "reserve", [])
        if len(reserve) > 1024 or not all(isinstance(v, str) for v in reserve):
            raise fail("reserve", "expected a list of GPU uuids")
        victims = list_of(d, "victims", [])
        gpus = list_of(d, "gpus", [])
        if not all(isinstance(v, str) for v in victims):
            raise fail("victims", "expected a list of lease ids")
        if len(gpus) > 1024 or not all(isinstance(v, str) for v in gpus):
            raise fail("gpus", "expected a list of GPU indexes or uuids")
        exclusive = bool_of(d, "exclusive", False)
        topology = str_of(d, "topology", "any")
        if topology not in TOPOLOGIES:
            raise fail("topology", f"expected one of {', '.join(TOPOLOGIES)}")
        return cls(rank=last_segment(kv.key), agent=str_of(d, "agent"), session_id=str_of(d, "session_id"),
                   etcd_lease=int_of(d, "etcd_lease", hi=2**64 - 1),
                   vram_mb=int_of(d, "vram_mb", 0 if exclusive else 1, 1 << 30),
                   gpu=str_of(d, "gpu"), priority=int_of(d, "priority", -(1 << 31), 1 << 31),
                   preemptible=bool_of(d, "preemptible"), request_id=str_of(d, "request_id"),
                   lease_id=str_of(d, "lease_id"), deadline_unix=num_of(d, "deadline_unix"),
                   replica=str_of(d, "replica"), victims=tuple(str(v) for v in victims),
                   wait_s=num_of(d, "wait_s", 0.0), gpu_count=int_of(d, "gpu_count", 1, 1024, default=1),
                   exclusive=exclusive, topology=topology, gpus=tuple(str(g) for g in gpus),
                   min_runtime_s=seconds_of(d, "min_runtime_s"), time_limit_s=seconds_of(d, "time_limit_s"),
                   time_limit_warning_s=seconds_of(d, "time_limit_warning_s"),
                   hosts=int_of(d, "hosts", 1, MAX_GANG_HOSTS, default=1), same=str_of(d, "same", ""),
                   prefer=str_of(d, "prefer", ""), reserve=tuple(str(v) for v in reserve),
                   start_after=num_of(d, "start_after", 0.0), mod_revision=kv.mod_revision)


_QUEUE_FIELDS = tuple(f.name for f in dataclasses.fields(QueueEntry) if f.name not in ("rank", "mod_revision"))
_QUEUE_V2 = frozenset({"gpu_count", "exclusive", "topology", "gpus"})
_QUEUE_V3 = frozenset({"min_runtime_s"})
_QUEUE_V4 = frozenset({"time_limit_s", "time_limit_warning_s"})
_QUEUE_V5 = frozenset({"hosts", "same", "prefer", "reserve", "start_after"})
_QUEUE_KEYS = frozenset(f.name for f in dataclasses.fields(QueueEntry)) - {"rank", "mod_revision"} | {"format"}
