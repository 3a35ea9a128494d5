"""One snapshot of the whole fleet as multi-host gangs see it (``replica/fleet.py``): every host's view (as a host's
own round reads it), the waiting gangs (``gangqueue/``), and each host as ``policy/fleet.py`` plans on it."""
from __future__ import annotations

import dataclasses
import time
from typing import Callable, Collection, Iterable, Mapping, Sequence

from coordinator import clock
from coordinator.config import CoordinatorConfig
from coordinator.etcd.types import KV
from coordinator.keys import Keys
from coordinator.policy.backfill import earliest_start
from coordinator.policy.fleet import FleetHost, FleetRequest
from coordinator.policy.gang import could_use, holders_from_views, slots_from_views
from coordinator.policy.host import HostView, host_guards
from coordinator.policy.placement import Chosen, GangRequest, Refused, place
from coordinator.policy.victims import Holder
from coordinator.records import (
    EvictionRecord,
    InvalidRecord,
    QueueEntry,
    SessionInfo,
    StoredKV,
    VramLease,
    dumps,
)
from coordinator.replica.call import AcquireCall
from coordinator.replica.context import ReplicaContext
from coordinator.replica.view import (
    HOST_KINDS,
    HostSnapshot,
    host_snapshot_of,
    host_view,
    lease_of,
    usage_is_stale,
)
from coordinator.replica.waits import lease_ends
from coordinator.txn import Absent, Compare, Delete, ModRevisionIs, Op, Put, Range


@dataclasses.dataclass
class Fleet:
    """One snapshot of the whole fleet, host by host, and the waiting gangs."""

    revision: int
    views: dict[str, HostView]
    gangs: dict[str, tuple[KV, QueueEntry]]    # lease id -> its gangqueue entry
    sessions: set[str]                         # live session ids among the calls'
    leases: dict[str, list[VramLease]] = dataclasses.field(default_factory=dict)   # id -> every record (any host)
    from_mirror: bool = False   # the replica's watch-fed copy (only a grant is decided from it)


ViewCache = dict[str, tuple[HostSnapshot, HostView]]


def mirror_fleet(ctx: ReplicaContext, sessions: Sequence[SessionInfo], cache: ViewCache | None = None) -> Fleet:
    """The fleet as the replica's mirror has it, at its revision: exactly the snapshot etcd would serve there
    (``replica/mirror.py``). A grant decided from it is validated by its transaction's compares; anything else is
    decided again from ``read_fleet`` (a stale copy never refuses, reserves or evicts). ``cache``: each host's view
    as last built, used again while none of the host's keys changed and its usage report is as fresh or stale as
    it was (its guards then compare from that view's revision: nothing was written there since)."""
    mirror, keys = ctx.mirror, ctx.keys
    views = {}
    for host in sorted(mirror.hosts()):
        snap = mirror.host_snapshot(host)
        kept = cache.get(host) if cache is not None else None
        if kept is not None and _same_keys(kept[0], snap) and usage_is_stale(
                kept[1].usage, ctx.usage_age(snap.usage) if snap.usage else -1.0) == kept[1].usage_stale:
            views[host] = kept[1]
            continue
        views[host] = host_view(keys, host, snap, ctx.config.untracked_vram, ctx.usage_age)
        if cache is not None:
            cache[host] = (snap, views[host])
    if cache is not None:
        for gone in set(cache) - set(views):
            del cache[gone]
    return Fleet(mirror.revision, views, _gangs(mirror.items("gangqueue")),
                 {x.session_id for x in sessions if mirror.get(keys.session(x.agent, x.session_id)) is not None},
                 _leases(mirror.all_host_items("leases")), from_mirror=True)


def _same_keys(a: HostSnapshot, b: HostSnapshot) -> bool:
    return (a.host, a.usage, a.partition, a.ledgers, a.leases, a.queue, a.departing, a.cordon) == \
        (b.host, b.usage, b.partition, b.ledgers, b.leases, b.queue, b.departing, b.cordon)


def _gangs(kvs: Iterable[KV]) -> dict[str, tuple[KV, QueueEntry]]:
    gangs = {}
    for kv in kvs:
        try:
            entry = QueueEntry.from_kv(kv)
        except InvalidRecord:
            continue
        gangs[entry.lease_id] = (kv, entry)
    return gangs


