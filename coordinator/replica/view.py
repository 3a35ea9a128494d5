"""What one snapshot of a host says, as plain records: the input of every admission decision."""
from __future__ import annotations

import collections
import dataclasses
import functools
import logging
from typing import Any, Callable, Iterable, Mapping, TypeVar

from coordinator import errors, metrics
from coordinator.etcd.contract import KVStore
from coordinator.etcd.types import KV
from coordinator.host_records import CordonRecord
from coordinator.keys import Keys
from coordinator.policy.admission import Departing, GpuView
from coordinator.policy.departing import still_reported
from coordinator.policy.host import HostView
from coordinator.policy.partition import Partition, default_partition
from coordinator.records import (
    DepartingRecord,
    GpuLedger,
    HostInventory,
    InvalidRecord,
    QueueEntry,
    VramLease,
    check_usage,
    load_record,
)
from coordinator.txn import Range

log = logging.getLogger(__name__)
T = TypeVar("T")

STALE_INTERVALS = 3
"""Usage is stale once this replica has seen no new report for this many of the node's intervals."""


def usage_is_stale(usage: dict[str, Any] | None, age_s: float) -> bool:
    return bool(usage) and age_s > STALE_INTERVALS * float(usage.get("interval_s", 5.0))  # type: ignore[union-attr]


def _usage_used(usage: dict[str, Any] | None, stale: bool, leased: dict[str, int]) -> dict[str, int]:
    """NVML used VRAM per GPU uuid, as admission must count it (``leased``: what leases, and ended leases whose
    processes are still reported, account for on each GPU).

    Fresh usage counts as reported. Stale usage (the node's scan hangs, or its writes do not arrive) fails
    closed: the untracked VRAM of the last report is kept, never less, whatever happened to the leases
    since (a lease released meanwhile may still be in use for all we know)."""
    if not usage:
        return {}
    used: dict[str, int] = {}
    for g in usage.get("gpus", ()):
        uuid, nvml = str(g["uuid"]), int(g["vram_used_mb"])
        if stale:
            reported_untracked = int(g.get("untracked_mb", nvml))
            nvml = max(nvml, leased.get(uuid, 0) + reported_untracked)
        used[uuid] = nvml
    return used


HOST_KINDS = ("hosts", "usage", "partitions", "gpus", "leases", "queue", "departing", "cordons")
"""The key kinds of one host's snapshot, in the order ``read_host`` reads them: three single keys (the
host, its usage report, its partition), four prefixes per host, and its cordon (a single key)."""


@dataclasses.dataclass(frozen=True)
class HostSnapshot:
    """One host's keys, all at one etcd ``revision``: the input of ``host_view``.

    ``extra`` holds the single keys the caller asked for too (the sessions of its calls), in its order;
    ``None`` where the key is absent."""

    revision: int
    host: KV | None
    usage: KV | None
    partition: KV | None
    ledgers: tuple[KV, ...]
    leases: tuple[KV, ...]
    queue: tuple[KV, ...]
    departing: tuple[KV, ...]
    extra: tuple[KV | None, ...] = ()
    cordon: KV | None = None   # ``cordons/<host>``: no grant while it exists


def _ranges(keys: Keys, host: str, extra_keys: Iterable[bytes]) -> list[Range]:
    return [Range(keys.host(host)), Range(keys.usage(host)), Range(keys.partition(host)),
            Range(keys.gpus(host), prefix=True), Range(keys.leases(host), prefix=True),
            Range(keys.queue(host), prefix=True), Range(keys.departings(host), prefix=True),
            Range(keys.cordon(host)), *(Range(k) for k in extra_keys)]


def _one(kvs: tuple[KV, ...]) -> KV | None:
    return kvs[0] if kvs else None


async def read_host(store: KVStore, keys: Keys, host: str, extra_keys: Iterable[bytes] = (),
                    deadline: float | None = None) -> HostSnapshot:
    """One host's keys (and ``extra_keys``) in one snapshot: every range at one revision."""
    snap = await store.snapshot(_ranges(keys, host, extra_keys), deadline=deadline)
    r = snap.ranges
    return HostSnapshot(snap.revision, _one(r[0]), _one(r[1]), _one(r[2]), r[3], r[4], r[5], r[6],
                        tuple(_one(x) for x in r[8:]), cordon=_one(r[7]))


