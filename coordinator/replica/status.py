"""The operator's view: every host at one revision with the eviction notices (``read_status``: a
``StatusReport``, which the servicer only converts to its message), and as plain JSON (``status_json``)."""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import math
from typing import Any

from coordinator import clock
from coordinator.aio import Pacer
from coordinator.etcd.types import KV
from coordinator.policy.departing import reported_pids
from coordinator.policy.host import HostView
from coordinator.policy.partition import default_partition
from coordinator.policy.waiting import WaitReason
from coordinator.records import (
    DepartingRecord,
    EvictionRecord,
    InvalidRecord,
    QueueEntry,
    VramLease,
    load_record,
)
from coordinator.replica.context import ReplicaContext
from coordinator.replica.idle import status_fields as idle_fields
from coordinator.replica.teams import mirror_team_state
from coordinator.replica.view import HOST_KINDS, host_snapshot_of, host_view, read_host
from coordinator.replica.waits import host_waits
from coordinator.txn import Range

# A whole fleet's status is built in slices with pauses for the event loop (``aio.Pacer``): 10,000 hosts and 100,000
# leases are seconds of work, during which an acquire of the same replica waited up to 2 s.
KEYS_AT_ONCE = 256     # keys grouped by host between two looks at the clock


@dataclasses.dataclass(frozen=True)
class StatusReport:
    """Every host's view at one revision (``views``, and as plain JSON in ``doc``), the remaining TTL of each
    session's etcd_lease (``ttls``), the eviction notices by lease id (read just after the snapshot, shown
    next to the leases they are about), the leader's replica id ("" when unknown) and why each queue entry
    waits (``waits``: host -> rank -> ``WaitReason``, docs/policies.md "Why a request waits")."""

    revision: int
    views: list[HostView]
    ttls: dict[int, int]
    notices: dict[str, EvictionRecord]
    leader: str = ""
    waits: dict[str, dict[str, WaitReason]] = dataclasses.field(default_factory=dict)
    idle: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)   # lease id -> its idle fields
    gangs: list[QueueEntry] = dataclasses.field(default_factory=list)   # the multi-host gangs waiting, by rank

    @property
    def doc(self) -> dict[str, Any]:
        return status_json(self.revision, self.views, self.ttls, self.idle)


async def read_report(ctx: ReplicaContext, host: str = "", leader: str = "") -> StatusReport:
    """The operator's view: ``read_status``, then the eviction notices (a malformed one is left out: the
    replica's watch has logged it)."""
    revision, views, ttls, gangs = await read_status(ctx, host)
    notices = {}
    for kv in (await ctx.store.get_prefix(ctx.keys.evictions())).kvs:
        try:
            notice = EvictionRecord.from_kv(kv)
        except InvalidRecord:
            continue
        notices[notice.lease_id] = notice
    teams = None
    if ctx.mirror.ready and ctx.mirror.items("teams"):
        teams = mirror_team_state(ctx.mirror)
    now = clock.wall()
    waits = {v.host: host_waits(v, notices, teams, now, ctx.config.eviction_kill_margin_s) for v in views if v.entries}
    return StatusReport(revision, views, ttls, notices, leader, waits, idle_fields(ctx), gangs)


