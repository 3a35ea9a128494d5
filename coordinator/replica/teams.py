"""Teams as operators manage them (``gpucoord team set|show|list|delete``): each write is one transaction that
compares the team's own key and that no team changed since the read, so no two teams ever claim the same
member pattern at any revision; and the teams' usage, read from etcd at one revision."""
from __future__ import annotations

import dataclasses
import logging
import weakref
from typing import Any, Callable, Iterable, Mapping, Sequence

from coordinator import clock, errors
from coordinator.etcd.types import KV
from coordinator.keys import Keys, last_segment
from coordinator.policy.accounting import decayed_by_team
from coordinator.policy.host import HostView
from coordinator.policy.team_admission import TeamState, by_lease, charge_of
from coordinator.policy.teams import (
    DEFAULT_TEAM,
    Charge,
    Membership,
    Team,
    TeamError,
    Usage,
    default_team,
    member_conflicts,
    usage_by_team,
)
from coordinator.policy.usage_days import gpu_seconds_by_day, last_days
from coordinator.records import (
    HostInventory,
    InvalidRecord,
    QueueEntry,
    VramLease,
    dumps,
    load_record,
)
from coordinator.replica.context import ReplicaContext
from coordinator.replica.mirror import Mirror
from coordinator.txn import Delete, ModRevisionIs, NothingWrittenSince, Put, Range

log = logging.getLogger(__name__)


def read_teams(kvs: Iterable[KV]) -> tuple[dict[str, Team], dict[str, KV]]:
    """The stored teams, and the malformed ones (left out of membership: their agents are in ``default``)."""
    teams: dict[str, Team] = {}
    bad: dict[str, KV] = {}
    for kv in kvs:
        try:
            team = Team.from_kv(kv)
        except InvalidRecord as e:
            log.warning("ignoring a malformed team %r: %s", kv.key[:200], e)
            bad[last_segment(kv.key)] = kv
            continue
        teams[team.name] = team
    return teams, bad


def waiting_charge_mb(vram_mb: int, gpu_count: int, exclusive: bool, usable: Iterable[int]) -> int:
    """What a waiting request counts as in its team's WAITING (``team list``): ``vram_mb`` on each of its
    GPUs; exclusive, the least its grant could be charged, the smallest usable VRAM of ``gpu_count`` of its
    host's GPUs (``usable``, in MiB)."""
    if not exclusive:
        return vram_mb * gpu_count
    return sum(sorted(usable)[:gpu_count])


def charges_from_views(views: Iterable[HostView], membership: Membership) -> tuple[list[Charge],
                                                                                    list[tuple[str, int]]]:
    """Every lease of the views as a charge (with its GPU's model), and every queue entry as (team, VRAM)."""
    charges: list[Charge] = []
    waiting: list[tuple[str, int]] = []
    for view in views:
        models = {g.uuid: g.name for g in view.inventory.gpus} if view.inventory is not None else {}
        records = [x for g in sorted(view.gpus.values(), key=lambda g: g.index) for x in g.leases]
        charges += [charge_of(parts, membership, models) for parts in by_lease(records)]
        usable = [g.usable_mb for g in view.gpus.values()]
        waiting += [(membership.team_of(e.agent), waiting_charge_mb(e.vram_mb, e.gpu_count, e.exclusive, usable))
                    for e in view.entries]
    return charges, waiting