def _leases(kvs: Iterable[KV]) -> dict[str, list[VramLease]]:
    leases: dict[str, list[VramLease]] = {}
    for kv in kvs:
        try:
            lease = lease_of(kv)
        except InvalidRecord:
            continue   # (its host is INVALID: the host's view says so)
        leases.setdefault(lease.id, []).append(lease)
    return leases


async def read_fleet(ctx: ReplicaContext, sessions: Sequence[SessionInfo]) -> Fleet:
    """The whole fleet and the waiting gangs in one snapshot, with which of ``sessions`` are live."""
    keys = ctx.keys
    session_keys = [keys.session(x.agent, x.session_id) for x in sessions]
    ranges = [Range(keys.kind(k), prefix=True) for k in HOST_KINDS]
    snap = await ctx.store.snapshot([*ranges, Range(keys.gang_queue(), prefix=True),
                                          *(Range(k, keys_only=True) for k in session_keys)])
    by_host: dict[str, dict[str, list[KV]]] = {}
    for kind, kvs in zip(HOST_KINDS, snap.ranges):
        for kv in kvs:
            parts = keys.parse(kv.key)[1]
            if parts:
                by_host.setdefault(parts[0], {}).setdefault(kind, []).append(kv)
    leases = _leases(snap.ranges[HOST_KINDS.index("leases")])
    views = {}
    for host, by_kind in by_host.items():
        views[host] = host_view(keys, host, host_snapshot_of(snap.revision, host, by_kind),
                                ctx.config.untracked_vram, ctx.usage_age)
    live = {x.session_id for x, r in zip(sessions, snap.ranges[len(HOST_KINDS) + 1:]) if r}
    return Fleet(snap.revision, views, _gangs(snap.ranges[len(HOST_KINDS)]), live, leases)


def fleet_hosts(fleet: Fleet, agent: str, rank: str, lease_id: str) -> dict[str, FleetHost]:
    """Every host as a multi-host gang of ``agent`` ranked ``rank`` sees it (``policy/fleet.FleetHost``): what
    requests ranked before it wait for there (G2), cordoned, or never usable (gone, INVALID, not its partition)."""
    out = {}
    for host, view in sorted(fleet.views.items()):
        inv = view.inventory
        never = ("gone" if not view.alive or inv is None else "INVALID" if view.invalid else "")
        partition = view.effective_partition() if inv is not None else None
        if not never and partition is not None and not partition.allows(agent):
            never = "outside the agent's partition"
        if never or inv is None or partition is None:
            out[host] = FleetHost(host, {}, (), {}, never=never)
            continue
        slots = slots_from_views(view.gpus.values(), agent, inv)
        by_uuid = {s.uuid: s.index for s in slots}
        blocked: set[int] = set()
        for e in view.entries:
            if e.rank >= rank or e.lease_id == lease_id:
                continue
            if e.multi_host:
                blocked |= {by_uuid[u] for u in e.reserve if u in by_uuid}
                continue
            theirs = GangRequest(e.gpu_count, e.vram_mb, partition.gpu_caps(e.agent, inv), e.exclusive, e.topology,
                                 e.gpus or ((e.gpu,) if e.gpu else None))
            usable = could_use(slots_from_views(view.gpus.values(), e.agent, inv), theirs)
            if not isinstance(usable, Refused):
                blocked |= set(usable)
        out[host] = FleetHost(host, dict(inv.labels), slots, partition.gpu_caps(agent, inv),
                              frozenset(blocked), cordoned=view.cordon is not None)
    return out


def entry_of(kv: StoredKV) -> QueueEntry | None:
    try:
        return QueueEntry.from_kv(kv)
    except InvalidRecord:
        return None