async def read_status(ctx: ReplicaContext, host: str = ""
                      ) -> tuple[int, list[HostView], dict[int, int], list[QueueEntry]]:
    """Every host's view at one revision, the remaining TTL of each session's etcd_lease, and (every host asked
    for) the multi-host gangs waiting."""
    gangs: list[QueueEntry] = []
    if host:
        one = await read_host(ctx.store, ctx.keys, host)
        revision = one.revision
        views = [host_view(ctx.keys, host, one, ctx.config.untracked_vram, ctx.usage_age)]
    else:
        # Seven whole-prefix ranges in one transaction, whatever the number of hosts (a range per host
        # would pass etcd's limit of operations per transaction).
        snap = await ctx.store.snapshot([*(Range(ctx.keys.kind(k), prefix=True) for k in HOST_KINDS),
                                         Range(ctx.keys.gang_queue(), prefix=True)])
        revision = snap.revision
        for kv in snap.ranges[len(HOST_KINDS)]:
            with contextlib.suppress(InvalidRecord):
                gangs.append(QueueEntry.from_kv(kv))
        per_host: dict[str, dict[str, list[KV]]] = {}
        pacer = Pacer()
        for kind, kvs in zip(HOST_KINDS, snap.ranges):
            for n, kv in enumerate(kvs, 1):
                h = ctx.keys.parse(kv.key)[1][0]
                per_host.setdefault(h, {}).setdefault(kind, []).append(kv)
                if n % KEYS_AT_ONCE == 0:
                    await pacer.step()
        views = []
        for h in sorted(per_host):
            views.append(host_view(ctx.keys, h, host_snapshot_of(revision, h, per_host[h]),
                                   ctx.config.untracked_vram, ctx.usage_age))
            await pacer.step()
    sessions = {lease.etcd_lease: lease for v in views for lease in v.leases.values()}
    ttls, asked = {}, []
    for x, lease in sessions.items():
        left = ctx.session_left(lease.session_id)
        if left is not None:
            ttls[x] = math.ceil(left)   # kept in this replica's memory: no etcd call (its etcd lease holds the keys)
        else:
            asked.append((x, lease))
    etcd_left = await asyncio.gather(*(ctx.store.time_to_live(x) for x, _ in asked))
    ttls.update({x: _session_left(ctx, lease, left) for (x, lease), left in zip(asked, etcd_left)})
    return revision, views, ttls, gangs


async def agent_hosts(ctx: ReplicaContext, agent: str) -> set[str]:
    """The hosts on which ``agent`` has a live session (authorization of an agent's reads)."""
    snap = await ctx.store.get_prefix(ctx.keys.sessions(agent))
    hosts = set()
    for kv in snap.kvs:
        try:
            hosts.add(str(load_record(kv.value).get("host", "")))
        except InvalidRecord:
            continue   # a malformed session grants no host
    return hosts


def _session_left(ctx: ReplicaContext, lease: VramLease, etcd_left: int) -> int:
    """What the lease's session, kept by another replica, has left: at most its TTL; -1 when its etcd lease is
    gone. (A session's etcd lease has the long session_etcd_ttl_s.)"""
    if etcd_left < 0:
        return -1
    kv = ctx.mirror.get(ctx.keys.session(lease.agent, lease.session_id))
    ttl = ctx.config.session_ttl_s
    if kv is not None:
        with contextlib.suppress(InvalidRecord):
            stored = load_record(kv.value).get("ttl")
            ttl = stored if isinstance(stored, int) and stored > 0 else ttl
    return min(etcd_left, ttl)


def departing_json(d: DepartingRecord, usage: dict[str, Any] | None, held: bool) -> dict[str, Any]:
    """An ended lease whose processes the node reported when it ended: which it still reports, and whether
    its VRAM still counts as held (false once they are gone, or the kill margin has passed: ``forced``)."""
    return {"lease_id": d.lease_id, "agent": d.agent, "vram_mb": d.vram_mb, "requested_by": d.requested_by,
            "reason": d.reason, "revoke": d.revoke, "forced": d.forced, "held": held,
            "pids": list(reported_pids(usage, d.gpu_uuid, d.lease_id, d.pids))}


NOT_IDLE = {"idle": False, "idle_since": 0.0, "idle_action": ""}


def _utilization(report: dict[str, Any], stale: bool) -> dict[str, Any]:
    """A GPU's utilization as status shows it: -1 when unknown or stale (docs/policies.md "Idle GPUs")."""
    pct = report.get("utilization_pct", -1)
    known = isinstance(pct, int) and not isinstance(pct, bool) and 0 <= pct <= 100 and not stale
    return {"utilization_pct": pct if known else -1,
            "process_utilization": [] if stale else list(report.get("process_sm_pct", ()))}