class Teams:
    def __init__(self, ctx: ReplicaContext) -> None:
        self.store, self.keys, self.config = ctx.store, ctx.keys, ctx.config

    async def set_team(self, name: str, changes: Mapping[str, Any]) -> tuple[Team, bool]:
        """Create or change a team: ``changes`` (fields of its JSON document) over its stored values (or the
        defaults). INVALID_ARGUMENT naming the field; FAILED_PRECONDITION naming ``members`` when another team
        claims one of its patterns. Nothing is written unless the whole team is valid."""
        for _ in range(self.config.commit_attempts * 4):
            snap = await self.store.snapshot([Range(self.keys.teams(), prefix=True)])
            teams, bad = read_teams(snap.ranges[0])
            current = teams.get(name)
            try:
                # A malformed record of this team is what a set repairs: it starts over from the defaults.
                team = (current or default_team(name)).changed(changes)
            except TeamError as e:
                raise errors.InvalidArgument(str(e), e.field.split("[")[0]) from None
            conflicts = member_conflicts(team, teams.values())
            if conflicts:
                raise errors.FailedPrecondition("members: " + "; ".join(conflicts[:4]), "members")
            key = self.keys.team(name)
            own = current.mod_revision if current is not None else (bad[name].mod_revision if name in bad else 0)
            res = await self.store.commit([ModRevisionIs(key, own),
                                           NothingWrittenSince(self.keys.teams(), snap.revision)],
                                          [Put(key, dumps(team.to_json()))])
            if res.succeeded:
                return Team.from_json(team.to_json(), name, res.revision), current is None and name not in bad
        raise errors.Unavailable("team set: too much contention on teams/; retry")

    async def delete_team(self, name: str) -> bool:
        """Delete a team's record (its agents fall to the next matching team, else ``default``); False when
        there was none. Leases are not touched."""
        key = self.keys.team(name)
        snap = await self.store.snapshot([Range(key)])
        if not snap.ranges[0]:
            return False
        res = await self.store.commit([ModRevisionIs(key, snap.ranges[0][0].mod_revision)], [Delete(key)])
        return res.succeeded or await self.delete_team(name)

    async def status_rows(self, views: Iterable[HostView]
                          ) -> tuple[list[tuple[Team, Usage, bool]], dict[str, dict[str, float]]]:
        """The teams table of ``gpucoord status``: every stored team and ``default`` with their usage in
        ``views`` (every host, from one snapshot), and each team's GPU-seconds on each of the last days
        (``accounting.gpu_seconds_by_day``); ([], {}) when no team is stored."""
        teams, _ = read_teams((await self.store.get_prefix(self.keys.teams())).kvs)
        if not teams:
            return [], {}
        membership = Membership(teams.values())
        charges, waiting = charges_from_views(views, membership)
        usage = usage_by_team(charges, membership, waiting)
        rollups = (await self.store.get_prefix(self.keys.usage_rollups())).kvs
        leases = [x for v in views for x in v.leases.values() for _ in x.gpus]   # one start per GPU
        now = clock.wall()
        decayed = decayed_by_team(self.keys, membership, rollups, leases, self.config.usage_half_life_s, now)
        return [(membership.team(n), dataclasses.replace(usage.get(n, Usage()), decayed_gpu_s=decayed.get(n, 0.0)),
                 n in teams) for n in sorted(set(usage) | set(teams) | {DEFAULT_TEAM})], \
            gpu_seconds_by_day(self.keys, rollups, last_days(now))

    async def team_status(self, name: str = "") -> tuple[int, list[tuple[Team, Usage, bool]]]:
        """Teams (one, or every stored team and ``default``) with their usage, all read at one revision:
        (revision, [(team, usage, stored)]). A malformed team reads as absent (its agents are in ``default``)."""
        kinds = ("teams", "leases", "queue", "hosts", "partitions")
        snap = await self.store.snapshot([*(Range(self.keys.kind(k), prefix=True) for k in kinds),
                                          Range(self.keys.usage_rollups(), prefix=True)])
        team_kvs, lease_kvs, queue_kvs, host_kvs, partition_kvs, rollup_kvs = snap.ranges
        teams, _ = read_teams(team_kvs)
        membership = Membership(teams.values())
        models = gpu_models(host_kvs)
        records = []
        for kv in lease_kvs:
            try:
                records.append(VramLease.from_kv(kv))
            except InvalidRecord:
                continue
        charges = [charge_of(parts, membership, models) for parts in by_lease(records)]
        waiting = []
        usable = usable_by_host(self.keys, host_kvs, partition_kvs)
        for kv in queue_kvs:
            try:
                entry = QueueEntry.from_kv(kv)
            except InvalidRecord:
                continue
            waiting.append((membership.team_of(entry.agent), waiting_charge_mb(
                entry.vram_mb, entry.gpu_count, entry.exclusive, usable.get(self.keys.parse(kv.key)[1][0], ()))))
        usage = usage_by_team(charges, membership, waiting)
        decayed = decayed_by_team(self.keys, membership, rollup_kvs, records, self.config.usage_half_life_s,
                                  clock.wall())
        names = [name] if name else sorted(set(usage) | set(teams) | {DEFAULT_TEAM})
        return snap.revision, [(membership.team(n), dataclasses.replace(usage.get(n, Usage()),
                                                                        decayed_gpu_s=decayed.get(n, 0.0)),
                                n in teams) for n in names]