def host_snapshot_of(revision: int, host: str, by_kind: Mapping[str, Iterable[KV]],
                     extra: Iterable[KV | None] = ()) -> HostSnapshot:
    """A ``HostSnapshot`` from the keys of one host by kind (``HOST_KINDS``; the single keys as at most one)."""
    def many(kind: str) -> tuple[KV, ...]:
        return tuple(by_kind.get(kind, ()))
    return HostSnapshot(revision, _one(many("hosts")), _one(many("usage")), _one(many("partitions")),
                        many("gpus"), many("leases"), many("queue"), many("departing"), tuple(extra),
                        cordon=_one(many("cordons")))


# Parsing the same stored JSON again on every admission is wasted work: these records are immutable, so
# they are cached by their exact bytes. Per-host caches hold a large fleet's hosts: the gauges and the samplers
# read every host in turn, and an LRU cache smaller than that cycle misses every time (4,096 missed at 10,000).
HOSTS_CACHED = 1 << 14


@functools.lru_cache(maxsize=HOSTS_CACHED)
def _inventory(value: bytes) -> HostInventory:
    return HostInventory.from_json(load_record(value).get("inventory"))  # type: ignore[arg-type]


# A lease record is parsed once per version: every round of its host, and every multi-host decision over the
# fleet, reads it again while it lives.
# Sized for the leases of a large fleet: the gauges and the sweeps read every lease of a host, or of the fleet,
# in turn, and an LRU cache smaller than that cycle misses every time (10,000 leases on a host made the fleet
# gauges a third of an idle replica's CPU with 8,192).
@functools.lru_cache(maxsize=1 << 17)
def lease_of(kv: KV) -> VramLease:
    return VramLease.from_kv(kv)


# A host's usage report, checked: its rounds read the same report until its node writes the next (every few
# seconds). Sized for the hosts a replica admits on at once, not the fleet: a report's dict is kilobytes. Shared
# by every view of it: read, never changed.
@functools.lru_cache(maxsize=1024)
def _usage(value: bytes) -> dict[str, object]:
    return check_usage(load_record(value))


@functools.lru_cache(maxsize=4096)
def _partition(value: bytes) -> Partition:
    return Partition.from_json(load_record(value).get("partition"))  # type: ignore[arg-type]


# -- malformed stored values -----------------------------------------------------------------------------
# A value that does not parse makes its host INVALID (status shows why) and admission there fails closed;
# every other host carries on. Each distinct bad value (key and mod_revision) is counted and logged once.
_REPORTED: collections.OrderedDict[tuple[bytes, int], None] = collections.OrderedDict()
_MAX_REPORTED = 4096
_PARSE_ERRORS = (InvalidRecord, ValueError, TypeError, KeyError, AttributeError, RecursionError, OverflowError)


def _report(keys: Keys, kv: KV, why: str) -> tuple[str, str]:
    """(key kind, ``kind/...: why`` for status); counted in gpucoord_invalid_records_total and logged once per
    value."""
    key = bytes(kv.key)
    try:
        kind = keys.parse(key)[0]
        where = key.decode(errors="replace")[len(keys.prefix):]
    except ValueError:
        kind, where = "unknown", key.decode(errors="replace")
    text = f"{where[:160]}: {why[:200]}"
    seen = (key, kv.mod_revision)
    if seen not in _REPORTED:
        _REPORTED[seen] = None
        while len(_REPORTED) > _MAX_REPORTED:
            _REPORTED.popitem(last=False)
        metrics.INVALID_RECORDS.labels(kind).inc()
        log.warning("invalid stored value %s (mod_revision %d): its host is INVALID and gets no admission until "
                    "it is rewritten", text, seen[1])
    return kind, text


def _parsed(keys: Keys, kv: KV, parse: Callable[[], T], problems: list[tuple[str, str]]) -> T | None:
    try:
        return parse()
    except _PARSE_ERRORS as e:
        problems.append(_report(keys, kv, str(e) or type(e).__name__))
        return None


def invalid_host(host: str, why: str) -> errors.FailedPrecondition:
    """The refusal of anything that needs a host whose stored values are malformed (it fails closed)."""
    return errors.FailedPrecondition(f"host: host {host!r} is INVALID: a stored value is malformed ({why[:300]}); "
                                     "no admission there until it is rewritten", "host")


@functools.lru_cache(maxsize=HOSTS_CACHED)
def _default_partition(host_value: bytes) -> Partition:
    return default_partition(_inventory(host_value))