def entry_ops(fleet: Fleet, lease_id: str, replica_id: str, keep: Mapping[str, tuple[str, ...]] | None = None,
              own_only: bool = False) -> tuple[list[Compare], list[Op]]:
    """Removing a gang's entries (its gangqueue entry, and its reservations except those ``keep`` lists
    unchanged), each compared on its mod_revision. ``own_only``: only while replica ``replica_id`` serves them
    (a cancelled try leaves the entries of its retry through another replica alone)."""
    compares: list[Compare] = []
    ops: list[Op] = []
    gang = fleet.gangs.get(lease_id)
    if own_only and gang is not None and gang[1].replica != replica_id:
        return compares, ops
    if gang is not None and keep is None:
        compares.append(ModRevisionIs(gang[0].key, gang[0].mod_revision))
        ops.append(Delete(gang[0].key))
    for host, view in fleet.views.items():
        for kv in view.queue:
            e = entry_of(kv)
            if e is not None and e.lease_id == lease_id and (keep is None or keep.get(host) != e.reserve):
                compares.append(ModRevisionIs(kv.key, kv.mod_revision))
                ops.append(Delete(kv.key))
    return compares, ops


def records_of(fleet: Fleet, lease_id: str) -> tuple[VramLease, ...]:
    """Every record of a granted lease in the snapshot, in rank order then GPU index order."""
    found = fleet.leases.get(lease_id, [])
    if not found:
        return ()
    order = {h: n for n, (h, _) in enumerate(found[0].parts)}
    return tuple(sorted(found, key=lambda x: (order.get(x.host, 0), x.gpu_index)))


def eviction_inputs(fleet: Fleet, hosts: dict[str, FleetHost], agent: str, evicting: set[str],
                    idle: Collection[str] = (), team_of: Callable[[str], str] | None = None
                    ) -> tuple[list[FleetHost], dict[str, list[Holder]]]:
    """The hosts and their leases as G3 over host sets sees them (``policy/fleet.plan_gang_eviction``): the leases
    already under a notice count as gone (as ``admission.plan_eviction`` counts them). With teams (``team_of``),
    another team's lease is never a victim by priority (G11: G3 stays within a team; ``reclaim.own_team_only``)."""
    def own(h: Holder) -> Holder:
        return h if team_of is None or team_of(h.agent) == team_of(agent) else dataclasses.replace(h, preemptible=False)
    out, holders = [], {}
    for name, h in hosts.items():
        view = fleet.views[name]
        if h.never or view.inventory is None:
            out.append(h)
            continue
        out.append(dataclasses.replace(h, slots=slots_from_views(view.gpus.values(), agent, view.inventory, evicting)))
        holders[name] = [own(x) for x in holders_from_views(view.gpus.values(), evicting, idle)]
    return out, holders


def reservation_start(fleet: Fleet, wanted: Mapping[str, tuple[str, ...]], notices: Mapping[str, EvictionRecord],
                      margin_s: float) -> float:
    """When the GPUs a gang reserves (``wanted``: host -> uuids) are all free at the latest: the latest known end of
    their leases over every host (``policy/backfill.earliest_start``); 0 when unknown. What a backfill's lease must
    be gone by."""
    start, now = 0.0, clock.wall()
    for host, uuids in wanted.items():
        view = fleet.views[host]
        at = earliest_start([view.gpus[u] for u in uuids if u in view.gpus], lease_ends(view, notices, margin_s), now)
        if at <= 0:
            return 0.0
        start = max(start, at)
    return start


def gang_entry(c: AcquireCall, req: FleetRequest, rank: str, replica_id: str) -> QueueEntry:
    """A waiting multi-host gang's entry (``gangqueue/<rank>``; with ``reserve``, its reservation on a host)."""
    left = max(0.0, c.deadline - time.monotonic())
    return QueueEntry(rank=rank, agent=c.session.agent, session_id=c.session.session_id,
                      etcd_lease=c.session.etcd_lease, vram_mb=c.vram_mb, gpu="", priority=c.priority,
                      preemptible=c.preemptible, request_id=c.request_id, lease_id=c.lease_id,
                      deadline_unix=clock.wall() + left, replica=replica_id, wait_s=left,
                      gpu_count=c.gpu_count, exclusive=c.exclusive, topology=c.topology,
                      time_limit_s=c.time_limit_s, time_limit_warning_s=c.time_limit_warning_s,
                      hosts=req.hosts, same=req.same, prefer=req.prefer)


