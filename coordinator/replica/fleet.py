"""Multi-host gangs on one replica (issue 30, G12): decided where the acquire arrives, from one snapshot of the
fleet (the mirror's first), and committed in one etcd transaction that compares what it read on every host it
touches; a retry through any replica finds the lease or takes the waiting entry over (docs/guarantees.md G12,
"Who decides, and races").

**Waiting.** A gang that does not fit waits as ``gangqueue/<rank>`` under its waiter's session, and reserves a
set of hosts (``policy/fleet.py``): on each an entry ``queue/<host>/<rank>`` (the same rank) that lists the GPUs
it reserves there. A host's own rounds never grant such an entry; they hold its GPUs back from every request
ranked after it (G2 across hosts). The grant deletes the gang's entries in its transaction. A wait that ends
removes them (or the leader's queue sweep, if this replica died and nobody retried), and a session that ends
takes them with it. Release, expiry and revoke take every record on every host in one transaction.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from typing import Any

from coordinator import clock, errors, metrics
from coordinator.aio import cancel_and_wait, spawn
from coordinator.keys import Keys, last_segment
from coordinator.policy.decide import wait_over
from coordinator.policy.fleet import (
    FleetGrant,
    FleetHost,
    FleetRequest,
    FleetWait,
    plan_gang,
)
from coordinator.policy.placement import Refused
from coordinator.policy.team_admission import (
    TeamState,
    grant_charge_mb,
    over_quota_mark,
    team_limit,
    team_writes,
)
from coordinator.policy.txn_budget import too_large
from coordinator.records import VramLease, dumps
from coordinator.replica.call import ORPHAN_GRACE_S, AcquireCall, give_back
from coordinator.replica.context import ReplicaContext
from coordinator.replica.fleet_victims import invalid_reclaims, new_victims
from coordinator.replica.fleet_view import (
    Fleet,
    ViewCache,
    beyond_one_transaction,
    entry_ops,
    fleet_hosts,
    gang_entry,
    gang_queue_full,
    grant_writes,
    is_gang_key,
    least_gang_charge,
    mirror_fleet,
    read_fleet,
    records_of,
    reservation_start,
    unneeded_victims,
    withdrawals,
)
from coordinator.replica.round import MIRROR_WAIT_S
from coordinator.replica.teams import team_state
from coordinator.txn import (
    Absent,
    Compare,
    Delete,
    Exists,
    ModRevisionIs,
    NothingWrittenSince,
    Op,
    Put,
)

log = logging.getLogger(__name__)
START_SLACK_S = 1.0   # a reservation's earliest start is rewritten when it moves by more than this
IDLE_WAKE_S = 1.0   # a waiting gang decides again at least this often (a safety net under the watch's wakes)
# The watch wakes waiting gangs on any change of any host: their rounds are paced to at most one per this long,
# so that a busy fleet (a thousand grants a second elsewhere) costs a few rounds, not one per change.
WATCH_PACE_S = 0.02


@dataclasses.dataclass(eq=False)
class GangCall:
    call: AcquireCall
    req: FleetRequest
    rank: str


class FleetAdmitter:
    """The multi-host gangs this replica serves: decided one at a time, in rank order."""

    def __init__(self, ctx: ReplicaContext) -> None:
        self.ctx, self.keys = ctx, ctx.keys
        self._calls: dict[str, GangCall] = {}
        self._writes = 0   # transactions sent: a round reads the fleet again after one
        self._last_commit = 0   # the revision of our last transaction (the mirror must have it to be used)
        self._orphans: dict[str, int] = {}   # lease id -> revision: granted to a caller that went away
        self._background: set[asyncio.Task[None]] = set()
        self._wake, self._kicked = asyncio.Event(), asyncio.Event()
        self._last_round = 0.0
        # The hosts that could hold a part of a waiting gang (by GPU count) as the last round saw them; None: all.
        self._relevant: set[str] | None = None
        self._views: ViewCache = {}   # each host's view from the mirror, kept while its keys stay as they were
        self._task = spawn(self._run(), "multi-host gangs")

    @property
    def has_calls(self) -> bool:
        return bool(self._calls)

    def notify(self, hosts: set[str], reshaped: set[str], team_room: bool) -> None:
        """Something moved on ``hosts`` (the watch; ``reshaped``: their registration, partition or cordon): the
        waiting gangs decide again, at most once per ``WATCH_PACE_S``, when it may matter to them: a host that
        could hold a part of one, a host reshaped, or room for a team."""
        if team_room or reshaped or self._relevant is None or hosts & self._relevant:
            self._wake.set()

    def _kick(self) -> None:
        """A call came or ended: decided again at once."""
        self._kicked.set()
        self._wake.set()

    async def stop(self) -> None:
        await cancel_and_wait([self._task])
        for g in self._calls.values():
            if not g.call.future.done():
                g.call.future.set_exception(errors.Unavailable("coordinator is shutting down; retry on another replica"))

    async def submit(self, call: AcquireCall, req: FleetRequest) -> VramLease:
        if self._task.done():
            raise errors.Unavailable("coordinator is shutting down; retry on another replica")
        rank = Keys.queue_rank(call.priority, call.arrival_ns, call.lease_id)
        self._orphans.pop(call.lease_id, None)   # a retry claims a lease its cancelled first try got
        prior = self._calls.get(call.lease_id)
        if prior is not None and not prior.call.future.done():
            prior.call.future.set_exception(errors.Unavailable("superseded by a retry of the same request"))
        self._calls[call.lease_id] = GangCall(call, req, prior.rank if prior is not None else rank)
        self._kick()
        call.future.add_done_callback(lambda _: self._kick())
        return await call.future

    # -- the loop ----------------------------------------------------------------------------------------
    async def _run(self) -> None:
        while True:
            if self._calls:
                nearest = min(g.call.deadline for g in self._calls.values())
                timeout = min(IDLE_WAKE_S, max(0.0, nearest - time.monotonic()))
            else:
                timeout = None
            try:
                await asyncio.wait_for(self._wake.wait(), timeout)
            except TimeoutError:
                self._kicked.set()   # a deadline, or the safety net: at once
            pause = self._last_round + WATCH_PACE_S - time.monotonic()
            if pause > 0 and not self._kicked.is_set():
                with contextlib.suppress(TimeoutError):   # the watch's wakes, paced (a call's own cut the pause)
                    await asyncio.wait_for(self._kicked.wait(), pause)
            self._wake.clear()
            self._kicked.clear()
            if not self._calls:
                continue
            self._last_round = time.monotonic()
            try:
                await self._round()
            except errors.GpucoordError as e:
                log.warning("multi-host gangs: a round failed (%s); deciding again", e)
                for g in list(self._calls.values()):
                    if g.call.wait_s <= 0 and not g.call.future.done():
                        g.call.future.set_exception(e)
                await asyncio.sleep(0.05)
                self._wake.set()
            # An answered call whose entries may still be in etcd (a rank) stays until a round removes them.
            self._calls = {k: g for k, g in self._calls.items() if not g.call.future.done() or g.call.rank is not None}

    async def _round(self) -> None:
        """Every call in rank order, from one snapshot of the fleet read again only after a write (or a lost
        compare). Each call is decided from the replica's mirror first (no read): a grant is committed from it,
        and a wait that writes nothing settled; anything else is decided again from etcd (``mirror_fleet``)."""
        fleet: Fleet | None = None
        etcd = False
        self._relevant, relevant = None, set()
        for g in sorted(self._calls.values(), key=lambda x: x.rank):
            attempts = 0
            while attempts < self.ctx.config.commit_attempts:
                if fleet is not None and fleet.from_mirror and etcd:
                    fleet = None
                if fleet is None:
                    fleet = await self._read(not etcd)
                writes = self._writes
                done = await self._decide(g, fleet)
                relevant |= {h for h, v in fleet.views.items() if len(v.gpus) >= g.call.gpu_count}
                if done is None:          # not a grant, decided from the mirror: again from etcd
                    fleet, etcd = None, True
                    continue
                if not done or self._writes != writes:
                    fleet = None
                if done:
                    break
                attempts, etcd = attempts + 1, True
                metrics.CONFLICTS.inc()
                await asyncio.sleep(0.005)
        self._relevant = relevant

    async def _read(self, mirror_ok: bool) -> Fleet:
        sessions = [x.call.session for x in self._calls.values()]
        mirror = self.ctx.mirror
        if mirror_ok and mirror.ready:
            if mirror.revision < self._last_commit:    # our own last write is about a millisecond away
                await mirror.caught_up(self._last_commit, MIRROR_WAIT_S)
            if mirror.revision >= self._last_commit:
                return mirror_fleet(self.ctx, sessions, self._views)
        return await read_fleet(self.ctx, sessions)

    async def _commit(self, compares: list[Compare], ops: list[Op]) -> Any:
        res = await self.ctx.store.commit(compares, ops)
        self._writes += 1
        self._last_commit = max(self._last_commit, res.revision)
        return res

    # -- one call ----------------------------------------------------------------------------------------
    async def _decide(self, g: GangCall, fleet: Fleet) -> bool | None:
        """Decide ``g`` on ``fleet`` and commit what it needs; False when a compare failed (read again); None when
        ``fleet`` is the mirror's and the decision is not a grant (decide again from etcd)."""
        c = g.call
        gang = fleet.gangs.get(c.lease_id)
        if gang is not None:
            g.rank = last_segment(gang[0].key)   # a retry (through any replica) keeps the place its entry holds
        granted = records_of(fleet, c.lease_id)
        if granted:
            return await self._leave(g, fleet, None, granted)
        if c.future.done():
            return await self._leave(g, fleet, None)
        if c.session.session_id not in fleet.sessions:
            if fleet.from_mirror:
                return None
            return await self._leave(g, fleet, errors.SessionGone(
                f"session: no live session {c.session.session_id} of agent {c.session.agent!r} (unknown or expired)",
                "session"))
        teams, no_teams_since = await team_state(self.ctx, fleet.revision, 0.5)
        hosts = fleet_hosts(fleet, c.session.agent, g.rank, c.lease_id)
        reserved = sorted(v.host for v in fleet.views.values() for e in v.entries if e.lease_id == c.lease_id)
        too_big = beyond_one_transaction(g.req, hosts.values(), self.ctx.config.etcd_max_txn_ops)
        decision = plan_gang(g.req, list(hosts.values()), reserved) if not too_big else \
            Refused(errors.FailedPrecondition(too_big, "hosts"))
        if isinstance(decision, FleetGrant):
            return await self._grant(g, fleet, decision, hosts, teams, no_teams_since)
        if fleet.from_mirror and not isinstance(decision, FleetWait):
            return None
        if isinstance(decision, Refused):
            return await self._leave(g, fleet, decision.error)
        if time.monotonic() >= c.deadline:
            if fleet.from_mirror:
                return None
            return await self._leave(g, fleet, wait_over(c.vram_mb, c.wait_s, c.gpu_count, c.exclusive))
        return await self._wait(g, fleet, decision, hosts, teams)

    # -- writes ------------------------------------------------------------------------------------------
    async def _leave(self, g: GangCall, fleet: Fleet, err: errors.GpucoordError | None,
                     granted: tuple[VramLease, ...] = ()) -> bool:
        compares, ops = entry_ops(fleet, g.call.lease_id, self.ctx.replica_id, own_only=g.call.future.done() and not granted)
        if ops:
            res = await self._commit(compares, ops)
            if not res.succeeded:
                return False
        g.call.rank = None
        if not g.call.future.done():
            if granted:
                g.call.parts = granted
                g.call.future.set_result(granted[0])
            else:
                g.call.future.set_exception(err or errors.Unavailable("the request was cancelled; retry"))
        return True

    async def _grant(self, g: GangCall, fleet: Fleet, decision: FleetGrant, hosts: dict[str, FleetHost],
                     teams: TeamState | None, no_teams_since: int) -> bool | None:
        c, keys, wall = g.call, self.keys, clock.wall()
        parts = tuple((host, tuple(s.uuid for s in hosts[host].slots if s.index in idx)) for host, idx in decision.parts)
        first = fleet.views[parts[0][0]]
        gpus = [fleet.views[h].gpus[u] for h, us in parts for u in us]
        charge = grant_charge_mb(gpus, c.vram_mb, c.exclusive)
        over = team_limit(teams, first, c.session.agent, charge) if teams is not None else None
        if over is not None:
            if fleet.from_mirror:
                return None
            if time.monotonic() >= c.deadline:
                return await self._leave(g, fleet, errors.CapacityError(over, "team"))
            return True    # waits for its team (decided again at the next wake)
        mark = over_quota_mark(teams, first, c.session.agent, charge)
        compares, ops = entry_ops(fleet, g.call.lease_id, self.ctx.replica_id)
        gang = fleet.gangs.get(c.lease_id)
        wc, wo = withdrawals(keys, self.ctx.mirror.get, fleet, gang[1].victims if gang is not None else (),
                             f"{c.session.agent}/{c.request_id}")   # granted on room it found: its notices go
        new, gc, go = grant_writes(keys, fleet, c, parts, mark, wall)
        compares, ops = compares + wc + gc, ops + wo + go
        compares.append(Exists(keys.session(c.session.agent, c.session.session_id)))
        if teams is not None:
            tc, to = team_writes(teams, keys, new)
            compares, ops = compares + tc, ops + to
        elif no_teams_since:
            compares.append(NothingWrittenSince(keys.teams(), no_teams_since))
        try:   # (etcd may refuse it as too large too: etcd_max_txn_ops set above its own --max-txn-ops)
            if why := too_large(compares, ops, self.ctx.config.etcd_max_txn_ops):
                raise errors.FailedPrecondition(f"hosts: {len(parts)} hosts x {len(parts[0][1])} GPUs need {why}", "hosts")
            res = await self._commit(compares, ops)
        except errors.FailedPrecondition as e:
            return None if fleet.from_mirror else await self._leave(g, fleet, e)
        if not res.succeeded:
            return False
        metrics.ADMISSIONS.labels(parts[0][0]).inc()
        g.call.rank = None
        granted = tuple(dataclasses.replace(x, mod_revision=res.revision) for x in new)
        if not c.future.done():
            c.parts = granted
            c.future.set_result(granted[0])
        else:
            # Its caller went away while the grant was committed: nobody knows the lease, so it is given back
            # unless a retry of the same request claims it first (as a host's round does, ``_give_back``).
            self._orphans[c.lease_id] = res.revision
            asyncio.get_running_loop().call_later(ORPHAN_GRACE_S, self._give_back, granted)
        return True

    def _give_back(self, granted: tuple[VramLease, ...]) -> None:
        revision = self._orphans.pop(granted[0].id, None)
        if revision is not None:    # (None: claimed by a retry)
            keys = [self.keys.lease(x.host, x.gpu_uuid, x.id) for x in granted]
            self._background.add(task := spawn(give_back(self.ctx.store, keys, revision, granted[0].id),
                                               f"giving back the orphaned lease {granted[0].id}"))
            task.add_done_callback(self._background.discard)

    async def _wait(self, g: GangCall, fleet: Fleet, decision: FleetWait, hosts: dict[str, FleetHost],
                    teams: TeamState | None) -> bool | None:
        """Wait: the gang's entry, reservation and victims, written when they change. From the mirror, only a
        wait that writes nothing is settled (anything else: None, decided again from etcd)."""
        c, keys = g.call, self.keys
        gang = fleet.gangs.get(c.lease_id)
        if fleet.from_mirror and (c.wait_s <= 0 or gang is None or gang[1].replica != self.ctx.replica_id):
            return None
        if c.wait_s <= 0:
            return await self._leave(g, fleet, wait_over(c.vram_mb, 0.0, c.gpu_count, c.exclusive))
        if gang is not None and gang[1].replica != self.ctx.replica_id and c.rank is not None:
            # A retry through another replica took the entry over: that replica serves the request now.
            c.rank = None
            if not c.future.done():
                c.future.set_exception(errors.Unavailable("superseded by a retry of the same request"))
            return True
        have = {v.host: e.reserve for v in fleet.views.values() for e in v.entries if e.lease_id == c.lease_id}
        live = set(fleet.leases)
        pending = tuple(v for v in (gang[1].victims if gang is not None else ()) if v in live)
        compares: list[Compare] = []
        ops: list[Op] = []
        if pending and have:   # its victims are still going: it keeps their hosts, and those it still needs
            wanted = dict(have)
            drop = unneeded_victims(fleet, {h: hosts[h] for h in have if h in hosts}, g.req, c.session.agent,
                                    pending, self.ctx.evictions)
            drop |= invalid_reclaims(fleet, teams, c.session.agent, least_gang_charge(fleet, g.req, have), pending,
                                     self.ctx.evictions)
            victims = tuple(v for v in pending if v not in drop)
            compares, ops = withdrawals(keys, self.ctx.mirror.get, fleet, drop, f"{c.session.agent}/{c.request_id}")
        else:
            wanted, victims, compares, ops = new_victims(self.ctx, fleet, hosts, c, g.req, decision, teams)
        if gang is None and (full := gang_queue_full(fleet, c.session.agent, c.lease_id, wanted, self.ctx.config)):
            return None if fleet.from_mirror else await self._leave(g, fleet, errors.CapacityError(full, "queue"))
        start = reservation_start(fleet, wanted, self.ctx.evictions, self.ctx.config.eviction_kill_margin_s)
        entry = dataclasses.replace(gang_entry(g.call, g.req, g.rank, self.ctx.replica_id), victims=victims, start_after=start)
        starts = {e.start_after for v in fleet.views.values() for e in v.entries if e.lease_id == c.lease_id}
        moved = any((x > 0) != (start > 0) or abs(x - start) > START_SLACK_S for x in starts)
        changed = gang is None or gang[1].victims != victims or gang[1].replica != self.ctx.replica_id or moved
        drop_compares, drop_ops = entry_ops(fleet, g.call.lease_id, self.ctx.replica_id, keep=None if changed else wanted)
        compares += [x for x in drop_compares if not is_gang_key(keys, x)]
        ops += [x for x in drop_ops if not is_gang_key(keys, x)]
        if gang is None:   # (the count of its agent's gangs holds at commit)
            compares += [Absent(keys.gang_queue_entry(g.rank)), NothingWrittenSince(keys.gang_queue(), fleet.revision)]
            ops.append(Put(keys.gang_queue_entry(g.rank), dumps(entry.to_json()), c.session.etcd_lease))
        elif changed:
            compares.append(ModRevisionIs(gang[0].key, gang[0].mod_revision))
            ops.append(Put(gang[0].key, dumps(entry.to_json()), c.session.etcd_lease))
        for host, uuids in wanted.items():
            if changed or have.get(host) != uuids:
                key = keys.queue_entry(host, g.rank)
                if not any(isinstance(x, Delete) and x.key == key for x in ops) and host not in have:
                    compares.append(Absent(key))
                ops = [x for x in ops if not (isinstance(x, Delete) and x.key == key)]   # rewritten (still compared)
                ops.append(Put(key, dumps(dataclasses.replace(entry, reserve=uuids).to_json()), c.session.etcd_lease))
        if ops and fleet.from_mirror:
            return None
        if ops:
            compares.append(Exists(keys.session(c.session.agent, c.session.session_id)))
            res = await self._commit(compares, ops)
            if not res.succeeded:
                return False
            if wanted.keys() != have.keys() or victims:
                log.info("multi-host gang %s of %s waits: %s%s", c.lease_id, c.session.agent, decision.reason,
                         f"; evicts {', '.join(victims)}" if victims and not pending else "")
            if victims and not pending:
                metrics.EVICTIONS.labels("notice").inc(len(victims))
        c.rank = g.rank
        return True