# -- admission (G11): the teams' state a round is decided against ------------------------------------------------

def gpu_models(host_kvs: Iterable[KV]) -> dict[str, str]:
    """GPU uuid -> model, from the hosts' registrations (malformed ones left out)."""
    models: dict[str, str] = {}
    for kv in host_kvs:
        try:
            inventory = HostInventory.from_json(load_record(kv.value).get("inventory"))  # type: ignore[arg-type]
        except (InvalidRecord, AttributeError):
            continue
        models.update((g.uuid, g.name) for g in inventory.gpus)
    return models


def usable_by_host(keys: Keys, host_kvs: Iterable[KV], partition_kvs: Iterable[KV]) -> dict[str, list[int]]:
    """Host -> the usable VRAM (MiB) of each of its GPUs: total less its partition's headroom (malformed
    records left out)."""
    headroom: dict[str, int] = {}
    for kv in partition_kvs:
        try:
            part = load_record(kv.value).get("partition")
            if isinstance(part, dict):
                headroom[keys.parse(kv.key)[1][0]] = int(part.get("headroom_mb", 0))
        except (InvalidRecord, AttributeError, TypeError, ValueError, IndexError):
            continue
    out: dict[str, list[int]] = {}
    for kv in host_kvs:
        try:
            inventory = HostInventory.from_json(load_record(kv.value).get("inventory"))  # type: ignore[arg-type]
        except (InvalidRecord, AttributeError):
            continue
        cut = headroom.get(inventory.host, 0)
        out[inventory.host] = [max(0, g.vram_total_mb - cut) for g in inventory.gpus]
    return out


@dataclasses.dataclass(frozen=True)
class _HostPart:
    """One host's leases as the teams count them, as of its lease stamp (-1: to be summed again)."""

    stamp: int
    leases: dict[bytes, tuple[int, VramLease]]        # lease key -> (mod_revision, the lease record)
    used: dict[str, int]                              # VRAM by team
    ids: frozenset[str]                               # the lease ids


@dataclasses.dataclass
class _Tally:
    """The teams' use as one mirror shows it, kept between rounds: each host's part is summed again only when
    one of its leases changed (``Mirror.lease_stamps``), and everything when a team changed."""

    generation: int = -1        # the mirror's generation("teams") the parts were summed under
    hosts: dict[str, _HostPart] = dataclasses.field(default_factory=dict)
    used: dict[str, int] = dataclasses.field(default_factory=dict)     # the sum of the hosts' parts
    # The hosts' lease ids, each with the count of hosts that list it (an id ended on one host and granted on
    # another between two rounds is on both until both are summed again).
    ids: dict[str, int] = dataclasses.field(default_factory=dict)


_tallies: weakref.WeakKeyDictionary[Mirror, _Tally] = weakref.WeakKeyDictionary()
# Per mirror: (``generation("teams")`` when parsed, the membership then).
_memberships: weakref.WeakKeyDictionary[Mirror, tuple[int, Membership | None]] = weakref.WeakKeyDictionary()


