"""What one snapshot of a host says, as plain records: the input of every admission decision."""
from __future__ import annotations

import functools
from typing import Any, Callable

from coordinator.policy.admission import Departing, GpuView
from coordinator.policy.departing import still_reported
from coordinator.policy.host import HostView
from coordinator.keys import Keys
from coordinator.records import DepartingRecord, GpuLedger, HostInventory, QueueEntry, VramLease, loads
from coordinator.policy.partition import Partition, default_partition
from coordinator.etcd.store import KV, Snapshot
from coordinator.etcd.ops import range_req


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


def host_ranges(keys: Keys, host: str) -> list[Any]:
    return [
        range_req(keys.host(host)),
        range_req(keys.usage(host)),
        range_req(keys.partition(host)),
        range_req(keys.gpus(host), prefix=True),
        range_req(keys.leases(host), prefix=True),
        range_req(keys.queue(host), prefix=True),
        range_req(keys.departings(host), prefix=True),
    ]


HOST_RANGES = 7
"""How many ranges ``host_ranges`` reads: a snapshot's further ranges are the caller's."""


# Parsing the same stored JSON again on every admission is wasted work: these records are immutable, so
# they are cached by their exact bytes.
@functools.lru_cache(maxsize=4096)
def _inventory(value: bytes) -> HostInventory:
    return HostInventory.from_json(loads(value)["inventory"])


@functools.lru_cache(maxsize=4096)
def _partition(value: bytes) -> Partition:
    return Partition.from_json(loads(value)["partition"])


@functools.lru_cache(maxsize=4096)
def _default_partition(host_value: bytes) -> Partition:
    return default_partition(_inventory(host_value))


def host_view(keys: Keys, host: str, snap: Snapshot, untracked: bool,
              usage_age: Callable[[KV], float] | None = None) -> HostView:
    """Build a HostView from the first ``HOST_RANGES`` ranges of a snapshot taken with ``host_ranges``.

    ``usage_age`` says how long ago the caller observed the usage report's revision (its own clock; see
    ``observed.py``); without it the report counts as fresh."""
    host_kvs, usage_kvs, part_kvs, ledger_kvs, lease_kvs, queue_kvs, departing_kvs = snap.ranges[:HOST_RANGES]
    host_kv = host_kvs[0] if host_kvs else None
    inventory = _inventory(host_kv.value) if host_kv else None
    part_kv = part_kvs[0] if part_kvs else None
    partition = _partition(part_kv.value) if part_kv else None
    usage = usage_kvs[0].json() if usage_kvs else None
    age = (usage_age(usage_kvs[0]) if usage_age is not None else 0.0) if usage_kvs else -1.0
    stale = usage_is_stale(usage, age)
    ledgers = {keys.parse(kv.key)[1][-1]: GpuLedger.from_kv(kv) for kv in ledger_kvs}
    leases = {}
    by_gpu: dict[str, list[VramLease]] = {}
    for kv in lease_kvs:
        lease = VramLease.from_kv(kv)
        leases[lease.id] = lease
        by_gpu.setdefault(lease.gpu_uuid, []).append(lease)
    departing = tuple(DepartingRecord.from_kv(kv) for kv in departing_kvs)
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
                    tuple(queue_entry(kv) for kv in queue_kvs), usage_age_s=age, usage_stale=stale,
                    departing=departing)


@functools.lru_cache(maxsize=8192)
def queue_entry(kv: KV) -> QueueEntry:
    """``QueueEntry.from_kv``, cached: every round reads the host's whole queue, and entries rarely change
    (a KV is immutable, and equal only with the same key, value and revisions)."""
    return QueueEntry.from_kv(kv)
