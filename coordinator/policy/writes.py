"""The write steps of an admission round (``planner.py`` decides): the round's state, and what each decision
writes into the round's one transaction: grants (a gang: one record per GPU, each with its GPU's next
fencing token, all in this transaction), queue entries, eviction notices, the bumped ledgers and the guards.
Pure: it builds the plan (``plan.Plan``) and changes nothing it is given.
"""
from __future__ import annotations

import collections
import dataclasses
from typing import Collection, Generic, Mapping, Sequence

from coordinator import errors
from coordinator.policy.admission import GpuView
from coordinator.policy.decide import (
    Grant,
    Item,
    Request,
    eligible,
    left_the_queue,
    wait_over,
)
from coordinator.policy.host import HostView, host_guards
from coordinator.policy.notices import (
    fits_with_gone,
    own_notices,
    requested_by,
    unneeded,
)
from coordinator.policy.placement import GangRequest
from coordinator.policy.plan import C, Context, Plan, Wait
from coordinator.policy.team_admission import (
    fleet_charges,
    grant_charge_mb,
    least_charge_mb,
    over_quota_mark,
    team_use,
)
from coordinator.policy.teams import in_quota
from coordinator.records import (
    EvictionRecord,
    QueueEntry,
    SessionInfo,
    VramLease,
    dumps,
)
from coordinator.txn import (
    Absent,
    Compare,
    Delete,
    Exists,
    ModRevisionIs,
    Put,
)