def membership_of(team_kvs: Iterable[KV]) -> Membership | None:
    """Who is in which team, from the stored teams; None when no team is stored (nothing is charged)."""
    teams, _ = read_teams(team_kvs)
    return Membership(teams.values()) if teams else None


def build_team_state(membership: Membership | None, ledger_kvs: Iterable[KV], leases: Sequence[VramLease],
                     revision: int, host_kvs: Callable[[], Iterable[KV]] = tuple) -> TeamState | None:
    """The teams' state from one copy at ``revision``: ``membership`` from its teams, ``leases`` every lease
    record of the fleet; None when no team is stored (nothing is charged). ``host_kvs`` gives the hosts'
    registrations, read only when a team has a quota per GPU model."""
    if membership is None:
        return None
    used: dict[str, int] = {}
    counted = set()
    for lease in leases:
        team = membership.team_of(lease.agent)
        used[team] = used.get(team, 0) + lease.vram_mb
        counted.add(lease.id)
    return TeamState(membership, used, frozenset(counted), _ledgers(ledger_kvs), revision, lambda: leases,
                     _models(membership, host_kvs))


def _models(membership: Membership, host_kvs: Callable[[], Iterable[KV]]) -> dict[str, str]:
    """GPU uuid -> model when a team has a quota per model (reclaim classifies by model then), else {}."""
    return gpu_models(host_kvs()) if any(t.quota_by_model for t in membership.teams.values()) else {}


def _ledgers(ledger_kvs: Iterable[KV]) -> dict[str, tuple[int, int]]:
    """The teams' ledgers: (mod_revision, seq) by team."""
    ledgers = {}
    for kv in ledger_kvs:
        try:
            seq = load_record(kv.value).get("seq", 0)
        except InvalidRecord:
            seq = 0
        ledgers[last_segment(kv.key)] = (kv.mod_revision, seq if isinstance(seq, int) and seq >= 0 else 0)
    return ledgers


def mirror_membership(mirror: Mirror) -> Membership | None:
    """``membership_of`` the mirror's teams, parsed again only when a team changed (or the mirror was reset):
    every round reads it, teams change when an operator says so."""
    generation = mirror.generation("teams")
    hit = _memberships.get(mirror)
    if hit is None or hit[0] != generation:
        hit = _memberships[mirror] = (generation, membership_of(mirror.items("teams")))
    return hit[1]


def _host_part(mirror: Mirror, host: str, membership: Membership,
               parsed: dict[bytes, tuple[int, VramLease]], stamp: int) -> _HostPart:
    """One host's leases as (mod_revision, record) by key (each parsed once: ``parsed`` holds the last ones),
    and their VRAM by team."""
    leases: dict[bytes, tuple[int, VramLease]] = {}
    used: dict[str, int] = {}
    for kv in mirror.host_items("leases", host):
        hit = parsed.get(kv.key)
        if hit is None or hit[0] != kv.mod_revision:
            try:
                lease = VramLease.from_kv(kv)
            except InvalidRecord:
                continue   # its host is INVALID: nothing is granted there
            hit = (kv.mod_revision, lease)
        leases[kv.key] = hit
        team = membership.team_of(hit[1].agent)
        used[team] = used.get(team, 0) + hit[1].vram_mb
    return _HostPart(stamp, leases, used, frozenset(x[1].id for x in leases.values()))


def _drop_ids(counts: dict[str, int], ids: Iterable[str]) -> None:
    for lease_id in ids:
        left = counts[lease_id] - 1
        if left:
            counts[lease_id] = left
        else:
            del counts[lease_id]