def host_view(keys: Keys, host: str, snap: HostSnapshot, untracked: bool,
              usage_age: Callable[[KV], float] | None = None) -> HostView:
    """Build a HostView from one host's snapshot (``read_host``, or the mirror's ``host_snapshot``).

    ``usage_age`` says how long ago the caller observed the usage report's revision (its own clock; see
    ``observed.py``); without it the report counts as fresh. A malformed stored value of the host leaves
    out what it would have said, and sets ``invalid`` (why, for status): admission there fails closed."""
    ledger_kvs, lease_kvs, queue_kvs, departing_kvs = snap.ledgers, snap.leases, snap.queue, snap.departing
    problems: list[tuple[str, str]] = []
    host_kv = snap.host
    inventory = _parsed(keys, host_kv, lambda: _inventory(host_kv.value), problems) if host_kv else None
    part_kv = snap.partition
    partition = _parsed(keys, part_kv, lambda: _partition(part_kv.value), problems) if part_kv else None
    usage_kv = snap.usage
    usage = (_parsed(keys, usage_kv, lambda: _usage(usage_kv.value), problems)
             if usage_kv else None)
    age = (usage_age(usage_kv) if usage_age is not None else 0.0) if usage_kv else -1.0
    stale = usage_is_stale(usage, age)
    ledgers = {}
    for kv in ledger_kvs:
        ledger = _parsed(keys, kv, lambda kv=kv: GpuLedger.from_kv(kv), problems)   # type: ignore[misc]
        if ledger is not None:
            ledgers[keys.parse(kv.key)[1][-1]] = ledger
    leases = {}
    by_gpu: dict[str, list[VramLease]] = {}
    for kv in lease_kvs:
        lease = _parsed(keys, kv, lambda kv=kv: lease_of(kv), problems)   # type: ignore[misc]
        if lease is None:
            continue
        leases[lease.id] = lease
        by_gpu.setdefault(lease.gpu_uuid, []).append(lease)
    entries = []
    for kv in queue_kvs:
        entry = _parsed(keys, kv, lambda kv=kv: queue_entry(kv), problems)   # type: ignore[misc]
        if entry is not None:
            entries.append(entry)
    departing_list = []
    for kv in departing_kvs:
        record = _parsed(keys, kv, lambda kv=kv: DepartingRecord.from_kv(kv), problems)   # type: ignore[misc]
        if record is not None:
            departing_list.append(record)
    departing = tuple(departing_list)
    cordon_kv = snap.cordon
    cordon = (_parsed(keys, cordon_kv, lambda: CordonRecord.from_json(load_record(cordon_kv.value)), problems)
              if cordon_kv else None)
    held: dict[str, list[Departing]] = {}
    for d in departing:
        # Until the node's report lists none of its processes, or the kill margin passed (forced).
        if not d.forced and still_reported(usage, d.gpu_uuid, d.lease_id, d.pids):
            held.setdefault(d.gpu_uuid, []).append(Departing(d.lease_id, d.agent, d.vram_mb))
    counted = {u: sum(x.vram_mb for x in ls) + sum(x.vram_mb for x in held.get(u, ())) for u, ls in by_gpu.items()}
    for u, ds in held.items():
        counted.setdefault(u, sum(x.vram_mb for x in ds))
    used = _usage_used(usage, stale, counted) if untracked else {}
    gpus: dict[str, GpuView] = {}
    if inventory is not None:
        part = partition or _default_partition(host_kv.value)  # type: ignore[union-attr]
        for g in inventory.gpus:
            gpus[g.uuid] = GpuView(
                uuid=g.uuid, index=g.index, total_mb=g.vram_total_mb, usable_mb=part.usable_mb(g),
                ledger=ledgers.get(g.uuid, GpuLedger(g.vram_total_mb, 0, 0)),
                leases=list(by_gpu.get(g.uuid, ())), nvml_used_mb=used.get(g.uuid),
                departing=list(held.get(g.uuid, ())))
    return HostView(host, snap.revision, inventory, host_kv, partition, part_kv, gpus, leases, usage, queue_kvs,
                    tuple(entries), usage_age_s=age, usage_stale=stale, departing=departing,
                    invalid="; ".join(t for _, t in problems[:3])
                    + (f"; and {len(problems) - 3} more" if len(problems) > 3 else ""),
                    invalid_kinds=frozenset(k for k, _ in problems), cordon=cordon, cordon_kv=cordon_kv)


@functools.lru_cache(maxsize=8192)
def queue_entry(kv: KV) -> QueueEntry:
    """``QueueEntry.from_kv``, cached: every round reads the host's whole queue, and entries rarely change
    (a KV is immutable, and equal only with the same key, value and revisions)."""
    return QueueEntry.from_kv(kv)