def gang_queue_full(fleet: Fleet, agent: str, lease_id: str, hosts: Iterable[str], cfg: CoordinatorConfig) -> str:
    """Why a new multi-host gang may not wait (G9, every queue is bounded): its agent already has ``per_agent``
    gangs waiting, or a host it would reserve has ``per_host`` waiting entries or ``per_agent`` of its agent's;
    "" when it may. Nothing is displaced: a gang that finds a queue full is refused naming ``queue``."""
    per_agent, per_host = cfg.max_queue_per_agent, cfg.max_queue_per_host
    mine = sum(1 for lid, (_, e) in fleet.gangs.items() if e.agent == agent and lid != lease_id)
    if mine >= per_agent:
        return f"queue: agent {agent!r} already has {mine} multi-host gangs waiting (limit {per_agent} per agent)"
    for host in sorted(hosts):
        entries = [e for e in fleet.views[host].entries if e.lease_id != lease_id]
        theirs = sum(1 for e in entries if e.agent == agent)
        if len(entries) >= per_host:
            return f"queue: host {host!r} already has {len(entries)} waiting requests (limit {per_host})"
        if theirs >= per_agent:
            return (f"queue: agent {agent!r} already has {theirs} waiting requests on host {host!r} "
                    f"(limit {per_agent} per agent)")
    return ""


def unneeded_victims(fleet: Fleet, hosts: Mapping[str, FleetHost], req: FleetRequest, agent: str,
                     pending: Sequence[str], evicting: Collection[str]) -> set[str]:
    """The victims of a waiting gang it no longer needs (G3: a notice serves its requester only while it needs
    the victim): each whose every host's part of the gang fits with that victim kept (the gang's other victims,
    and every lease under a notice, counted gone), free of what requests ranked before it wait for."""
    out = set()
    for v in pending:
        needed = False
        for name, h in hosts.items():
            view = fleet.views[name]
            if view.inventory is None or not any(x.id == v for gpu in view.gpus.values() for x in gpu.leases):
                continue
            slots = slots_from_views(view.gpus.values(), agent, view.inventory, set(evicting) - {v})
            needed = needed or h.never != "" or not isinstance(place(slots, req.on(h), h.blocked), Chosen)
        if not needed:
            out.add(v)
    return out


def withdrawals(keys: Keys, notice: Callable[[bytes], KV | None], fleet: Fleet, victims: Iterable[str], me: str
                ) -> tuple[list[Compare], list[Op]]:
    """Withdrawing the notices ``me`` (agent/request id) made to ``victims`` whose lease still lives, each compared
    on its mod_revision (``notice``: a key's record in the replica's mirror of etcd)."""
    compares: list[Compare] = []
    ops: list[Op] = []
    for victim in victims:
        kv = notice(keys.eviction(victim))
        if victim in fleet.leases and kv is not None and requested_by(kv) == me:
            compares.append(ModRevisionIs(kv.key, kv.mod_revision))
            ops.append(Delete(kv.key))
    return compares, ops


def grant_writes(keys: Keys, fleet: Fleet, c: AcquireCall, parts: tuple[tuple[str, tuple[str, ...]], ...],
                 mark: bool | None, wall: float) -> tuple[list[VramLease], list[Compare], list[Op]]:
    """A gang's grant over ``parts`` (host -> GPU uuids, in rank order): a lease record and a bumped ledger per GPU,
    and each host's guards (``policy/host.host_guards``, as a host's own round compares)."""
    new: list[VramLease] = []
    compares: list[Compare] = []
    ops: list[Op] = []
    for host, uuids in parts:
        view = fleet.views[host]
        compares += host_guards(keys, view)
        for u in uuids:
            gpu = view.gpus[u]
            lease = VramLease(
                id=c.lease_id, host=host, gpu_uuid=u, gpu_index=gpu.index, agent=c.session.agent,
                session_id=c.session.session_id, vram_mb=gpu.usable_mb if c.exclusive else c.vram_mb,
                priority=c.priority, preemptible=c.preemptible, request_id=c.request_id, token=gpu.seq + 1,
                created_at=wall, gang=uuids if len(uuids) > 1 else (), exclusive=c.exclusive, topology=c.topology,
                over_quota=mark, time_limit_s=c.time_limit_s, time_limit_warning_s=c.time_limit_warning_s,
                hosts=parts, etcd_lease=c.session.etcd_lease)
            new.append(lease)
            ops.append(Put(keys.lease(host, u, c.lease_id), dumps(lease.to_json()), c.session.etcd_lease))
            ops.append(Put(keys.gpu(host, u), dumps({"capacity_mb": gpu.total_mb, "seq": gpu.seq + 1})))
    return new, compares, ops