class Round(Generic[C]):
    """The state of one round as it decides, and its write steps."""

    def __init__(self, view: HostView, ctx: Context) -> None:
        # Copies of what a round changes as it decides (tokens, leases): the snapshot stays as it was given.
        gpus = {}
        for uuid_, g in view.gpus.items():
            copy = dataclasses.replace(g, leases=list(g.leases))
            copy.seq = g.seq
            gpus[uuid_] = copy
        self.view = dataclasses.replace(view, gpus=gpus, leases=dict(view.leases))
        self.ctx = ctx
        self.cfg = ctx.config
        self.keys = ctx.keys
        self.host = view.host
        self.now = ctx.now
        self.out: Plan[C] = Plan()
        self.departing_held = self.view.departing_held
        self.evicting = set(ctx.evicting)
        self.items: list[Item[C]] = []
        self.attached_calls: set[int] = set()   # ids of the calls that retry a request already waiting
        self.blocked: set[str] = set()          # GPUs that a request ranked earlier is still waiting for
        self.waited: set[str] = set()           # ... of them, those a host's own waiter waits for (``block``)
        self.backfill: dict[str, float] = {}    # reserved GPUs: the gang's earliest start (``policy/backfill``)
        self.displaced: set[str] = set()        # ranks of entries this round displaces
        self.queued = 0                         # entries in the queue after what is decided so far
        self.per_agent: collections.Counter[str] = collections.Counter()
        self._used: dict[str, int] = {}         # team -> its use over the fleet (``team_used``)

    def block(self, uuids: set[str]) -> None:
        """A waiter of this host holds ``uuids`` back from every request ranked after it (G2; no backfill)."""
        self.blocked |= uuids
        self.waited |= uuids

    def team_used(self, team: str) -> int:
        """The team's use over the fleet as this round stands (``team_admission.team_use``, summed once a
        round and kept up to date with the round's grants)."""
        used = self._used.get(team)
        if used is None:
            assert self.ctx.teams is not None
            used = self._used[team] = team_use(self.ctx.teams, self.view, team)
        return used

    def _team_room(self, req: Request, going: bool = False) -> int | None:
        """What the request's team may still be charged under its limit (None: it has none); ``going``: with
        its leases on this host that are already being evicted counted as gone."""
        state = self.ctx.teams
        if state is None:
            return None
        team = state.membership.team_of(req.agent)
        limit = state.membership.team(team).limit_mb
        if limit is None:
            return None
        gone = sum(x.vram_mb for g in self.view.gpus.values() for x in g.leases
                   if going and x.id in self.evicting and state.membership.team_of(x.agent) == team)
        return limit - self.team_used(team) + gone

    def parts(self, lease_id: str) -> tuple[VramLease, ...]:
        """Every GPU's record of a lease (one, or a gang's), in index order, in the round's copy."""
        return tuple(x for g in sorted(self.view.gpus.values(), key=lambda g: g.index) for x in g.leases
                     if x.id == lease_id)

    def _eviction(self, victim: VramLease, it: Item[C], reclaim: str = "") -> EvictionRecord:
        """The notice to ``victim`` for ``it``: by priority (G3), or reclaimed by team ``reclaim`` (G11)."""
        wall, req = self.ctx.wall, it.req
        what = (f"{req.gpu_count} {'whole GPUs' if req.exclusive else f'GPUs with {req.vram_mb} MiB each'}"
                if req.is_gang else f"{req.vram_mb} MiB")
        reason = (f"team {reclaim!r} reclaims its quota for a request for {what}: this lease is over its team's "
                  "quota" if reclaim else f"priority {req.priority} request for {what} needs the room")
        return EvictionRecord(
            lease_id=victim.id, host=self.host, gpu_uuid=victim.gpu_uuid, agent=victim.agent,
            session_id=victim.session_id, victim_priority=victim.priority,
            requested_by=f"{req.agent}/{req.request_id}", requester_priority=req.priority,
            reason=reason, deadline_unix=wall + self.cfg.eviction_grace_s, created_at=wall, reclaim=reclaim)

    def _leaving(self, it: Item[C]) -> bool:
        """Our waiter whose caller went away or whose wait is over: the expiry removes its entry, so it
        neither blocks a GPU nor counts against the queue bounds, and it is not granted any more."""
        c = it.call
        return (c is not None and it.entry is not None and id(c) not in self.attached_calls
                and (c.gone or self.now >= c.deadline))

    # -- bound the queue -------------------------------------------------------------------------------
    def _bound_queue(self, n: int, it: Item[C]) -> errors.GpucoordError | None:
        """Room in the host's queue for the new waiter ``items[n]``, or why not. When the queue is full, an
        arrival that outranks the lowest-ranked waiter takes its place (that waiter is told
        RESOURCE_EXHAUSTED); one that does not is refused."""
        limit = self.cfg.max_queue_per_host
        if self.queued < limit:
            return None
        lowest = self._lowest_waiter(n + 1)
        if lowest is None:
            return errors.CapacityError(
                f"queue: host {self.host!r} already has {self.queued} waiting requests ranked at or above "
                f"this one (limit {limit})", "queue")
        assert lowest.entry is not None
        self.displaced.add(lowest.rank)
        self._leaves(lowest.entry, lowest.call, errors.CapacityError(
            f"queue: displaced from the full queue of host {self.host!r} (limit {limit}) by a request of "
            "higher priority", "queue"))
        return None

    def _lowest_waiter(self, start: int) -> Item[C] | None:
        """The lowest-ranked entry of the queue among ``items[start:]`` (which rank below the arrival) that a
        higher-ranked arrival may displace."""
        for it in reversed(self.items[start:]):
            if (it.entry is not None and it.rank not in self.displaced and not self._leaving(it)
                    and not it.entry.multi_host):   # a multi-host gang's reservation is never displaced
                return it
        return None

    # -- notices that serve their requester (``policy/notices.py``) ---------------------------------------
    def _withdraw(self, entry: QueueEntry, victims: Collection[str]) -> tuple[str, ...]:
        """Withdraw, in this transaction, the notices ``entry``'s request made to ``victims`` whose lease still
        lives (each compared on the mod_revision the round knows); returns the victims withdrawn."""
        plan, me, out = self.out, requested_by(entry), []
        for v in victims:
            known = self.ctx.notices.get(v)
            if known is None or known[1].requested_by != me or v in plan.withdrawn or v not in self.view.leases:
                continue
            key = self.keys.eviction(v)
            plan.compares.append(ModRevisionIs(key, known[0]))
            plan.ops.append(Delete(key))
            plan.withdrawn.append(v)
            out.append(v)
        if out:
            # Still counted as leaving in this round, so that no other request names it a victim in this
            # transaction (a key deleted and written again in one transaction is refused): the next decides again.
            self.out.more = True
        return tuple(out)

    def _kept(self, entry: QueueEntry, keep: Collection[str]) -> tuple[str, ...]:
        """``entry``'s victims once the notices it made to those not in ``keep`` are withdrawn."""
        withdrawn = self._withdraw(entry, [v for v in entry.victims if v not in keep])
        return tuple(v for v in entry.victims if v not in withdrawn)

    def _serve(self, it: Item[C], free_of_queue: Sequence[GpuView], caps: Mapping[str, int],
               gang: GangRequest | None) -> tuple[str, ...]:
        """The victims a queued request whose victims still live keeps: the notices it no longer needs are
        withdrawn in this transaction (``notices.unneeded``)."""
        entry, req, teams = it.entry, it.req, self.ctx.teams
        assert entry is not None
        own = own_notices(entry, self.view, self.ctx.notices)
        if not own:
            return entry.victims
        invalid: set[str] = set()
        reclaimed = [v for v in own if self.ctx.notices[v][1].reclaim]
        if reclaimed and teams is not None:
            team = teams.membership.team(teams.membership.team_of(req.agent))
            charges = fleet_charges(teams, self.view)
            marks = in_quota(charges, teams.membership)
            # The least its grant could be charged (an exclusive request: its host's smallest whole GPUs).
            least = least_charge_mb(list(self.view.gpus.values()), req.vram_mb, req.gpu_count, req.exclusive)
            over = self.team_used(team.name) + least > team.quota_mb
            invalid = {v for v in reclaimed if over or marks.get(v, False)}
        unavailable = {g.index for g in self.view.gpus.values() if g.uuid in self.blocked}
        drop = unneeded(entry, own, invalid, self.departing_held, lambda gone: fits_with_gone(
            self.view, req.agent, req.vram_mb, free_of_queue, caps, gang, unavailable, gone))
        if not drop:
            return entry.victims
        withdrawn = self._withdraw(entry, drop)    # decided again next round: other victims, or a fit
        return tuple(v for v in entry.victims if v not in withdrawn)

    def _why_removed(self, c: C) -> errors.GpucoordError:
        """The answer for our waiter whose entry someone else removed without a grant, from the snapshot:
        FAILED_PRECONDITION only when it can never be granted there any more (the host is gone, the
        partition changed); otherwise it was displaced, or removed at the end of its wait."""
        try:
            eligible(self.view, self.cfg, Request.of_call(c), count_leases=False)
        except errors.GpucoordError as e:
            return left_the_queue(e)
        if self.now >= c.deadline:
            return wait_over(c.vram_mb, c.wait_s, c.gpu_count, c.exclusive)
        return errors.CapacityError(
            "queue: the waiting request was removed from the queue without a grant (displaced by a request "
            "of higher priority)", "queue")

    # -- write the ops ---------------------------------------------------------------------------------
    def _write_grant(self, it: Item[C], g: Grant) -> None:
        plan = self.out
        if g.existing is not None:
            lease = g.existing
            parts = self.parts(lease.id)
            if len(parts) > 1 or parts and parts[0].format > 1:
                plan.gangs[lease.id] = parts
                lease = parts[0]
        else:
            if it.call is not None and it.entry is None:
                plan.sessions[it.call.session.session_id] = it.call.session
            req = it.req
            gpus = g.gang or ((g.gpu,) if g.gpu is not None else ())
            over = over_quota_mark(self.ctx.teams, self.view, req.agent,
                                   grant_charge_mb(gpus, req.vram_mb, req.exclusive), self.team_used,
                                   self._by_model(gpus, req.vram_mb, req.exclusive))
            if g.gang:
                # All or nothing: every GPU's record in this one transaction, each with its GPU's next token.
                gang = tuple(x.uuid for x in g.gang) if len(g.gang) > 1 else ()
                parts = tuple(self._grant(it, gpu, gang, over) for gpu in g.gang)
                plan.new_leases += parts
                plan.gangs[parts[0].id] = parts
                lease = parts[0]
            else:
                assert g.gpu is not None
                lease = self._grant(it, g.gpu, over_quota=over)
                plan.new_leases.append(lease)
        if self.ctx.teams is not None and g.existing is None:
            team = self.ctx.teams.membership.team_of(lease.agent)
            if team in self._used:    # this round's grant counts in its team's use from now on
                self._used[team] += sum(x.vram_mb for x in plan.gangs.get(lease.id, (lease,)))
        plan.grants.append((it.call, lease))
        if it.entry is not None:
            self._withdraw(it.entry, it.entry.victims)    # granted on room it found free: its notices go
            self._leaves(it.entry, None, None)

    def _by_model(self, gpus: Sequence[GpuView], vram_mb: int, exclusive: bool) -> dict[str, int]:
        """What a grant on ``gpus`` charges each GPU model (each GPU's charge to its own model)."""
        models = {g.uuid: g.name for g in self.view.inventory.gpus} if self.view.inventory is not None else {}
        out: dict[str, int] = {}
        for g in gpus:
            model = models.get(g.uuid, "")
            out[model] = out.get(model, 0) + (g.usable_mb if exclusive else vram_mb)
        return out

    def _grant(self, it: Item[C], gpu: GpuView, gang: tuple[str, ...] = (),
               over_quota: bool | None = None) -> VramLease:
        """The lease on ``gpu`` (one GPU's record of a gang, with ``gang``), with the GPU's next fencing token
        (in this round's copies). An exclusive lease holds the GPU's whole usable VRAM. ``over_quota``: its
        team's quota mark (teams)."""
        gpu.seq += 1
        if it.entry is not None:
            session_id, etcd_lease = it.entry.session_id, it.entry.etcd_lease
        else:
            assert it.call is not None
            session_id, etcd_lease = it.call.session.session_id, it.call.session.etcd_lease
        req = it.req
        lease = VramLease(
            id=req.lease_id, host=self.host, gpu_uuid=gpu.uuid, gpu_index=gpu.index, agent=req.agent,
            session_id=session_id, vram_mb=gpu.usable_mb if req.exclusive else req.vram_mb, priority=req.priority,
            preemptible=req.preemptible, request_id=req.request_id, token=gpu.seq, created_at=self.ctx.wall,
            gang=gang, exclusive=req.exclusive, topology=req.topology, min_runtime_s=self._min_runtime(req.agent,
                                                                                                    req.min_runtime_s),
            over_quota=over_quota, time_limit_s=req.time_limit_s, time_limit_warning_s=req.time_limit_warning_s,
            etcd_lease=etcd_lease)
        gpu.leases.append(lease)
        self.view.leases[lease.id] = lease
        return lease

    def _min_runtime(self, agent: str, declared: float) -> float:
        """The minimum runtime a new lease records: as declared, capped by its team's ``max_min_runtime_s``
        (0 for a team without a record), so that what a lease says is what reclaim applies."""
        teams = self.ctx.teams
        team = teams.membership.team(teams.membership.team_of(agent)) if teams is not None else None
        return min(declared, team.max_min_runtime_s if team is not None else 0.0)

    def _write_wait(self, it: Item[C], victims: tuple[str, ...]) -> None:
        """A new entry for a new waiter; for a queued one, its entry rewritten if its victims or its serving
        replica changed."""
        plan, ctx = self.out, self.ctx
        if it.entry is None:
            assert it.call is not None
            plan.sessions[it.call.session.session_id] = it.call.session
            entry = self._entry(it.call, it.rank, victims)
            key = self.keys.queue_entry(self.host, it.rank)
            plan.compares.append(Absent(key))
            plan.ops.append(Put(key, dumps(entry.to_json()), it.call.session.etcd_lease))
            plan.waits.append(Wait(it.call, it.rank, 0))
            plan.new_entries += 1
            self.queued += 1
            self.per_agent[it.agent] += 1
            return
        updated = it.entry
        if victims != it.entry.victims:
            updated = dataclasses.replace(updated, victims=victims)
        if it.call is not None and (it.entry.replica != ctx.replica_id or id(it.call) in self.attached_calls):
            # Served by this replica now (a retry through it): the entry says so, and keeps the later of the
            # two deadlines. A retry through the replica that already serves the entry rewrites it too: the
            # expiry removes the entry of the earlier attempt (its caller gone) comparing the revision it knows,
            # and must not remove it from under the retry (which would be answered before its wait ends).
            updated = dataclasses.replace(
                updated, replica=ctx.replica_id,
                deadline_unix=max(updated.deadline_unix, ctx.wall + max(0.0, it.call.deadline - self.now)))
        if updated is not it.entry:
            key = self.keys.queue_entry(self.host, it.entry.rank)
            plan.compares.append(ModRevisionIs(key, it.entry.mod_revision))
            plan.ops.append(Put(key, dumps(updated.to_json()), updated.etcd_lease))
        if it.call is not None:
            # A retry keeps the entry's deadline when it is later than its own (measured from its own, later
            # arrival, it may be earlier): the waiter is never answered before its entry says its wait ends.
            stated = self.now + (updated.deadline_unix - ctx.wall)
            plan.waits.append(Wait(it.call, it.entry.rank, 0 if updated is not it.entry else it.entry.mod_revision,
                                   stated if stated > it.call.deadline else None))

    def _entry(self, c: C, rank: str, victims: tuple[str, ...]) -> QueueEntry:
        return QueueEntry(rank=rank, agent=c.session.agent, session_id=c.session.session_id,
                          etcd_lease=c.session.etcd_lease, vram_mb=c.vram_mb, gpu=c.gpu_ref or "",
                          priority=c.priority, preemptible=c.preemptible, request_id=c.request_id,
                          lease_id=c.lease_id, deadline_unix=self.ctx.wall + max(0.0, c.deadline - self.now),
                          replica=self.ctx.replica_id, victims=victims, wait_s=max(0.0, c.deadline - self.now),
                          gpu_count=c.gpu_count, exclusive=c.exclusive, topology=c.topology, gpus=tuple(c.gpus),
                          min_runtime_s=float(c.min_runtime_s), time_limit_s=float(c.time_limit_s),
                          time_limit_warning_s=float(c.time_limit_warning_s))

    def _leaves(self, entry: QueueEntry, call: C | None, err: errors.GpucoordError | None) -> None:
        """The entry leaves the queue in this transaction (if nobody changed it since the snapshot); its
        caller (if ours) is told after the commit."""
        plan = self.out
        key = self.keys.queue_entry(self.host, entry.rank)
        plan.compares.append(ModRevisionIs(key, entry.mod_revision))
        plan.ops.append(Delete(key))
        self.queued -= 1
        self.per_agent[entry.agent] -= 1
        if err is not None:
            plan.left.append(entry)
            if call is not None:
                plan.failures.append((call, err))

    def _write_transaction(self) -> None:
        """The new leases, the bumped ledgers, and the guards of the whole transaction."""
        plan, view = self.out, self.view
        for lease in plan.new_leases:
            plan.ops.append(Put(self.keys.lease(self.host, lease.gpu_uuid, lease.id), dumps(lease.to_json()),
                                lease.etcd_lease))
        for uuid_ in sorted({lease.gpu_uuid for lease in plan.new_leases}):
            gpu = view.gpus[uuid_]
            plan.ops.append(Put(self.keys.gpu(self.host, uuid_), dumps({"capacity_mb": gpu.total_mb, "seq": gpu.seq})))
        if plan.ops:
            # Admitting or queueing needs a live host; removing entries of a host that is gone does not.
            adds = bool(plan.new_leases) or plan.new_entries > 0
            plan.compares += self._guards(list(plan.sessions.values()), host_must_live=adds)

    def _guards(self, sessions: list[SessionInfo], host_must_live: bool) -> list[Compare]:
        """What must still hold at commit: nothing admitted or queued on the host since the snapshot, none of
        its records the round read rewritten since (one may now be malformed: the host INVALID, fail closed), and
        the sessions of the new grants and entries still live. (Its usage report, rewritten every interval by its
        node, is not compared: what it says is advisory, as of the snapshot.)"""
        return [*host_guards(self.keys, self.view, host_must_live),
                *(Exists(self.keys.session(x.agent, x.session_id)) for x in sessions)]