def status_json(revision: int, views: list[HostView], ttls: dict[int, int],
                idle: dict[str, dict[str, Any]] | None = None) -> dict[str, Any]:
    """The operator's view, as plain JSON (``gpucoord status --json``); ``idle``: each lease's idle fields."""
    return {"revision": revision, "hosts": [host_json(v, ttls, idle or {}) for v in views]}


def host_json(v: HostView, ttls: dict[int, int], idle: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """One host of ``status_json``."""
    inv = v.inventory
    part = v.partition or (default_partition(inv) if inv else None)
    # The node's attribution of each GPU's processes to leases (over-use, orphans), as last reported.
    reported = {str(g.get("uuid")): g for g in (v.usage or {}).get("gpus", ())}
    gpus = []
    described = {x.uuid: x for x in inv.gpus} if inv else {}
    for g in sorted(v.gpus.values(), key=lambda g: g.index):
        info = described.get(g.uuid)
        numa = info.numa_node if info is not None else None
        gpus.append({"index": g.index, "uuid": g.uuid, "total_mb": g.total_mb, "usable_mb": g.usable_mb,
                     "leased_mb": g.leased_mb, "used_mb": -1 if g.nvml_used_mb is None else g.nvml_used_mb,
                     "untracked_mb": g.untracked_mb, "free_mb": g.free_mb, "seq": g.seq,
                     "name": info.name if info is not None else "",
                     "numa_node": -1 if numa is None else numa,     # -1: unknown
                     "nvlink_peers": list(info.nvlink_peers) if info is not None else [],
                     "processes": list(reported.get(g.uuid, {}).get("processes", ())),
                     "lease_use": list(reported.get(g.uuid, {}).get("leases", ())),
                     "departing_mb": g.departing_mb, **_utilization(reported.get(g.uuid, {}), v.usage_stale),
                     "departing": [departing_json(d, v.usage, held) for d in v.departing
                                   if d.gpu_uuid == g.uuid for held in [d.lease_id in v.departing_held]]})
    leases = [{**lease.to_json(), "ttl_remaining": ttls.get(lease.etcd_lease, -1),
               **idle.get(lease.id, NOT_IDLE)}
              for lease in sorted(v.leases.values(), key=lambda x: (x.gpu_index, x.token))]
    agents = []
    if part is not None and inv is not None:
        for alloc in part.allocations:
            # Every GPU's record (a gang holds VRAM on each), counted as one lease per id.
            used = [x for g in v.gpus.values() for x in g.leases if x.agent == alloc.agent]
            agents.append({"agent": alloc.agent, "allocation": alloc.to_json(),
                           "leased_mb": sum(x.vram_mb for x in used), "leases": len({x.id for x in used})})
    queue = [{**e.to_json(), "rank": e.rank} for e in v.entries]
    return {
        "host": v.host, "alive": v.alive, "address": inv.address if inv else "",
        "invalid": v.invalid,   # why a stored value of the host is malformed ("" when none is)
        "simulated": bool(inv.simulated) if inv else False, "labels": dict(inv.labels) if inv else {},
        "usage_age_s": round(v.usage_age_s, 1),
        "usage_stale": v.usage_stale,
        "cpu_count": inv.cpu_count if inv else 0, "mem_bytes": inv.mem_bytes if inv else 0,
        "disk_bytes": inv.disk_bytes if inv else 0, "partition_mode": part.mode if part else "shared",
        "partition_explicit": v.partition is not None, "gpus": gpus, "agents": agents, "leases": leases,
        "queue": queue, "cordoned": v.cordon is not None, "cordon": v.cordon.to_json() if v.cordon else None,
        "draining": v.cordon is not None and v.cordon.drain and bool(v.leases)}