def least_gang_charge(fleet: Fleet, req: FleetRequest, reserved: Mapping[str, tuple[str, ...]]) -> int:
    """The least a waiting gang's grant on the hosts it reserves could be charged (G11): VRAM x GPUs x hosts, or,
    exclusive, the usable VRAM of the ``gpu_count`` smallest GPUs it reserves on each host."""
    if not req.exclusive:
        return req.vram_mb * req.gpu_count * req.hosts
    return sum(sum(sorted(fleet.views[h].gpus[u].usable_mb for u in uuids if u in fleet.views[h].gpus)[:req.gpu_count])
               for h, uuids in reserved.items())


def uuids_of(host: FleetHost, indexes: tuple[int, ...]) -> tuple[str, ...]:
    return tuple(s.uuid for s in host.slots if s.index in indexes)


def is_gang_key(keys: Keys, x: object) -> bool:
    key = getattr(x, "key", b"")
    return isinstance(key, bytes) and key.startswith(keys.gang_queue())


def requested_by(kv: KV) -> str:
    try:
        return EvictionRecord.from_kv(kv).requested_by
    except InvalidRecord:
        return ""


def beyond_one_transaction(req: FleetRequest, hosts: Iterable[FleetHost], max_txn_ops: int) -> str:
    """Why no transaction can ever grant ``req`` (etcd's per-transaction limit ``max_txn_ops``, less
    ``policy/txn_budget.py``): a lease record and a ledger per GPU, a guard per host and per ledger of each
    host; "" when one can."""
    from coordinator.policy.txn_budget import beyond, gang_txn_bytes
    usable = [h for h in hosts if not h.never]
    widest = max((len(h.slots) for h in usable), default=0)
    ops = 2 * req.hosts * req.gpu_count + req.hosts + 1
    compares = req.hosts * (7 + widest) + 3
    size = gang_txn_bytes(req.hosts, req.gpu_count, max((len(h.host) for h in usable), default=0),
                          max((len(s.uuid) for h in usable for s in h.slots), default=0))
    why = beyond(ops, compares, size, max_txn_ops)
    return f"hosts: {req.hosts} hosts x {req.gpu_count} GPUs need up to {why}" if why else ""


def gang_notices(keys: Keys, fleet: Fleet, c: AcquireCall, req: FleetRequest, victims: Sequence[tuple[str, str]],
                 grace_s: float, reclaim: str = "") -> tuple[list[Compare], list[Op]]:
    """The eviction notices of a gang's victims (``victims``: (host, lease id)), each compared on its records on its
    host: by priority (G3), or reclaimed by team ``reclaim`` (G11)."""
    wall = clock.wall()
    what = f"{req.hosts} hosts x {c.gpu_count} {'whole GPUs' if c.exclusive else f'GPUs with {c.vram_mb} MiB each'}"
    reason = (f"team {reclaim!r} reclaims its quota for a request for {what}: this lease is over its team's quota"
              if reclaim else f"priority {c.priority} request for {what} needs the room")
    compares: list[Compare] = []
    ops: list[Op] = []
    for host, lease_id in victims:
        parts = [x for gpu in fleet.views[host].gpus.values() for x in gpu.leases if x.id == lease_id]
        first = parts[0]
        record = EvictionRecord(
            lease_id=lease_id, host=host, gpu_uuid=first.gpu_uuid, agent=first.agent, session_id=first.session_id,
            victim_priority=first.priority, requested_by=f"{c.session.agent}/{c.request_id}",
            requester_priority=c.priority, reason=reason, deadline_unix=wall + grace_s, created_at=wall,
            reclaim=reclaim)
        compares += [ModRevisionIs(keys.lease(host, x.gpu_uuid, x.id), x.mod_revision) for x in parts]
        compares.append(Absent(keys.eviction(lease_id)))
        ops.append(Put(keys.eviction(lease_id), dumps(record.to_json()), first.etcd_lease))
    return compares, ops