def mirror_team_state(mirror: Mirror) -> TeamState | None:
    """The teams' state as the mirror shows it (at ``mirror.revision``). The use by team is kept between
    rounds and summed again for the hosts whose leases changed since the last round (all of them when a team
    changed), so a round costs the hosts' count, not the fleet's leases."""
    membership = mirror_membership(mirror)
    if membership is None:
        return None
    tally = _tallies.get(mirror)
    generation = mirror.generation("teams")
    if tally is None or tally.generation != generation:
        # Keep what was parsed; sum every host again under the new membership.
        old = tally.hosts if tally is not None else {}
        tally = _tallies[mirror] = _Tally(generation)
        tally.hosts = {h: _HostPart(-1, part.leases, {}, frozenset()) for h, part in old.items()}
    stamps = mirror.lease_stamps()
    for host in [h for h in tally.hosts if h not in stamps]:    # its last lease ended (or a reset)
        gone = tally.hosts.pop(host)
        for team, mb in gone.used.items():
            tally.used[team] -= mb
        _drop_ids(tally.ids, gone.ids)
    for host, stamp in stamps.items():
        part = tally.hosts.get(host)
        if part is not None and part.stamp == stamp:
            continue
        new = tally.hosts[host] = _host_part(mirror, host, membership, part.leases if part is not None else {}, stamp)
        if part is not None:
            for team, mb in part.used.items():
                tally.used[team] -= mb
            _drop_ids(tally.ids, part.ids)
        for team, mb in new.used.items():
            tally.used[team] = tally.used.get(team, 0) + mb
        for lease_id in new.ids:
            tally.ids[lease_id] = tally.ids.get(lease_id, 0) + 1
    counted = frozenset(tally.ids)
    used_now = {team: mb for team, mb in tally.used.items() if mb}
    parts = list(tally.hosts.values())     # as of now: a later round replaces parts, never changes one

    def records() -> list[VramLease]:
        return [lease for part in parts for _, lease in part.leases.values()]
    return TeamState(membership, used_now, counted, _ledgers(mirror.items("teamledgers")), mirror.revision,
                     records, _models(membership, lambda: mirror.items("hosts")))


async def team_state(ctx: ReplicaContext, revision: int, wait_s: float,
                     again: bool = False) -> tuple[TeamState | None, int]:
    """The teams' state at ``revision`` or later: from the mirror once it has caught up (within ``wait_s``),
    else read from etcd (every team, ledger and lease of the fleet). With it, the revision it was read at.

    (None, R) when no team is stored as of revision R: at once when the mirror shows none, even when it has
    not caught up with ``revision`` yet (a fleet without teams pays no wait). The round then compares that no
    team was written after R (``planner``: ``Context.no_teams_since``): a team created meanwhile fails its
    grant, which is decided again counting it, so no grant escapes a team stored before it. ``again``: the
    round's earlier attempt failed; the mirror must then have caught up for its "no team" to count."""
    if ctx.mirror.ready:
        if not ctx.mirror.items("teams") and (not again or ctx.mirror.revision >= revision):
            return None, ctx.mirror.revision
        if await ctx.mirror.caught_up(revision, wait_s):
            if not ctx.mirror.items("teams"):
                return None, ctx.mirror.revision
            state = mirror_team_state(ctx.mirror)
            return with_shares(state, ctx), ctx.mirror.revision
    keys = ctx.keys
    snap = await ctx.store.snapshot([Range(keys.teams(), prefix=True)])
    if not snap.ranges[0]:
        return None, snap.revision
    kinds = ("teams", "teamledgers", "leases", "hosts")
    snap = await ctx.store.snapshot([Range(keys.kind(k), prefix=True) for k in kinds])
    leases = []
    for kv in snap.ranges[2]:
        try:
            leases.append(VramLease.from_kv(kv))
        except InvalidRecord:
            continue
    built = build_team_state(membership_of(snap.ranges[0]), snap.ranges[1], leases, snap.revision,
                             lambda: snap.ranges[3])
    return with_shares(built, ctx), snap.revision


def with_shares(state: TeamState | None, ctx: ReplicaContext) -> TeamState | None:
    """The state with this replica's fair-share factors and the fleet's VRAM beyond the quotas."""
    shares = bool(ctx.fair_share) or ctx.borrowable_mb is not None
    return dataclasses.replace(state, fair=ctx.fair_share, borrowable_mb=ctx.borrowable_mb) if state and shares else state
